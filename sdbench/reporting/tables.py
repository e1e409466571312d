"""The rich tables of `sdbench report` beside the summary's own: the summary (speedups with their intervals),
acceptance by draft position, adaptive lookahead's gamma against fixed ones, repeat-to-repeat spread, and
retrieval tasks' answers found. Rows whose random weights say nothing show n/m.
"""

from __future__ import annotations

import math

import pandas as pd
from rich.table import Table
from rich.text import Text

from sdbench.engine.counters import AdaptiveRowStats
from sdbench.engine.metrics import speedup
from sdbench.reporting.bounds import beyond
from sdbench.reporting.cells import fmt
from sdbench.reporting.labels import labelled
from sdbench.reporting.results import parse_stats
from sdbench.reporting.stats import MIN_PROMPTS, describe, mark, repeat_spread
from sdbench.reporting.summary import ALL, per_position_rates, speedup_of, summarize

NOT_MEANINGFUL = "n/m"
INTERVAL_CAPTION = ("speedup ±: half the width of its 95 % bootstrap interval over prompts; * the interval "
                    f"contains 1.0; ? too few prompts (< {MIN_PROMPTS}) for an interval; ! above the bound its accepted "
                    "length allows (see the notes); busy: others used the cores while it or its baseline ran; "
                    "lossless exact: held to plain decoding bit for bit (every step width-invariant), else up to "
                    "ties in its path's rounding")
PER_STEP = ("acc.len: the mean accepted length per step, tokens per target verification pooled over the rows "
            "(bonus token included; `sdbench profile` also gives the mean per request)")
MAX_POSITIONS = 16


