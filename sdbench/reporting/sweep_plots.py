"""Figures of sweeps and of runs under load: the frontier heat-map (reporting/sweep.py's best setting per point,
with the measured and predicted frontiers drawn on it) and the throughput-latency curve per strategy. Each
function returns (file stem, title, matplotlib figure) for reporting/plots.py to render."""

from __future__ import annotations

import numpy as np
import pandas as pd

from sdbench.reporting.labels import labelled
from sdbench.reporting.load import load_rows, summarize_load
from sdbench.reporting.sweep import axis_noun, best_points, frontier


def frontier_heatmaps(plt, df: pd.DataFrame) -> list[tuple]:
    """One figure per sweep: a panel per strategy, size up and prompt length across, each cell coloured by the
    best setting's measured speedup (blue pays, red loses) and labelled with it and the predicted one; the
    measured frontier drawn solid black, the predicted one dashed orange, between the last paying and first losing size."""
    from matplotlib.colors import LogNorm  # optional and slow to import: only the plots need it

    points = best_points(df)
    figures = []
    for sweep, mine in points.groupby("sweep", sort=False):
        families = list(dict.fromkeys(mine["family"]))
        sizes, lengths = sorted(mine["size"].unique()), sorted(mine["prompt_len"].unique())
        values = mine["speedup"].to_numpy(float)
        finite = values[np.isfinite(values)]
        reach = float(np.clip(np.exp(np.abs(np.log(finite[finite > 0]))).max(initial=1.1), 1.1, 4.0))
        norm = LogNorm(1 / reach, reach, clip=True)  # symmetric in log around 1: as far from paying as from losing
        size = (max(5.5, 1.8 + 1.5 * len(lengths) * len(families)), 1.6 + 0.7 * len(sizes))
        fig, axes = plt.subplots(1, len(families), figsize=size, squeeze=False, layout="constrained")
        for ax, family in zip(axes[0], families):
            cells = mine[mine["family"] == family]
            image = _panel(ax, cells, sizes, lengths, norm)
            ax.set_title(family)
            _frontier_lines(ax, frontier(cells), sizes, lengths)
        axis = axis_noun(mine["axis"].iloc[0])
        axes[0][0].set_ylabel(axis)
        ticks = [t for t in (0.25, 0.5, 0.8, 1.0, 1.25, 2.0, 4.0) if norm.vmin <= t <= norm.vmax]
        bar = fig.colorbar(image, ax=list(axes[0]), label="speedup (best setting, measured)", ticks=ticks)
        bar.ax.set_yticklabels([f"{t:g}x" for t in ticks])
        bar.ax.minorticks_off()
        fig.suptitle("Where speculative decoding stops paying\nfrontier measured: solid black; predicted: dashed orange",
                     fontsize="medium")
        figures.append((f"frontier_{len(figures)}" if len(figures) else "frontier",
                        f"Speedup per {axis} and prompt length, with the break-even frontier ({sweep})", fig))
    return figures


def _panel(ax, cells: pd.DataFrame, sizes: list, lengths: list, norm):
    grid = np.full((len(sizes), len(lengths)), np.nan)
    for r in cells.itertuples():
        i, j = sizes.index(r.size), lengths.index(r.prompt_len)
        grid[i, j] = r.speedup
        predicted = "" if np.isnan(r.predicted_best) else f"\npred {r.predicted_best:.2f}x"
        dark = np.isfinite(r.speedup) and r.speedup > 0 and abs(np.log(r.speedup)) > 0.6 * np.log(norm.vmax)
        ax.text(j, i, f"{r.speedup:.2f}x{predicted}", ha="center", va="center", fontsize="small",
                color="white" if dark else "black")
    image = ax.imshow(grid, cmap="RdBu", norm=norm, origin="lower", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(int(x)) for x in lengths])
    ax.set_yticks(range(len(sizes)), [str(int(s)) for s in sizes])
    ax.set_xlabel("prompt length (tokens)")
    return image


def _frontier_lines(ax, front: pd.DataFrame, sizes: list, lengths: list) -> None:
    """Per prompt length, a horizontal segment below the first losing size (at the top edge when SD pays at
    every size, none when nothing is known)."""
    lines = (("loses_from", "pays_up_to", "-", "black", -0.06), ("predicted_loses_from", "predicted_pays_up_to", "--",
                                                                   "darkorange", 0.06))
    for column, pays, style, color, shift in lines:  # shifted apart: where the two agree, both stay visible
        for r in front.to_dict("records"):
            if pd.isna(r[column]) and pd.isna(r[pays]):
                continue
            y = len(sizes) - 0.5 if pd.isna(r[column]) else sizes.index(r[column]) - 0.5
            j = lengths.index(r["prompt_len"])
            ax.plot([j - 0.5, j + 0.5], [y + shift, y + shift], color=color, linestyle=style, linewidth=2.5,
                    clip_on=False)
    ax.set_ylim(-0.5, len(sizes) - 0.5)  # a frontier at an edge stays on the edge, not past it


def throughput_latency(plt, df: pd.DataFrame) -> tuple | None:
    """Under load: output throughput against the median time per output token, one curve per strategy (and
    prompt length, in a sweep) through its load points; None without a strategy served at two or more."""
    served = load_rows(df)
    if not served.any():
        return None
    data = labelled(df[served])
    summary = summarize_load(data)
    lengths = data.groupby("run_id")["prompt_len"].first() if "prompt_len" in data else pd.Series(dtype=float)
    summary["curve"] = [s if pd.isna(lengths.get(r)) else f"{s} · {int(lengths.get(r))} tokens"
                        for r, s in zip(summary["run_id"], summary["strategy"])]
    curves = [(name, g.sort_values(["concurrency", "request_rate"])) for name, g in summary.groupby("curve", sort=False)
              if len(g) > 1]
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, group in curves:
        ax.plot(group["output_throughput"], group["p50_tpot_ms"], marker="o", label=name)
        for r in group.itertuples():
            ax.annotate(f"{int(r.concurrency)}", (r.output_throughput, r.p50_tpot_ms), textcoords="offset points",
                        xytext=(4, 4), fontsize="x-small")
    ax.set_xlabel("output throughput (tokens/s)")
    ax.set_ylabel("median time per output token (ms)")
    ax.set_title("Throughput against latency under load (points: requests in flight)")
    ax.legend(fontsize="small")
    return ("throughput_latency", "Throughput against latency per strategy under load", fig)


def sweep_figures(plt, df: pd.DataFrame) -> list[tuple]:
    found = frontier_heatmaps(plt, df)
    curve = throughput_latency(plt, df)
    return found + ([curve] if curve is not None else [])
