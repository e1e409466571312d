"""PNG plots of result rows (matplotlib, Agg backend): `sdbench report --plots DIR` and the HTML page.

Each plot is drawn only when the rows hold its data: a sweep plot needs its setting to take several values,
predicted vs measured needs predicted speedups. Labels are the tables' labels (labels.labelled).
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from sdbench.errors import MissingPackageError, SdbenchError
from sdbench.paths import output_dir
from sdbench.reporting.cells import numeric
from sdbench.reporting.explain import FACTORS, breakdown
from sdbench.reporting.labels import labelled
from sdbench.reporting.summary import ALL, per_position_rates, summarize
from sdbench.reporting.sweep_plots import sweep_figures

# settings a sweep may vary, and where each is found: a result column or a key of the params JSON
SWEEPS = (("gamma", "γ (draft tokens per step)"), ("budget", "draft KV budget (tokens)"),
          ("prompt_tokens", "prompt length (tokens)"), ("batch_size", "batch size"))


@dataclass(frozen=True)
class Plot:
    name: str  # file stem
    title: str
    png: bytes


def _pyplot():
    try:
        import matplotlib  # optional and slow to import: only the plots need it
    except ImportError:
        raise MissingPackageError("matplotlib", "plots (sdbench report --plots/--html)",
                                  "pip install matplotlib") from None
    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    return plt


def _png(plt, fig) -> bytes:
    buffer = io.BytesIO()
    if fig.get_layout_engine() is None:  # a figure made with its own layout (constrained) keeps it
        fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def _strategies(df: pd.DataFrame) -> pd.DataFrame:
    """Strategy rows (no baseline), labelled; the run id prefixed when labels repeat across runs."""
    data = labelled(df)
    data = data[data["role"] != "baseline"].copy()
    if data.groupby("strategy")["run_id"].nunique().gt(1).any():
        data["strategy"] = data["run_id"].astype(str) + " · " + data["strategy"]
    return data


def speedup_by_strategy(plt, df: pd.DataFrame) -> Plot | None:
    summary = summarize(df, by=("dataset",))
    overall = summary[(summary["role"] != "baseline") & (summary["dataset"] != ALL)]
    overall = overall[np.isfinite(numeric(overall["speedup"]))]
    if overall.empty:
        return None
    many_runs = overall.groupby("strategy")["run_id"].nunique().gt(1).any()
    many_sets = overall["dataset"].nunique() > 1
    labels = [" · ".join(x for x in ((r if many_runs else ""), s, (d if many_sets else "")) if x)
              for r, s, d in zip(overall["run_id"], overall["strategy"], overall["dataset"])]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(labels) + 2), 4))
    values = numeric(overall["speedup"])
    ax.bar(range(len(values)), values, color=["tab:green" if v >= 1 else "tab:red" for v in values])
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    tilt = len(labels) > 3
    ax.set_xticks(range(len(values)), labels, rotation=30 if tilt else 0, ha="right" if tilt else "center")
    ax.set_ylabel("speedup vs plain decoding")
    ax.set_title("Speedup by strategy")
    return Plot("speedup_by_strategy", "Speedup by strategy", _png(plt, fig))


def acceptance_histogram(plt, df: pd.DataFrame) -> Plot | None:
    data = _strategies(df)
    data = data[np.isfinite(numeric(data["mean_accepted_len"]))] if "mean_accepted_len" in data else data.iloc[:0]
    if data.empty:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    values = numeric(data["mean_accepted_len"])
    bins = np.linspace(1.0, max(2.0, float(values.max())), 21)
    for name, group in data.groupby("strategy", sort=False):
        ax.hist(numeric(group["mean_accepted_len"]), bins=bins, alpha=0.55, label=str(name))
    ax.set_xlabel("mean accepted length per prompt (bonus token included)")
    ax.set_ylabel("prompts")
    ax.legend(fontsize="small")
    ax.set_title("Acceptance length")
    return Plot("acceptance_length", "Acceptance length per prompt", _png(plt, fig))


def per_position(plt, df: pd.DataFrame) -> Plot | None:
    rates = per_position_rates(df)
    if not rates:
        return None
    many_runs = len({run for run, _, _ in rates}) > 1
    fig, ax = plt.subplots(figsize=(7, 4))
    for run_id, strategy, values in rates:
        ax.plot(range(1, len(values) + 1), values, marker="o", label=f"{run_id} · {strategy}" if many_runs else strategy)
    ax.set_xticks(range(1, max(len(v) for _, _, v in rates) + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize="small")
    ax.set_title("Acceptance by draft position")
    return Plot("acceptance_per_position", "Acceptance by draft position", _png(plt, fig))


def _setting(data: pd.DataFrame, name: str) -> np.ndarray:
    if name in data and name != "budget":
        return numeric(data[name])
    return np.array([_param(p, name) for p in data["params"]], dtype="float64")


def _param(params, name: str) -> float:
    try:
        value = json.loads(params or "{}").get(name)
    except (TypeError, ValueError):
        return math.nan
    return float(value) if isinstance(value, (int, float)) else math.nan


def speedup_sweeps(plt, df: pd.DataFrame) -> list[Plot]:
    """Speedup against each setting that takes several values among a strategy's rows."""
    data = df[df["role"] != "baseline"]
    data = data[np.isfinite(numeric(data["speedup"]))] if "speedup" in data else data.iloc[:0]
    plots = []
    for name, axis in SWEEPS:
        x = _setting(data, name) if len(data) else np.array([])
        varying = [s for s, g in data.assign(_x=x).groupby("strategy") if g["_x"].dropna().nunique() > 1]
        if not varying:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for strategy in varying:
            keep = (data["strategy"] == strategy).to_numpy() & np.isfinite(x)
            xs, ys = x[keep], numeric(data["speedup"])[keep]
            points = ax.scatter(xs, ys, alpha=0.35, s=14)
            levels = np.unique(xs)
            ax.plot(levels, [np.median(ys[xs == v]) for v in levels], marker="o", color=points.get_facecolor()[0],
                    alpha=1.0, label=f"{strategy} (median)")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        tried = np.unique(x[np.isfinite(x)])
        if name != "prompt_tokens" and len(tried) <= 12:
            ax.set_xticks(tried)  # settings are whole numbers: tick each tried value
        ax.set_xlabel(axis)
        ax.set_ylabel("speedup vs plain decoding")
        ax.legend(fontsize="small")
        ax.set_title(f"Speedup vs {axis.split(' (')[0]}")
        plots.append(Plot(f"speedup_vs_{name}", f"Speedup vs {axis}", _png(plt, fig)))
    return plots


