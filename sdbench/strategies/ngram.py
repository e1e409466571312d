"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's suffix."""

from __future__ import annotations

from sdbench.drafting.ngram import NGramDrafter, check_ngram
from sdbench.strategies.base import FixedLookahead
from sdbench.strategies.spec import Option, Strategy, need_gamma, register


class NGram(FixedLookahead):
    name = "ngram"

    def __init__(self, gamma: int, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__(NGramDrafter(max_ngram, min_ngram), gamma)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def params(self) -> dict:
        return {"gamma": self.gamma, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}


@register
class NGramStrategy(Strategy):
    name = "ngram"
    help = "prompt lookup: draft from the latest earlier match of the context's suffix (no model)"
    aliases = ("prompt-lookup", "pld")
    options = (
        Option("max_ngram", 3, "longest suffix (tokens) to match"),
        Option("min_ngram", 1, "shortest suffix (tokens) to match"),
    )
    proposer = NGram

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        need_gamma(cls.name, gamma)
        check_ngram(cls.name, options["max_ngram"], options["min_ngram"])

    @classmethod
    def search_space(cls, trial, space) -> tuple[int, dict]:
        gamma = trial.suggest_int("gamma", 1, 8)
        max_ngram = trial.suggest_int("max_ngram", 1, 5)
        return gamma, {"max_ngram": max_ngram, "min_ngram": trial.suggest_int("min_ngram", 1, max_ngram)}
