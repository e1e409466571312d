"""A `tune` trial judged while it runs (`commands/tune.py`): its rows checked for losslessness batch by batch, its
running objective reported, and the pruner that stops a trial starting clearly worse than the finished ones.

Losslessness is a constraint, not a score: a trial whose output differs from plain greedy decoding fails (`Lossy`),
so it can never be best.
"""

from __future__ import annotations

import math

import numpy as np
import optuna
import pandas as pd
from optuna.trial import TrialState

from sdbench.commands.trials import objective_value


class Lossy(Exception):
    """A trial's output differed from plain greedy decoding."""


class ClearlyWorse(optuna.pruners.BasePruner):
    """Prunes a trial whose running objective after a number of batches is below (1 - margin) times the
    median of the finished trials after as many batches. Every trial sees the same prompts in the same
    order, so the comparison is fair; the margin keeps per-prompt timing noise from pruning good trials."""

    def __init__(self, margin: float = 0.1, min_trials: int = 2):
        self.margin, self.min_trials = margin, min_trials

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        step = trial.last_step
        if step is None:
            return False
        done = [t.intermediate_values[step] for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if step in t.intermediate_values]
        if len(done) < self.min_trials:
            return False
        return trial.intermediate_values[step] < (1.0 - self.margin) * float(np.median(done))


class Feed:
    """RunHarness's on_batch callback: checks losslessness, reports the running objective, prunes."""

    def __init__(self, trial, objective: str, reference: dict | None):
        self.trial, self.objective, self.reference = trial, objective, reference
        self.rows: list[dict] = []
        self.batches = 0

    def __call__(self, rows: list[dict]) -> None:
        self.rows.extend(rows)
        self.batches += 1
        for row in rows:
            if row["role"] == "baseline":
                continue
            same = row.get("lossless")
            if self.reference is not None and same is None:
                same = list(row["output_ids"]) == self.reference.get((row["prompt_id"], row.get("turn", 1)))
            if same is False and row.get("divergence") != "tie":  # a low-precision tie is not a loss
                raise Lossy(f"lossless broke: output differs from plain decoding on {row['prompt_id']}")
        value = objective_value(self.frame(), self.objective)
        if math.isfinite(value):
            self.trial.report(value, self.batches)
            if self.trial.should_prune():
                raise optuna.TrialPruned(f"pruned after {self.batches} batch(es) at {value:.3g}")

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows)


class NoPrune:
    """Stands in for a trial where nothing is being tuned."""

    def report(self, value, step) -> None:
        pass

    def should_prune(self) -> bool:
        return False
