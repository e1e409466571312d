"""Aggregates over result rows, each defined once, and acceptance by draft position from element-wise sums.

The aggregates are the project's contract (tokens/s, speedups, mean accepted length and acceptance rate
are sdbench.engine.metrics functions of the sums):
  tokens_per_s       sum(new_tokens) / sum(wall_s over unique (run_id, role, batch_id, repeat)):
                     rows of one batch share its wall time, which must be counted once
  speedup            strategy tokens_per_s / baseline tokens_per_s of the same run and group
  decode_speedup     the same ratio for the decode phase alone: (new_tokens - one first token per row) /
                     sum(wall_s - ttft_s over unique batches); at long context the shared prefill no longer
                     dilutes what the strategy does
  mean_accepted_len  (sum(new_tokens) - one first token per row) / sum(steps): tokens committed per step, the
                     target's own token included, 1.0 = plain decoding (sdbench.engine.metrics defines each count)
  acceptance_rate    sum(accepted) / sum(drafted)
  lossless           all of the known values, a row whose output differs only from a tie on (divergence
                     "tie", see sdbench.commands.divergence) counting as lossless; null when none is known
  ties               rows whose output differs from the baseline's only from such a tie
  width_invariant    every row's target steps ran width-invariant (its lossless is bit for bit, no tie allowed)
  speedup_low/high   the 95 % bootstrap interval of speedup (and decode_speedup_low/high of decode_speedup),
                     paired with the baseline of the same batch and repeat (sdbench.reporting.stats)
  predicted_speedup  the rows' predictions combined as decode_speedup combines their tokens and times: decode
                     tokens (new_tokens - 1 per row) over the time each row's prediction gives them
                     (sdbench.engine.formulas.combined_speedup)
  draft_share        draft_s / (draft_s + verify_s), each summed over unique batches of the batch's value
                     (the max over its rows: a row records the batch's time while the row was active)
  accept_s, observe_s, loop_s, setup_s   summed as draft_s and verify_s: a round's other parts and the
                     proposer's setup (engine/metrics.py)
  busy_others, cpu_steal  the share of the cores other processes (and the hypervisor) took while the rows were
                     measured, over the unique batches weighted by their wall time (sdbench/busy.py)
  speedup_bound, distorted, busy, distortion   what the speedups cannot exceed and the rows above it, the machine
                     busy on either side (reporting/bounds.py)
  weights_say_nothing  rows with random weights (MODEL@random), whose acceptance and speedups depend on values
                     the weights do not have; the tables show them as n/m (a model drafting for itself with a
                     dense cache is exempt: it accepts every draft whatever its weights)
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from sdbench.engine.formulas import acceptance_rate, combined_speedup, mean_accepted_length, rate
from sdbench.engine.metrics import speedup
from sdbench.reporting.bounds import bounded, workers_of
from sdbench.reporting.cells import numeric
from sdbench.reporting.labels import labelled, prepared
from sdbench.reporting.positions import position_acceptance
from sdbench.reporting.stats import Interval, row_interval, speedup_interval

ALL = "ALL"
ROUND_PARTS = ("accept_s", "observe_s", "loop_s", "setup_s")  # summed over unique batches as draft_s and verify_s
BATCH = ["run_id", "role", "batch_id", "repeat"]


def summarize(df: pd.DataFrame, by: tuple[str, ...] | list[str] = ("category",)) -> pd.DataFrame:
    """One row per (run, role/strategy, group), plus one per (run, role/strategy) with every `by` = "ALL"."""
    by = list(by)
    data = prepared(df, by)
    keys = ["run_id", "role", "strategy"]
    records = []
    for key, group in data.groupby(keys + by, sort=False, dropna=False):
        records.append({**dict(zip(keys + by, key)), **_aggregate(group)})
    for key, group in data.groupby(keys, sort=False, dropna=False):
        records.append({**dict(zip(keys, key)), **{b: ALL for b in by}, **_aggregate(group)})
    summary = pd.DataFrame(records, columns=keys + by + list(_aggregate(data.iloc[:0])))
    summary["speedup"] = _speedups(summary, by, "tokens_per_s")
    summary["decode_speedup"] = _speedups(summary, by, "decode_tokens_per_s")
    summary = summary.join(_intervals(data, summary, by))
    summary = summary.join(bounded(summary, by))
    summary.attrs["by"] = tuple(by)
    if "hardware" in data:  # run -> the machine it ran on: tables of several machines' runs name each
        summary.attrs["hardware"] = data.groupby("run_id", sort=False)["hardware"].first().astype(str).to_dict()
    return summary


def _intervals(data: pd.DataFrame, summary: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Per summary row, the bootstrap interval of its speedup and decode speedup over the baseline rows of the
    same run and group; NaN for the baseline itself and where nothing can be resampled."""
    columns = ["speedup_low", "speedup_high", "decode_speedup_low", "decode_speedup_high"]
    out = pd.DataFrame(np.nan, index=summary.index, columns=columns)
    for i, row in summary.iterrows():
        if row["role"] == "baseline" or not np.isfinite(row["speedup"]):
            continue
        mask = data["run_id"].eq(row["run_id"])
        for b in by:
            if row[b] != ALL:
                mask &= data[b].eq(row[b])
        mine = data[mask & data["role"].eq(row["role"]) & data["strategy"].eq(row["strategy"])]
        base = data[mask & data["role"].eq("baseline")]
        for prefix, decode in (("speedup", False), ("decode_speedup", True)):
            interval = speedup_interval(mine, base, decode)
            out.loc[i, [f"{prefix}_low", f"{prefix}_high"]] = [interval.low, interval.high]
    return out


