"""The leaderboard: one row per run (of batches; requests served under load are on their run's page), strategy
configuration and group (every category and turn, each category, each turn), with the figures `sdbench report`
shows, from the same aggregates (reporting/summary.py) and the same intervals (reporting/stats.py). A speedup is always against the baseline of its own run, so rows of different machines are
never pooled: every row names the hardware it was measured on.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from sdbench.reporting.labels import labelled
from sdbench.reporting.load import load_rows
from sdbench.reporting.summary import ALL, per_position_rates, summarize

# the run's settings every row of it shares, taken from its strategy rows (the baseline's draft is "")
RUN_FIELDS = ("dataset", "target", "draft", "batch_size", "prompt_len", "dtype", "device", "hardware", "timestamp",
              "engine")
FIGURES = ("steps", "draft_s", "verify_s", "accept_s", "observe_s", "loop_s", "speedup", "speedup_low", "speedup_high",
           "decode_speedup", "tokens_per_s", "mean_accepted_len", "acceptance_rate", "predicted_speedup", "draft_share",
           "lossless", "ties", "width_invariant", "n_prompts", "n_rows", "weights_say_nothing", "speedup_bound",
           "distorted", "distortion", "busy", "busy_others", "cpu_steal")
COLUMNS = ("run_id", "role", "strategy", "settings", "target", "draft", "dataset", "category", "turn", "batch_size",
           "prompt_len", "gamma", *FIGURES, "acceptance_by_position", "dtype", "device", "hardware", "engine",
           "timestamp", "partial")


def leaderboard(summary: pd.DataFrame) -> pd.DataFrame:
    """The leaderboard: the summary's strategy rows (every row but the baselines')."""
    return summary[summary["role"] != "baseline"].reset_index(drop=True)


def summaries(rows: pd.DataFrame, partial: dict[str, str] | None = None) -> pd.DataFrame:
    """Every run's summary rows, its baselines' included; `partial`: run_id -> why that run stopped early."""
    rows = rows[~load_rows(rows)] if not rows.empty else rows  # requests served under load: their run's page
    if rows.empty:
        return pd.DataFrame(columns=list(COLUMNS))
    parts = [part for _, run in rows.groupby("run_id", sort=False) for part in _run_summary(run)]
    board = pd.concat(parts, ignore_index=True)  # a run is of one data set: its rows name it (RUN_FIELDS)
    board = board.join(_run_fields(rows), on="run_id")
    configs = _configurations(rows)
    key = pd.MultiIndex.from_arrays([board["run_id"].astype(str), board["strategy"].astype(str)])
    found = configs.reindex(key)
    board["gamma"] = found["gamma"].to_numpy(dtype="float64")
    board["settings"] = found["settings"].to_numpy()
    positions = {(r, s): rates for r, s, rates in per_position_rates(rows)}
    board["acceptance_by_position"] = [
        positions.get((r, s)) if c == ALL and t == ALL else None
        for r, s, c, t in zip(board["run_id"], board["strategy"], board["category"], board["turn"])]
    board["partial"] = board["run_id"].map(partial or {})
    board["turn"] = board["turn"].astype(str)
    return board[list(COLUMNS)].reset_index(drop=True)


def _run_summary(run: pd.DataFrame) -> list[pd.DataFrame]:
    """One run's summary by category, and by turn where it has several (each speedup within the run)."""
    parts = [_with_all(summarize(run, by=("category",)), "turn")]
    if pd.to_numeric(run["turn"], errors="coerce").fillna(1).nunique() > 1:
        by_turn = _with_all(summarize(run, by=("turn",)), "category")
        parts.append(by_turn[by_turn["turn"] != ALL])  # the ALL rows are already there
    return parts


def _with_all(summary: pd.DataFrame, column: str) -> pd.DataFrame:
    return summary.assign(**{column: ALL})


def _run_fields(rows: pd.DataFrame) -> pd.DataFrame:
    """run_id -> the settings of RUN_FIELDS, from its strategy rows where it has them."""
    ordered = rows.assign(_base=rows["role"].eq("baseline")).sort_values("_base", kind="stable")
    present = [f for f in RUN_FIELDS if f in rows]
    fields = ordered.groupby("run_id", sort=False)[present].first()
    return fields.reindex(columns=list(RUN_FIELDS))


def _configurations(rows: pd.DataFrame) -> pd.DataFrame:
    """(run_id, strategy label as the tables show it) -> the γ its rows share (NaN for several or none) and its
    settings as text ('budget=64 kv=snapkv'; γ has its own column)."""
    data = labelled(rows)
    data = data[data["role"] != "baseline"].assign(
        _gamma=pd.to_numeric(data["gamma"], errors="coerce").astype("float64"))
    out = {}
    for (run_id, label), group in data.groupby(["run_id", "strategy"], sort=False):
        gammas = group["_gamma"]
        settings = {json.dumps(_settings(p), sort_keys=True) for p in group["params"]}
        out[(str(run_id), str(label))] = {
            "gamma": float(gammas.iloc[0]) if gammas.nunique() == 1 and gammas.notna().all() else np.nan,
            "settings": " ".join(f"{k}={v}" for k, v in json.loads(settings.pop()).items()) if len(settings) == 1
            else "several"}
    return pd.DataFrame.from_dict(out, orient="index", columns=["gamma", "settings"])


def _settings(params) -> dict:
    return {k: v for k, v in sorted(json.loads(params or "{}").items()) if k != "gamma"}


def position_text(rates) -> str:
    """Acceptance by draft position as the leaderboard prints it: '0.91 0.74 0.52'."""
    if rates is None or (not isinstance(rates, (list, tuple, np.ndarray))):
        return ""
    return " ".join("–" if not np.isfinite(r) else f"{r:.2f}" for r in rates)

