"""Aggregates over result rows and the rich tables that show them, each defined once.

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
  speedup_low/high   the 95 % bootstrap interval of speedup (and decode_speedup_low/high of decode_speedup),
                     paired with the baseline of the same batch and repeat (sdbench.reporting.stats)
  predicted_speedup  mean of the computed values
  draft_share        draft_s / (draft_s + verify_s), each summed over unique batches of the batch's value
                     (the max over its rows: a row records the batch's time while the row was active)
  weights_say_nothing  rows with random weights (MODEL@random), whose acceptance and speedups depend on values
                     the weights do not have; the tables show them as n/m (a model drafting for itself with a
                     dense cache is exempt: it accepts every draft whatever its weights)
"""

from __future__ import annotations

import json

import math

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table
from rich.text import Text

from sdbench.engine.counters import AdaptiveRowStats
from sdbench.engine.formulas import acceptance_rate, mean_accepted_length, rate
from sdbench.engine.metrics import speedup
from sdbench.errors import SdbenchError
from sdbench.reporting.cells import fmt, numeric
from sdbench.reporting.load import load_rows, load_tables
from sdbench.reporting.results import parse_stats
from sdbench.reporting.stats import Interval, describe, repeat_spread, speedup_interval

ALL = "ALL"
_BATCH = ["run_id", "role", "batch_id", "repeat"]
_OPTIONAL = {"draft": "", "params": "", "category": "", "lossless": None, "predicted_speedup": np.nan, "ttft_s": np.nan,
             "draft_s": np.nan, "verify_s": np.nan, "peak_mem_bytes": np.nan, "drafted": 0, "accepted": 0,
             "divergence": None, "turn": 1, "weights": None, "target": ""}
MAX_POSITIONS = 16


def summarize(df: pd.DataFrame, by: tuple[str, ...] | list[str] = ("category",)) -> pd.DataFrame:
    """One row per (run, role/strategy, group), plus one per (run, role/strategy) with every `by` = "ALL"."""
    by = list(by)
    data = _prepare(df, by)
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
    summary.attrs["by"] = tuple(by)
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
    return Interval(float(row[prefix]), float(row.get(f"{prefix}_low", np.nan)),
                    float(row.get(f"{prefix}_high", np.nan)))


