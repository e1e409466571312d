"""`sdbench tune --batch 1,4 [--prompt-len L1,L2]`: one study per bucket, the winners as one schedule preset;
`sdbench schedule show|export NAME`: a schedule as a table, or in an engine's form.

Each bucket is an ordinary `tune` study (commands/tune.py) at that batch size and prompt length, on one loaded
pair, named after the bucket so that it resumes on its own; its settings are chosen by sdbench/schedule.py's
selection rule, and `run` looks them up by sdbench/schedule.py's lookup rule. By default (`--per-bucket gamma`) the
larger batch sizes tune gamma alone, holding the other settings as the smallest chose them (Optuna's partially
fixed sampler): engines vary only the drafted tokens with the batch size (sdbench/commands/schedule_formats.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from sdbench.commands.schedule_formats import render
from sdbench.commands.trials import best_trials, write_whole
from sdbench.commands.tune import Tuner, slug
from sdbench.config import TuneConfig
from sdbench.errors import SdbenchError
from sdbench.models.loading.aliases import EmbeddedModel, HubModel, model_registry
from sdbench.presets import read_presets
from sdbench.reporting.cells import fmt
from sdbench.schedule import Entry, Schedule, pick
from sdbench.strategies import resolve_strategy

PER_BUCKET = ("gamma", "all")  # what each --batch bucket tunes beyond the smallest: gamma alone, or every setting
RULE = ("highest measured objective; a trial inside the best one's 95 % bootstrap interval ties, and the smallest "
        "gamma among the tied wins")


def buckets(cfg: TuneConfig) -> list[tuple[int, int | None]]:
    """(batch size, prompt length) per study: every --batch × every --prompt-len, the smallest batch first."""
    sizes = sorted(cfg.batches or (cfg.run.batch_size,))
    lengths = cfg.prompt_lens or (cfg.run.prompt_len,)
    return [(b, length) for length in lengths for b in sizes]


def bucket_config(cfg: TuneConfig, study: str, batch: int, prompt_len: int | None,
                  held: tuple = ()) -> TuneConfig:
    """One bucket's study: the run at that size and length (at least one batch of prompts), named after it and
    after the settings it holds (held at other values, it is another study)."""
    run = replace(cfg.run, batch_size=batch, prompt_len=prompt_len, limit=max(cfg.run.limit, batch))
    suffix = f"-b{batch}" + (f"-L{prompt_len}" if prompt_len is not None else "")
    if held:
        suffix += "-held-" + hashlib.sha1(json.dumps(held, sort_keys=True).encode()).hexdigest()[:8]
    return replace(cfg, run=run, study=study + suffix, batches=(), prompt_lens=(), held=tuple(held))


def tune_schedule(cfg: TuneConfig, console: Console, pair=None) -> Path:
    """Tune every bucket, then write the schedule preset; returns its path. With --per-bucket gamma (the default)
    the smallest batch of each prompt length tunes every setting and the larger ones gamma alone, the rest held as
    it chose them: the drafted tokens per batch size the engines take (sdbench/commands/schedule_formats.py)."""
    if len(cfg.strategies) > 1:
        raise SdbenchError("a schedule holds one strategy's settings per bucket: give one --strategy with --batch "
                           "or several --prompt-len lengths")
    if cfg.per_bucket not in PER_BUCKET:
        raise SdbenchError(f"--per-bucket {cfg.per_bucket}: use one of {', '.join(PER_BUCKET)}")
    planned = Tuner(cfg, console, write=False)
    name = cfg.preset or slug(f"schedule-{planned.strategy}-{planned.run.target}")
    first = Tuner(replace(cfg, preset=name), console, write=False)  # checks the preset's name
    plans = [Tuner(bucket_config(cfg, first.study_name, b, length), console, write=False)
             for b, length in buckets(cfg)]
    if pair is None:
        widest = max(plans, key=lambda t: (t.run.prompt_len or 0, t.run.limit))
        pair = widest.load()
    entries, held = [], {}  # prompt length -> the settings its smallest batch chose, held by the larger
    for tuner in plans:
        length = tuner.run.prompt_len
        if held.get(length):
            tuner = Tuner(bucket_config(cfg, first.study_name, tuner.run.batch_size, length, held[length]), console,
                          write=False)
        label = Entry(tuner.run.batch_size, length, 0).label
        kept = " ".join(f"{k}={v}" for k, v in tuner.cfg.held)
        console.rule(f"{label}: study {tuner.study_name}" + (f" (gamma alone; {kept} held)" if kept else ""))
        tuner.pair = pair
        study = tuner.tune()
        entry = chosen(study, tuner.run.batch_size, length)
        if entry is None:
            raise SdbenchError(f"{label}: no trial finished losslessly, so the schedule has no entry for it; "
                               "run the same command again with more --trials")
        entries.append(entry)
        if cfg.per_bucket == "gamma" and length not in held:
            held[length] = tuple(sorted((k, v) for k, v in study.trials[entry.trial].params.items() if k != "gamma"))
    path = write_schedule(first.preset_path, name, first.strategy, Schedule(tuple(entries)), cfg)
    console.print(schedule_table(name, Schedule(tuple(entries))))
    console.print(f"schedule → {path} (`sdbench run --strategy {name} --batch-size B` applies the entry for B; "
                  f"`sdbench schedule export {name} --format vllm`)", highlight=False)
    return path


def chosen(study, batch: int, prompt_len: int | None) -> Entry | None:
    """The bucket's entry by the selection rule, or None when no trial completed."""
    trials = best_trials(study)
    if not trials:
        return None
    intervals = [tuple(t.user_attrs.get("interval") or (None, None)) for t in trials]
    t = trials[pick([(t.value, iv, t.user_attrs["settings"]["gamma"]) for t, iv in zip(trials, intervals)])]
    s = t.user_attrs["settings"]
    low, high = t.user_attrs.get("interval") or (float("nan"), float("nan"))
    return Entry(batch, prompt_len, int(s["gamma"]), dict(s["options"]), tuple(s["drafts"]), float(t.value),
                 (float(low), float(high)), study.study_name, t.number)


