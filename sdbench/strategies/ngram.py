"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's suffix."""

from __future__ import annotations

import numpy as np
import torch

from sdbench.errors import SdbenchError
from sdbench.strategies.base import Option, Proposal, Proposer, need_gamma

DRAFT_NAME = "ngram"  # `--draft ngram`: prompt lookup as a draft candidate, no model to load


def lookup(seq: np.ndarray, k: int, max_n: int, min_n: int = 1) -> np.ndarray:
    """Up to k tokens following the most recent earlier match of the longest suffix of seq (n-gram
    length from max_n down to min_n). seq: [L] int. Empty when nothing matches."""
    L = len(seq)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[: L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == seq[L - n :]).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return seq[start : start + k]
    return seq[:0]


def check_ngram(strategy: str, max_ngram: int, min_ngram: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise SdbenchError(f"{strategy} needs 1 <= min_ngram <= max_ngram (got --set min_ngram={min_ngram}, "
                           f"max_ngram={max_ngram})")


class NGram(Proposer):
    name = "ngram"
    options = (
        Option("max_ngram", 3, "longest suffix (tokens) to match"),
        Option("min_ngram", 1, "shortest suffix (tokens) to match"),
    )

    def __init__(self, gamma: int, max_ngram: int = 3, min_ngram: int = 1):
        need_gamma(self.name, gamma)
        check_ngram(self.name, max_ngram, min_ngram)
        super().__init__(gamma)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, state, gamma: int | None = None) -> Proposal:
        """Up to gamma (default: self.gamma) tokens per row, never more than a row can still commit;
        lengths[b] says how many were found."""
        gamma = state.lookahead(self.gamma if gamma is None else gamma)
        tokens = torch.zeros(state.batch, gamma, dtype=torch.long)
        lengths = torch.zeros(state.batch, dtype=torch.long)
        for b in range(state.batch):
            if state.done[b]:
                continue
            found = lookup(state.row(b).numpy(), min(gamma, state.room(b)), self.max_ngram, self.min_ngram)
            tokens[b, : len(found)] = torch.from_numpy(found)
            lengths[b] = len(found)
        return Proposal(tokens, lengths)

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