def _prepare(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Adds missing optional columns and gives each strategy configuration of a run its own label."""
    data = df.copy()
    for column, default in _OPTIONAL.items():
        if column not in data:
            data[column] = default
    data["turn"] = data["turn"].fillna(1)  # files from before turns hold first turns only
    for column in by:
        if column not in data:
            raise SdbenchError(f"--by {column}: no such results column (e.g. category, turn, depth, gamma, dataset)")
        if data[column].dtype == object:
            data[column] = data[column].fillna("–")
    baseline = data["role"] == "baseline"
    ident = data[["strategy", "draft", "params"]].fillna("").astype(str)
    data["weights_say_nothing"] = say_nothing(data, ident) & ~baseline
    label = ident["strategy"].where(~baseline, "baseline")
    # Several configurations under one strategy name in a run must not be pooled into one row.
    config = ident["draft"] + "\x1f" + ident["params"]
    shared = ~baseline & config.groupby([data["run_id"], label], dropna=False).transform("nunique").gt(1)
    label = label.astype(object)
    if shared.any():
        label.loc[shared] = [f"{n} {d}" for n, d in zip(ident.loc[shared, "strategy"], _differing(ident.loc[shared]))]
    data["strategy"] = label
    return data


def say_nothing(data: pd.DataFrame, ident: pd.DataFrame) -> pd.Series:
    """Rows whose acceptance and speedup say nothing of a real model: random weights, unless the target drafts
    for itself through a dense cache (`draft`, no sparse draft_kv), which accepts every draft whatever the values."""
    random = data["weights"].astype(object).eq("random").fillna(False).astype(bool)
    dense = ident["params"].map(lambda p: json.loads(p or "{}").get("draft_kv", "dense") == "dense")
    own = ident["strategy"].eq("draft") & ident["draft"].eq(data["target"].fillna("").astype(str)) & dense
    return random & ~own


def labelled(df: pd.DataFrame) -> pd.DataFrame:
    """The rows with `strategy` relabelled as the tables show it ('baseline', 'draft gamma=2', ...)."""
    return _prepare(df, [])


def _differing(ident: pd.DataFrame) -> pd.Series:
    """Per row, only the settings that differ between the configurations: 'gamma=2', 'draft=x gamma=4'."""
    settings = [{"draft": d, **json.loads(p or "{}")} for d, p in zip(ident["draft"], ident["params"])]
    varying = {k for k in {k for s in settings for k in s} if len({json.dumps(s.get(k)) for s in settings}) > 1}
    text = [" ".join(f"{k}={s[k]}" for k in sorted(varying) if k in s) for s in settings]
    return pd.Series(text, index=ident.index, dtype=object)


def _ratio(num: float, den: float) -> float:
    return num / den if den and not math.isnan(den) and not math.isnan(num) else math.nan


def _per_batch(group: pd.DataFrame, column: str) -> float:
    """Sum over unique batches of a batch-level time (its max over the batch's rows).

    A row without batch_id is its own batch, so missing ids can never hide wall time.
    """
    keys = group[_BATCH].astype(object)
    loose = keys["batch_id"].isna()
    keys.loc[loose, "batch_id"] = [f"row-{i}" for i in range(int(loose.sum()))]
    values = pd.Series(numeric(group[column]), index=group.index)
    per_batch = values.groupby([keys[k] for k in _BATCH], dropna=False).max()
    return float(per_batch.sum(min_count=1)) if len(per_batch) else math.nan


def _aggregate(group: pd.DataFrame) -> dict:
    new_tokens = np.nansum(numeric(group["new_tokens"]))
    steps, accepted = np.nansum(numeric(group["steps"])), np.nansum(numeric(group["accepted"]))
    wall = _per_batch(group, "wall_s")
    decode = _per_batch(group.assign(decode_s=numeric(group["wall_s"]) - numeric(group["ttft_s"])), "decode_s")
    draft_s, verify_s = _per_batch(group, "draft_s"), _per_batch(group, "verify_s")
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
        "lossless": _all_known(group["lossless"].astype(object).where(~ties, True)),
        "ties": int(ties.sum()),
        "predicted_speedup": float(np.nanmean(predicted)) if np.isfinite(predicted).any() else math.nan,
        "peak_mem_bytes": float(np.nanmax(peak)) if np.isfinite(peak).any() else math.nan,
        "weights_say_nothing": bool(group["weights_say_nothing"].any()),
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


def summary_table(summary: pd.DataFrame, title: str | None = None) -> Table:
    """The summary as a table; per-group rows first, the overall rows last and bold."""
    by = list(summary.attrs.get("by", ("category",)))
    many_runs = summary["run_id"].nunique() > 1
    table = Table(title=title, caption=INTERVAL_CAPTION)
    if many_runs:
        table.add_column("run", no_wrap=True)
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
        cells = [row["strategy"], " / ".join(str(row[b]) for b in by), str(row["n_prompts"]),
                 fmt(row["tokens_per_s"], "{:.1f}"), *values, fmt(row["draft_share"], "{:.1%}"),
                 _mark(row["lossless"]) + (f" ({row['ties']} tie)" if row.get("ties") else "")]
        cells = ([row["run_id"]] if many_runs else []) + cells
        table.add_row(*(Text(str(c)) for c in cells), style="bold" if overall else None)
    return table


NOT_MEANINGFUL = "n/m"
PARTIAL = " (partial)"  # after the run id of a run stopped before its end
INTERVAL_CAPTION = ("speedup ±: half the width of its 95 % bootstrap interval over prompts and repeats; "
                    "* the interval contains 1.0")


def speedup_cell(row, prefix: str = "speedup") -> str:
    """'1.12x ±0.04', with '*' when the interval contains 1.0 (no speedup or slowdown shown beyond noise)."""
    interval = speedup_of(row, prefix)
    return describe(interval) + ("*" if interval.contains(1.0) else "")


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


def _mark(value) -> str:
    if value is None or pd.isna(value):
        return "–"
    return "✓" if value else "✗"


def per_position_rates(df: pd.DataFrame) -> list[tuple[str, str, list[float]]]:
    """(run_id, strategy, acceptance rate per draft position) from element-wise sums; NaN = never drafted."""
    if "accepted_per_position" not in df or "drafted_per_position" not in df:
        return []
    data = _prepare(df, [])
    out = []
    for (run_id, strategy), group in data[data["role"] != "baseline"].groupby(["run_id", "strategy"], sort=False):
        accepted = _padded_sum(group["accepted_per_position"])
        drafted = _padded_sum(group["drafted_per_position"])
        width = max(len(accepted), len(drafted))
        if width == 0:
            continue
        accepted, drafted = np.pad(accepted, (0, width - len(accepted))), np.pad(drafted, (0, width - len(drafted)))
        rates = [acceptance_rate(a, d) for a, d in zip(accepted, drafted)]
        out.append((run_id, strategy, rates))
    return out


def _padded_sum(lists: pd.Series) -> np.ndarray:
    total = np.zeros(0, dtype=np.int64)
    for value in lists:
        if value is None or (not hasattr(value, "__len__") and pd.isna(value)):
            continue
        array = np.asarray(value, dtype=np.int64)
        if len(array) > len(total):
            total = np.pad(total, (0, len(array) - len(total)))
        total[: len(array)] += array
    return total


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
    data = _prepare(df, [])
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
    data = _prepare(df, [])
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
    data = _prepare(df, [])
    table = Table(title="Repeatability (tokens/s from repeat to repeat)")
    for name in ("run", "strategy", "repeats", "spread (MAD/median)"):
        table.add_column(name, justify="right" if name in ("repeats", "spread (MAD/median)") else "left")
    for (run_id, strategy), group in data.groupby(["run_id", "strategy"], sort=False):
        value, n = repeat_spread(group)
        table.add_row(Text(str(run_id)), Text(str(strategy)), str(n), fmt(value, "{:.1%}"))
    return table


def environment_lines(df: pd.DataFrame) -> list[str]:
    """One line per distinct environment among the rows, naming its runs when there are several."""
    columns = ["device", "dtype", "torch_version", "transformers_version", "sdbench_version", "git_commit",
               "hardware"]
    data = df.reindex(columns=["run_id"] + columns).astype(object).where(lambda d: d.notna(), "?")
    envs = data.groupby(columns, sort=False)["run_id"].unique()
    lines = []
    for values, runs in envs.items():
        env = dict(zip(columns, values))
        line = (f"{env['device']} · {env['dtype']} · torch {env['torch_version']} · "
                f"transformers {env['transformers_version']} · sdbench {env['sdbench_version']} "
                f"@ {env['git_commit']} · {env['hardware']}")
        lines.append(f"{', '.join(map(str, runs))}: {line}" if len(envs) > 1 else line)
    return lines


def _title(df: pd.DataFrame) -> str:
    parts = []
    for column in ("target", "engine", "dataset", "run_id"):
        if column in df:
            values = [str(v) for v in dict.fromkeys(df[column].dropna())]
            label = ", ".join(values)
            parts.append(f"through {label}'s server" if column == "engine" and label else label)
    return " · ".join(p for p in parts if p)


def marked_partial(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of a partial run (`unfinished` set by read_results) under the run id 'RUN (partial)', so that every
    table and plot says so; idempotent."""
    if "unfinished" not in df or not df["unfinished"].notna().any():
        return df
    run_id = df["run_id"].astype(str)
    relabel = df["unfinished"].notna() & ~run_id.str.endswith(PARTIAL)
    return df.assign(run_id=run_id.where(~relabel, run_id + PARTIAL))


def _notes(df: pd.DataFrame) -> list[str]:
    notes = []
    if "unfinished" in df:
        for run_id, reason in df[["run_id", "unfinished"]].dropna().drop_duplicates().itertuples(index=False):
            notes.append(f"{run_id.removesuffix(PARTIAL)} is partial: {reason}; its rows cover only the batches "
                         "that finished, not the whole run")
    if {"category", *_BATCH} <= set(df.columns):
        mixed = df.groupby(_BATCH, dropna=True)["category"].nunique()
        if (mixed > 1).any():
            notes.append(f"{int((mixed > 1).sum())} batch(es) mix categories: each category's tokens/s "
                         "counts those batches' whole wall time")
    if "weights" in df and _prepare(df, [])["weights_say_nothing"].any():
        notes.append(f"{NOT_MEANINGFUL}: not meaningful with random weights (MODEL@random): acceptance and speedups "
                     "depend on the weights' values; tokens/s, step costs and memory do not (a model drafting for "
                     "itself is exempt: it accepts every draft whatever its weights)")
    if "mem_kind" in df and df["mem_kind"].astype(str).str.startswith("process_peak_rss").any():
        notes.append("CPU peak memory is the whole process's peak RSS, model weights included")
    return notes


def retrieval_table(df: pd.DataFrame) -> Table | None:
    """Retrieval tasks: the share of outputs holding the answer, per strategy and depth; None without any."""
    if "found" not in df or not df["found"].notna().any():
        return None
    data = _prepare(df[df["found"].notna()], [])
    table = Table(title="Answer found (retrieval)")
    for column in ("strategy", "depth", "found", "prompt tokens"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for (strategy, depth), group in data.groupby(["strategy", "depth"], sort=False, dropna=False):
        found = group["found"].astype(bool)
        table.add_row(*(Text(str(c)) for c in (strategy, fmt(depth, "{:.0%}"), f"{int(found.sum())}/{len(found)}",
                                                 fmt(group["prompt_tokens"].median(), "{:.0f}"))))
    return table


def print_report(df: pd.DataFrame, console: Console | None = None, by: tuple[str, ...] = ()) -> None:
    """Environment, summary and per-position tables: what `sdbench report` and the end of `sdbench run` show.
    by: the summary's grouping (category when empty, and then one table per turn too when rows have several)."""
    console = console or Console()
    if df.empty:
        console.print("no result rows")
        return
    df = marked_partial(df)
    for line in environment_lines(df):
        console.print(Text(line, style="dim"))
    served = load_rows(df)
    if served.any():  # requests served under load have their own tables; batches (if any) follow
        for table in load_tables(labelled(df[served])):
            console.print(table)
        df = df[~served]
        if df.empty:
            return
    console.print(summary_table(summarize(df, by or ("category",)), title=_title(df)))
    if not by and "turn" in df and df["turn"].fillna(1).nunique() > 1:
        console.print(summary_table(summarize(df, ("turn",)), title="by turn"))
    found = retrieval_table(df)
    if found is not None:
        console.print(found)
    positions = per_position_table(df)
    if positions is not None:
        console.print(positions)
    for extra in (adaptive_table(df), repeat_table(df)):
        if extra is not None:
            console.print(extra)
    for note in _notes(df):
        console.print(Text(f"note: {note}", style="dim"))
