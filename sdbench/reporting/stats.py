"""Uncertainty, defined once: bootstrap intervals on speedups and rates, the repeats' spread, and how many
prompts a claim would need. Report, compare and tune all use these helpers.

A speedup aggregates as a ratio of sums: (tokens / seconds of the measured side) / (tokens / seconds of the
reference side), summed over the same prompts and repeats. Its 95 % interval comes from a seeded two-stage
bootstrap: draw clusters (a batch of prompts decoded together: one prompt at --batch-size 1) with
replacement, then, within each drawn cluster, its repeats with replacement; each draw keeps a cluster's
measured side and its reference side together (paired: the baseline of the same prompts and repeat). The
interval is the 2.5th to 97.5th percentile of the ratio over the draws. Rows of one batch share one wall time,
so a batch, not a row, is the unit resampled. The same seed gives the same interval every time.

The interval counts independent units (prompts; batches at --batch-size > 1), never tokens or repeats: below
MIN_PROMPTS of them no interval is drawn (two numbers give no 95 % interval that means anything, however many
repeats each has), and the tables say "too few prompts" instead of showing the figure as beyond noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

LEVEL = 0.95
DRAWS = 2000
SEED = 0
MIN_PROMPTS = 5  # independent units (prompts, or batches) below which no interval is drawn
_CELL_BUDGET = 4_000_000  # floats per chunk of draws: bounds memory on large runs


@dataclass(frozen=True)
class Interval:
    """A point estimate and its bootstrap interval; low/high NaN when there was nothing to resample, or too little."""

    value: float
    low: float = math.nan
    high: float = math.nan
    units: int | None = None  # the independent units it resampled (or had too few of); None: not counted

    @property
    def too_few(self) -> bool:
        """No interval for want of prompts (fewer than MIN_PROMPTS independent units)."""
        return self.units is not None and self.units < MIN_PROMPTS

    @property
    def known(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high)

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2 if self.known else math.nan

    def contains(self, x: float) -> bool:
        return self.known and self.low <= x <= self.high

    def shifted(self, by: float) -> Interval:
        return Interval(self.value + by, self.low + by, self.high + by, self.units)


def row_interval(row, column: str) -> Interval:
    """A summary row's figure (`speedup`, `decode_speedup`) with its interval (`<column>_low`, `<column>_high`)."""
    return Interval(float(row[column]), float(row.get(f"{column}_low", np.nan)),
                    float(row.get(f"{column}_high", np.nan)))


def _ratio(sums: np.ndarray) -> np.ndarray:
    """[..., 4] sums (tokens, seconds, reference tokens, reference seconds) -> the ratio of the two rates."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return (sums[..., 0] / sums[..., 1]) / (sums[..., 2] / sums[..., 3])


def bootstrap_ratio(cells: np.ndarray, paired_repeats: bool = True, draws: int = DRAWS, seed: int = SEED,
                    level: float = LEVEL) -> Interval:
    """cells: [C, R, 4] per cluster and repeat, (tokens, seconds) of the measured side then of the reference
    side; a missing repeat is NaN. The interval of the ratio of rates (see the module docstring); none below
    MIN_PROMPTS clusters. paired_repeats False: the two sides' repeats are drawn independently (repeats of separate
    runs, as `compare` has)."""
    cells = np.asarray(cells, dtype="float64")
    value = float(_ratio(np.nansum(cells, axis=(0, 1))))
    clusters, repeats = cells.shape[:2]
    if clusters < MIN_PROMPTS or not math.isfinite(value):
        return Interval(value, units=clusters)
    rng = np.random.default_rng(seed)
    picked_clusters = rng.integers(0, clusters, size=(draws, clusters))[:, :, None]
    measured_repeats = rng.integers(0, repeats, size=(draws, clusters, repeats))
    reference_repeats = measured_repeats if paired_repeats else rng.integers(0, repeats, size=measured_repeats.shape)
    chunk = max(1, _CELL_BUDGET // (clusters * repeats * 4))
    ratios = []
    for i in range(0, draws, chunk):
        at = slice(i, i + chunk)
        measured = np.nansum(cells[picked_clusters[at], measured_repeats[at], :2], axis=(1, 2))
        reference = np.nansum(cells[picked_clusters[at], reference_repeats[at], 2:], axis=(1, 2))
        ratios.append(_ratio(np.concatenate([measured, reference], axis=-1)))
    ratios = np.concatenate(ratios)
    tail = (1 - level) / 2 * 100
    low, high = np.nanpercentile(ratios, [tail, 100 - tail]) if np.isfinite(ratios).any() else (math.nan,) * 2
    return Interval(value, float(low), float(high), clusters)


def _unit_keys(rows: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(cluster, repeat) per row: the batch decoded together (its prompt when the batch is not recorded)."""
    batch = rows["batch_id"] if "batch_id" in rows else pd.Series(np.nan, index=rows.index)
    prompt = rows["prompt_id"] if "prompt_id" in rows else pd.Series(rows.index, index=rows.index)
    cluster = batch.astype(object).where(batch.notna(), "p:" + prompt.astype(str))
    repeat = rows["repeat"] if "repeat" in rows else pd.Series(0, index=rows.index)
    return cluster.astype(str), repeat.fillna(0).astype(int)


