"""EAGLE (1 and 3): a trained head drafts gamma tokens per round from the target's hidden states (--head)."""

from __future__ import annotations

from sdbench.errors import SdbenchError
from sdbench.strategies.base import TrainedHead
from sdbench.strategies.spec import BuildContext, Option, Strategy, need_gamma, register

HEAD_OPTION = Option("head", "", "the trained head: a folder or a hub id (also --head)", str)


def need_head(strategy: str, options: dict) -> None:
    if not options.get("head"):
        raise SdbenchError(f"strategy '{strategy}' needs --head PATH|HUB_ID (a trained head for the target)")


def loaded_head(ctx: BuildContext, kinds: tuple[str, ...], strategy: str):
    """The --head for ctx's target, refused when it is another strategy's kind of head."""
    from sdbench.drafting.heads.load import load_head  # reads weights: only a run that drafts with it

    return load_head(ctx.options["head"], ctx.target, kinds, strategy)


@register
class EagleStrategy(Strategy):
    name = "eagle"
    help = "EAGLE-1/EAGLE-3 trained head (--head) drafting from the target's hidden states, fixed gamma"
    options = (HEAD_OPTION,)

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        need_gamma(cls.name, gamma)
        need_head(cls.name, options)

    @classmethod
    def build(cls, ctx: BuildContext) -> TrainedHead:
        from sdbench.drafting.heads.drafter import EagleDrafter

        head = loaded_head(ctx, ("eagle1", "eagle3"), cls.name)
        return TrainedHead(EagleDrafter(head, ctx.target), ctx.gamma, ctx.options["head"])