def predicted_vs_measured(plt, df: pd.DataFrame) -> Plot | None:
    if "predicted_speedup" not in df or "speedup" not in df:
        return None
    data = _strategies(df)
    pred, meas = numeric(data["predicted_speedup"]), numeric(data["speedup"])
    keep = np.isfinite(pred) & np.isfinite(meas)
    if not keep.any():
        return None
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for name in dict.fromkeys(data["strategy"][keep]):
        mine = keep & (data["strategy"] == name).to_numpy()
        ax.scatter(pred[mine], meas[mine], alpha=0.6, s=18, label=str(name))
    low, high = float(min(pred[keep].min(), meas[keep].min())), float(max(pred[keep].max(), meas[keep].max()))
    ax.plot([low, high], [low, high], color="black", linewidth=0.8, linestyle="--", label="measured = predicted")
    ax.set_xlabel("predicted speedup (cost model)")
    ax.set_ylabel("measured speedup")
    ax.legend(fontsize="small")
    ax.set_title("Predicted vs measured speedup")
    return Plot("predicted_vs_measured", "Predicted vs measured speedup", _png(plt, fig))


def speedup_waterfalls(plt, df: pd.DataFrame) -> list[Plot]:
    """Per configuration, the explain factors as a waterfall on a log scale: from 1.0, each factor moves the
    running product up (green) or down (red), ending at the measured speedup."""
    plots = []
    for i, row in enumerate(breakdown(df).to_dict("records")):
        values = [row[f] for f in FACTORS]
        if not all(math.isfinite(v) and v > 0 for v in values):
            continue
        running = np.cumprod([1.0, *values])
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for j, (low, high) in enumerate(zip(running[:-1], running[1:])):
            ax.bar(j, high - low, bottom=low, color="tab:green" if high >= low else "tab:red")
            ax.text(j, max(low, high), f"×{values[j]:.3f}", ha="center", va="bottom", fontsize="small")
        ax.bar(len(values), running[-1], color="tab:blue")
        ax.text(len(values), running[-1], f"{row['speedup']:.3f}x", ha="center", va="bottom", fontsize="small")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_yscale("log")
        ax.set_xticks(range(len(values) + 1), [*FACTORS, "measured"])
        ax.set_ylabel("speedup (running product)")
        title = f"Where the speedup goes: {row['strategy']}"
        ax.set_title(title)
        plots.append(Plot(f"speedup_waterfall_{i}", f"{title} ({row['run_id']})", _png(plt, fig)))
    return plots


def render(df: pd.DataFrame) -> list[Plot]:
    """Every plot the rows have data for, in report order."""
    if df.empty:
        raise SdbenchError("no result rows to plot")
    plt = _pyplot()
    plots = [speedup_by_strategy(plt, df), acceptance_histogram(plt, df), per_position(plt, df),
             *speedup_sweeps(plt, df), predicted_vs_measured(plt, df), *speedup_waterfalls(plt, df),
             *_figures(plt, df)]
    return [p for p in plots if p is not None]


def sweep_plots(df: pd.DataFrame) -> list[Plot]:
    """The frontier heat-map of each sweep in the rows and the throughput-latency curves under load, alone."""
    return _figures(_pyplot(), df)


def _figures(plt, df: pd.DataFrame) -> list[Plot]:
    return [Plot(name, title, _png(plt, fig)) for name, title, fig in sweep_figures(plt, df)]


def write_plots(df: pd.DataFrame, folder: str | Path, plots: list[Plot] | None = None) -> list[Path]:
    folder = output_dir(folder, "--plots")
    paths = []
    for plot in render(df) if plots is None else plots:
        path = folder / f"{plot.name}.png"
        path.write_bytes(plot.png)
        paths.append(path)
    return paths
