"""Medusa-1: k trained heads (--head) draft the next k tokens at once from the target's last hidden state."""

from __future__ import annotations

from sdbench.errors import SdbenchError
from sdbench.strategies.base import TrainedHead
from sdbench.strategies.eagle import HEAD_OPTION, loaded_head, need_head
from sdbench.strategies.spec import BuildContext, Strategy, need_gamma, register


@register
class MedusaStrategy(Strategy):
    name = "medusa"
    help = "Medusa-1 trained heads (--head) drafting a chain from the target's last hidden state, fixed gamma"
    options = (HEAD_OPTION,)

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        need_gamma(cls.name, gamma)
        need_head(cls.name, options)

    @classmethod
    def build(cls, ctx: BuildContext) -> TrainedHead:
        from sdbench.drafting.heads.drafter import MedusaDrafter

        head = loaded_head(ctx, ("medusa",), cls.name)
        heads = int(head.config["medusa_num_heads"])
        if ctx.gamma > heads:
            raise SdbenchError(f"--gamma {ctx.gamma}: --head {head.name} has {heads} Medusa heads, one per draft")
        return TrainedHead(MedusaDrafter(head, ctx.target), ctx.gamma, ctx.options["head"])
