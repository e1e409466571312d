"""Result rows as the tables show them: missing optional columns filled with their defaults, each strategy
configuration of a run under its own label ('baseline', 'draft gamma=2', ...), and the rows whose random weights
make acceptance and speedups say nothing marked.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from sdbench.errors import SdbenchError

_OPTIONAL = {"draft": "", "params": "", "category": "", "lossless": None, "predicted_speedup": np.nan, "ttft_s": np.nan,
             "draft_s": np.nan, "verify_s": np.nan, "accept_s": np.nan, "observe_s": np.nan,
             "loop_s": np.nan, "peak_mem_bytes": np.nan, "drafted": 0, "accepted": 0,
             "divergence": None, "turn": 1, "weights": None, "target": "", "busy_others": np.nan,
             "cpu_steal": np.nan, "width_invariant": None}


def prepared(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
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
    return prepared(df, [])


def _differing(ident: pd.DataFrame) -> pd.Series:
    """Per row, only the settings that differ between the configurations: 'gamma=2', 'draft=x gamma=4'."""
    settings = [{"draft": d, **json.loads(p or "{}")} for d, p in zip(ident["draft"], ident["params"])]
    varying = {k for k in {k for s in settings for k in s} if len({json.dumps(s.get(k)) for s in settings}) > 1}
    text = [" ".join(f"{k}={s[k]}" for k in sorted(varying) if k in s) for s in settings]
    return pd.Series(text, index=ident.index, dtype=object)
