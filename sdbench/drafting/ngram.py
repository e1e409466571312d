"""Prompt lookup: the tokens that followed the latest earlier occurrence of the context's suffix."""

from __future__ import annotations

import numpy as np
import torch

from sdbench.engine.state import DecodeState, Proposal
from sdbench.errors import SdbenchError

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


class NGramDrafter:
    """Prompt lookup as a drafter: deterministic (one-hot) drafts, trimmed to the longest match so that the
    verifier sees no padding."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        check_ngram(DRAFT_NAME, max_ngram, min_ngram)
        self.name = DRAFT_NAME
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def begin(self, state: DecodeState) -> None:
        pass

    def begin_rows(self, state: DecodeState, rows: list[int]) -> None:
        pass  # no table: each lookup reads the row's own context, which `state` holds afresh

    def catch_up(self, ctx: torch.Tensor, lengths: list[int]) -> int:
        return 0

    def draft(self, ctx: torch.Tensor, lengths: list[int], limits: list[int]) -> Proposal:
        tokens = torch.zeros(len(lengths), max(limits, default=0), dtype=torch.long)
        found_lengths = torch.zeros(len(lengths), dtype=torch.long)
        for b, (n, k) in enumerate(zip(lengths, limits)):
            if k > 0:
                found = lookup(ctx[b, :n].numpy(), k, self.max_ngram, self.min_ngram)
                tokens[b, : len(found)] = torch.from_numpy(found)
                found_lengths[b] = len(found)
        return Proposal(tokens, found_lengths).fit(limits)

    def end(self) -> None:
        pass
