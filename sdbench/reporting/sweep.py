"""Where speculative decoding stops paying: a sweep's points, the best setting per point, and the break-even
frontier, measured and predicted.

A sweep (`sdbench sweep`, commands/sweep.py) is one run per grid point, its rows marked with the sweep's id
(`sweep`), the point's size (`batch_size`, or `concurrency` under load) and prompt length (`prompt_len`). Per
point and strategy configuration:
  speedup    static batches: tokens/s over the baseline's on the same batches (reporting.summary.summarize, as
             `run`'s table shows it); under load: output throughput over the baseline's on the same arrivals
             (reporting.load.summarize_load, the "vs baseline" column)
  predicted  the cost model's predicted speedup (the rows' `predicted_speedup`, engine/metrics.py), combined over
             the rows by their decode tokens (engine/formulas.py `combined_speedup`)
Per point and strategy the best setting is the configuration with the highest measured speedup; `predicted`
is that setting's prediction and `predicted_best` the highest prediction over the strategy's settings (the
setting the cost model would pick). With several strategies, "any" is the best of them all at each point.

SD pays at a point when its speedup is above 1. Along the sizes at one prompt length, the frontier is the
first size where it does not (`loses_from`; none: it pays at every size) and the size before it (`pays_up_to`;
none: it loses already at the smallest), once from the measured speedups and once from the predicted ones.
`steps_apart` counts the grid steps between the two; `pays_again` (`predicted_pays_again`) names sizes past the
frontier where SD pays once more (a speedup that is not monotone in the size).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table
from rich.text import Text

from sdbench.engine.formulas import combined_speedup
from sdbench.reporting.cells import fmt
from sdbench.reporting.labels import labelled
from sdbench.reporting.load import load_rows, summarize_load
from sdbench.reporting.stats import Interval, mark
from sdbench.reporting.summary import ALL, summarize

ANY = "any"
SPEEDUPS = ["run_id", "family", "setting", "speedup", "speedup_low", "speedup_high", "decode_speedup", "predicted",
            "distorted"]
POINTS = ["sweep", "axis", "size", "prompt_len", "family", "setting", "speedup", "speedup_low", "speedup_high",
          "decode_speedup", "predicted", "predicted_best", "distorted"]
FRONTIER = ["sweep", "axis", "family", "prompt_len", "pays_up_to", "loses_from", "predicted_pays_up_to",
            "predicted_loses_from", "steps_apart", "pays_again", "predicted_pays_again"]


def sweep_rows(df: pd.DataFrame) -> pd.Series:
    """Which rows belong to a sweep."""
    if "sweep" not in df:
        return pd.Series(False, index=df.index)
    return df["sweep"].notna()


def point_speedups(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run and strategy configuration (no baseline): SPEEDUPS. df: result rows of one or more runs."""
    served = load_rows(df)
    parts = [_batch_speedups(df[~served]) if (~served).any() else None,
             _load_speedups(df[served]) if served.any() else None]
    parts = [p for p in parts if p is not None and not p.empty]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=SPEEDUPS)


def _families(data: pd.DataFrame, raw: pd.DataFrame) -> dict[tuple, tuple[str, str]]:
    """(run_id, label) -> (the strategy the label is a configuration of, its setting: the settings that differ
    between that strategy's configurations in the run, else its lookahead). raw: the rows before labelling."""
    ident = pd.DataFrame({"run_id": data["run_id"].to_numpy(), "label": data["strategy"].to_numpy(),
                          "family": raw["strategy"].to_numpy(), "draft": raw["draft"].fillna("").to_numpy(),
                          "params": raw["params"].fillna("{}").to_numpy()}).drop_duplicates(["run_id", "label"])
    found = {}
    for _, group in ident.groupby(["run_id", "family"], sort=False):
        settings = [{"draft": d, **json.loads(p or "{}")} for d, p in zip(group["draft"], group["params"])]
        varying = sorted(k for k in {k for s in settings for k in s}
                         if len({json.dumps(s.get(k)) for s in settings}) > 1) or ["gamma"]
        for row, setting in zip(group.itertuples(), settings):
            text = " ".join(f"{k}={setting[k]}" for k in varying if k in setting)
            found[row.run_id, row.label] = (row.family, text or "–")
    return found


def _batch_speedups(df: pd.DataFrame) -> pd.DataFrame:
    summary = summarize(df, ("category",))
    summary = summary[(summary["category"] == ALL) & (summary["role"] != "baseline")]
    family = _families(labelled(df), df)
    keys = list(zip(summary["run_id"], summary["strategy"]))
    return pd.DataFrame({
        "run_id": summary["run_id"].to_numpy(), "setting": [family[k][1] for k in keys],
        "family": [family[k][0] for k in keys],
        "speedup": summary["speedup"].to_numpy(float), "speedup_low": summary["speedup_low"].to_numpy(float),
        "speedup_high": summary["speedup_high"].to_numpy(float),
        "decode_speedup": summary["decode_speedup"].to_numpy(float),
        "predicted": summary["predicted_speedup"].to_numpy(float),
        "distorted": summary["distorted"].to_numpy(bool)}, columns=SPEEDUPS)


