"""`sdbench report --explain`: where each configuration's speedup comes from, from the run's own measurements.

Per configuration (its overall row) and the baseline of the same run, with L the mean accepted length, V the
verification time, Dr the drafting time, D the decode time (wall_s - ttft_s), each summed over unique batches,
and steps the target verifications:

  ideal         L_s / L_b: the speedup if a step cost what a plain step costs and drafting were free
  verification  (V_b / steps_b) / (V_s / steps_s): 1 / v, v the measured cost of one verification over a
                plain 1-token step
  draft         V_s / (V_s + Dr_s): what drafting takes away
  overhead      ((V_s + Dr_s) / D_s) / (V_b / D_b): the share of decode time spent drafting and verifying,
                over the baseline's share spent in its forwards; below 1 when the strategy spends more of its
                time outside both (bookkeeping, rewinds, host syncs)
  prefill       measured speedup / decode speedup: the shared prefill and first token pulling the end-to-end
                speedup toward 1

The first four telescope to the decode speedup ((tokens_s / D_s) / (tokens_b / D_b), one first token per row
left out) and the fifth turns it into the measured speedup, so the product is exact by construction.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table
from rich.text import Text

from sdbench.engine.formulas import (acceptance_rate, mean_accepted_length, specbench_mean_accepted_tokens,
                                     vllm_draft_acceptance_rate, vllm_mean_acceptance_length)
from sdbench.reporting.cells import fmt, numeric, ratio
from sdbench.reporting.labels import labelled
from sdbench.reporting.round_parts import round_parts, round_parts_table
from sdbench.reporting.positions import position_acceptance
from sdbench.reporting.summary import ALL, summarize

FACTORS = ("ideal", "verification", "draft", "overhead", "prefill")


def factors(strategy: pd.Series, baseline: pd.Series) -> dict[str, float]:
    """The five factors of one configuration's summary row against its baseline's (see the module docstring)."""
    s, b = strategy, baseline
    busy_s = s["verify_s"] + s["draft_s"]
    return {
        "ideal": ratio(s["mean_accepted_len"], b["mean_accepted_len"]),
        "verification": ratio(ratio(b["verify_s"], b["steps"]), ratio(s["verify_s"], s["steps"])),
        "draft": ratio(s["verify_s"], busy_s),
        "overhead": ratio(ratio(busy_s, s["decode_s"]), ratio(b["verify_s"], b["decode_s"])),
        "prefill": ratio(s["speedup"], s["decode_speedup"]),
    }


def breakdown(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, configuration): measured speedup, the five factors, their product, v and the
    predicted speedup."""
    summary = summarize(df)
    summary = summary[summary["category"] == ALL]
    records = []
    for run_id, group in summary.groupby("run_id", sort=False):
        base = group[group["role"] == "baseline"]
        if base.empty:
            continue
        for _, row in group[group["role"] != "baseline"].iterrows():
            parts = factors(row, base.iloc[0])
            records.append({"run_id": run_id, "strategy": row["strategy"], "speedup": row["speedup"], **parts,
                            "product": float(np.prod([parts[f] for f in FACTORS])),
                            "verify_cost": ratio(1.0, parts["verification"]),
                            "predicted": row["predicted_speedup"]})
    return pd.DataFrame(records, columns=["run_id", "strategy", "speedup", *FACTORS, "product", "verify_cost",
                                          "predicted"])


def definitions(df: pd.DataFrame) -> pd.DataFrame:
    """Per (run, configuration), what sdbench, Spec-Bench and vLLM would print for the same rows."""
    data = labelled(df)
    records = []
    for (run_id, strategy), group in data[data["role"] != "baseline"].groupby(["run_id", "strategy"], sort=False):
        num = {c: float(np.nansum(numeric(group[c]))) for c in ("new_tokens", "steps", "accepted", "drafted")}
        drafts = float(position_acceptance(group).rounds)  # the steps that drafted: vLLM's num_drafts
        records.append({
            "run_id": run_id, "strategy": strategy,
            "sdbench_mean_accepted_len": mean_accepted_length(num["new_tokens"], num["steps"], len(group)),
            "sdbench_acceptance_rate": acceptance_rate(num["accepted"], num["drafted"]),
            "specbench_mean_accepted_tokens": specbench_mean_accepted_tokens(num["accepted"], num["steps"]),
            "vllm_mean_acceptance_length": vllm_mean_acceptance_length(num["accepted"], drafts),
            "vllm_draft_acceptance_rate": vllm_draft_acceptance_rate(num["accepted"], num["drafted"]),
        })
    return pd.DataFrame(records)


