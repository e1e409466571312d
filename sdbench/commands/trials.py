"""A tuning study's trials: the objective read from a trial's result rows, the figures kept with each trial, the
best trials' table and the doubts about them, the trials as Parquet, and the preset written from the best."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import optuna
import pandas as pd
import yaml
from optuna.trial import TrialState
from rich.table import Table

from sdbench.commands.studies import NOT_NEEDED, reason as trial_reason
from sdbench.config import TuneConfig
from sdbench.reporting.cells import fmt
from sdbench.reporting.labels import labelled
from sdbench.reporting.summary import ALL, speedup_of, summarize
from sdbench.reporting.stats import Interval, describe as describe_interval, doubt, speedup_interval
from sdbench.engine.tree import tree_text


def overall(rows: pd.DataFrame) -> pd.Series | None:
    """The tuned configuration's summary over all rows, aggregated as `sdbench report` does; not the
    baseline, nor configurations a strategy runs beside itself for comparison (roles compare-*)."""
    data = rows if "run_id" in rows else rows.assign(run_id="trial")
    summary = summarize(data, by=("dataset",))
    summary = summary[summary["dataset"] == ALL]
    mine = summary[~summary["role"].astype(str).str.startswith(("baseline", "compare"))]
    return None if mine.empty else mine.iloc[0]


def objective_value(rows: pd.DataFrame, objective: str) -> float:
    row = overall(rows)
    return math.nan if row is None else float(row["speedup" if objective == "speedup" else "tokens_per_s"])


def objective_interval(rows: pd.DataFrame, objective: str) -> Interval:
    """The 95 % bootstrap interval of the objective: the report's speedup interval, or that of tokens/s."""
    row = overall(rows)
    if row is None:
        return Interval(math.nan)
    if objective == "speedup":
        return speedup_of(row)
    mine = labelled(rows if "run_id" in rows else rows.assign(run_id="trial"))
    return speedup_interval(mine[mine["role"] == row["role"]], None)


def doubts(study: optuna.Study, objective: str) -> list[str]:
    """Why the best trial cannot be called best (its interval is wider than its lead over the runner-up) or
    claimed as a speedup (wider than its distance from 1.0); empty when both claims stand."""
    ranked = best_trials(study)
    if not ranked:
        return []
    best, attrs = ranked[0], ranked[0].user_attrs
    interval = Interval(best.value, *(attrs.get("interval") or (math.nan, math.nan)))
    prompts = attrs.get("prompts") or 0
    found = []
    if len(ranked) > 1:
        found.append(doubt(interval, ranked[1].value, prompts, f"trial {best.number} is not shown better than "
                                                                 f"trial {ranked[1].number}"))
    if objective == "speedup":
        found.append(doubt(interval, 1.0, prompts, f"trial {best.number} shows no speedup beyond noise"))
    return [d for d in found if d]


def describe(settings: dict) -> str:
    """e.g. 'gamma=4 max_ngram=3 draft=smollm2-135m' ('strategy=eagle gamma=3 head=...' among several)."""
    parts = [*([f"strategy={settings['strategy']}"] if settings.get("strategy") else []),
             f"gamma={settings['gamma']}", *(f"{k}={v}" for k, v in settings["options"].items())]
    if settings.get("drafts"):
        parts.append(f"draft={','.join(settings['drafts'])}")
    return " ".join(parts)


def record_trial(trial, rows: pd.DataFrame, objective: str, batches: int) -> None:
    """The trial's measured figures (from its result rows), for the tables and the trials Parquet."""
    row = overall(rows)
    if row is None:
        return
    for key in ("tokens_per_s", "speedup", "mean_accepted_len"):
        value = float(row[key])
        trial.set_user_attr(key, value if math.isfinite(value) else None)
    interval = objective_interval(rows, objective)
    trial.set_user_attr("interval", [interval.low, interval.high] if interval.known else None)
    trial.set_user_attr("prompts", int(row["n_prompts"]))
    lossless = row["lossless"]
    trial.set_user_attr("lossless", None if lossless is None or pd.isna(lossless) else bool(lossless))
    trial.set_user_attr("batches", batches)


def best_trials(study: optuna.Study) -> list:
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    return sorted(done, key=lambda t: -t.value)


