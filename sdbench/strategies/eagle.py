"""EAGLE (1 and 3): a trained head drafts gamma tokens per round from the target's hidden states (--head).
`HeadStrategy` is what every trained-head strategy declares alike (medusa.py is the other)."""

from __future__ import annotations

from pathlib import Path

from sdbench.errors import SdbenchError
from sdbench.strategies.base import TrainedHead
from sdbench.strategies.spec import BuildContext, Option, SearchContext, Strategy, need_gamma, register

MAX_TUNED_GAMMA = 8


class HeadStrategy(Strategy):
    """A strategy drafting with a trained head of one of `head_kinds` (models/heads/load.py), read from --head."""

    options = (Option("head", "", "the trained head: a folder or a hub id (also --head)", str),)

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        from sdbench.models.heads.load import looks_like_path  # light: no weights read

        need_gamma(cls.name, gamma)
        head = options.get("head")
        if not head:
            raise SdbenchError(f"strategy '{cls.name}' needs --head PATH|HUB_ID (a trained head for the target)")
        if looks_like_path(head) and not Path(head).expanduser().is_dir():  # a typo fails before the target loads
            raise SdbenchError(f"--head {head}: no such folder, nor a hub id (owner/name)")

    @classmethod
    def drafter(cls, head, target, gamma: int):
        """The drafter over a loaded head (raises SdbenchError on settings the head cannot honour)."""
        raise NotImplementedError

    @classmethod
    def max_gamma(cls, heads: tuple[str, ...]) -> int:
        """The largest lookahead `tune` tries with these head candidates."""
        return MAX_TUNED_GAMMA

    @classmethod
    def search_space(cls, trial, space: SearchContext) -> tuple:
        """gamma, and the head: one of the candidates (--head, or the target's heads train-head recorded)."""
        if not space.heads:
            raise SdbenchError(f"strategy '{cls.name}' needs a trained head to tune with: give --head PATH|HUB_ID")
        head = space.heads[0] if len(space.heads) == 1 else trial.suggest_categorical("head", list(space.heads))
        return trial.suggest_int("gamma", 1, cls.max_gamma(space.heads)), {"head": head}

    @classmethod
    def proposer_for(cls, head, target, gamma: int) -> TrainedHead:
        """The proposer drafting with a loaded head."""
        return TrainedHead(cls.drafter(head, target, gamma), gamma, head.name)

    @classmethod
    def build(cls, ctx: BuildContext) -> TrainedHead:
        from sdbench.models.heads.load import load_head  # reads weights: only a run that drafts with it

        return cls.proposer_for(load_head(ctx.options["head"], ctx.target, cls.head_kinds, cls.name), ctx.target,
                                ctx.gamma)


@register
class EagleStrategy(HeadStrategy):
    name = "eagle"
    help = "EAGLE-1/EAGLE-3 trained head (--head) drafting from the target's hidden states, fixed gamma"
    head_kinds = ("eagle3", "eagle1")

    @classmethod
    def drafter(cls, head, target, gamma: int):
        from sdbench.drafting.heads import EagleDrafter
        from sdbench.models.heads.eagle import EagleHead

        try:
            forward = EagleHead(head, target)
        except (ValueError, KeyError, TypeError) as err:  # the library refuses its layer's config
            line = (str(err).strip() or type(err).__name__).splitlines()[0]
            raise SdbenchError(f"--head {head.name}: its layer's config is not one sdbench reads ({line})") from None
        return EagleDrafter(forward, head.name, head.layers)
