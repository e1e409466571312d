"""`sdbench train-head`: load the target, make self-distillation data from shipped prompts, fit the head within
the time budget, and write it where `--head` reads it — after every evaluation, so that an interruption loses
at most the steps since the last one. A re-run with the same --out resumes: the data shards made are kept, the
fit continues from its checkpoint and the budget counts the time already spent.

The data (`--answers`): the data sets' own replies read in one forward each (fast; at most half the data's
share of the budget when the target answers too), then the target's own answers (one decoding each). The
held-out prompts are always answered by the target, first: acceptance is measured on what decoding drafts
from, and no held-out prompt is read as training text."""

from __future__ import annotations

import contextlib
import json
import time
from functools import partial
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn
from rich.table import Table

from sdbench.config import HEAD_ANSWERS, TrainHeadConfig
from sdbench.env import environment
from sdbench.errors import Interrupted, SdbenchError
from sdbench.models.heads.registry import HeadRecord, read_record, write_record
from sdbench.models.loading.names import BLOCK_TYPES
from sdbench.paths import output_dir
from sdbench.strategies.spec import head_strategy
from sdbench.training import data as D
from sdbench.training.fit import FitPlan, Progress, fit
from sdbench.training.heads import (build, draft_vocab_note, head_layers, rebuild, target_weights, text_config,
                                    verifier_name, write_head)
from sdbench.training.kinds import KIND_OPTIONS, MIN_DRAFT_VOCAB, head_kind, head_kinds, unused_option

STATE = "train_state.json"  # what the folder was made for and how far data and fit went
CHECKPOINT = "checkpoint.pt"
DATA_SHARE = 0.4  # of the budget, at most, for generating data (the rest fits)
READ_SHARE = 0.75  # of the data's share, at most, for reading the data sets' replies when the target answers too
HELDOUT_EVERY = 16  # one training prompt in this many is held out for the acceptance it reports
MAX_PROMPT = 512  # a longer training prompt keeps its last tokens
MAX_REPLY = 512  # a data set's reply is read up to this many tokens


def validate(cfg: TrainHeadConfig) -> None:
    """One line on the first impossible setting, before anything is loaded: an unknown kind, an option the kind
    does not read (the head-kind registry says which read which), a value out of range, unknown data."""
    from sdbench.data.tasks import check_dataset

    if cfg.kind not in head_kinds:
        raise SdbenchError(f"--kind {cfg.kind}: use one of {', '.join(head_kinds.names())}")
    unused = unused_option(cfg.kind, {option: getattr(cfg, name) for option, name in KIND_OPTIONS.items()})
    if unused:
        raise SdbenchError(unused)
    if cfg.answers not in HEAD_ANSWERS:
        raise SdbenchError(f"--answers {cfg.answers}: use one of {', '.join(HEAD_ANSWERS)}")
    if not cfg.data:
        raise SdbenchError("train-head needs training data: --data NAME (a data set of `sdbench list datasets` "
                           "or a prompt file)")
    for name in cfg.data:
        check_dataset(name)
    if cfg.minutes <= 0:
        raise SdbenchError(f"--minutes {cfg.minutes}: give a positive number of minutes")
    if cfg.prompts < 2:
        raise SdbenchError(f"--prompts {cfg.prompts}: at least 2 (one is held out to measure acceptance)")
    if cfg.max_new_tokens < 4:
        raise SdbenchError(f"--max-new-tokens {cfg.max_new_tokens}: at least 4 (the head learns from the answers)")
    if cfg.draft_vocab is not None and cfg.draft_vocab != 0 and cfg.draft_vocab < MIN_DRAFT_VOCAB:
        raise SdbenchError(f"--draft-vocab {cfg.draft_vocab}: at least {MIN_DRAFT_VOCAB} tokens, or 0 for all the "
                           "target's")
    if cfg.dtype in BLOCK_TYPES:
        raise SdbenchError(f"train-head --dtype {cfg.dtype}: a head is fitted on the target's float weights (float32, "
                           "bfloat16 or float16); it drafts for the target's block copy as it is")
    if cfg.steps is not None and not 1 <= cfg.steps <= 16:
        raise SdbenchError(f"--steps {cfg.steps}: between 1 and 16")