def best_table(study: optuna.Study, objective: str, top: int = 5) -> Table:
    trials = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("reason") != NOT_NEEDED]
    states = {s: sum(t.state == s for t in trials) for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}
    caption = (f"{len(trials)} trials: {states[TrialState.COMPLETE]} complete, {states[TrialState.PRUNED]} pruned, "
               f"{states[TrialState.FAIL]} failed")
    caption = "\n".join([caption, *doubts(study, objective)])
    table = Table(title=f"best trials by {objective} (± half the 95 % interval)", caption=caption)
    for name in ("trial", "tok/s", "speedup", "acc.len/step", "settings"):
        table.add_column(name, justify="left" if name == "settings" else "right")
    for t in best_trials(study)[:top]:
        attrs = t.user_attrs
        bounds = attrs.get("interval") or (math.nan, math.nan)
        shown = {objective: describe_interval(Interval(t.value, *bounds), "" if objective == "tokens" else "x",
                                              1 if objective == "tokens" else 2)}
        table.add_row(str(t.number), shown.get("tokens", fmt(attrs.get("tokens_per_s"), "{:.1f}")),
                      shown.get("speedup", fmt(attrs.get("speedup"), "{:.2f}x")),
                      fmt(attrs.get("mean_accepted_len"), "{:.2f}"), describe(attrs["settings"]))
    return table


def trial_records(study: optuna.Study) -> pd.DataFrame:
    """One row per trial of the study (every machine's), settings as JSON."""
    hardware = study.user_attrs.get("hardware")
    records = []
    for t in study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        settings = attrs.get("settings") or {}
        records.append({
            "study": study.study_name, "trial": t.number, "state": t.state.name, "value": t.value,
            "strategy": settings.get("strategy") or "+".join(study.user_attrs.get("strategies") or ()) or None,
            "gamma": settings.get("gamma"), "tree": tree_text(settings.get("options", {})),
            "options": json.dumps(settings.get("options", {}), sort_keys=True),
            "drafts": ",".join(settings.get("drafts", [])), "params": json.dumps(t.params, sort_keys=True, default=str),
            "tokens_per_s": attrs.get("tokens_per_s"), "speedup": attrs.get("speedup"),
            "mean_accepted_len": attrs.get("mean_accepted_len"), "lossless": attrs.get("lossless"),
            "batches": attrs.get("batches"), "reason": trial_reason(t),
            "hardware": attrs.get("hardware", hardware), "worker": attrs.get("worker"), "results": attrs.get("results"),
            "started": t.datetime_start.isoformat() if t.datetime_start else None,
            "duration_s": t.duration.total_seconds() if t.duration else None,
        })
    frame = pd.DataFrame(records)
    for column in ("value", "tokens_per_s", "speedup", "mean_accepted_len", "duration_s"):
        if column in frame:
            frame[column] = pd.to_numeric(frame[column], errors="coerce").astype("float64")
    return frame


def write_whole(path: Path, write) -> Path:
    """write(tmp) then rename over path: readers, and other processes of a shared study writing the same
    file, only ever see a whole one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)
    return path


def write_trials(study: optuna.Study, path: Path) -> Path:
    return write_whole(path, lambda tmp: trial_records(study).to_parquet(tmp, index=False))


def write_preset(path: Path, name: str, strategy: str, trial, study: optuna.Study, cfg: TuneConfig, run,
                 found: list[str] = ()) -> Path:
    """The best settings as a named preset that `sdbench run --strategy NAME` accepts. found: doubts() about
    the trial; with any, the description claims no speedup and no best, only what was measured."""
    settings = trial.user_attrs["settings"]
    unit = "x speedup" if cfg.objective == "speedup" else " tokens/s"
    bounds = trial.user_attrs.get("interval") or (math.nan, math.nan)
    measured = describe_interval(Interval(trial.value, *bounds), "x" if cfg.objective == "speedup" else "", 2)
    claim = (f"{trial.value:.3g}{unit} (95 % interval {measured})" if not found else
             f"measured {measured}{'' if cfg.objective == 'speedup' else ' tokens/s'}, not a claim: {found[0]}")
    spec = {
        "name": name,
        "strategy": strategy,
        "description": (f"tuned on {run.target} · {run.dataset} ({run.limit} prompts, {run.max_new_tokens} new tokens): "
                        f"{claim} on {study.user_attrs.get('hardware')}"),
        "gamma": settings["gamma"],
        "options": settings["options"],
        **({"drafts": settings["drafts"]} if settings["drafts"] else {}),
        "tuned": {"study": study.study_name, "trial": trial.number, "objective": cfg.objective,
                  "value": float(trial.value), "interval": [float(b) for b in bounds], "claimed": not found,
                  "target": run.target, "dataset": run.dataset},
    }
    header = "# Written by `sdbench tune`; tuning the same study again rewrites it.\n"
    text = header + yaml.safe_dump(spec, sort_keys=False, allow_unicode=True)
    return write_whole(path, lambda tmp: tmp.write_text(text))
