"""Every metric formula, defined once.

Tokens are counted from token ids: a row's new tokens are the ids it committed after its prompt, for the
baseline and for every strategy alike. A step is one target verification; the mean accepted length counts
the token the target adds itself (correction or bonus), so plain decoding scores exactly 1.0.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import torch


def now(device: torch.device | str | None = None) -> float:
    """perf_counter after the device has finished its queued work."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Marks:
    """Phase timestamps that need no wait of their own: CUDA events on a GPU, read once the round's results
    have reached the host anyway (the one wait per round), perf_counter elsewhere. The time between two
    marks is then the device's time from one to the other, as a synchronised clock would measure it."""

    def __init__(self, device: torch.device | str | None = None):
        self.cuda = device is not None and torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        """Time from mark a to mark b; on a GPU, only after the work before b has finished."""
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def mean_accepted_length(accepted: int, steps: int) -> float:
    return (accepted + steps) / steps if steps else math.nan


def acceptance_rate(accepted: int, drafted: int) -> float:
    return accepted / drafted if drafted else math.nan


def rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else math.nan


@dataclass
class RowStats:
    """One prompt's counters over a generation."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # steps that rejected one of their drafted tokens
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: steps whose draft j was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [j]: steps that drafted a token at j
    draft_s: float = 0.0  # the batch's drafting time over the steps this row was active
    verify_s: float = 0.0

    def add_step(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += accepted < drafted
        self.draft_s += draft_s
        self.verify_s += verify_s
        for counts, n in ((self.drafted_per_position, drafted), (self.accepted_per_position, accepted)):
            counts.extend([0] * (n - len(counts)))
            for j in range(n):
                counts[j] += 1


@dataclass
class BatchResult:
    """The outcome of decoding one batch of prompts."""

    output_ids: list[list[int]]  # new tokens per row (prompt excluded)
    prompt_tokens: list[int]
    rows: list[RowStats]
    wall_s: float  # prefill to last token, the whole batch
    ttft_s: float  # prefill to first token
    extras: list[dict] = field(default_factory=list)  # per row: the proposer's row_stats()

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.output_ids)


def row_metrics(result: BatchResult, b: int) -> dict:
    """The per-prompt metric columns of a result row."""
    stats, n = result.rows[b], len(result.output_ids[b])
    return {
        "prompt_tokens": result.prompt_tokens[b],
        "new_tokens": n,
        "wall_s": result.wall_s,
        "tokens_per_s": rate(n, result.wall_s),
        "batch_tokens_per_s": rate(result.new_tokens, result.wall_s),
        "steps": stats.steps,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "mean_accepted_len": mean_accepted_length(stats.accepted, stats.steps),
        "acceptance_rate": acceptance_rate(stats.accepted, stats.drafted),
        "accepted_per_position": list(stats.accepted_per_position),
        "drafted_per_position": list(stats.drafted_per_position),
        "ttft_s": result.ttft_s,
        "tpot_s": (result.wall_s - result.ttft_s) / (n - 1) if n > 1 else math.nan,
        "draft_s": stats.draft_s,
        "verify_s": stats.verify_s,
        "strategy_stats": json.dumps(result.extras[b] if b < len(result.extras) else {}, sort_keys=True),
    }


def speedup(tokens_per_s: float, baseline_tokens_per_s: float) -> float:
    return tokens_per_s / baseline_tokens_per_s if baseline_tokens_per_s > 0 else math.nan


def predicted_speedup(stats: RowStats, baseline: RowStats) -> float:
    """The cost model's speedup from this run's own measurements.

    alpha: fitted to the row's accepted lengths; gamma: mean drafted tokens per step; draft cost c: drafting
    time per drafted token over the baseline's time per target forward; verify cost v: time per
    verification over the same. Whatever the model leaves out (bookkeeping, non-geometric acceptance, the
    budget cutting the last step short) shows as the gap to the measured speedup.
    """
    from sdbench.theory import fit_alpha, predicted_speedup as formula

    if not (stats.steps and baseline.steps and baseline.verify_s > 0):
        return math.nan
    target_forward = baseline.verify_s / baseline.steps
    gamma = stats.drafted / stats.steps
    c = stats.draft_s / stats.drafted / target_forward if stats.drafted else 0.0
    v = stats.verify_s / stats.steps / target_forward
    return formula(fit_alpha(stats.accepted, stats.rejections), gamma, c, v)
