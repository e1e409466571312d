"""Tables of runs served under load: each strategy against the baseline at each load point.

The figures are engine/serving.py's `serving_summary` (vLLM benchmark_serving's names), computed per role,
load point and repeat from the request rows, then averaged over repeats.
"""

from __future__ import annotations

import math

import pandas as pd
from rich.table import Table

from sdbench.engine.serving import LATENCIES, PERCENTILES, serving_summary
from sdbench.reporting.cells import fmt

POINT = ["request_rate", "concurrency"]


def load_rows(df: pd.DataFrame) -> pd.Series:
    """Which rows were served under load."""
    if "request_rate" not in df:
        return pd.Series(False, index=df.index)
    return df["request_rate"].notna()


def summarize_load(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (load point, strategy label): serving_summary averaged over repeats, the output-throughput
    ratio to the baseline at the same point and run, and lossless requests. df: rows labelled as the tables
    show them (reporting.labels.labelled)."""
    data = df
    out = []
    for (run, rate, conc, label), group in data.groupby(["run_id", *POINT, "strategy"], sort=False, dropna=False):
        per_repeat = [serving_summary(_records(g), float(g["duration_s"].iloc[0])) for _, g in group.groupby("repeat")]
        row = {k: sum(s[k] for s in per_repeat) / len(per_repeat) for k in per_repeat[0]}
        lossless = group["lossless"].dropna()
        row.update(run_id=run, request_rate=rate, concurrency=conc, strategy=label,
                   lossless=f"{int(lossless.sum())}/{len(lossless)}" if len(lossless) else "–")
        out.append(row)
    table = pd.DataFrame(out)
    base = table[table["strategy"] == "baseline"].set_index(["run_id", *POINT])["output_throughput"]
    key = pd.MultiIndex.from_frame(table[["run_id", *POINT]])
    table["vs_baseline"] = table["output_throughput"].to_numpy() / base.reindex(key).to_numpy()
    return table


def _records(group: pd.DataFrame) -> list[dict]:
    records = group.to_dict("records")
    for r in records:  # a missing SLO verdict is pandas' NA here, None to serving_summary
        r["slo_met"] = None if pd.isna(r["slo_met"]) else bool(r["slo_met"])
    return records


def _point(row) -> str:
    rate = "inf" if math.isinf(row.request_rate) else f"{row.request_rate:g}"
    return f"{rate} req/s · ≤{int(row.concurrency)} in flight"


def throughput_table(summary: pd.DataFrame) -> Table:
    table = Table(title="under load: throughput (vs baseline: output_throughput over the baseline's on the same arrivals)")
    for name in ("load", "strategy", "completed", "request_throughput", "output_throughput", "request_goodput",
                 "vs baseline", "lossless"):
        table.add_column(name, justify="left" if name in ("load", "strategy") else "right")
    for row in summary.itertuples():
        table.add_row(_point(row), row.strategy, fmt(row.completed, "{:.0f}"), fmt(row.request_throughput, "{:.2f}"),
                      fmt(row.output_throughput, "{:.1f}"), fmt(row.request_goodput, "{:.2f}"),
                      fmt(row.vs_baseline, "{:.2f}x"), row.lossless)
    return table


def latency_table(summary: pd.DataFrame) -> Table:
    quantiles = "/".join(f"p{q}" for q in PERCENTILES)
    table = Table(title=f"under load: latencies in ms ({quantiles})")
    table.add_column("load")
    table.add_column("strategy")
    for name in LATENCIES:
        table.add_column(name, justify="right")
    for row in summary.itertuples():
        cells = ["/".join(fmt(getattr(row, f"p{q}_{name}"), "{:.1f}") for q in PERCENTILES) for name in LATENCIES]
        table.add_row(_point(row), row.strategy, *cells)
    return table


def load_tables(df: pd.DataFrame) -> list[Table]:
    summary = summarize_load(df)
    return [throughput_table(summary), latency_table(summary)]