def write_schedule(path: Path, name: str, strategy: str, schedule: Schedule, cfg: TuneConfig) -> Path:
    run = cfg.run
    first = schedule.entries[0]
    spec = {
        "name": name, "strategy": strategy,
        "description": (f"schedule tuned on {run.target} · {run.dataset} ({run.limit} prompts or a batch, "
                        f"{run.max_new_tokens} new tokens), {len(schedule.entries)} buckets, objective "
                        f"{cfg.objective}"),
        "gamma": first.gamma, "options": dict(first.options), **({"drafts": list(first.drafts)} if first.drafts else {}),
        "schedule": schedule.spec(RULE),
        "tuned": {"objective": cfg.objective, "target": run.target, "dataset": run.dataset,
                  "per_bucket": cfg.per_bucket},
    }
    header = "# Written by `sdbench tune --batch ...`; tuning the same buckets again rewrites it.\n"
    text = header + yaml.safe_dump(spec, sort_keys=False, allow_unicode=True)
    return write_whole(path, lambda tmp: tmp.write_text(text))


def schedule_table(name: str, schedule: Schedule) -> Table:
    table = Table(title=f"schedule {name} (the entry of the largest tuned size at or below the run's)")
    for column in ("batch", "prompt", "gamma", "settings", "tuned value", "95 % interval", "trial"):
        table.add_column(column, justify="left" if column == "settings" else "right")
    for e in schedule.entries:
        settings = " ".join([*(f"{k}={v}" for k, v in e.options.items()), *(f"draft={d}" for d in e.drafts)])
        table.add_row(str(e.batch), fmt(e.prompt_len, "{:.0f}"), str(e.gamma), settings or "–", fmt(e.value, "{:.3g}"),
                      f"{fmt(e.interval[0], '{:.3g}')}-{fmt(e.interval[1], '{:.3g}')}", fmt(e.trial, "{:.0f}"))
    return table


def load_schedule(name: str) -> tuple[str, Schedule]:
    """(strategy, schedule) of the preset `name`; one line when there is none."""
    if name.lower() not in read_presets():
        raise SdbenchError(f"no preset named '{name}' (`sdbench list strategies` shows the presets)")
    choice = resolve_strategy(name)
    if choice.schedule is None:
        raise SdbenchError(f"preset '{name}' has no schedule (tune one with `sdbench tune --batch 1,4 ...`)")
    return choice.base, choice.schedule


def hub_id(name: str) -> str:
    """A draft as an engine would load it: a hub alias's repository id (an embedded GGUF's, the model it
    quantises), anything else as written."""
    model = model_registry.get(name) if name in model_registry else None
    if isinstance(model, (HubModel, EmbeddedModel)) and model.repo_id:
        return model.repo_id
    return name


def export_schedule(name: str, fmt_: str, out: str | None, console: Console, batch: int | None = None) -> None:
    """The schedule (or, with `batch`, the bucket a server of that batch size runs) in format `fmt_`, printed or
    written whole to `out`."""
    strategy, schedule = load_schedule(name)
    text = render(fmt_, strategy, schedule, hub_id, batch)
    if out is None:
        console.print(text, highlight=False, soft_wrap=True)
        return
    path = Path(out)
    try:
        write_whole(path, lambda tmp: tmp.write_text(text + "\n"))
    except OSError as e:
        raise SdbenchError(f"--out {out}: {e.strerror or e}") from None
    console.print(f"wrote {path}", highlight=False)


def show_schedule(name: str, console: Console) -> None:
    strategy, schedule = load_schedule(name)
    console.print(f"{name}: {strategy}", highlight=False)
    console.print(schedule_table(name, schedule))