def _load_speedups(df: pd.DataFrame) -> pd.DataFrame:
    data = labelled(df)
    summary = summarize_load(data)
    summary = summary[summary["strategy"] != "baseline"]
    family = _families(data, df)
    rows = data.assign(_n=pd.to_numeric(data["new_tokens"], errors="coerce") - 1,
                       _p=pd.to_numeric(data["predicted_speedup"], errors="coerce"))
    predicted = {k: combined_speedup(g["_n"], g["_p"]) for k, g in rows.groupby(["run_id", "strategy"])}
    keys = list(zip(summary["run_id"], summary["strategy"]))
    return pd.DataFrame({
        "run_id": summary["run_id"].to_numpy(), "setting": [family[k][1] for k in keys],
        "family": [family[k][0] for k in keys], "speedup": summary["vs_baseline"].to_numpy(float),
        "speedup_low": math.nan, "speedup_high": math.nan, "decode_speedup": math.nan,
        "predicted": [float(predicted.get(k, math.nan)) for k in keys], "distorted": False}, columns=SPEEDUPS)


def _point_info(df: pd.DataFrame) -> pd.DataFrame:
    """run_id -> sweep, axis ("batch" or "concurrency"), size and prompt length."""
    served = load_rows(df)
    size = df["concurrency"].where(served, df["batch_size"]) if "concurrency" in df else df["batch_size"]
    info = pd.DataFrame({"run_id": df["run_id"], "sweep": df["sweep"], "axis": np.where(served, "concurrency", "batch"),
                         "size": pd.to_numeric(size), "prompt_len": pd.to_numeric(df["prompt_len"])})
    return info.groupby("run_id", sort=False).first().reset_index()


def best_points(df: pd.DataFrame) -> pd.DataFrame:
    """Per sweep point and strategy (and "any" when there are several): POINTS, the best measured setting's
    speedup with its prediction, and the best prediction over the strategy's settings. df: result rows."""
    data = df[sweep_rows(df)]
    if data.empty:
        return pd.DataFrame(columns=POINTS)
    speedups = point_speedups(data).merge(_point_info(data), on="run_id")
    rows = []
    point = ["sweep", "axis", "size", "prompt_len"]
    for key, group in speedups.groupby(point, sort=True):
        families = list(dict.fromkeys(group["family"]))
        for family in families + ([ANY] if len(families) > 1 else []):
            mine = group if family == ANY else group[group["family"] == family]
            honest = mine[~mine["distorted"].astype(bool)]  # a speedup above its bound never wins a point
            best = (honest if len(honest) else mine)
            best = best.loc[best["speedup"].fillna(-np.inf).idxmax()]
            guessed = mine["predicted"].dropna()
            setting = best["setting"] if family != ANY else f"{best['family']} {best['setting']}"
            rows.append({**dict(zip(point, key)), "family": family, "setting": setting,
                         **{c: best[c] for c in ("speedup", "speedup_low", "speedup_high", "decode_speedup", "predicted",
                                                 "distorted")},
                         "predicted_best": float(guessed.max()) if len(guessed) else math.nan})
    return pd.DataFrame(rows, columns=POINTS)


def frontier(points: pd.DataFrame) -> pd.DataFrame:
    """Per sweep, strategy and prompt length: where SD stops paying along the sizes (FRONTIER), measured (from
    `speedup`) and predicted (from `predicted_best`). points: best_points' frame (or any with its columns)."""
    rows = []
    for (sweep, axis, family, length), group in points.groupby(["sweep", "axis", "family", "prompt_len"], sort=False):
        group = group.sort_values("size")
        sizes = [int(s) for s in group["size"]]
        measured = _edge(sizes, group["speedup"].to_numpy(float))
        predicted = _edge(sizes, group["predicted_best"].to_numpy(float))
        steps = (abs(_step(sizes, measured[1]) - _step(sizes, predicted[1]))
                 if predicted[2] is not None else None)
        rows.append({"sweep": sweep, "axis": axis, "family": family, "prompt_len": int(length),
                     "pays_up_to": measured[0], "loses_from": measured[1], "predicted_pays_up_to": predicted[0],
                     "predicted_loses_from": predicted[1], "steps_apart": steps, "pays_again": measured[2] or "",
                     "predicted_pays_again": predicted[2] or ""})
    front = pd.DataFrame(rows, columns=FRONTIER)
    for column in ("pays_up_to", "loses_from", "predicted_pays_up_to", "predicted_loses_from", "steps_apart"):
        front[column] = pd.array(front[column].tolist(), dtype="Int64")  # a size, or <NA> for "none"
    return front


def _edge(sizes: list[int], speedups: np.ndarray) -> tuple[int | None, int | None, str | None]:
    """(pays_up_to, loses_from, pays_again as text) along ascending sizes; all None when nothing is known (no
    finite speedup: a prediction the cost model cannot make). A missing value counts as not paying."""
    if not np.isfinite(speedups).any():
        return None, None, None
    pays = [bool(np.isfinite(s) and s > 1.0) for s in speedups]
    first_loss = next((i for i, p in enumerate(pays) if not p), None)
    if first_loss is None:
        return sizes[-1], None, ""
    again = [str(s) for s, p in zip(sizes[first_loss + 1:], pays[first_loss + 1:]) if p]
    return (sizes[first_loss - 1] if first_loss else None), sizes[first_loss], ",".join(again)