def train_head(cfg: TrainHeadConfig, console: Console) -> Path:
    """Fit and write the head `cfg` asks for (module docstring); returns its folder."""
    cfg, device, dtype, out, state = _settle(cfg, console)
    t_start = time.perf_counter()
    loaded, runner, eos, verifier = _target(cfg, device, dtype, console)
    _save_state(out, state)  # the folder is this fit's from now on (a target that failed to load left it empty)
    steps = cfg.steps or head_kind(cfg.kind).default_steps
    layers = head_layers(cfg.kind, loaded.model.config)
    prompts = D.training_prompts(cfg.data, cfg.prompts, cfg.seed, loaded.tokenizer)
    heldout_ids = {(src, p.id) for i, (src, p) in enumerate(prompts) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1}
    seqs = _make_data(out, cfg, state, runner, loaded.tokenizer, prompts, heldout_ids, layers, eos, device, console)
    train, heldout = _held_out(seqs, heldout_ids)
    if not train:
        raise SdbenchError("no training data was made within --minutes: give more minutes")
    budget = cfg.minutes * 60 - state["data_seconds"]
    runner.share_plain()  # the fit reads the target's embedding and head in the library's layout (no forward follows)
    model, optimizer, progress = _trainee(out, cfg, loaded.model, train, steps, device)
    plan = FitPlan(steps=steps, lr=1e-3,
                batch_tokens=16384 if device.type == "cuda" else 2048,
                eval_every_s=max(30.0, budget / 10), seed=cfg.seed)
    save_dtype = dtype  # the head in the target's dtype (vLLM loads both in the serving dtype)
    record = HeadRecord(target=cfg.target, kind=cfg.kind,
                        trained_on=_trained_on(train), draft_vocab=getattr(model, "draft_ids", torch.empty(0)).numel()
                        or None, env=environment(str(device), cfg.dtype), target_weights=target_weights(loaded))

    def on_eval(p: Progress) -> None:
        _save_checkpoint(out, model, optimizer, p)
        write_head(out, cfg.kind, model, loaded.model, verifier, save_dtype)
        record.steps, record.heldout_acceptance = p.step, (p.heldout or {}).get("tau")
        record.created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        write_record(out, record)

    with _bar(console, cfg.kind, budget, progress.seconds) as on_step:
        try:
            fit(model, optimizer, train, heldout, plan, progress, budget, device, on_eval, on_step)
        except KeyboardInterrupt:
            on_eval(progress)  # the steps since the last evaluation are kept too
            raise Interrupted(f"interrupted at step {progress.step}: the head so far is in {out}; the same command "
                              "resumes the fit") from None
    _summary(console, cfg, out, progress, len(train), len(heldout), seqs, time.perf_counter() - t_start)
    return out


def _settle(cfg: TrainHeadConfig, console: Console):
    """The settings checked, the kind as registered, the device and dtype resolved, and --out's folder and state
    (`_state`), all before any model loads: (cfg, device, dtype, out, state)."""
    validate(cfg)
    cfg = replace(cfg, kind=head_kinds.entry(cfg.kind).name)  # as registered, whatever its case
    from sdbench.models.loading.pair import resolve_device, resolve_dtype  # transformers: once the settings are sound

    device = resolve_device(cfg.device)
    dtype_name = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    dtype = resolve_dtype(dtype_name, device)
    cfg = replace(cfg, dtype=dtype_name)  # what the folder records: a resumed fit must answer in the same dtype
    out = output_dir(cfg.out)
    return cfg, device, dtype, out, _state(out, cfg, console)


