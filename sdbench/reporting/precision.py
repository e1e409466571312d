"""What a precision costs in acceptance: each strategy's mean accepted length and acceptance by draft position at
every dtype its rows ran at (`run --dtype float32,q4_0`, or `report` over runs of several dtypes), the accepted
length's change against the first dtype. Acceptance is what quantizing a target (and its draft) moves most
directly: a draft now has to agree with the quantized model."""

from __future__ import annotations

import numpy as np
import pandas as pd
from rich.table import Table
from rich.text import Text

from sdbench.engine.formulas import mean_accepted_length
from sdbench.reporting.cells import fmt, numeric
from sdbench.reporting.labels import labelled
from sdbench.reporting.summary import per_position_rates
from sdbench.reporting.tables import MAX_POSITIONS, PER_STEP


def precision_table(df: pd.DataFrame) -> Table | None:
    """The table, or None where the rows ran at one dtype (or none drafted)."""
    if "dtype" not in df or df["dtype"].nunique() < 2:
        return None
    dtype_of = df.groupby("run_id", sort=False)["dtype"].first()
    order = list(dict.fromkeys(dtype_of))  # the dtypes in the order their runs came
    rates = {(dtype_of[run], strategy): r for run, strategy, r in per_position_rates(df)}
    if not rates:
        return None
    lengths = _accepted_lengths(df, dtype_of)
    width = min(MAX_POSITIONS, max(len(r) for r in rates.values()))
    table = Table(title="Acceptance by precision",
                  caption=f"change: the accepted length against {order[0]}'s; {PER_STEP}")
    for name in ("strategy", "dtype", "acc.len", "change"):
        table.add_column(name, justify="left" if name in ("strategy", "dtype") else "right")
    for position in range(1, width + 1):
        table.add_column(str(position), justify="right")
    for strategy in dict.fromkeys(s for _, s in rates):
        first = lengths.get((order[0], strategy), np.nan)
        for dtype in order:
            if (dtype, strategy) not in rates:
                continue
            length, row = lengths.get((dtype, strategy), np.nan), rates[(dtype, strategy)]
            change = "" if dtype == order[0] else fmt(length / first - 1, "{:+.1%}")
            cells = [fmt(row[i] if i < len(row) else None, "{:.1%}") for i in range(width)]
            table.add_row(*(Text(c) for c in [strategy, dtype, fmt(length, "{:.2f}"), change, *cells]))
    return table


def _accepted_lengths(df: pd.DataFrame, dtype_of: pd.Series) -> dict[tuple[str, str], float]:
    """(dtype, strategy) -> mean accepted length over its rows (tokens per step, every row's first excluded)."""
    data = labelled(df)
    data = data[data["role"] != "baseline"]
    out = {}
    for (run, strategy), group in data.groupby(["run_id", "strategy"], sort=False):
        tokens, steps = np.nansum(numeric(group["new_tokens"])), np.nansum(numeric(group["steps"]))
        out[(dtype_of[run], strategy)] = mean_accepted_length(tokens, steps, len(group))
    return out