def _step(sizes: list[int], loses_from: int | None) -> int:
    """The grid index of the first losing size; len(sizes) when SD pays at every size."""
    return len(sizes) if loses_from is None else sizes.index(loses_from)


# ---- what is shown -----------------------------------------------------------------------------------------


def axis_noun(axis: str) -> str:
    return "batch" if axis == "batch" else "concurrency"


def _says(pays_up_to, loses_from, axis: str, pays_again: str = "") -> str:
    if pd.isna(loses_from) and pd.isna(pays_up_to):
        return "–"
    if pd.isna(loses_from):
        return f"pays at every {axis_noun(axis)} (to {pays_up_to})"
    if pd.isna(pays_up_to):
        return f"loses from {axis_noun(axis)} {loses_from}" + ("" if pays_again else " (never pays)")
    return f"pays to {pays_up_to}, loses from {loses_from}"


def _cuts(group: pd.DataFrame, pays: str, loses: str) -> str:
    cells = []
    for length, up, lo in zip(group["prompt_len"], group[pays], group[loses]):
        cells.append(f"? at {length}" if pd.isna(up) and pd.isna(lo) else
                     f"none at {length}" if pd.isna(lo) else f"≥ {int(lo)} at {length}")
    return ", ".join(cells)


def frontier_line(front: pd.DataFrame) -> str:
    """One line per sweep and strategy: from which size SD loses at each prompt length, measured and predicted
    ("none": it pays at every size; "?": the cost model made no prediction)."""
    lines = []
    for (sweep, axis, family), group in front.groupby(["sweep", "axis", "family"], sort=False):
        lines.append(f"frontier ({family}): SD loses at {axis_noun(axis)} {_cuts(group, 'pays_up_to', 'loses_from')} "
                     f"tokens of context, measured; predicted {_cuts(group, 'predicted_pays_up_to', 'predicted_loses_from')}")
    return "\n".join(lines)


def points_table(points: pd.DataFrame) -> Table:
    axis = axis_noun(points["axis"].iloc[0]) if len(points) else "size"
    table = Table(title="sweep: the best setting per point (speedup vs plain decoding; * its 95 % interval holds 1.0; "
                        "? too few prompts for one; ! above its bound)")
    for name in ("strategy", axis, "prompt", "best setting", "speedup", "decode", "predicted", "pred. best"):
        table.add_column(name, justify="left" if name in ("strategy", "best setting") else "right")
    for r in points.itertuples():
        star = mark(Interval(r.speedup, r.speedup_low, r.speedup_high)) + ("!" if r.distorted else "")
        table.add_row(*(Text(str(c)) for c in (
            r.family, int(r.size), int(r.prompt_len), r.setting, fmt(r.speedup, "{:.2f}x") + star,
            fmt(r.decode_speedup, "{:.2f}x"), fmt(r.predicted, "{:.2f}x"), fmt(r.predicted_best, "{:.2f}x"))))
    return table


def frontier_table(front: pd.DataFrame) -> Table:
    axis = axis_noun(front["axis"].iloc[0]) if len(front) else "size"
    table = Table(title=f"where speculative decoding stops paying: along the {axis}, per prompt length")
    for name in ("strategy", "prompt", "measured", "predicted", "grid steps apart", "pays again at"):
        table.add_column(name, justify="right" if name in ("prompt", "grid steps apart") else "left")
    for r in front.itertuples():
        table.add_row(*(Text(str(c)) for c in (
            r.family, r.prompt_len, _says(r.pays_up_to, r.loses_from, r.axis, r.pays_again),
            _says(r.predicted_pays_up_to, r.predicted_loses_from, r.axis, r.predicted_pays_again),
            "–" if pd.isna(r.steps_apart) else int(r.steps_apart), r.pays_again or "–")))
    return table


def print_frontier(df: pd.DataFrame, console: Console) -> pd.DataFrame | None:
    """The sweep's tables and frontier line, when df holds sweep rows; returns the frontier (None: no sweep)."""
    points = best_points(df)
    if points.empty:
        return None
    front = frontier(points)
    console.print(points_table(points))
    console.print(frontier_table(front))
    console.print(frontier_line(front), highlight=False, soft_wrap=True)
    data = df[sweep_rows(df) & df["role"].ne("baseline")]
    known = data["lossless"].dropna().astype(bool) if "lossless" in data else pd.Series(dtype=bool)
    ties = int(data["divergence"].eq("tie").sum()) if "divergence" in data else 0
    if len(known):
        tied = f" ({ties} more parted by a tie in their path's rounding)" if ties else ""
        console.print(f"lossless: {int(known.sum())}/{len(known)} of the strategies' outputs equal the baseline's"
                      f"{tied}", style=None if known.sum() + ties == len(known) else "red", highlight=False)
    return front
