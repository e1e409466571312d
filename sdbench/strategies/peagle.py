"""P-EAGLE: an EAGLE-3 head trained to draft several positions at once (--head, the speculators format): the
forward that feeds it the committed tokens carries gamma - 1 mask positions after them and drafts the whole
chain (drafting/parallel.py), one head forward per round whatever gamma."""

from __future__ import annotations

from sdbench.strategies.eagle import HeadStrategy, eagle_head
from sdbench.strategies.spec import Option, SearchContext, register


@register
class PEagleStrategy(HeadStrategy):
    name = "peagle"
    help = ("P-EAGLE head (--head, speculators format): EAGLE-3 drafting gamma tokens in one forward (mask "
            "positions after the committed ones), no chain of head steps")
    head_kinds = ("peagle",)
    options = (Option("head", "", "the P-EAGLE head: a folder or a hub id (also --head)", str),)

    @classmethod
    def tree(cls, gamma: int, options: dict):
        return None

    @classmethod
    def drafter(cls, head, target, gamma: int, tree=None, options: dict | None = None):
        from sdbench.drafting.parallel import ParallelDrafter

        return ParallelDrafter(eagle_head(head, target), head.name, head.layers, head.mask_token_id,
                               head.weights["mask_hidden"], gamma)

    @classmethod
    def search_space(cls, trial, space: SearchContext) -> tuple:
        """gamma and the head (no tree: the parallel positions are one chain)."""
        head = cls.chosen_head(trial, space)
        return trial.suggest_int("gamma", 1, cls.max_gamma(space.heads)), {"head": head}
