"""The DSI paper's heat-maps: expected latency of plain decoding, SI and DSI over drafter latency c and
acceptance rate a, each algorithm at its best lookahead, and the four speedup panels the paper draws.

The grid follows the paper's reference implementation: grid + 1 values of c and of a spread evenly over
[0, 1], c at least 0.01 and a clipped to [0.01, 0.99]; a fixed number of target workers (the paper's node:
7); per cell only lookaheads the workers sustain, ceil(1 / (k c)) <= workers, are tried, for DSI and SI
alike. The reference implementation tries k = 1 .. ndim (its README gives ndim = 20 for the paper's figure;
an earlier configuration had ndim = 200); sdbench tries k = 1 .. kmax, by default 200, which holds both
(a wider range can only lower a cell's best latency). Offline (counting forwards), vectorised over a and k:
the same renewal sums as sdbench.analysis.theory, checked against it by the tests.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from sdbench.errors import SdbenchError
from sdbench.analysis.theory import dsi_window_starts, dsi_workers_needed, renewal_terms

KMAX = 200  # lookaheads tried per cell: 1 .. KMAX
PAPER_WORKERS = 7  # the paper's single node: 8 GPUs, one of them the drafter's

# (column, title, colour-bar cap, contour lines): the paper's four panels
PANELS = (
    ("speedup_dsi_vs_si", "DSI / SI", 3.0, (1.1, 1.25, 1.5, 2.0)),
    ("speedup_dsi_vs_plain", "DSI / non-SI (plain decoding)", 10.0, (1.5, 2, 3, 5)),
    ("speedup_si_vs_plain", "SI / non-SI (plain decoding)", 10.0, (1.0, 1.5, 2, 3, 5)),
    ("speedup_dsi_vs_best", "DSI / min(SI, non-SI)", 3.0, (1.1, 1.25, 1.5, 2.0)),
)


def grid_values(grid: int, c_min: float = 0.01, a_range=(0.01, 0.99)):
    c = np.maximum(np.linspace(0.0, 1.0, grid + 1), c_min)
    a = np.clip(np.linspace(0.0, 1.0, grid + 1), *a_range)
    return c, a


def heatmap(workers: int = PAPER_WORKERS, grid: int = 20, kmax: int = KMAX, c_min: float = 0.01,
            a_range=(0.01, 0.99)):
    """Offline expected latency per token over a (c, a) grid (1.0 = plain decoding), each algorithm at its best
    lookahead among those the workers sustain; `si_any_k` is SI at its best over every k <= kmax. Returns a
    DataFrame: c, a, workers, best k of each, latencies and the speedups of the four panels."""
    if grid < 1 or kmax < 1 or workers < 1:
        raise SdbenchError("need --grid >= 1, --kmax >= 1 and --workers >= 1")
    cs, as_ = grid_values(grid, c_min, a_range)
    frames = [_column(float(c), as_, workers, kmax) for c in cs]
    frame = pd.concat(frames, ignore_index=True)
    for col in ("k_si", "k_dsi", "k_si_any"):
        frame[col] = frame[col].astype("Int64")
    frame["speedup_si_vs_plain"] = 1.0 / frame["si"]
    frame["speedup_dsi_vs_si"] = frame["si"] / frame["dsi"]
    frame["speedup_dsi_vs_plain"] = 1.0 / frame["dsi"]
    frame["speedup_dsi_vs_best"] = np.minimum(frame["si"], 1.0) / frame["dsi"]
    frame["speedup_dsi_vs_si_any_k"] = frame["si_any_k"] / frame["dsi"]
    return frame


def si_latencies(a, c: float, ks):
    """SI latency per token, [A, K]: (k c + 1) / Omega(k, a), Omega = (1 - a^(k+1)) / (1 - a)."""
    a, ks = np.asarray(a, dtype=float)[:, None], np.asarray(ks, dtype=float)[None, :]
    omega = np.where(a >= 1.0, ks + 1.0, (1.0 - a ** (ks + 1.0)) / np.where(a >= 1.0, 1.0, 1.0 - a))
    return (ks * c + 1.0) / omega


def dsi_latencies(a, c: float, ks, workers: int | None = None, bonus: bool = True):
    """DSI latency per token, [A, K]: analysis.theory.dsi_latency_per_token for every a and k at once (the same
    renewal sum with the same tail)."""
    a = np.asarray(a, dtype=float)
    inner = a[a < 1.0]
    jmax = renewal_terms(float(inner.max())) if inner.size else 0
    j = np.arange(jmax + 1)
    cost = np.empty((jmax + 1, len(ks)))
    for col, k in enumerate(ks):
        windows = np.ceil((j if bonus else j + 1) / k).astype(int)
        starts = np.asarray(dsi_window_starts(c, int(k), int(windows[-1]), workers))
        cost[:, col] = np.minimum(starts[windows] + 1.0, j + 1.0)
    safe = np.where(a < 1.0, a, 0.0)[:, None]  # [A, 1]
    ks_arr = np.asarray(ks, dtype=float)[None, :]  # [1, K]
    pace = np.minimum(c if workers is None else np.maximum(c, 1.0 / (workers * ks_arr)), 1.0)
    weights = (1.0 - safe) * safe ** j[None, :]  # [A, J]
    tail = safe ** (jmax + 1) * (cost[-1][None, :] + pace / (1.0 - safe))  # [A, K]
    out = (1.0 - safe) * (weights @ cost + tail)
    return np.where(a[:, None] >= 1.0, np.broadcast_to(pace, out.shape), out)


def _column(c: float, as_, workers: int, kmax: int):
    """The heat-map's rows for one drafter latency c (every a)."""
    ks = np.arange(1, kmax + 1)
    valid = ks[[dsi_workers_needed(c, int(k)) <= workers for k in ks]]
    si = si_latencies(as_, c, ks)
    rows = pd.DataFrame({"c": c, "a": as_, "workers": workers, "plain": 1.0})
    best_any = si.argmin(axis=1)
    rows["si_any_k"], rows["k_si_any"] = si[np.arange(len(as_)), best_any], ks[best_any]
    if not len(valid):
        for col in ("k_si", "k_dsi", "si", "dsi", "dsi_paper"):
            rows[col] = math.nan
        return rows
    si_valid = si[:, valid - 1]
    dsi = dsi_latencies(as_, c, valid)
    paper = dsi_latencies(as_, c, valid, bonus=False)
    at = np.arange(len(as_))
    rows["k_si"], rows["si"] = valid[si_valid.argmin(axis=1)], si_valid[at, si_valid.argmin(axis=1)]
    rows["k_dsi"], rows["dsi"] = valid[dsi.argmin(axis=1)], dsi[at, dsi.argmin(axis=1)]
    rows["dsi_paper"] = paper.min(axis=1)
    return rows