def summary_table(summary: pd.DataFrame, title: str | None = None) -> Table:
    """The summary as a table; per-group rows first, the overall rows last and bold."""
    by = list(summary.attrs.get("by", ("category",)))
    many_runs = summary["run_id"].nunique() > 1
    hardware = summary.attrs.get("hardware", {})
    machines = len(set(hardware.values())) > 1  # rows of several machines: each row names its own
    table = Table(title=title, caption=f"{INTERVAL_CAPTION}\n{PER_STEP}")
    if many_runs:
        table.add_column("run", no_wrap=True)
    if machines:
        table.add_column("hardware", no_wrap=True)
    table.add_column("strategy", no_wrap=True)
    table.add_column(" / ".join(by) if by != ["category"] else "category", no_wrap=True)
    # short headers keep the table readable in an 80-column terminal
    for name in ("n", "tok/s", "speedup", "decode", "pred.", "acc.len", "accept", "draft%"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("lossless", justify="center", no_wrap=True)
    started_overall = False
    for row in _ordered(summary, by):
        overall = all(row[b] == ALL for b in by)
        if overall and not started_overall:
            table.add_section()
            started_overall = True
        values = [speedup_cell(row), speedup_cell(row, "decode_speedup"), fmt(row["predicted_speedup"], "{:.2f}x"),
                  fmt(row["mean_accepted_len"], "{:.2f}"), fmt(row["acceptance_rate"], "{:.1%}")]
        if row.get("weights_say_nothing"):
            values = [NOT_MEANINGFUL] * len(values)
        cells = [row["strategy"] + (" busy" if flagged(row, "busy") else ""), " / ".join(str(row[b]) for b in by), str(row["n_prompts"]),
                 fmt(row["tokens_per_s"], "{:.1f}"), *values, fmt(row["draft_share"], "{:.1%}"),
                 lossless_cell(row)]
        cells = ([row["run_id"]] if many_runs else []) + ([hardware.get(row["run_id"], "?")] if machines else []) + cells
        table.add_row(*(Text(str(c)) for c in cells), style="bold" if overall else None)
    return table


def speedup_cell(row, prefix: str = "speedup") -> str:
    """'1.12x ±0.04', with '*' when the interval contains 1.0 (no speedup or slowdown shown beyond noise), '?' when
    too few prompts gave no interval, '!' when the figure is above its bound (reporting/bounds.py); the baseline's
    own 1.00x unmarked."""
    interval = speedup_of(row, prefix)
    if row.get("role") == "baseline":
        return describe(interval)
    above = beyond(interval, float(row.get("speedup_bound", math.nan)))
    return describe(interval) + mark(interval) + ("!" if above else "")


def flagged(row, column: str) -> bool:
    """A summary row's flag (distorted, busy), False where the column is missing or unknown."""
    value = row.get(column)
    return value is not None and not pd.isna(value) and bool(value)


def _ordered(summary: pd.DataFrame, by: list[str]) -> list[dict]:
    """Groups in order of appearance, the overall group last; within a group, runs, then baseline first."""
    rows = summary.to_dict("records")
    groups = list(dict.fromkeys(tuple(r[b] for b in by) for r in rows))
    runs = list(dict.fromkeys(r["run_id"] for r in rows))

    def key(r: dict) -> tuple:
        group = tuple(r[b] for b in by)
        return (all(g == ALL for g in group), groups.index(group), runs.index(r["run_id"]),
                r["role"] != "baseline", r["strategy"])

    return sorted(rows, key=key)


def lossless_cell(row) -> str:
    """'✓ exact' (held bit for bit: every step width-invariant), '✓', '✓ (2 tie)', '✗' or '–' (not known)."""
    exact = flagged(row, "lossless") and flagged(row, "width_invariant") and not row.get("ties")
    return _mark(row["lossless"]) + (" exact" if exact else f" ({row['ties']} tie)" if row.get("ties") else "")


def _mark(value) -> str:
    if value is None or pd.isna(value):
        return "–"
    return "✓" if value else "✗"


def per_position_table(df: pd.DataFrame) -> Table | None:
    """Acceptance rate at each draft position, per strategy; None when no row recorded positions."""
    rates = per_position_rates(df)
    if not rates:
        return None
    many_runs = len({run for run, _, _ in rates}) > 1
    width = min(MAX_POSITIONS, max(len(r) for _, _, r in rates))
    caption = f"positions beyond {MAX_POSITIONS} not shown" if any(len(r) > width for _, _, r in rates) else None
    title = "Acceptance rate by draft position"
    table = Table(title=title, caption=caption, min_width=len(title) + 4)
    if many_runs:
        table.add_column("run")
    table.add_column("strategy")
    for position in range(1, width + 1):
        table.add_column(str(position), justify="right")
    data = labelled(df)
    hidden = set(map(tuple, data.loc[data["weights_say_nothing"], ["run_id", "strategy"]].to_numpy()))
    for run_id, strategy, row in rates:
        cells = [fmt(row[i] if i < len(row) else None, "{:.1%}") for i in range(width)]
        if (run_id, strategy) in hidden:
            cells = [NOT_MEANINGFUL] * width
        table.add_row(*(Text(c) for c in ([run_id] if many_runs else []) + [strategy] + cells))
    return table


def adaptive_table(df: pd.DataFrame) -> Table | None:
    """For strategies that record a gamma trajectory (`gamma_hist` in strategy_stats): mean gamma, its
    histogram, rounds drafted per candidate, and tokens/s relative to the fixed-gamma configurations run
    beside them (roles compare-*): the best of those, and the one at the strategy's starting --gamma."""
    if "strategy_stats" not in df:
        return None
    data = labelled(df)
    stats = data["strategy_stats"].map(lambda text: AdaptiveRowStats.from_dict(parse_stats(text)))
    mask = stats.map(lambda s: bool(s.gamma_hist))
    if not mask.any():
        return None
    overall = summarize(df)
    overall = overall[overall["category"] == ALL].set_index(["run_id", "role"])
    gammas = data.groupby(["run_id", "role"], sort=False)["gamma"].first()
    table = Table(title="Adaptive lookahead (gamma: rounds at each value; drafts: rounds per candidate)")
    for column in ("strategy", "mean γ", "γ histogram", "drafts", "vs best fixed", "vs --gamma"):
        table.add_column(column, justify="right" if column.startswith(("mean", "vs")) else "left")
    for (run_id, role), group in data[mask].groupby(["run_id", "role"], sort=False):
        hist, drafts = {}, {}
        for s in stats[group.index]:
            for g, n in s.gamma_hist.items():
                hist[g] = hist.get(g, 0) + n
            for name, n in s.drafts.items():
                drafts[name] = drafts.get(name, 0) + n
        rounds = sum(hist.values())
        mean = sum(g * n for g, n in hist.items()) / rounds if rounds else math.nan
        best, guessed = _versus_fixed(overall, gammas, run_id, role)
        table.add_row(*(Text(c) for c in (
            group["strategy"].iloc[0], fmt(mean, "{:.2f}"), " ".join(f"{g}:{n}" for g, n in sorted(hist.items())),
            " ".join(f"{k}:{n}" for k, n in drafts.items()) or "–", best, guessed)))
    return table


def _versus_fixed(overall: pd.DataFrame, gammas: pd.Series, run_id: str, role: str) -> tuple[str, str]:
    """'1.07x (draft gamma=4)' against the fastest compare-* configuration of the run, and against the first
    one at the strategy's own --gamma; '–' when the run has none."""
    tps = overall["tokens_per_s"]
    fixed = [r for r in overall.loc[run_id].index if str(r).startswith("compare-")] if run_id in overall.index else []
    if not fixed:
        return "–", "–"

    def versus(other: str) -> str:
        ratio = speedup(tps[(run_id, role)], tps[(run_id, other)])
        return f"{fmt(ratio, '{:.2f}x')} ({overall.loc[(run_id, other), 'strategy']})"

    best = max(fixed, key=lambda r: tps[(run_id, r)])
    same = [r for r in fixed if gammas.get((run_id, r)) == gammas.get((run_id, role))]
    return versus(best), versus(same[0]) if same else "–"


def repeat_table(df: pd.DataFrame) -> Table | None:
    """Per configuration, the repeat-to-repeat spread of tokens/s (MAD / median over repeats, each repeat's
    tokens/s aggregated over its batches); None when no configuration ran more than once."""
    if "repeat" not in df or pd.to_numeric(df["repeat"], errors="coerce").nunique() < 2:
        return None
    data = labelled(df)
    table = Table(title="Repeatability (tokens/s from repeat to repeat)")
    for name in ("run", "strategy", "repeats", "spread (MAD/median)"):
        table.add_column(name, justify="right" if name in ("repeats", "spread (MAD/median)") else "left")
    for (run_id, strategy), group in data.groupby(["run_id", "strategy"], sort=False):
        value, n = repeat_spread(group)
        table.add_row(Text(str(run_id)), Text(str(strategy)), str(n), fmt(value, "{:.1%}"))
    return table


def retrieval_table(df: pd.DataFrame) -> Table | None:
    """Retrieval tasks: the share of outputs holding the answer, per strategy and depth; None without any."""
    if "found" not in df or not df["found"].notna().any():
        return None
    data = labelled(df[df["found"].notna()])
    table = Table(title="Answer found (retrieval)")
    for column in ("strategy", "depth", "found", "prompt tokens"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for (strategy, depth), group in data.groupby(["strategy", "depth"], sort=False, dropna=False):
        found = group["found"].astype(bool)
        table.add_row(*(Text(str(c)) for c in (strategy, fmt(depth, "{:.0%}"), f"{int(found.sum())}/{len(found)}",
                                                 fmt(group["prompt_tokens"].median(), "{:.0f}"))))
    return table
