"""Building a result row: the one place a row is assembled, every column named (schema.SCHEMA), from what the
run's rows record alike, the configuration that decoded it, its place, its metrics and what they are judged
against.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Protocol

from sdbench.busy import Busy
from sdbench.engine.metrics import RowMetrics, speedup


@dataclass(frozen=True)
class RunFields:
    """What every row of a run (or of one load point of it) records alike."""

    target: str
    dataset: str
    batch_size: int  # under load: the load point's slots
    temperature: float
    top_p: float
    seed: int
    fast: bool
    max_new_tokens: int
    prompt_len: int | None
    schedule_entry: str | None
    runner: str | None
    probe: str | None
    probe_gap: float | None
    probe_reused: bool | None = None
    sweep: str | None = None
    request_rate: float | None = None  # under load
    concurrency: int | None = None  # under load
    slo: str | None = None  # under load, with --slo
    engine: str | None = None  # `run --engine`: the engine whose server decodes every role; None: sdbench's loop


@dataclass(frozen=True)
class Place:
    """Where a row sits: its prompt, the repeat, the batch (or load point) and the turn."""

    category: str
    prompt_id: str
    repeat: int
    batch_id: int
    turn: int = 1
    depth: float | None = None  # retrieval tasks: where the answer was hidden


class Described(Protocol):
    """What a row records of the configuration that decoded it (commands/roles.py Role)."""

    name: str  # the `role` column
    strategy: str
    drafts: tuple[str, ...]

    def params(self) -> dict: ...


@dataclass(frozen=True)
class Judged:
    """What a row's figures are judged against: the baseline's row of the same prompt, and the cost model."""

    baseline: RowMetrics | None  # None: no baseline ran (or the request was not served by it)
    greedy: bool  # outputs are compared token for token only under greedy decoding
    predicted_speedup: float = math.nan
    found: bool | None = None  # retrieval tasks: the output holds the answer
    divergence: tuple[str, float] | None = None  # greedy output unlike the baseline's: ("tie" | "real", logit gap)
    width_invariant: bool | None = None  # every target step past the prefill ran width-invariant (None: not known)


def result_row(run: RunFields, role: Described, place: Place, m: RowMetrics, judged: Judged,
               memory: tuple[int | None, str], weights: str, busy: Busy = Busy()) -> dict:
    """One result row, every column named here (SCHEMA). memory: (peak bytes, kind) as sdbench.env.peak_memory;
    weights: "random" when the row's target or a draft is MODEL@random, else "real"; busy: the machine's use by
    others while the row's batch was decoded (sdbench/busy.py)."""
    params = role.params()
    row = {**asdict(run), **asdict(place), "role": role.name, "strategy": role.strategy,
           "params": json.dumps(params, sort_keys=True), "draft": ",".join(role.drafts), "gamma": params.get("gamma"),
           "output_ids": list(m.output_ids), "prompt_tokens": m.prompt_tokens, "new_tokens": m.new_tokens,
           "steps": m.steps, "drafted": m.drafted, "accepted": m.accepted, "mean_accepted_len": m.mean_accepted_len,
           "acceptance_rate": m.acceptance_rate, "accepted_per_position": list(m.accepted_per_position),
           "drafted_per_position": list(m.drafted_per_position), "draft_s": m.draft_s, "verify_s": m.verify_s,
           "accept_s": m.accept_s, "observe_s": m.observe_s, "loop_s": m.loop_s,
           "wall_s": m.wall_s, "tokens_per_s": m.tokens_per_s, "batch_tokens_per_s": m.batch_tokens_per_s,
           "ttft_s": m.ttft_s, "tpot_s": m.tpot_s, "setup_s": m.setup_s,
           "strategy_stats": json.dumps(m.strategy_stats, sort_keys=True), "peak_mem_bytes": memory[0],
           "mem_kind": memory[1], "weights": weights, "predicted_speedup": judged.predicted_speedup,
           "found": judged.found, "tree_steps": m.tree_steps, "tree_nodes": m.tree_nodes,
           "sibling_accepts": m.sibling_accepts, "verified_width": m.verified_width,
           "tried_per_depth_rank": [list(r) for r in m.tried_per_depth_rank],
           "accepted_per_depth_rank": [list(r) for r in m.accepted_per_depth_rank],
           "busy_others": _known(busy.others), "cpu_steal": _known(busy.steal),
           "width_invariant": judged.width_invariant}
    if m.served is not None:
        row.update(asdict(m.served))
    if judged.baseline is not None:
        row["speedup"] = speedup(m.tokens_per_s, judged.baseline.tokens_per_s)
        if judged.greedy:
            row["lossless"] = m.output_ids == judged.baseline.output_ids
    if judged.divergence is not None:
        row["divergence"], row["divergence_gap"] = judged.divergence
    return row


def _known(value: float) -> float | None:
    return value if math.isfinite(value) else None
