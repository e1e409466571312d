"""The site's charts as Plotly figures (plain data and layout dicts, drawn in the browser by plotly.js): a run's
speedup by strategy with its 95 % interval, acceptance by draft position, where a round's time goes and speedup
against γ; across runs, speedup against γ per configuration and machine; a sweep's frontier as a heat-map; the
carry-over of each engine, predicted against measured.
"""

from __future__ import annotations

import math

import pandas as pd

from sdbench.reporting.summary import ALL
from sdbench.reporting.sweep import ANY

PARTS = (("draft_s", "drafting"), ("verify_s", "verifying forward"), ("accept_s", "verdict"),
         ("observe_s", "observe"), ("loop_s", "loop"))


def _num(x) -> float | None:
    """A JSON-safe number: NaN and missing become null (a gap in the chart)."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _layout(title: str, x: str, y: str, **extra) -> dict:
    return {"title": {"text": title}, "xaxis": {"title": {"text": x}, **extra.pop("xaxis", {})},
            "yaxis": {"title": {"text": y}, **extra.pop("yaxis", {})}, "margin": {"t": 50, "l": 60, "r": 20},
            "height": 380, **extra}


def overall(board: pd.DataFrame) -> pd.DataFrame:
    """The leaderboard's rows over every category and turn."""
    return board[(board["category"] == ALL) & (board["turn"] == ALL)]


def speedup_bars(board: pd.DataFrame) -> dict | None:
    """Speedup per strategy of one run, with its 95 % interval as error bars."""
    rows = overall(board)
    if rows.empty:
        return None
    value = [_num(v) for v in rows["speedup"]]
    plus = [_num(h - v) if _num(h) is not None and _num(v) is not None else None
            for h, v in zip(rows["speedup_high"], rows["speedup"])]
    minus = [_num(v - lo) if _num(lo) is not None and _num(v) is not None else None
             for lo, v in zip(rows["speedup_low"], rows["speedup"])]
    trace = {"type": "bar", "x": list(rows["strategy"]), "y": value, "name": "speedup",
             "error_y": {"type": "data", "symmetric": False, "array": plus, "arrayminus": minus}}
    return {"data": [trace], "layout": _layout("Speedup by strategy (95 % interval)", "strategy", "speedup (x)",
                                               shapes=[_one_line()])}


def _one_line() -> dict:
    return {"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": 1, "y1": 1, "line": {"dash": "dot", "width": 1}}


def acceptance_lines(board: pd.DataFrame) -> dict | None:
    """Acceptance rate by draft position, one line per strategy."""
    rows = overall(board).dropna(subset=["acceptance_by_position"])
    traces = [{"type": "scatter", "mode": "lines+markers", "name": s, "x": list(range(1, len(r) + 1)),
               "y": [_num(v) for v in r]} for s, r in zip(rows["strategy"], rows["acceptance_by_position"])
              if r is not None and len(r)]
    if not traces:
        return None
    return {"data": traces, "layout": _layout("Acceptance by draft position", "draft position", "acceptance rate",
                                              yaxis={"range": [0, 1.05]})}


def round_parts(summary: pd.DataFrame) -> dict | None:
    """Milliseconds per round by part, stacked, one bar per strategy (the baseline's round is one token)."""
    rows = summary[(summary["category"] == ALL) & (summary["steps"] > 0)]
    if rows.empty or not rows["draft_s"].notna().any():
        return None
    traces = []
    for column, name in PARTS:
        if column in rows:
            per_round = 1000 * pd.to_numeric(rows[column], errors="coerce") / rows["steps"]
            traces.append({"type": "bar", "name": name, "x": list(rows["strategy"]), "y": [_num(v) for v in per_round]})
    return {"data": traces, "layout": _layout("Where a round's time goes", "strategy", "ms per round",
                                              barmode="stack")}


def gamma_lines(board: pd.DataFrame, title: str = "Speedup against γ") -> dict | None:
    """Speedup against γ, one line per configuration and machine that was measured at two γ or more."""
    rows = overall(board).dropna(subset=["gamma", "speedup"]).sort_values("timestamp", kind="stable")
    base = rows["strategy"].str.replace(r"\s*gamma=\S+", "", regex=True)
    draft = rows["draft"].fillna("").map(lambda d: f" ({d})" if d else "")
    settings = rows["settings"].fillna("").map(lambda t: f" [{t}]" if t else "")
    keys = (base + settings + " · " + rows["target"].fillna("") + draft + " · " + rows["dataset"].astype(str)
            + " · batch "
            + rows["batch_size"].astype(str) + " · " + rows["hardware"].fillna(""))
    traces = []
    for key, group in rows.groupby(keys, sort=False):
        group = group.drop_duplicates("gamma", keep="last").sort_values("gamma")  # the latest run at each γ
        if len(group) < 2:
            continue
        traces.append({"type": "scatter", "mode": "lines+markers", "name": key, "x": [_num(g) for g in group["gamma"]],
                       "y": [_num(v) for v in group["speedup"]]})
    if not traces:
        return None
    return {"data": traces, "layout": _layout(title, "γ (drafts per round)", "speedup (x)", shapes=[_one_line()])}


def frontier_map(points: pd.DataFrame, sweep: str) -> dict | None:
    """A sweep's best measured speedup at each size and prompt length, as a heat-map centred on 1x."""
    rows = points[points["sweep"] == sweep]
    if (rows["family"] == ANY).any():  # several strategies: the best of them all at each point
        rows = rows[rows["family"] == ANY]
    if rows.empty:
        return None
    grid = rows.pivot_table(index="prompt_len", columns="size", values="speedup", aggfunc="max")
    z = [[_num(v) for v in row] for row in grid.to_numpy()]
    trace = {"type": "heatmap", "x": [str(c) for c in grid.columns], "y": [str(i) for i in grid.index], "z": z,
             "zmid": 1.0, "colorscale": "RdBu", "colorbar": {"title": {"text": "speedup"}}}
    return {"data": [trace], "layout": _layout(f"Sweep {sweep}: best speedup", "batch size / concurrency",
                                               "prompt length")}


def carry_bars(rows: list) -> dict | None:
    """Each system of a bench file: predicted (carried from sdbench's run) against measured decode speedup, the
    measured one's whiskers at its lowest and highest repeat where the file has them."""
    if not rows:
        return None
    names = [r.system for r in rows]
    traces = [{"type": "bar", "name": name, "x": names, "y": [_num(getattr(r, field)) for r in rows]}
              for field, name in (("carried", "predicted (carried)"), ("own", "predicted (own)"),
                                  ("measured", "measured"))]
    if any(math.isfinite(r.measured_low) for r in rows):  # the lowest and highest repeat's, as whiskers
        traces[-1]["error_y"] = {"type": "data", "symmetric": False,
                                 "array": [_num(r.measured_high - r.measured) for r in rows],
                                 "arrayminus": [_num(r.measured - r.measured_low) for r in rows]}
    return {"data": traces, "layout": _layout("Does it carry over?", "system", "decode speedup (x)",
                                              barmode="group", shapes=[_one_line()])}
