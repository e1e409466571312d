"""bench's results as they leave it: each system's measurement (`SystemMeasurement`), sdbench's outputs checked against
transformers' `generate`, an engine's agreement reported, the speed table, the engines' lines and bench.parquet's
rows."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from rich.table import Table

from sdbench.busy import BUSY, Busy, weighted
from sdbench.engine.counters import Rounds
from sdbench.engine.formulas import rate
from sdbench.env import environment
from sdbench.errors import SdbenchError
from sdbench.reporting.carry import Carried
from sdbench.reporting.carry import columns as carry_columns
from sdbench.reporting.latency import Call, Latency, Timed, latencies, over_repeats, repeat_tpot, repeat_ttft
from sdbench.reporting.latency import columns as latency_columns
from sdbench.reporting.schema import env_fields
from sdbench.servers.engines import EngineTotals

GENERIC_ROW = "sdbench autoregressive, generic runner (the library's forward)"
SAME_OUTPUT = ("sdbench's fast systems against its fast plain decoding (exact: bit for bit, every step "
               "width-invariant), its other systems and the engines against generate's dynamic cache, up to ties in "
               "their rounding")


class OutputDiffers(SdbenchError):
    """An sdbench system's tokens differ from transformers' greedy `generate` on some prompt: not lossless."""

    exit_code = 1


@dataclass
class SystemMeasurement:
    system: str
    fast: bool  # runs on the packed (fast-path) weights; the others on plain ones
    tokens: list[int] = field(default_factory=list)  # per repeat, over all prompts
    seconds: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # the first repeat's, per prompt
    engine: EngineTotals | None = None  # an engine's system: its replies (timings, its own acceptance counters)
    failed: str | None = None  # why the system stopped mid-measurement (an engine's server died): not measured
    # the measured callable: sdbench's own (SdbenchSystem), transformers' (TransformersSystem), an engine's (EngineSystem)
    source: object = None
    calls: list[Call] = field(default_factory=list)  # every measured call, timed by `_measure`
    load: list[tuple[Busy, float]] = field(default_factory=list)  # per measured call: others' use, its seconds

    def busy(self) -> Busy:
        """The machine's use by others over its measured calls, weighted by their times (sdbench/busy.py)."""
        return weighted(self.load)

    @property
    def key(self) -> tuple[str, str | None] | None:
        """(strategy, drafter) of an sdbench or engine system, None for transformers'."""
        return getattr(self.source, "key", None)

    @property
    def decoding(self) -> tuple[str, str | None] | None:
        """(strategy, drafter) of every system, transformers' too: what an engine's row of the same decoding is."""
        return self.key if self.key is not None else getattr(self.source, "decoding", None)

    @property
    def rounds(self) -> Rounds | None:
        """Its decoding after each first token, in rounds (`engine/counters.py` `Rounds`); None for transformers'."""
        if self.engine is not None:
            return self.engine.rounds()
        return getattr(self.source, "rounds", None)

    def rates(self) -> list[float]:
        return [rate(t, s) for t, s in zip(self.tokens, self.seconds)]

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(self.rates())

    def repeat_calls(self, r: int) -> list[Call]:
        return [c for c in self.calls if c.repeat == r]

    def repeat_tpots(self) -> list[float]:
        """Its time per output token after the first, per repeat (`reporting/latency.repeat_tpot`)."""
        return [repeat_tpot(self.repeat_calls(r)) for r in range(len(self.tokens))]

    def timed(self) -> Timed:
        """Its latency figures (`reporting/latency.py`): per repeat, then their medians."""
        repeats = range(len(self.tokens))
        return Timed(self.system, None if self.engine is None else self.engine.engine, self.decoding,
                     self.tokens_per_s if self.tokens else math.nan,
                     over_repeats([repeat_ttft(self.repeat_calls(r)) for r in repeats]),
                     over_repeats(self.repeat_tpots()), bool(self.failed))


def first_difference(outputs: list[list[int]], reference: list[list[int]]) -> tuple[int, int] | None:
    """(prompt, new token) where outputs first differ from the reference, or None."""
    for i, (ours, theirs) in enumerate(zip(outputs, reference)):
        if ours != theirs:
            at = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            return i, at
    return None


def write_bench(results: list[SystemMeasurement], out: str, common: dict, carried: list[Carried] = (),
                held: dict | None = None):
    """<out>/bench.parquet: one row per system and repeat, with the environment columns `run` records, the repeat's
    TTFT and TPOT and the system's ratios over each engine (`reporting/latency.py`), each speculative system's
    carry-over row (`reporting/carry.py`) and what its outputs were held to (`bench_judge.Held`)."""
    env = env_fields(environment(common["device"], common["dtype"]))
    ref = results[0].outputs
    carry_of = {c.system: c for c in carried}
    latency_of: dict[str, Latency] = {row.system: row for row in latencies([m.timed() for m in results])}
    rows = [{"system": m.system, **common, "repeat": r, "tokens": m.tokens[r], "seconds": m.seconds[r],
             "tokens_per_s": m.rates()[r], "same_output": m.outputs == ref, "threads": torch.get_num_threads(),
             "ttft_s": repeat_ttft(m.repeat_calls(r)), "tpot_s": repeat_tpot(m.repeat_calls(r)),
             **latency_columns(latency_of.get(m.system)), **_engine_fields(m, ref),
             **carry_columns(carry_of.get(m.system)), **_busy_columns(m), **_held_columns((held or {}).get(m.system)),
             **env}
            for m in results for r in range(len(m.tokens))]
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path / "bench.parquet", index=False)
    return path / "bench.parquet"


