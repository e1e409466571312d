"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's suffix."""

from __future__ import annotations

from sdbench.drafting.ngram import NGramDrafter, check_ngram
from sdbench.strategies.base import FixedLookahead
from sdbench.strategies.spec import TREE_TOPKS, Option, SearchContext, Strategy, need_gamma, register


class NGram(FixedLookahead):
    name = "ngram"

    def __init__(self, gamma: int, max_ngram: int = 3, min_ngram: int = 1, tree: int = 0):
        super().__init__(NGramDrafter(max_ngram, min_ngram, tree), gamma)
        self.max_ngram, self.min_ngram, self.tree = max_ngram, min_ngram, tree

    @property
    def proposes_trees(self) -> bool:
        return self.tree > 0

    @property
    def max_lookahead(self) -> int:
        return self.gamma * max(self.tree, 1)  # a tree's nodes: up to `tree` branches of gamma tokens

    def params(self) -> dict:
        params = {"gamma": self.gamma, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}
        return params | ({"tree": self.tree} if self.tree else {})


@register
class NGramStrategy(Strategy):
    name = "ngram"
    help = "prompt lookup: draft from the latest earlier match of the context's suffix (no model)"
    aliases = ("prompt-lookup", "pld")
    options = (
        Option("max_ngram", 3, "longest suffix (tokens) to match"),
        Option("min_ngram", 1, "shortest suffix (tokens) to match"),
        Option("tree", 0, "0: one continuation (a chain); K >= 1: a token tree of up to K distinct continuations "
                          "(common prefixes merged), each up to --gamma deep"),
    )
    proposer = NGram

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        need_gamma(cls.name, gamma)
        check_ngram(cls.name, options["max_ngram"], options["min_ngram"], options["tree"])

    @classmethod
    def search_space(cls, trial, space: SearchContext) -> tuple[int, dict]:
        """gamma and the match lengths; with `tune --trees`, the chain (tree 0) or a tree of 2 to 4 branches
        (tree=1 is the chain's draft verified as a tree: nothing to learn from it)."""
        gamma = trial.suggest_int("gamma", 1, 8)
        max_ngram = trial.suggest_int("max_ngram", 1, 5)
        options = {"max_ngram": max_ngram, "min_ngram": trial.suggest_int("min_ngram", 1, max_ngram)}
        if space.trees and (tree := trial.suggest_categorical("tree", [0, *TREE_TOPKS])):
            options["tree"] = tree
        return gamma, options
