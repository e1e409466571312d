"""Acceptance by draft position, defined once: from the rows' per-position counts (engine/metrics.py), the rounds
that reached each position and the shares accepted there, for the tables, the plots, the site and `profile`.

A round is a verification step that drafted at least one token; position k (0-based here, shown 1-based) is the
round's k-th draft (a token tree's depth k + 1). From accepted[k] (rounds whose draft k was committed) and
drafted[k] (rounds that drafted a token at k), summed over rows:
  rounds          drafted[0]: the rounds that drafted anything (vLLM's num_drafts)
  reached[k]      the rounds whose drafts before k were all committed: rounds at k = 0, accepted[k - 1] after
  conditional[k]  accepted[k] / reached[k]: accepted at k given every earlier draft was (specdec_bench's
                  conditional acceptance; the ratio of successive marginals an engine's synthetic mode draws with)
  marginal[k]     accepted[k] / rounds: the rounds that committed their first k + 1 drafts (vLLM's
                  `synthetic_acceptance_rates`, llama.cpp's `--spec-synth-rates`, specdec_bench's marginal rates);
                  the product of conditional[0..k], never increasing, and 1 + sum(marginal) is vLLM's mean
                  acceptance length (1 + accepted / rounds)
  per_drafted[k]  accepted[k] / drafted[k]: of the rounds that drafted a token at k, the share whose draft k was
                  committed (the report's per-position rates); the marginal where every round drafts every position
A round that drafted fewer tokens than k + 1 (an n-gram miss, adaptive lookahead) and committed them all reaches
k and is not accepted there, as an engine replaying the marginals would count it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import pandas as pd


def position_matrix(lists: Iterable, width: int | None = None) -> np.ndarray:
    """[rows, K] per-position counts (a column of them, or any lists), each row's list padded with zeros (a row
    without counts: all zeros); K the longest list's length, or `width` (longer lists cut)."""
    rows = [np.zeros(0, dtype=np.int64) if _missing(v) else np.asarray(v, dtype=np.int64) for v in lists]
    k = max((len(r) for r in rows), default=0) if width is None else width
    out = np.zeros((len(rows), k), dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : min(k, len(r))] = r[:k]
    return out


def reached(accepted: np.ndarray, drafted: np.ndarray) -> np.ndarray:
    """[..., K] the rounds that reached each position (see the module docstring), of sums or of rows alike."""
    return np.concatenate([drafted[..., :1], accepted[..., :-1]], axis=-1)


def _share(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


@dataclass(frozen=True)
class PositionAcceptance:
    """Per-position counts summed over rows ([K] each) and the shares the module docstring defines."""

    accepted: np.ndarray  # [K]
    drafted: np.ndarray  # [K]

    @property
    def rounds(self) -> int:
        return int(self.drafted[0]) if len(self.drafted) else 0

    @property
    def reached(self) -> np.ndarray:
        return reached(self.accepted, self.drafted)

    @property
    def conditional(self) -> np.ndarray:
        return _share(self.accepted, self.reached)

    @property
    def marginal(self) -> np.ndarray:
        return _share(self.accepted, np.full(len(self.accepted), self.rounds))

    @property
    def per_drafted(self) -> np.ndarray:
        return _share(self.accepted, self.drafted)


def position_acceptance(group: pd.DataFrame, width: int | None = None) -> PositionAcceptance:
    """The rows' counts summed, padded to one width: the longest list, or `width` (e.g. the run's gamma)."""
    accepted, drafted = (position_matrix(group[c]) if c in group else np.zeros((0, 0), dtype=np.int64)
                         for c in ("accepted_per_position", "drafted_per_position"))
    k = max(accepted.shape[1], drafted.shape[1]) if width is None else width
    return PositionAcceptance(_fit(accepted.sum(axis=0), k), _fit(drafted.sum(axis=0), k))


def _fit(values: np.ndarray, width: int) -> np.ndarray:
    return np.pad(values, (0, max(0, width - len(values))))[:width]


def _missing(value) -> bool:
    return value is None or (not hasattr(value, "__len__") and pd.isna(value))
