"""Speculation profiles: per run and configuration, what an engine's synthetic acceptance or a capacity model
needs from sdbench's rows, with intervals, and the forms `sdbench profile` writes (reporting/profile_formats.py).

Per draft position (reporting/positions.py defines each share): the rounds that drafted a token there, reached it
and committed it; the conditional and the marginal acceptance. Two means of the accepted length, named apart
because they differ (specdec_bench warns of the same):
  mean_accept_length_per_step     sdbench's mean accepted length: (new tokens - one first token per row) / steps,
                                  pooled over every row (reporting/summary.py `mean_accepted_len`)
  mean_accept_length_per_request  the mean over rows (one prompt, turn and repeat: one request) of each row's own;
                                  a short answer weighs as much as a long one. Rows with no step are left out
  implied_mean_accept_length      1 + the sum of the marginal rates: the mean acceptance length vLLM reports,
                                  over the rounds that drafted (engine/formulas.py `vllm_mean_acceptance_length`);
                                  what an engine replaying the marginals should show
Every share and mean carries a 95 % interval: reporting/stats.py's cluster bootstrap over prompts (batches at
--batch-size > 1), none below MIN_PROMPTS of them. Rounds within one answer are not independent draws, which a
binomial (Wilson) interval over rounds would assume.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from sdbench.engine.formulas import mean_accepted_length, vllm_mean_acceptance_length
from sdbench.reporting.cells import numeric
from sdbench.reporting.labels import labelled
from sdbench.reporting.positions import position_acceptance, position_matrix, reached
from sdbench.reporting.stats import DRAWS, MIN_PROMPTS, SEED, Interval, sums_interval

SCHEMA = "sdbench-profile/1"
DIGITS = 6
INTERVAL = (f"95 % bootstrap over prompts (batches at --batch-size > 1): {DRAWS} draws, seed {SEED}; null below "
            f"{MIN_PROMPTS} prompts")


def configurations(df: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    """(run, configuration as the tables label it, its rows) for each whose rows drafted at least once."""
    data = labelled(df)
    data["method"] = df["strategy"].to_numpy()  # the strategy's own name, beside the label
    if "drafted_per_position" not in data:
        return []
    groups = data[data["role"] != "baseline"].groupby(["run_id", "strategy"], sort=False)
    return [(run_id, label, group) for (run_id, label), group in groups if position_acceptance(group).rounds > 0]


def speculation_profiles(df: pd.DataFrame) -> list[dict]:
    return [profile_of(*found) for found in configurations(df)]


def profile_of(run_id: str, label: str, group: pd.DataFrame) -> dict:
    gamma = numeric(group["gamma"]) if "gamma" in group else np.zeros(0)
    width = len(position_acceptance(group).drafted)
    width = max([width, *(int(g) for g in gamma if math.isfinite(g))])  # an engine takes one rate per drafted token
    found = position_acceptance(group, width)
    first = group.iloc[0]
    return {
        "run_id": run_id, "strategy": label, "method": str(first["method"]),
        "params": json.loads(_text(first.get("params")) or "{}"), "target": _text(first.get("target")),
        "draft": _text(first.get("draft")), "dataset": ", ".join(sorted({_text(d) for d in group.get("dataset", [])})),
        "weights_say_nothing": bool(group["weights_say_nothing"].any()),
        "num_speculative_tokens": width, "prompts": int(group["prompt_id"].nunique()), "rows": len(group),
        "steps": int(np.nansum(numeric(group["steps"]))), "rounds": found.rounds,
        "positions": _positions(group, found, width),
        "conditional_accept_rates": _rounded(found.conditional), "marginal_accept_rates": _rounded(found.marginal),
        **_means(group),
        "implied_mean_accept_length": _round(vllm_mean_acceptance_length(float(found.accepted.sum()), found.rounds)),
    }


def _positions(group: pd.DataFrame, found, width: int) -> list[dict]:
    """Per position (1-based), its counts and both shares with their intervals, from the rows' own counts."""
    accepted = position_matrix(group["accepted_per_position"], width)  # [rows, K]
    drafted = position_matrix(group["drafted_per_position"], width)
    reach = reached(accepted, drafted)
    out = []
    for k in range(width):
        out.append({"position": k + 1, "drafted": int(found.drafted[k]), "reached": int(found.reached[k]),
                    "accepted": int(found.accepted[k]),
                    "conditional": _round(found.conditional[k]),
                    "conditional_interval": _bounds(sums_interval(group, accepted[:, k], reach[:, k])),
                    "marginal": _round(found.marginal[k]),
                    "marginal_interval": _bounds(sums_interval(group, accepted[:, k], drafted[:, 0]))})
    return out


def _means(group: pd.DataFrame) -> dict:
    tokens, steps = numeric(group["new_tokens"]), numeric(group["steps"])
    per_step = mean_accepted_length(float(np.nansum(tokens)), float(np.nansum(steps)), len(group))
    stepped = np.isfinite(tokens) & np.isfinite(steps) & (steps > 0)
    own = np.array([mean_accepted_length(t, s) for t, s in zip(tokens[stepped], steps[stepped])])
    per_request = float(own.mean()) if len(own) else math.nan
    return {
        "mean_accept_length_per_step": _round(per_step),
        "mean_accept_length_per_step_interval": _bounds(sums_interval(group, tokens - 1, steps)),
        "mean_accept_length_per_request": _round(per_request),
        "mean_accept_length_per_request_interval": _bounds(
            sums_interval(group[stepped], own, np.ones(len(own)))),
    }


def _round(value) -> float | None:
    value = float(value)
    return round(value, DIGITS) if math.isfinite(value) else None


def _rounded(values) -> list[float | None]:
    return [_round(v) for v in values]


def _bounds(interval: Interval) -> list[float | None] | None:
    return [_round(interval.low), _round(interval.high)] if interval.known else None


def _text(value) -> str:
    return "" if value is None or (not isinstance(value, str) and pd.isna(value)) else str(value)


def as_json(profiles: list[dict]) -> str:
    """Every profile, in the layout docs/results.md describes."""
    return json.dumps({"schema": SCHEMA, "interval": INTERVAL, "profiles": profiles}, indent=2)


def as_vllm(profile: dict) -> str:
    """vLLM's speculative-config keys for its synthetic rejection sampler: one unconditional (marginal) rate per
    speculative token, non-increasing (vllm/config/speculative.py checks both); merge it into --speculative-config."""
    return json.dumps({"num_speculative_tokens": profile["num_speculative_tokens"],
                       "rejection_sample_method": "synthetic",
                       "synthetic_acceptance_rates": profile["marginal_accept_rates"]})


def synth_rates(rates) -> str:
    """llama-server's --spec-synth-rates value: the unconditional (marginal) rates, comma-separated: what `sdbench
    profile --format llama.cpp` writes and bench's own replay passes (servers/llamacpp.py), one text for both."""
    return ",".join(f"{p:.6f}" for p in rates)


def as_llamacpp(profile: dict) -> str:
    """llama-server's arguments: as many unconditional (marginal) rates as --spec-draft-n-max, comma-separated,
    non-increasing (its argument parser checks all three)."""
    return (f"--spec-draft-n-max {profile['num_speculative_tokens']} "
            f"--spec-synth-rates {synth_rates(profile['marginal_accept_rates'])}")
