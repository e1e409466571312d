"""Medusa-1: k trained heads (--head) draft the next k tokens at once from the target's last hidden state."""

from __future__ import annotations

from sdbench.errors import SdbenchError
from sdbench.strategies.eagle import HeadStrategy
from sdbench.strategies.spec import register


@register
class MedusaStrategy(HeadStrategy):
    name = "medusa"
    help = "Medusa-1 trained heads (--head) drafting a chain from the target's last hidden state, fixed gamma"
    kinds = ("medusa",)

    @classmethod
    def drafter(cls, head, target, gamma: int):
        from sdbench.drafting.heads import MedusaDrafter
        from sdbench.models.heads.medusa import MedusaHead

        heads = int(head.config["medusa_num_heads"])
        if gamma > heads:
            raise SdbenchError(f"--gamma {gamma}: --head {head.name} has {heads} Medusa heads, one per draft")
        return MedusaDrafter(MedusaHead(head, target), head.name, head.layers)
