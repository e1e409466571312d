"""The carry-over table (`bench`, and `report` of a bench.parquet): per speculative system, the decode speedup
predicted from sdbench's acceptance and its own engine's step costs beside the one it measured, and the gap's two
factors (`analysis/carry.py` defines them and computes the rows); plus the bench.parquet columns that hold one row
of it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from sdbench.reporting import latency
from sdbench.reporting.cells import fmt, number, ratio


@dataclass(frozen=True)
class Carried:
    """One speculative system's row of the carry-over table (`analysis/carry.py` defines its numbers)."""

    system: str
    engine: str  # "sdbench" for sdbench's own rows (carried = own: its acceptance measured where it runs)
    tokens_per_round: float  # the system's own L
    drafts_per_round: float
    verify: float  # v over the system's own rounds (their widths', else at its g + 1), in its engine
    draft: float  # c in its engine
    draft_round: float  # target forwards the round's drafting costs: draft_steps(g) c
    carried: float
    own: float
    measured: float
    overhead: float = math.nan  # o = h + s R / N: the round's overhead the prediction holds (analysis/carry.py)
    host_cost: float = math.nan  # h
    setup_cost: float = math.nan  # s
    rest_forwards: float = math.nan  # the rest's factors, for a system whose rounds were timed by part
    rest_host: float = math.nan
    rest_setup: float = math.nan
    measured_low: float = math.nan  # the lowest and highest decode speedup of one repeat (each over its engine's
    measured_high: float = math.nan  # plain decoding in the same repeat): the run's own noise

    @property
    def acceptance(self) -> float:
        return ratio(self.own, self.carried)

    @property
    def rest(self) -> float:
        return ratio(self.measured, self.own)

    @property
    def within_noise(self) -> bool | None:
        """Whether the carried prediction lies between the lowest and highest repeat's measured speedup (None where
        the run had fewer than two repeats to say)."""
        if math.isnan(self.measured_low) or math.isnan(self.carried):
            return None
        return self.measured_low <= self.carried <= self.measured_high

    @property
    def gap(self) -> float:
        """carried / measured - 1: how far the prediction from sdbench's acceptance lands from the engine."""
        return ratio(self.carried, self.measured) - 1.0


# Carried's fields as bench.parquet's columns
COLUMNS = {"tokens_per_round": "tokens_per_round", "drafts_per_round": "drafts_per_round",
           "verify": "step_verify_cost", "draft": "step_draft_cost", "draft_round": "round_draft_cost",
           "carried": "carried_speedup", "own": "own_predicted_speedup", "measured": "decode_speedup",
           "overhead": "round_overhead_cost", "host_cost": "round_host_cost", "setup_cost": "request_setup_cost",
           "rest_forwards": "rest_forwards", "rest_host": "rest_host", "rest_setup": "rest_setup",
           "measured_low": "repeat_speedup_low", "measured_high": "repeat_speedup_high"}
TITLE = "Does it carry over? Decode speedup of each speculative system over its own engine's plain decoding"
CAPTION = ("L tokens per round and g drafts per round: the system's own; v = T(k) / T(1) over the widths k "
           "its rounds verified (at k = g + 1 where they are not known) and c: its engine's step costs; drafting: the round's draft forwards in target forwards (g c; c for a block head, whose one "
           "forward drafts the round; more where the engine's drafter also runs the verification batch); o: the round's "
           "overhead beyond its forwards (host work and the draft's setup, timed by sdbench for its own systems); "
           "predicted = L / (drafting + v + o) with L and g from sdbench's run of the same strategy (carried) or "
           "from the engine's own counters (own); measured: tokens after the first over the time after the first "
           "token; per repeat: the lowest and highest repeat's (each over plain decoding in the same repeat), the "
           "gap marked ~ where the carried prediction lies between them. measured / carried = acceptance (own / "
           "carried) x rest (measured / own); sdbench's rest = forwards x host x setup, each part's measured time per "
           "round against its predicted one")


def columns(row: Carried | None) -> dict:
    """One bench.parquet row's carry-over columns (None where the system has no carry-over row)."""
    return {col: None if row is None else getattr(row, field) for field, col in COLUMNS.items()}


def from_frame(df: pd.DataFrame) -> list[Carried]:
    """The carry-over rows a bench.parquet holds: one per system that has them (its first repeat's row)."""
    if "carried_speedup" not in df:
        return []
    rows = []
    for system, group in df.groupby("system", sort=False):
        first = group.iloc[0]
        if pd.isna(first.get("decode_speedup")) and pd.isna(first.get("carried_speedup")):
            continue
        values = {field: number(first.get(col)) for field, col in COLUMNS.items()}
        rows.append(Carried(str(system), str(first.get("engine") or "sdbench"), **values))
    return rows


def carry_table(rows: list[Carried]) -> Table:
    table = Table(title=TITLE, caption=CAPTION)
    for col in ("system", "L", "g", "v", "c", "drafting", "o", "predicted (carried)", "predicted (own)",
                "measured", "per repeat", "carried / measured", "acceptance", "rest", "forwards x host x setup"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in rows:
        gap = fmt(r.gap, "{:+.0%}") + (" ~" if r.within_noise else "")
        table.add_row(r.system, fmt(r.tokens_per_round, "{:.2f}"), fmt(r.drafts_per_round, "{:.2f}"),
                      fmt(r.verify, "{:.2f}"), fmt(r.draft, "{:.2f}"), fmt(r.draft_round, "{:.2f}"),
                      fmt(r.overhead, "{:.3f}"), fmt(r.carried, "{:.2f}x"),
                      fmt(r.own, "{:.2f}x"), fmt(r.measured, "{:.2f}x"), _spread(r), gap,
                      fmt(r.acceptance, "{:.2f}"), fmt(r.rest, "{:.2f}"), _parts(r))
    return table


def _spread(r: Carried) -> str:
    if math.isnan(r.measured_low):
        return "—"
    return f"{r.measured_low:.2f}-{r.measured_high:.2f}x"


def _parts(r: Carried) -> str:
    if math.isnan(r.rest_forwards):
        return "—"
    return " x ".join(fmt(x, "{:.2f}") for x in (r.rest_forwards, r.rest_host, r.rest_setup))


def bench_files(paths: list[str]) -> list[str]:
    """The paths that are `bench --out` files (bench.parquet: a `system` column, no `run_id`)."""
    found = []
    for p in paths:
        path = Path(p)
        if path.is_file() and path.suffix == ".parquet":
            try:
                names = pq.read_schema(path).names
            except Exception:  # not Parquet: read_results says so
                continue
            if "system" in names and "run_id" not in names:
                found.append(p)
    return found


def print_bench(path: str, console: Console) -> None:
    """A bench.parquet's carry-over table, or one line where it has none (a run without speculative systems, or
    written before bench measured them); then its latency table (`reporting/latency.py`) where it has one."""
    df = pd.read_parquet(path)
    rows = from_frame(df)
    if rows:
        table = carry_table(rows)
        table.title = f"{path}: {TITLE}"
        console.print(table)
    else:
        console.print(f"{path}: a bench file without carry-over rows", highlight=False)
    timed = latency.from_frame(df)
    if timed:
        table = latency.latency_table(timed)
        table.title = f"{path}: {latency.TITLE}"
        console.print(table)