def speedup_of(row, prefix: str = "speedup") -> Interval:
    """A summary row's speedup (or decode_speedup) with its interval."""
    return row_interval(row, prefix)


def _ratio(num: float, den: float) -> float:
    return num / den if den and not math.isnan(den) and not math.isnan(num) else math.nan


def _per_batch(group: pd.DataFrame, columns: list[str]) -> dict[str, float]:
    """Per column, the sum over unique batches of a batch-level time (its max over the batch's rows); one grouping
    for every column.

    A row without batch_id is its own batch, so missing ids can never hide wall time.
    """
    keys = group[BATCH].astype(object)
    loose = keys["batch_id"].isna()
    keys.loc[loose, "batch_id"] = [f"row-{i}" for i in range(int(loose.sum()))]
    values = pd.DataFrame({c: numeric(group[c]) for c in columns}, index=group.index)
    per_batch = values.groupby([keys[k] for k in BATCH], dropna=False).max()
    return {c: float(per_batch[c].sum(min_count=1)) if len(per_batch) else math.nan for c in columns}


def _aggregate(group: pd.DataFrame) -> dict:
    new_tokens = np.nansum(numeric(group["new_tokens"]))
    steps, accepted = np.nansum(numeric(group["steps"])), np.nansum(numeric(group["accepted"]))
    parts = [part for part in ROUND_PARTS if part in group]
    wall_s = numeric(group["wall_s"])
    times = _per_batch(group.assign(decode_s=wall_s - numeric(group["ttft_s"]),
                                    busy_s=numeric(group["busy_others"]) * wall_s,
                                    steal_s=numeric(group["cpu_steal"]) * wall_s),
                       ["wall_s", "decode_s", "draft_s", "verify_s", "busy_s", "steal_s", *parts])
    wall, decode, draft_s, verify_s = (times[c] for c in ("wall_s", "decode_s", "draft_s", "verify_s"))
    predicted = numeric(group["predicted_speedup"])
    peak = numeric(group["peak_mem_bytes"])
    ties = group["divergence"].eq("tie").fillna(False).astype(bool)
    return {
        "n_prompts": int(group["prompt_id"].nunique()),
        "n_rows": len(group),
        "new_tokens": int(new_tokens),
        "wall_s": wall,
        "tokens_per_s": rate(new_tokens, wall),
        "speedup": math.nan,
        "decode_tokens_per_s": rate(new_tokens - len(group), decode),
        "decode_speedup": math.nan,
        "mean_accepted_len": mean_accepted_length(new_tokens, steps, len(group)),
        "acceptance_rate": acceptance_rate(accepted, np.nansum(numeric(group["drafted"]))),
        "steps": float(steps),
        "decode_s": decode,
        "draft_s": draft_s,
        "verify_s": verify_s,
        "draft_share": _ratio(draft_s, np.nansum([draft_s, verify_s])),
        **{part: times[part] for part in parts},
        "lossless": _all_known(group["lossless"].astype(object).where(~ties, True)),
        "ties": int(ties.sum()),
        "width_invariant": _all_known(group["width_invariant"]),
        "predicted_speedup": combined_speedup(numeric(group["new_tokens"]) - 1, predicted),
        "peak_mem_bytes": float(np.nanmax(peak)) if np.isfinite(peak).any() else math.nan,
        "weights_say_nothing": bool(group["weights_say_nothing"].any()),
        "busy_others": _ratio(times["busy_s"], wall),
        "cpu_steal": _ratio(times["steal_s"], wall),
        "workers": workers_of(group["params"]),
    }


def _all_known(values: pd.Series) -> bool | None:
    known = [bool(v) for v in values if not pd.isna(v)]
    return all(known) if known else None


def _speedups(summary: pd.DataFrame, by: list[str], column: str) -> pd.Series:
    keys = ["run_id"] + by
    base = summary.loc[summary["role"] == "baseline"].groupby(keys, dropna=False)[column].first()
    joined = summary.join(base.rename("_base"), on=keys)
    return pd.Series([speedup(a, b) for a, b in zip(joined[column], joined["_base"])], index=joined.index,
                     dtype="float64")


def per_position_rates(df: pd.DataFrame) -> list[tuple[str, str, list[float]]]:
    """(run_id, strategy, acceptance rate per draft position) from element-wise sums: reporting/positions.py's
    per_drafted; NaN = never drafted."""
    if "accepted_per_position" not in df or "drafted_per_position" not in df:
        return []
    data = labelled(df)
    out = []
    for (run_id, strategy), group in data[data["role"] != "baseline"].groupby(["run_id", "strategy"], sort=False):
        found = position_acceptance(group)
        if len(found.drafted):
            out.append((run_id, strategy, [float(r) for r in found.per_drafted]))
    return out
