"""`bench`'s latency table: every system's time to first token (TTFT) and time per output token after it (TPOT),
sdbench's, transformers' and each engine's, from the calls the one measuring loop timed (`commands/bench.measure_systems`;
`engine/metrics.py` defines the per-call figures, `engine/formulas.py` computes them); each system beside every
engine's row of the same decoding, end to end and after the first token; and the bench.parquet columns that hold
them.

Per repeat: TTFT the median over its calls, TPOT the calls' times after their first tokens over their tokens after
them (`decode_time_per_token`). Per system, as its tokens/s: the medians over the repeats.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import pandas as pd
from rich.table import Table

from sdbench.engine.formulas import decode_time_per_token
from sdbench.reporting.cells import fmt, number, ratio

END_TO_END, DECODE = "end_to_end", "decode"


@dataclass(frozen=True)
class Call:
    """One measured call of a system, in perf_counter seconds."""

    repeat: int
    start: float  # the loop called the system
    first: float  # its first new token was available (NaN: the system keeps no time after its first token)
    end: float  # the call returned its last token
    tokens: int  # new tokens, counted from the ids returned

    @property
    def ttft(self) -> float:
        return self.first - self.start

    @property
    def after_first(self) -> float:
        return self.end - self.first


def repeat_ttft(calls: list[Call]) -> float:
    """The median TTFT of calls that returned a token (NaN where none did)."""
    known = [c.ttft for c in calls if c.tokens > 0 and math.isfinite(c.ttft)]
    return statistics.median(known) if known else math.nan


def repeat_tpot(calls: list[Call]) -> float:
    return decode_time_per_token((c.after_first, c.tokens) for c in calls if math.isfinite(c.after_first))


def over_repeats(values: list[float]) -> float:
    """The median of a system's per-repeat figures, those it has (NaN where it has none)."""
    known = [v for v in values if math.isfinite(v)]
    return statistics.median(known) if known else math.nan


@dataclass(frozen=True)
class Timed:
    """What the latency table reads of one system: its medians over the repeats, and where it stands."""

    system: str
    engine: str | None  # the engine that runs it; None for sdbench's and transformers' systems
    decoding: tuple | None  # (strategy, drafter), as sdbench names the same decoding
    tokens_per_s: float  # end to end
    ttft: float
    tpot: float
    failed: bool = False


@dataclass(frozen=True)
class Latency:
    """One row of the latency table."""

    system: str
    ttft: float
    tpot: float
    vs: dict = field(default_factory=dict)  # engine -> (end to end, after the first token): the system over the
    # engine's row of the same decoding, above 1 where the system is faster (NaN: no such row, or the row itself)
    failed: bool = False


def latencies(systems: list[Timed]) -> list[Latency]:
    """Each system's row, with its ratios over every engine's row of the same decoding: tokens/s over the
    engine row's (end to end), the engine row's TPOT over the system's (after the first token)."""
    engines = list(dict.fromkeys(s.engine for s in systems if s.engine))
    same: dict = {}
    for s in systems:
        if s.engine and not s.failed:
            same.setdefault((s.engine, s.decoding), s)
    rows = []
    for s in systems:
        vs = {}
        for name in engines:
            other = same.get((name, s.decoding))
            vs[name] = ((math.nan, math.nan) if other is None or other is s or s.failed or s.decoding is None else
                        (ratio(s.tokens_per_s, other.tokens_per_s), ratio(other.tpot, s.tpot)))
        rows.append(Latency(s.system, s.ttft, s.tpot, vs, s.failed))
    return rows


def column(engine: str, kind: str) -> str:
    """The bench.parquet column of a system's ratio over `engine`'s row of the same decoding."""
    return f"vs_{engine}_{kind}"


def columns(row: Latency | None) -> dict:
    """A bench.parquet row's ratio columns (a system's, the same on each of its repeats)."""
    if row is None:
        return {}
    return {column(e, kind): v for e, pair in row.vs.items() for kind, v in zip((END_TO_END, DECODE), pair)}


TITLE = "Time to first token and per output token, every system timed by the same loop"
CAPTION = ("TTFT: the call to its first new token, median over the prompts; TPOT: the time after each first token "
           "over the tokens after it, summed over the prompts (answers of one token have none); both medians over "
           "the repeats. vs ENGINE: over that engine's row of the same decoding (plain, n-gram, draft model, "
           "head), end to end (tokens/s over its tokens/s) and after the first token (its TPOT over this TPOT); "
           "above 1: faster than the engine")


def latency_table(rows: list[Latency]) -> Table:
    engines = list(dict.fromkeys(e for r in rows for e in r.vs))
    table = Table(title=TITLE, caption=CAPTION)
    for col in ("system", "TTFT (ms)", "TPOT (ms)",
                *(f"vs {e} {k}" for e in engines for k in ("end to end", "after first token"))):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in rows:
        if r.failed:
            table.add_row(r.system, "failed", *[""] * (1 + 2 * len(engines)))
            continue
        ratios = [fmt(v, "{:.2f}x") for e in engines for v in r.vs.get(e, (math.nan, math.nan))]
        table.add_row(r.system, fmt(r.ttft * 1e3, "{:.1f}"), fmt(r.tpot * 1e3, "{:.2f}"), *ratios)
    return table


def from_frame(df: pd.DataFrame) -> list[Latency]:
    """The latency rows a bench.parquet holds (none where it has no TPOT column: written before bench timed every
    system)."""
    if "tpot_s" not in df or "ttft_s" not in df:
        return []
    engines = [c[len("vs_"):-len("_" + END_TO_END)] for c in df.columns
               if c.startswith("vs_") and c.endswith("_" + END_TO_END)]
    rows = []
    for system, group in df.groupby("system", sort=False):
        first = group.iloc[0]
        failed = "failed" in group and group.failed.notna().any()
        vs = {e: (number(first.get(column(e, END_TO_END))), number(first.get(column(e, DECODE)))) for e in engines}
        rows.append(Latency(str(system), over_repeats([number(v) for v in group.ttft_s]),
                            over_repeats([number(v) for v in group.tpot_s]), vs, bool(failed)))
    return rows