@contextlib.contextmanager
def _bar(console: Console, kind: str, budget: float, done: float):
    """A progress bar over the fit's time budget; yields the fit's per-step callback, which moves it."""
    columns = (TextColumn("[bold]fitting {task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn())
    with Bar(*columns, console=console, transient=True) as bar:
        task = bar.add_task(kind, total=budget, completed=done, info="")

        def on_step(p: Progress) -> None:
            tau = (p.heldout or {}).get("tau")
            info = f"step {p.step}  loss {p.loss:.3f}" + (f"  held-out τ {tau:.2f}" if tau else "")
            bar.update(task, completed=min(p.seconds, budget), info=info)

        yield on_step


def _target(cfg: TrainHeadConfig, device, dtype, console: Console):
    """The target loaded (`load_models`), its notes said and its runner probed unless --probe never (the states
    the head learns from come from a runner equal to the library's): (loaded, runner, eos ids, verifier)."""
    from sdbench.models.loading import loader
    from sdbench.models.loading.pair import Pair, load_models
    from sdbench.models.probing.probe import probe_pair
    from sdbench.models.probing.probe_cache import ProbeCache

    got = load_models([cfg.target], device, dtype, console)[cfg.target]
    loaded, runner = got.loaded, got.runner
    verifier = verifier_name(loaded)
    _notes(console, cfg, loaded, verifier)
    eos = loader.eos_token_ids(loaded)
    if cfg.probe != "never":
        pair = Pair(runner, loaded.tokenizer, [], eos, 1 << 30)
        probe_pair(pair, MAX_PROMPT + cfg.max_new_tokens, {}, console, ProbeCache(cfg.probe))
        runner = pair.target
    return loaded, runner, eos, verifier


def _held_out(seqs: list, heldout_ids: set) -> tuple[list, list]:
    """(training, held-out) sequences; with none held out, the last the target answered (else the last) is
    evaluated on."""
    train = [s for s in seqs if (s.source, s.id) not in heldout_ids]
    heldout = ([s for s in seqs if (s.source, s.id) in heldout_ids]
               or [s for s in train if s.answered_by == "target"][-1:] or train[-1:])
    return train, heldout


def _notes(console: Console, cfg: TrainHeadConfig, loaded, verifier: str | None) -> None:
    """One line each on what the head will be other than asked: a draft vocabulary capped at the target's, a
    config that names no verifier."""
    capped = draft_vocab_note(cfg.draft_vocab, text_config(loaded.model.config).vocab_size)
    if capped:
        console.print(capped, style="yellow", highlight=False)
    if verifier is None and loaded.source == "gguf":
        console.print(f"note: the head names no verifier ({cfg.target} is a GGUF file, which engines do not load by "
                      "name): vLLM runs it beside the target it is given; for speculators, write the model's hub id "
                      "or folder into config.json's speculators_config.verifier.name_or_path", style="yellow",
                      highlight=False, soft_wrap=True)


def _state(out: Path, cfg: TrainHeadConfig, console: Console) -> dict:
    """The folder's state, read before any model loads: a new fit in an empty folder (saved once the target has
    loaded), or a fit train-head started there with the same settings, resumed and said so in one line. A folder
    holding anything else, or a fit with other settings, is refused; nothing in it is touched."""
    path = out / STATE
    made = {"target": cfg.target, "kind": cfg.kind, "data": list(cfg.data), "max_new_tokens": cfg.max_new_tokens,
            "steps": cfg.steps, "draft_vocab": cfg.draft_vocab, "dtype": cfg.dtype, "answers": cfg.answers}
    if not path.is_file():
        held = sorted(p.name for p in out.iterdir())
        if held:
            more = f" and {len(held) - 1} more" if len(held) > 1 else ""
            raise SdbenchError(f"--out {out} holds files train-head did not write ({held[0]}{more}): give a new or "
                               "empty folder")
        return {**made, "data_seconds": 0.0}
    try:
        state = {"answers": "target", **json.loads(path.read_text())}  # folders made before --answers: the target's
    except (OSError, ValueError, TypeError):
        raise SdbenchError(f"--out {out}: its {STATE} is not readable: give another folder") from None
    differ = [k for k, v in made.items() if state.get(k) != v]
    if differ:
        raise SdbenchError(f"--out {out} holds a fit with another {differ[0]} ({state.get(differ[0])!r}): resume it "
                           f"with the same settings, or give another folder")
    record = read_record(out)
    done = f"fitted {record.steps} steps" if record else "made data"
    console.print(f"note: --out {out} holds this fit ({done}): it goes on from there, its data kept, within "
                  f"--minutes {cfg.minutes:g} counted from its first run", style="yellow", highlight=False)
    return state


def _save_state(out: Path, state: dict) -> None:
    tmp = out / (STATE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(out / STATE)


def _make_data(out, cfg, state, runner, tokenizer, prompts, heldout_ids, layers, eos, device,
               console) -> list[D.Sequence]:
    """The sequences made so far (a resumed run keeps them), then the rest, in batches landed as shards: the data
    sets' replies read (--answers data|both), then the target's answers (--answers target|both; with data, the
    held-out prompts only), each until its prompts or its share of the budget run out."""
    folder = out / "data"
    seqs = D.load_shards(folder)
    done = {(s.source, s.id, s.answered_by) for s in seqs}
    share = cfg.minutes * 60 * DATA_SHARE
    if cfg.answers != "target":
        todo = [(src, p) for src, p in prompts if p.reference and (src, p.id) not in heldout_ids]
        if cfg.answers == "data" and not todo and not any(by == "data" for _, _, by in done):
            raise SdbenchError(f"--answers {cfg.answers}: no prompt of --data {', '.join(cfg.data)} carries a reply "
                               "of its own (sharegpt, gsm8k and humaneval do): use --answers target")
        read = partial(D.teacher_forced, runner, layers=layers, tokenizer=tokenizer, max_tokens=MAX_REPLY)
        seqs += _landed(folder, state, out, todo, done, "data", read, 8, share * (READ_SHARE if cfg.answers == "both"
                        else 1.0), "reading the data sets' replies", len(seqs), tokenizer, console)
    answer = [(src, p) for src, p in prompts if cfg.answers != "data" or (src, p.id) in heldout_ids]
    answer.sort(key=lambda e: (e[0], e[1].id) not in heldout_ids)  # held out first: acceptance always measured
    write = partial(D.distil, runner, layers=layers, max_new_tokens=cfg.max_new_tokens, eos=eos)
    seqs += _landed(folder, state, out, answer, done, "target", write, 32 if device.type == "cuda" else 8,
                    share, "target answering training prompts", len(seqs), tokenizer, console)
    return seqs


def _landed(folder, state, out, prompts, done, by: str, make, size: int, share: float, label: str, shard0: int,
            tokenizer, console) -> list[D.Sequence]:
    """make(batch) over the prompts not yet `done` by `by`, a batch at a time, each landed as a shard, until the
    data's seconds (state["data_seconds"], over both kinds and every resumed run) reach `share`."""
    todo = D.encode([(src, p) for src, p in prompts if (src, p.id, by) not in done], tokenizer, MAX_PROMPT)
    made_here: list[D.Sequence] = []
    if not todo:
        return made_here
    shard = len(list(folder.glob("shard-*.pt")))
    columns = (TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Bar(*columns, console=console, transient=True) as bar:
        task = bar.add_task(by, total=len(prompts), completed=len(prompts) - len(todo))
        for i in range(0, len(todo), size):
            if state["data_seconds"] >= share:
                console.print(f"note: {label} stopped at its share of --minutes ({len(prompts) - len(todo) + i} of "
                              f"{len(prompts)} prompts)", style="yellow", highlight=False)
                break
            t0 = time.perf_counter()
            try:
                made = make(todo[i:i + size])
            except KeyboardInterrupt:
                raise Interrupted(f"interrupted while {label}: {shard0 + len(made_here)} sequences kept in {folder}; "
                                  "the same command goes on from there") from None
            D.save_shard(folder, shard, made)
            shard += 1
            made_here += made
            state["data_seconds"] += time.perf_counter() - t0
            _save_state(out, state)
            bar.update(task, advance=min(size, len(todo) - i))
    return made_here


def _trainee(out: Path, cfg: TrainHeadConfig, model, train, steps: int, device):
    """The trainee, its optimizer and progress: from the checkpoint when resuming, else new."""
    path = out / CHECKPOINT
    if path.is_file():
        saved = torch.load(path, weights_only=False)
        trainee = rebuild(cfg.kind, model, steps, saved.get("draft_ids")).to(device)
        trainee.load_state_dict(saved["model"])
        optimizer = _optimizer(trainee)
        optimizer.load_state_dict(saved["optimizer"])
        return trainee, optimizer, Progress(**saved["progress"])
    trainee = build(cfg.kind, model, train, steps, cfg.draft_vocab, cfg.seed).to(device)
    return trainee, _optimizer(trainee), Progress()


def _optimizer(trainee) -> torch.optim.AdamW:
    """AdamW over the trainee's parameters; fit sets the learning rate at every step (its warm-up)."""
    return torch.optim.AdamW([p for p in trainee.parameters() if p.requires_grad], lr=0.0, weight_decay=0.0)


def _save_checkpoint(out: Path, model, optimizer, progress: Progress) -> None:
    ids = getattr(model, "draft_ids", None)
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "progress": vars(progress),
             "draft_ids": None if ids is None else ids.cpu()}
    tmp = out / (CHECKPOINT + ".tmp")
    torch.save(saved, tmp)
    tmp.replace(out / CHECKPOINT)


def _trained_on(seqs: list[D.Sequence]) -> dict[str, list[str]]:
    by: dict[str, list[str]] = {}
    for s in seqs:
        if s.id not in by.setdefault(s.source, []):  # a prompt both read with its reply and answered: once
            by[s.source].append(s.id)
    return by


def _summary(console: Console, cfg: TrainHeadConfig, out: Path, progress: Progress, n_train: int, n_heldout: int,
             seqs, wall: float) -> None:
    held = progress.heldout or {}
    table = Table(title=f"train-head {cfg.kind} for {cfg.target}", title_justify="left")
    for col in ("steps", "train / held-out sequences", "tokens (target / data)", "loss", "held-out τ",
                "acceptance by depth", "wall"):
        table.add_column(col)
    reach = held.get("per_step") or []
    tokens = {by: sum(len(s.tokens) for s in seqs if s.answered_by == by) for by in ("target", "data")}
    table.add_row(str(progress.step), f"{n_train} / {n_heldout}", f"{tokens['target']} / {tokens['data']}",
                  f"{progress.loss:.3f}", f"{held.get('tau', float('nan')):.2f}",
                  " ".join(f"{r:.2f}" for r in reach), f"{wall / 60:.1f} min")
    console.print(table)
    console.print(f"head written to {out} (run it: --strategy {head_strategy(cfg.kind).name} --head {out})",
                  highlight=False)
