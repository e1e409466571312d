"""`report --explain`'s round table: where a configuration's decode time goes, by the parts the decode loop times
(engine/loop.py `_rounds`), per round.

Per configuration (its overall row), each summed over unique batches: the proposer's setup (a draft model's
prefill or a cache's compression, once per batch, inside the decode time) and, per round, drafting (without the
setup), the target's verifying forward, acceptance (the verdict, its sampling and the commit), the proposer's
bookkeeping after the verdict (observe) and the loop's own work between rounds. With the setup spread over the
rounds they sum to the decode time per round; `other` is what no part holds (a request's admission under load,
a decoder with its own loop: DSI's ledger)."""

from __future__ import annotations

import math

import pandas as pd
from rich.table import Table
from rich.text import Text

from sdbench.reporting.cells import fmt, ratio
from sdbench.reporting.summary import ALL, summarize

PARTS = ("draft", "verify", "accept", "observe", "loop", "setup")


def round_parts(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, configuration, baseline included): milliseconds per round of each part (PARTS, the setup
    spread over the rounds), `other`, the whole round, and the share of the decode time outside drafting and
    verification."""
    summary = summarize(df)
    records = []
    for row in summary[summary["category"] == ALL].to_dict("records"):
        if "accept_s" not in row or not row["steps"]:  # results written before the parts were timed
            continue
        seconds = {"setup": _known(row.get("setup_s"))}
        seconds["draft"] = row["draft_s"] - seconds["setup"]
        seconds.update(verify=row["verify_s"], accept=row["accept_s"], observe=row["observe_s"], loop=row["loop_s"])
        seconds["other"] = row["decode_s"] - sum(seconds.values())
        ms = {part: 1e3 * s / row["steps"] for part, s in seconds.items()}
        outside = sum(seconds[p] for p in ("accept", "observe", "loop", "setup", "other"))
        records.append({"run_id": row["run_id"], "strategy": row["strategy"], "rounds": row["steps"], **ms,
                        "round": 1e3 * row["decode_s"] / row["steps"], "outside": ratio(outside, row["decode_s"])})
    return pd.DataFrame(records)


def _known(value) -> float:
    return 0.0 if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def round_parts_table(parts: pd.DataFrame) -> Table:
    table = Table(title="Where a round's time goes (ms per round; engine/loop.py times each part)",
                  caption="setup: the proposer's (a draft's own prefill), spread over the rounds; other: decode time "
                          "no part holds; outside: the share of decode time spent neither drafting nor verifying")
    for name in ("run", "strategy", "rounds", *PARTS, "other", "round", "outside"):
        table.add_column(name, justify="left" if name in ("run", "strategy") else "right", no_wrap=True)
    for row in parts.to_dict("records"):
        cells = [row["run_id"], row["strategy"], fmt(row["rounds"], "{:.0f}")]
        cells += [fmt(row[p], "{:.2f}") for p in (*PARTS, "other", "round")] + [fmt(row["outside"], "{:.1%}")]
        table.add_row(*(Text(str(c)) for c in cells))
    return table
