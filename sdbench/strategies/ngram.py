"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's suffix."""

from __future__ import annotations

from sdbench.drafting.ngram import NGramDrafter, check_ngram
from sdbench.strategies.base import FixedLookahead, Option


class NGram(FixedLookahead):
    name = "ngram"
    options = (
        Option("max_ngram", 3, "longest suffix (tokens) to match"),
        Option("min_ngram", 1, "shortest suffix (tokens) to match"),
    )

    def __init__(self, gamma: int, max_ngram: int = 3, min_ngram: int = 1):
        check_ngram(self.name, max_ngram, min_ngram)
        super().__init__(NGramDrafter(max_ngram, min_ngram), gamma)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def params(self) -> dict:
        return {"gamma": self.gamma, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}

    @classmethod
    def check(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        cls(gamma, **options)

    @classmethod
    def search_space(cls, trial, space) -> tuple[int, dict]:
        gamma = trial.suggest_int("gamma", 1, 8)
        max_ngram = trial.suggest_int("max_ngram", 1, 5)
        return gamma, {"max_ngram": max_ngram, "min_ngram": trial.suggest_int("min_ngram", 1, max_ngram)}
