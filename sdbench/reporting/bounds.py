"""Speedups that cannot be true, and a busy machine, said on every summary row.

A round of speculative decoding commits its accepted length L of tokens (the target's own included) and costs at
least one verifying forward, which costs at least a plain step: a speedup over plain decoding is at most L
(`engine.formulas.speedup_bound`; W times that with W target workers verifying at once). A speedup, or decode
speedup, more than SLACK above its bound, with an interval (where there is one) wholly above it, is **distorted**:
one side's time moved — most often plain decoding's, slowed by other work on the machine — and the figure says
nothing of the strategy. Each distorted row gets one line saying which side's time moved and what the machine's
use by others was on each side. A row is **busy** where other processes (or the hypervisor) took more than
sdbench.busy's thresholds of the cores while it or its baseline was measured.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from sdbench.busy import is_busy
from sdbench.engine.formulas import combined_speedup, mean_accepted_length, speedup_bound
from sdbench.reporting.stats import Interval, row_interval

SLACK = 0.03  # a speedup this far above its bound is still read as the clocks' noise
COLUMNS = ["speedup_bound", "distorted", "busy", "distortion"]
_FIGURES = (("speedup", "speedup"), ("decode_speedup", "decode speedup"))


def bounded(summary: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Per summary row (speedups, intervals and the round's times already in it): its bound, whether a speedup is
    above it, whether the machine was busy on either side, and the line that says why a row is distorted."""
    keys = ["run_id", *by]
    baselines = {tuple(r[k] for k in keys): r for r in summary[summary["role"] == "baseline"].to_dict("records")}
    out = pd.DataFrame({"speedup_bound": np.nan, "distorted": False, "busy": False, "distortion": None},
                       index=summary.index, columns=COLUMNS)
    out = out.astype({"distorted": bool, "busy": bool, "distortion": object})
    for i, row in summary.iterrows():
        busy = _busy(row)
        if row["role"] == "baseline":
            out.loc[i, "busy"] = busy
            continue
        base = baselines.get(tuple(row[k] for k in keys))
        bound = speedup_bound(float(row["mean_accepted_len"]), workers=int(row.get("workers") or 1))
        above = [(name, row_interval(row, column)) for column, name in _FIGURES
                 if beyond(row_interval(row, column), bound)]
        out.loc[i, ["speedup_bound", "busy"]] = [bound, busy or (base is not None and _busy(base))]
        if above:
            out.loc[i, "distorted"] = True
            out.loc[i, "distortion"] = _why(row, base, bound, *above[0], by)
    return out


def beyond(interval: Interval, bound: float) -> bool:
    """A figure more than SLACK above its bound, its interval (where it has one) wholly above the bound too."""
    if not (math.isfinite(interval.value) and math.isfinite(bound)):
        return False
    return interval.value > bound * (1 + SLACK) and not (interval.known and interval.low <= bound)


def rows_distorted(rows: pd.DataFrame) -> bool:
    """Result rows of one configuration (each with its `speedup` over the baseline row of its prompt and repeat):
    whether their speedup taken together (`combined_speedup`) is above the bound their accepted length sets."""
    def number(column: str) -> pd.Series:
        return pd.to_numeric(rows[column], errors="coerce") if column in rows else pd.Series(np.nan, index=rows.index)

    tokens, steps = number("new_tokens"), number("steps")
    together = combined_speedup(tokens.to_numpy(float), number("speedup").to_numpy(float))
    length = mean_accepted_length(float(tokens.sum()), float(steps.sum()), len(rows))
    return beyond(Interval(together), speedup_bound(length, workers=workers_of(rows.get("params", []))))


def workers_of(params) -> int:
    """The most target workers verifying at once in rows' parameters (DSI's `workers`; 1 for any other strategy)."""
    settings = [json.loads(p) for p in params if isinstance(p, str) and p]
    return max([int(s.get("workers") or 1) for s in settings], default=1)


def _busy(row) -> bool:
    return is_busy(float(row.get("busy_others", np.nan)), float(row.get("cpu_steal", np.nan)))


def _why(row, base, bound: float, name: str, figure: Interval, by: list[str]) -> str:
    """One line: the figure, its bound, which side's time moved, and the machine's use by others on each side."""
    group = " / ".join(str(row[b]) for b in by)
    head = (f"{row['strategy']} ({group}): {name} {figure.value:.2f}x is above {bound:.2f}x, the most a mean "
            f"accepted length of {float(row['mean_accepted_len']):.2f} allows")
    return f"{head}; {_side(row, base)}{_use(row, base)}"


def _side(row, base) -> str:
    """Which side's time moved: plain decoding's time per token against one whole round of the strategy (a round
    verifies at least one token, so it cannot take less), else the two first tokens."""
    if base is None:
        return "no baseline row to tell which side's time moved"
    per_token = _per(base["decode_s"], base["new_tokens"] - base["n_rows"])
    per_round = _per(row["decode_s"], row["steps"])
    if math.isfinite(per_token) and math.isfinite(per_round) and per_token > per_round:
        return (f"plain decoding took {per_token * 1e3:.3g} ms a token, more than one whole round of the strategy "
                f"({per_round * 1e3:.3g} ms), which verifies at least one token: the baseline's time moved")
    first_base = _per(base["wall_s"] - base["decode_s"], base["n_rows"])
    first_own = _per(row["wall_s"] - row["decode_s"], row["n_rows"])
    if math.isfinite(first_base) and math.isfinite(first_own) and first_base > first_own:
        return (f"plain decoding's first tokens took {first_base * 1e3:.3g} ms each against the strategy's "
                f"{first_own * 1e3:.3g} ms over the same prompts: the baseline's time moved")
    return "the strategy's time is short of what its rounds must cost: its time moved"


def _use(row, base) -> str:
    said = [f"{who} {float(r['busy_others']):.0%}" for who, r in (("the baseline", base), ("the strategy", row))
            if r is not None and math.isfinite(float(r.get("busy_others", np.nan)))]
    return f" (other processes' share of the cores while measuring: {', '.join(said)})" if said else ""


def _per(seconds, count) -> float:
    seconds, count = float(seconds), float(count)
    return seconds / count if math.isfinite(seconds) and math.isfinite(count) and count > 0 else math.nan


def bound_notes(summary: pd.DataFrame) -> list[str]:
    """The lines a report prints under its tables: each distorted row's, then which runs ran on a busy machine."""
    if "distorted" not in summary:
        return []
    notes = [str(line) for line in summary.loc[summary["distorted"].astype(bool), "distortion"]]
    busy = summary[summary["busy"].astype(bool)] if "busy" in summary else summary.iloc[:0]
    for run_id, rows in busy.groupby("run_id", sort=False):
        others, steal = pd.to_numeric(rows["busy_others"]).max(), pd.to_numeric(rows["cpu_steal"]).max()
        took = [f"other processes up to {others:.0%}" if math.isfinite(others) else "",
                f"the hypervisor up to {steal:.0%}" if math.isfinite(steal) and steal >= 0.005 else ""]
        notes.append(f"{run_id}: measured on a busy machine ({' and '.join(t for t in took if t)} of the cores): the "
                     "rows marked busy hold timings slowed by other work, not this machine's own")
    return notes