def unit_sums(rows: pd.DataFrame, decode: bool = False) -> pd.DataFrame:
    """Tokens and seconds per (cluster, repeat): tokens summed over the rows, seconds the batch's once (its max
    over the rows: they share it). decode: the decode phase alone (one first token per row and ttft_s left out)."""
    cluster, repeat = _unit_keys(rows)
    tokens = pd.to_numeric(rows["new_tokens"], errors="coerce").astype("float64")
    seconds = pd.to_numeric(rows["wall_s"], errors="coerce").astype("float64")
    if decode:
        tokens = tokens - 1
        seconds = seconds - pd.to_numeric(rows.get("ttft_s", np.nan), errors="coerce")
    frame = pd.DataFrame({"cluster": cluster, "repeat": repeat, "tokens": tokens, "seconds": seconds})
    return frame.groupby(["cluster", "repeat"]).agg(tokens=("tokens", "sum"), seconds=("seconds", "max"))


def paired_cells(measured: pd.DataFrame, reference: pd.DataFrame | None) -> np.ndarray:
    """[C, R, 4] from two (cluster, repeat)-indexed frames of tokens and seconds (unit_sums), joined on the
    units both have; reference None: the measured side's own rate (reference tokens = seconds = 1)."""
    if reference is None:
        reference = pd.DataFrame({"tokens": 1.0, "seconds": 1.0}, index=measured.index)
    joined = measured.join(reference.add_suffix("_ref"), how="inner").dropna()
    if joined.empty:
        return np.zeros((0, 0, 4))
    clusters = list(dict.fromkeys(joined.index.get_level_values(0)))
    repeats = list(dict.fromkeys(joined.index.get_level_values(1)))
    cells = np.full((len(clusters), len(repeats), 4), np.nan)
    at_c, at_r = {c: i for i, c in enumerate(clusters)}, {r: i for i, r in enumerate(repeats)}
    for (c, r), values in zip(joined.index, joined[["tokens", "seconds", "tokens_ref", "seconds_ref"]].to_numpy()):
        cells[at_c[c], at_r[r]] = values
    return cells


def speedup_interval(measured: pd.DataFrame, reference: pd.DataFrame | None, decode: bool = False) -> Interval:
    """The interval of measured's rate over reference's (result rows), paired by batch and repeat."""
    base = None if reference is None else unit_sums(reference, decode)
    cells = paired_cells(unit_sums(measured, decode), base)
    return bootstrap_ratio(cells) if cells.size else Interval(math.nan)


def sums_interval(rows: pd.DataFrame, numerator, denominator) -> Interval:
    """The interval of sum(numerator) / sum(denominator) over `rows` (one value of each per row: an acceptance
    share, a mean accepted length), by the same cluster bootstrap as a speedup's with no reference side."""
    cluster, repeat = _unit_keys(rows)
    frame = pd.DataFrame({"tokens": np.asarray(numerator, dtype="float64"),
                          "seconds": np.asarray(denominator, dtype="float64")}, index=rows.index)
    sums = frame.groupby([cluster.rename("cluster"), repeat.rename("repeat")]).sum()
    cells = paired_cells(sums, None)
    return bootstrap_ratio(cells) if cells.size else Interval(math.nan)


def spread(values) -> tuple[float, float, int]:
    """(median, median absolute deviation, count) of the finite values."""
    values = np.asarray(values, dtype="float64")
    values = values[np.isfinite(values)]
    if not len(values):
        return math.nan, math.nan, 0
    median = float(np.median(values))
    return median, float(np.median(np.abs(values - median))), len(values)


def repeat_spread(rows: pd.DataFrame) -> tuple[float, int]:
    """(MAD / median of tokens/s over repeats, repeats): each repeat's tokens/s aggregated over its batches."""
    sums = unit_sums(rows).groupby(level="repeat").sum()
    median, mad, n = spread(sums["tokens"] / sums["seconds"])
    return (mad / median if n > 1 and median > 0 else math.nan), n


def prompts_needed(prompts: int, half_width: float, difference: float) -> int | None:
    """An estimate of the prompts at which the interval's half-width would fall below `difference`: the
    half-width shrinks like 1/sqrt(n), so n * (half_width / difference)^2; None when it cannot be told."""
    if not (prompts > 0 and math.isfinite(half_width) and math.isfinite(difference) and difference > 0):
        return None
    return max(prompts + 1, math.ceil(prompts * (half_width / difference) ** 2))


def describe(interval: Interval, unit: str = "x", digits: int = 2) -> str:
    """'1.12x ±0.04' (half the interval's width), '1.12x' when no interval is known, '–' without a value."""
    if not math.isfinite(interval.value):
        return "–"
    text = f"{interval.value:.{digits}f}{unit}"
    return f"{text} ±{interval.half_width:.{digits}f}" if interval.known else text


def mark(interval: Interval, than: float = 1.0) -> str:
    """What a figure's interval lets it claim against `than` (1.0: no speedup): '*' the interval contains it (no
    difference beyond noise), '?' no interval (too few prompts, or nothing to resample), '' a difference shown."""
    if not math.isfinite(interval.value):
        return ""
    if not interval.known:
        return "?"
    return "*" if interval.contains(than) else ""


def doubt(interval: Interval, than: float, prompts: int, what: str) -> str | None:
    """None when the interval's half-width is below the claimed difference |value - than|; otherwise why the
    claim ('what') cannot be made, with an estimate of the prompts that would settle it."""
    difference = abs(interval.value - than)
    if interval.known and interval.half_width < difference:
        return None
    if not interval.known:
        return f"{what}: no interval ({prompts} prompt(s); an interval needs at least {MIN_PROMPTS}): run more prompts"
    needed = prompts_needed(prompts, interval.half_width, difference)
    more = f"about {needed} prompts would settle it (estimate: n·(width/difference)²)" if needed else \
        "no prompt count would settle a zero difference"
    return (f"{what}: the 95 % interval (±{interval.half_width:.3g}) is wider than the difference "
            f"{difference:.3g} over {prompts} prompt(s); {more}")
