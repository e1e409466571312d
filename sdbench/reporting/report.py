"""What `sdbench report` and the end of `sdbench run` print: the environment, the summary and the other tables
(requests served under load in their own), and notes on what the numbers cannot say; partial runs marked.
"""

from __future__ import annotations

import pandas as pd
from rich.console import Console
from rich.text import Text

from sdbench.reporting.bounds import bound_notes
from sdbench.reporting.labels import labelled
from sdbench.reporting.load import load_rows, load_tables
from sdbench.reporting.precision import precision_table
from sdbench.reporting.summary import BATCH, summarize
from sdbench.reporting.tables import (NOT_MEANINGFUL, adaptive_table, per_position_table, repeat_table,
                                      retrieval_table, summary_table)

PARTIAL = " (partial)"  # after the run id of a run stopped before its end


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
    summary = summarize(df, by or ("category",))
    console.print(summary_table(summary, title=_title(df)))
    if not by and "turn" in df and df["turn"].fillna(1).nunique() > 1:
        console.print(summary_table(summarize(df, ("turn",)), title="by turn"))
    found = retrieval_table(df)
    if found is not None:
        console.print(found)
    positions = per_position_table(df)
    if positions is not None:
        console.print(positions)
    for extra in (precision_table(df), adaptive_table(df), repeat_table(df)):
        if extra is not None:
            console.print(extra)
    for note in bound_notes(summary) + _notes(df):
        console.print(Text(f"note: {note}", style="dim"))


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
    if {"category", *BATCH} <= set(df.columns):
        mixed = df.groupby(BATCH, dropna=True)["category"].nunique()
        if (mixed > 1).any():
            notes.append(f"{int((mixed > 1).sum())} batch(es) mix categories: each category's tokens/s "
                         "counts those batches' whole wall time")
    if "weights" in df and labelled(df)["weights_say_nothing"].any():
        notes.append(f"{NOT_MEANINGFUL}: not meaningful with random weights (MODEL@random): acceptance and speedups "
                     "depend on the weights' values; tokens/s, step costs and memory do not (a model drafting for "
                     "itself is exempt: it accepts every draft whatever its weights)")
    if "mem_kind" in df and df["mem_kind"].astype(str).str.startswith("process_peak_rss").any():
        notes.append("CPU peak memory is the whole process's peak RSS, model weights included")
    return notes