def plot_heatmap(frame, path, mark: tuple[float, float] | None = None) -> list[str]:
    """The paper's four panels over (drafter latency c, acceptance rate a). Where the ratio is below 1 (the
    first algorithm slower) the cell is pink, as in the paper's figure. `mark`: a measured (c, a) to show.
    Returns the panels' titles."""
    import matplotlib  # slow to import, and only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs, as_ = np.sort(frame["c"].unique()), np.sort(frame["a"].unique())
    fig, axes = plt.subplots(2, 2, figsize=(13, 10), constrained_layout=True)
    titles = []
    for ax, (column, title, cap, lines) in zip(axes.flat, PANELS):
        grid = frame.pivot(index="a", columns="c", values=column).reindex(index=as_, columns=cs).to_numpy()
        top = min(cap, float(np.nanmax(grid)))
        filled = ax.contourf(cs, as_, grid, levels=np.linspace(1.0, max(top, 1.01), 15), cmap="viridis",
                             extend="max")
        if np.nanmin(grid) < 1.0:
            ax.contourf(cs, as_, grid, levels=[0.0, 1.0], colors=["#f81894"])
        contours = ax.contour(cs, as_, grid, levels=list(lines), colors="white", linewidths=0.7)
        ax.clabel(contours, fmt="%gx", fontsize=8)
        fig.colorbar(filled, ax=ax, format="%.2gx")
        if mark is not None:
            ax.plot([mark[0]], [mark[1]], marker="*", color="red", markersize=14, markeredgecolor="white")
        ax.set_xlabel("drafter latency c (draft forward / target forward)")
        ax.set_ylabel("acceptance rate a")
        titles.append(f"{title} (min {np.nanmin(grid):.2f}x, max {np.nanmax(grid):.1f}x)")
        ax.set_title(titles[-1])
    workers = int(frame["workers"].iloc[0])
    kmax = int(frame["k_si_any"].max())
    fig.suptitle(f"{workers} target workers, offline; each algorithm at its best lookahead k <= {kmax} among those "
                 f"the workers sustain (ceil(1/(k·c)) <= {workers})" + ("; red star: measured" if mark else ""))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return titles


def heatmap_summary(frame) -> str:
    """One line: the range of each panel and whether 'DSI is never slower than SI or plain decoding' holds."""
    def span(column):
        return f"{frame[column].min():.2f}x..{frame[column].max():.1f}x"

    worst = frame["speedup_dsi_vs_best"].min()
    verdict = "holds" if worst >= 1 - 1e-9 else "FAILS"
    workers = int(frame["workers"].iloc[0])
    kmax = int(frame["k_si_any"].max())
    return (f"heat-map ({len(frame)} settings of c and a, {workers} worker{'s' * (workers != 1)}, k <= {kmax}): "
            f"DSI/SI {span('speedup_dsi_vs_si')}, DSI/plain {span('speedup_dsi_vs_plain')}, SI/plain "
            f"{span('speedup_si_vs_plain')}, DSI/min(SI, plain) {span('speedup_dsi_vs_best')}; 'never slower than "
            f"SI or plain decoding' {verdict}. Against SI free to pick a lookahead the workers cannot sustain for "
            f"DSI: {span('speedup_dsi_vs_si_any_k')}")


def table_lookahead(c: float, workers: int, choices=(1, 5, 10)) -> int | None:
    """The paper's rule for its latency table: the smallest lookahead of {1, 5, 10} whose worker bound
    ceil(1 / (k c)) the workers meet; None when none does."""
    return next((k for k in sorted(choices) if dsi_workers_needed(c, k) <= workers), None)
