"""EAGLE (1 and 3): a trained head drafts gamma tokens per round from the target's hidden states (--head).
`HeadStrategy` is what every trained-head strategy declares alike (medusa.py is the other)."""

from __future__ import annotations

from sdbench.errors import SdbenchError
from sdbench.strategies.base import TrainedHead
from sdbench.strategies.spec import BuildContext, Option, Strategy, need_gamma, register


class HeadStrategy(Strategy):
    """A strategy drafting with a trained head of one of `kinds` (drafting/heads/load.py), read from --head."""

    kinds: tuple[str, ...] = ()
    options = (Option("head", "", "the trained head: a folder or a hub id (also --head)", str),)

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        need_gamma(cls.name, gamma)
        if not options.get("head"):
            raise SdbenchError(f"strategy '{cls.name}' needs --head PATH|HUB_ID (a trained head for the target)")

    @classmethod
    def drafter(cls, head, target, gamma: int):
        """The drafter over a loaded head (raises SdbenchError on settings the head cannot honour)."""
        raise NotImplementedError

    @classmethod
    def build(cls, ctx: BuildContext) -> TrainedHead:
        from sdbench.models.heads.load import load_head  # reads weights: only a run that drafts with it

        head = load_head(ctx.options["head"], ctx.target, cls.kinds, cls.name)
        return TrainedHead(cls.drafter(head, ctx.target, ctx.gamma), ctx.gamma, ctx.options["head"])


@register
class EagleStrategy(HeadStrategy):
    name = "eagle"
    help = "EAGLE-1/EAGLE-3 trained head (--head) drafting from the target's hidden states, fixed gamma"
    kinds = ("eagle3", "eagle1")

    @classmethod
    def drafter(cls, head, target, gamma: int):
        from sdbench.drafting.heads import EagleDrafter
        from sdbench.models.heads.eagle import EagleHead

        return EagleDrafter(EagleHead(head, target), head.name, head.layers)