def _held_columns(h) -> dict:
    """held_to (what its outputs must equal), exact (held bit for bit: every step width-invariant on both sides),
    divergence ("real", "tie" or None) and ties (prompts parted by a tie); None on transformers' rows."""
    if h is None:
        return {"held_to": None, "exact": None, "divergence": None, "ties": None}
    return {"held_to": h.against, "exact": h.exact, "divergence": h.verdict(), "ties": h.ties}


def _busy_columns(m: SystemMeasurement) -> dict:
    busy = m.busy()
    return {"busy_others": busy.others, "cpu_steal": busy.steal}


def _engine_fields(m: SystemMeasurement, reference: list[list[int]]) -> dict:
    """An engine system's columns (None on sdbench's and transformers' rows): the engine's own counters over the
    measurement, the median gap between its stream's events carrying tokens, prompts with generate's tokens, why it
    failed."""
    t = m.engine
    if t is None:
        return {"engine": None, "engine_drafted": None, "engine_accepted": None, "itl_s": None,
                "same_prompts": None, "failed": None}
    return {"engine": t.engine, "engine_drafted": t.drafted, "engine_accepted": t.accepted, "itl_s": t.itl,
            "same_prompts": same_prompts(m.outputs, reference), "failed": m.failed}


def _table(results: list[SystemMeasurement], roofline: float, held: dict, title: str) -> Table:
    table = Table(title=title)
    for col in ("system", "tokens", "tokens/s (median)", "spread (min-max)", "vs peer", "same output", "of roofline"):
        table.add_column(col, justify="right" if col != "system" else "left")
    ref = results[0].outputs
    peer = None
    plains = {}  # each engine's first row: its plain decoding
    for m in results:
        if m.engine is not None:
            plains.setdefault(m.engine.engine, m)
    for m in results:
        if m.failed:
            table.add_row(m.system, "", "failed", "", "", "", "")
            continue
        if m.system.startswith("transformers"):
            peer = m  # each sdbench row is compared with the transformers row above it
        mine = plains[m.engine.engine] if m.engine is not None else peer  # an engine's rows: with its own plain
        ratio = "" if m is mine or not mine.tokens_per_s else f"{m.tokens_per_s / mine.tokens_per_s:.2f}x"
        rates = m.rates()
        same = held[m.system].cell(len(ref)) if m.system in held else "yes" if m.outputs == ref else "no"
        table.add_row(m.system + (" (busy)" if m.busy().busy else ""), str(sum(m.tokens)), f"{m.tokens_per_s:.2f}",
                      f"{min(rates):.2f}-{max(rates):.2f}", ratio, same, f"{m.tokens_per_s / roofline:.0%}")
    plain = next((m for m in results if "no fast path" in m.system), None)
    fast = fast_row(results)
    generic = next((m for m in results if m.system == GENERIC_ROW), None)
    table.caption = (f"roofline (weights read once per token at the best streaming read measured): {roofline:.1f} "
                     f"tokens/s; same output: {SAME_OUTPUT}")
    if plain and fast and plain.tokens_per_s:
        table.caption += f"; fast path / no fast path (autoregressive): {fast.tokens_per_s / plain.tokens_per_s:.2f}x"
    if plain and generic and generic.tokens_per_s:
        table.caption += (f"; native / generic runner (autoregressive, no fast path): "
                          f"{plain.tokens_per_s / generic.tokens_per_s:.2f}x")
    busy = [m for m in results if m.busy().busy]
    if busy:
        table.caption += (f"; busy: other processes (or the hypervisor) took more than {BUSY:.0%} of the cores while "
                          "it was measured (" + "; ".join(f"{m.system}: {m.busy().said()}" for m in busy) +
                          "): its figures are slowed by other work")
    for plain_engine in plains.values() if fast else ():
        if not plain_engine.failed and plain_engine.tokens_per_s:
            table.caption += (f"; {fast.system} / {plain_engine.system}: "
                              f"{fast.tokens_per_s / plain_engine.tokens_per_s:.2f}x")
    return table


def fast_row(results: list[SystemMeasurement]) -> SystemMeasurement | None:
    """sdbench's own plain decoding on its fastest path: the row every sdbench strategy is measured against."""
    return next((m for m in results if m.system.startswith("sdbench autoregressive")
                 and "no fast path" not in m.system and m.system != GENERIC_ROW), None)


def same_prompts(outputs: list[list[int]], reference: list[list[int]]) -> int:
    """Prompts whose tokens equal the reference's."""
    return sum(a == b for a, b in zip(outputs, reference))


def engine_lines(results: list[SystemMeasurement]) -> list[str]:
    """One line per engine system: its own acceptance counters, the median gap between its stream's events (its
    TTFT and TPOT are in the latency table, timed as every system's; its agreement with generate's tokens is the
    table's, each differing prompt a line of `bench_judge.held_lines`); or why it failed."""
    lines = []
    for m in results:
        if m.engine is None:
            continue
        if m.failed:
            lines.append(f"{m.system}: failed mid-measurement, left out: {m.failed}")
            continue
        t = m.engine
        parts = []
        if t.drafted is not None:
            rate_ = f" ({t.acceptance:.0%})" if t.acceptance is not None else ""
            parts.append(f"the engine's own counters: {t.accepted} of {t.drafted} drafted tokens accepted{rate_}")
        if t.itl is not None:
            parts.append(f"median ITL {t.itl * 1000:.1f} ms")
        if parts:
            lines.append(f"{m.system}: " + "; ".join(parts))
    return lines