def breakdown_table(parts: pd.DataFrame) -> Table:
    table = Table(title="Where the speedup goes (factors multiply to the measured speedup)",
                  caption="verification: 1/v, v = one verification over a plain 1-token step (shown in brackets); "
                          "docs/results.md, 'Explaining a speedup', defines each factor")
    for name in ("run", "strategy", "measured", *FACTORS, "product", "predicted"):
        table.add_column(name, justify="left" if name in ("run", "strategy") else "right", no_wrap=True)
    for row in parts.to_dict("records"):
        cells = [row["run_id"], row["strategy"], fmt(row["speedup"], "{:.3f}x")]
        cells += [fmt(row[f], "{:.3f}") + (f" (v={row['verify_cost']:.2f})" if f == "verification"
                                           and math.isfinite(row["verify_cost"]) else "") for f in FACTORS]
        cells += [fmt(row["product"], "{:.3f}x"), fmt(row["predicted"], "{:.2f}x")]
        table.add_row(*(Text(str(c)) for c in cells))
    return table


def definitions_table(defs: pd.DataFrame) -> Table:
    table = Table(title="The same run by other tools' definitions (sdbench.engine.metrics)")
    columns = (("run", "run_id", "{}"), ("strategy", "strategy", "{}"),
               ("sdbench acc.len per step", "sdbench_mean_accepted_len", "{:.3f}"),
               ("sdbench accept", "sdbench_acceptance_rate", "{:.1%}"),
               ("Spec-Bench mean accepted tokens", "specbench_mean_accepted_tokens", "{:.3f}"),
               ("vLLM mean acceptance length", "vllm_mean_acceptance_length", "{:.3f}"),
               ("vLLM draft acceptance rate", "vllm_draft_acceptance_rate", "{:.1%}"))
    for name, _, _ in columns:
        table.add_column(name, justify="left" if name in ("run", "strategy") else "right")
    for row in defs.to_dict("records"):
        table.add_row(*(Text(p.format(row[k]) if isinstance(row[k], str) else fmt(row[k], p))
                        for _, k, p in columns))
    return table


def trees_table(rows: list[dict]) -> Table:
    """analysis/tree_explain.py `explain_trees`: what trees were verified, how their nodes were accepted, and what
    the tree cost model predicts from that."""
    table = Table(title="Token trees: size, acceptance by depth and sibling rank, and what the tree cost model "
                        "predicts (analysis/trees.py)",
                  caption="acceptance: per depth, rank 0 / 1 / ... accepted when tried; model: the run's own tree "
                          "(static shapes only); best: the dynamic programme's tree of the run's mean size; "
                          "speedups at the run's measured draft cost per level and verification cost; acc.len: "
                          "tokens per step (measured: pooled over the rows)")
    columns = (("run", "run_id", "{}"), ("strategy", "strategy", "{}"), ("nodes", "tree_size", "{:.1f}"),
               ("width", "width", "{:.1f}"), ("acceptance", "acceptance", "{}"), ("acc.len", "acc_len", "{:.2f}"),
               ("model acc.len", "model_acc_len", "{:.2f}"), ("model pred.", "model_speedup", "{:.2f}x"),
               ("best nodes", "best_nodes", "{:.0f}"), ("best acc.len", "best_acc_len", "{:.2f}"),
               ("best pred.", "best_speedup", "{:.2f}x"))
    for name, _, _ in columns:
        table.add_column(name, justify="left" if name in ("run", "strategy", "acceptance") else "right")
    for row in rows:
        table.add_row(*(Text(p.format(row[k]) if isinstance(row[k], str) else fmt(row[k], p)) for _, k, p in columns))
    return table


def print_explain(df: pd.DataFrame, console: Console, trees: list[dict] | None = None) -> None:
    """The factors, the other tools' definitions and, given `trees` (analysis/tree_explain.py explain_trees), the
    token trees' table."""
    parts = breakdown(df)
    if parts.empty:
        console.print("nothing to explain: no configuration ran beside a baseline")
    else:
        console.print(breakdown_table(parts))
    rounds = round_parts(df)
    if not rounds.empty:
        console.print(round_parts_table(rounds))
    defs = definitions(df)
    if not defs.empty:
        console.print(definitions_table(defs))
    if trees:
        console.print(trees_table(trees))
