"""Medusa-1: k trained heads (--head) draft the next k tokens at once from the target's last hidden state."""

from __future__ import annotations

from sdbench.errors import SdbenchError
from sdbench.strategies.eagle import MAX_TUNED_GAMMA, HeadStrategy
from sdbench.strategies.spec import register


@register
class MedusaStrategy(HeadStrategy):
    name = "medusa"
    help = "Medusa-1 trained heads (--head) drafting a chain from the target's last hidden state, fixed gamma"
    head_kinds = ("medusa",)

    @classmethod
    def drafter(cls, head, target, gamma: int):
        from sdbench.drafting.heads import MedusaDrafter
        from sdbench.models.heads.medusa import MedusaHead

        heads = int(head.config["medusa_num_heads"])
        if gamma > heads:
            raise SdbenchError(f"--gamma {gamma}: --head {head.name} has {heads} Medusa heads, one per draft")
        return MedusaDrafter(MedusaHead(head, target), head.name, head.layers)

    @classmethod
    def max_gamma(cls, heads: tuple[str, ...]) -> int:
        """One draft per Medusa head: at most the fewest heads among the candidates (read from their configs)."""
        from sdbench.models.heads.load import medusa_heads

        return min([MAX_TUNED_GAMMA, *(n for n in map(medusa_heads, heads) if n)])
