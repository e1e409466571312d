"""`sdbench run`: load the pair, pick the prompts, warm up, then baseline and strategy batch by batch.

Baseline and strategy decode the same batches through the same loop (the baseline is the proposer that
proposes nothing), so tokens and time are counted identically on both sides. Rows are written as each
batch finishes.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sdbench.commands.backends import backend_for
from sdbench.commands.divergence import invariant, judged_output, same_arithmetic
from sdbench.commands.load import serve_points
from sdbench.commands.plan import plan
from sdbench.commands.roles import EveryRole, Measured, Measuring, Role, compared_roles, plan_roles
from sdbench.config import RunConfig, SamplingConfig
from sdbench.data.passkey import answer_found
from sdbench.data.prompts import encode_prompts
from sdbench.data.tasks import dataset_label
from sdbench.data.turns import Conversations
from sdbench.decoders import SEQUENTIAL, decoder_for
from sdbench.drafting.datastore import held_note
from sdbench.engine.counters import BatchResult
from sdbench.engine.metrics import predicted_batch_speedup, row_metrics
from sdbench.engine.state import needed_capacity
from sdbench.env import environment
from sdbench.errors import Interrupted, SdbenchError
from sdbench.models.heads.registry import trained_on_note
from sdbench.models.loading.names import weights_of
from sdbench.models.loading.pair import Pair, device_and_dtype
from sdbench.paths import output_dir
from sdbench.reporting.rows import Judged, Place, RunFields, result_row
from sdbench.reporting.writer import RunWriter, new_run_id
from sdbench.servers.engines import SDBENCH
from sdbench.servers.process import EngineFailed

WARMUP_PROMPT_TOKENS = 256


def decode(target, proposer, prompts: list[list[int]], **kwargs) -> BatchResult:
    """One batch with the decoder this proposer runs on (sdbench/decoders.py): every generation of a run."""
    return decoder_for(proposer)(target, proposer, prompts, **kwargs)


class RunHarness:
    """Runs one configured benchmark; `run` returns the path of the Parquet file it wrote."""

    def __init__(self, cfg: RunConfig, console: Console | None = None, pair: Pair | None = None,
                 on_batch=None, run_id: str | None = None):
        """pair: already-loaded models to reuse (tuning runs many configurations on one pair);
        on_batch(rows): called with each batch's rows once they are written (e.g. to prune a trial);
        run_id: the id a new run takes (a sweep names its points) instead of a fresh one."""
        self.console = console or Console()
        self.pair, self.on_batch = pair, on_batch
        self._given_id = run_id
        self.run_id: str | None = None  # set when run() starts: the results it writes are RUN_ID.*
        self.plan = plan(cfg)
        self.cfg, self.choice, self.compared = self.plan.cfg, self.plan.choice, self.plan.compared
        note = self.plan.gamma_note()
        if note:
            self.console.print(note, style="yellow", highlight=False)
        if self.choice.entry is not None:
            self.console.print(f"schedule '{self.choice.name}': the {self.choice.entry.label} entry", highlight=False)
        self.backend = backend_for(self.cfg)  # sdbench's own loop, or an engine's server
        self.device, self.dtype = device_and_dtype(self.cfg.device, self.cfg.dtype, self.cfg.engine != SDBENCH)
        output_dir(self.cfg.out)  # a bad --out fails now, not after the models have loaded

    def _load(self) -> Pair:
        """The pair to decode with: the one given, else the backend's."""
        return self.pair if self.pair is not None else self.backend.load(self)

    def plan_roles(self, pair: Pair) -> list[Role]:
        """The strategy's roles (commands/roles.py); the baseline is added by the backend."""
        return plan_roles(self.plan.strategy, pair, self.cfg.drafts) + compared_roles(self.compared, pair,
                                                                                       self.cfg.drafts)

    def _generate(self, pair: Pair, proposer, batch: list[list[int]], max_new: int, seed: int,
                  capacity: int = 0) -> BatchResult:
        gen = torch.Generator(self.device).manual_seed(seed)
        return decode(pair.target, proposer, batch, max_new_tokens=max_new, sampling=self.cfg.sampling,
                      eos_ids=pair.eos, generator=gen, capacity=capacity)

    def run(self) -> Path:
        cfg = self.cfg
        pair = self._load()
        roles = self.backend.roles(self, pair)
        lookahead = max(r.proposer.max_lookahead for r in roles)
        prompts, encoded = encode_prompts(cfg, pair, lookahead)
        if not cfg.under_load and cfg.batch_size > len(prompts):  # rows record the batch that was run
            self.console.print(f"note: --batch-size {cfg.batch_size} with {len(prompts)} prompt(s): batches of "
                               f"{len(prompts)} are run and recorded", style="yellow", highlight=False)
            cfg = self.cfg = replace(cfg, batch_size=len(prompts))
        most = max(len(p.turns) for p in prompts)
        if cfg.turns is not None and cfg.turns > most:
            self.console.print(f"note: --turns {cfg.turns}: the prompts have at most {most} turn(s), so {most} "
                               f"{'is' if most == 1 else 'are'} run", style="yellow", highlight=False)
        ids = [p.id for p in prompts]
        for options in (cfg.options, *(c.options for c in self.compared)):
            for seen in (trained_on_note(options.get("head", ""), ids), held_note(options.get("datastore", ""), ids)):
                if seen:
                    self.console.print(f"note: {seen}", style="yellow", highlight=False, soft_wrap=True)
        context = max(len(e) for e in encoded) + cfg.max_new_tokens
        for note in dict.fromkeys(n for r in roles for n in r.proposer.notes(context)):
            self.console.print(f"note: {note}", highlight=False, soft_wrap=True)
        batches = [list(range(i, min(i + cfg.batch_size, len(prompts)))) for i in range(0, len(prompts),
                                                                                      cfg.batch_size)]
        run_id = self.run_id = cfg.resume or self._given_id or new_run_id(self.choice.name)
        env = environment(str(self.device), cfg.dtype)
        writer = RunWriter(cfg.out, run_id, env)
        done = writer.done_keys() if cfg.resume else set()
        if cfg.resume and not writer.exists():
            raise SdbenchError(f"--resume {run_id}: no such run under {cfg.out}")
        with self.backend.servers(self, roles, pair, lookahead):
            self._measure(pair, roles, prompts, encoded, batches, writer, done)
        writer.mark_finished()
        return writer.final_path

    def _measure(self, pair: Pair, roles: list[Role], prompts, encoded, batches, writer: RunWriter, done: set) -> None:
        """Warm up, then every batch with every role, rows written as each batch finishes; an interrupt or an
        engine's failure keeps the finished rows and says how to continue."""
        cfg, run_id = self.cfg, self.run_id
        try:
            self._warm_up(pair, roles, encoded, batches)
        except KeyboardInterrupt:  # nothing is on disk yet: no run to resume
            raise Interrupted("interrupted during warm-up: nothing was saved") from None
        self._save_config(run_id)  # only now: a run that never measured leaves nothing behind
        writer.mark_unfinished()  # until the last batch: a run stopped before it reads as partial
        on = Measuring(pair, EveryRole(roles, str(self.device)), self.run_fields(pair))
        try:
            with writer, self._progress() as progress:
                if cfg.under_load:
                    serve_points(self, on, prompts, encoded, writer, progress)
                else:
                    talk = Conversations(prompts, pair.tokenizer, cfg.turns)
                    self._batches(on, talk, batches, done, writer, progress)
        except KeyboardInterrupt:
            if not writer.exists():  # no batch finished: forget the run instead of pointing at it
                self._config_path(run_id).unlink(missing_ok=True)
                writer.mark_finished()
                raise Interrupted("interrupted before any batch finished: nothing was saved") from None
            writer.mark_unfinished("interrupted (Ctrl-C)")
            if cfg.under_load:
                raise Interrupted(f"interrupted: finished load points are saved in {writer.final_path}") from None
            raise Interrupted(f"interrupted: finished prompts are saved in {writer.final_path}; continue with "
                               f"`sdbench run --resume {run_id} --out {cfg.out}`") from None
        except EngineFailed as err:  # the engine's server died or refused a request: the finished rows stay
            if not writer.exists():
                self._config_path(run_id).unlink(missing_ok=True)
                writer.mark_finished()
                raise EngineFailed(f"{err}; no prompt had finished: nothing was saved") from None
            writer.finalize()
            writer.mark_unfinished(f"the engine failed: {err}")
            raise EngineFailed(f"{err}; finished prompts are saved in {writer.final_path}; continue with "
                               f"`sdbench run --resume {run_id} --out {cfg.out}`") from None

    def _batches(self, on: Measuring, talk: Conversations, batches: list[list[int]], done: set, writer: RunWriter,
                 progress) -> None:
        """Every batch (and turn) with every role, a part written per batch; batches `done` are skipped."""
        prompts, roles = talk.prompts, on.every.roles
        total = self.cfg.repeats * sum(talk.turns_of(idx) for idx in batches) * len(roles)
        task = progress.add_task(self.choice.name, total=total)
        for repeat in range(self.cfg.repeats):
            for batch_id, idx in enumerate(batches):
                if all((r.name, prompts[i].id, repeat, t + 1) in done for r in roles for i in idx
                       for t in range(talk.count[i])):
                    progress.advance(task, len(roles) * talk.turns_of(idx))
                    continue
                rows = []  # every turn of a batch goes into one part: a resumed run redoes whole batches
                for turn in range(talk.turns_of(idx)):
                    rows += self._turn(on, talk, idx, Place("", "", repeat, batch_id, turn + 1),
                                       lambda role: progress.update(task, advance=1, description=(
                                           f"{role.name}: batch {batch_id + 1}/{len(batches)}")))
                writer.append(rows)
                if self.on_batch is not None:
                    self.on_batch(rows)

    def _warm_up(self, pair: Pair, roles: list[Role], encoded, batches) -> None:
        """Every configuration once, unmeasured, with caches as long as the longest batch needs: static-shape
        caches and their CUDA graphs are then made here and reused by the measured batches.

        On CPU kernels warm up on short inputs as well (a long-context prefill would only cost time here). On a
        GPU the warm-up prefills the batch holding the longest prompt in full: the first prefill of a new size
        grows the allocator's pool and picks GEMM kernels, several times the cost of a later prefill of the same
        size, which would otherwise fall on whichever side is measured first."""
        cfg = self.cfg
        with self.console.status("warming up"):
            if self.device.type == "cuda":
                holding = max(batches, key=lambda idx: max(len(encoded[i]) for i in idx))
                warm = [encoded[i] for i in holding]
            else:
                warm = [encoded[i][:WARMUP_PROMPT_TOKENS] for i in batches[0]]
            for role in roles:
                prop = role.proposer
                longest = max(needed_capacity(max(len(encoded[i]) for i in idx), cfg.max_new_tokens, prop.max_lookahead)
                              for idx in batches)
                self._generate(pair, prop, warm, min(cfg.warmup_tokens, cfg.max_new_tokens), cfg.sampling.seed,
                               capacity=longest)
                prop.warmed_up()

    def _turn(self, on: Measuring, talk: Conversations, idx: list[int], at: Place, advance) -> list[dict]:
        """Decode one turn (at.turn) of the batch of prompts idx with every role; the answer carried into the next
        turn is the first role's (the baseline's, when it runs). A turn past the first is its own batch (batch_id)."""
        pair = on.pair
        members = talk.members(idx, at.turn - 1)
        at = replace(at, batch_id=at.batch_id * talk.most + at.turn - 1)
        seed = self.cfg.sampling.group_seed(at.repeat, at.batch_id)
        batch = [talk.encode(i, at.turn - 1) for i in members]
        measured = on.every.measure(
            lambda role: self._generate(pair, role.proposer, batch, self.cfg.max_new_tokens, seed), done=advance)
        talk.record(members, at.turn - 1, measured[0].result.output_ids)
        return self._rows(on, measured, [talk.prompts[i] for i in members], batch, at)

    def _progress(self) -> Progress:
        return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=self.console, transient=False)

    def _config_path(self, run_id: str) -> Path:
        return Path(self.cfg.out) / f"{run_id}.config.json"

    def _save_config(self, run_id: str) -> None:
        output_dir(self.cfg.out)  # a file or an uncreatable folder is one line, not a traceback
        path = self._config_path(run_id)
        path.write_text(json.dumps(asdict(self.cfg), indent=2, default=str))

    def run_fields(self, pair: Pair) -> RunFields:
        cfg = self.cfg
        return RunFields(
            target=cfg.target, dataset=_label(cfg), batch_size=cfg.batch_size, temperature=cfg.sampling.temperature,
            top_p=cfg.sampling.top_p, seed=cfg.sampling.seed, fast=bool(getattr(pair.target, "fast", False)),
            max_new_tokens=cfg.max_new_tokens, prompt_len=cfg.prompt_len,
            schedule_entry=self.choice.entry.label if self.choice.entry is not None else None,
            engine=getattr(self.backend.engine, "name", None), **pair.fidelity())

    def _rows(self, on: Measuring, measured: list[Measured[BatchResult]], prompts, encoded: list[list[int]],
              at: Place) -> list[dict]:
        """The rows of one decoded batch: one per role and prompt (prompts: the batch's, in row order; encoded:
        their token ids), each judged against the baseline's row of its prompt before it is made."""
        rows, pair, greedy = [], on.pair, self.cfg.sampling.greedy
        base = EveryRole.baseline(measured)
        base_rows = [row_metrics(base, b) for b in range(len(prompts))] if base is not None else None
        for m in measured:
            res = m.result
            predicted = math.nan  # the sequential-SD model says nothing of DSI
            if base is not None and not m.role.is_baseline and m.role.proposer.decoder == SEQUENTIAL:
                predicted = predicted_batch_speedup(res.rows, base.rows, [len(o) for o in res.output_ids])
            weights = weights_of([self.cfg.target, *m.role.drafts])  # a @random model: "random"
            for b, p in enumerate(prompts):
                mine, base_row = row_metrics(res, b), base_rows[b] if base_rows is not None else None
                expected = base_row.output_ids if base_row is not None else None
                divergence = judged_output(pair.target, encoded[b], expected, mine.output_ids, greedy,
                                           same_arithmetic(res, base))
                judged = Judged(base_row, greedy, predicted, answer_found(p, mine.output_ids, pair.tokenizer),
                                divergence, invariant(res))
                place = replace(at, category=p.category, prompt_id=p.id, depth=p.depth)
                rows.append(result_row(on.fields, m.role, place, mine, judged, self.backend.memory(m), weights,
                                       m.busy))
        return rows


def _label(cfg: RunConfig) -> str:
    return dataset_label(cfg.dataset, cfg.prompt_len)


def load_config(out: str, run_id: str) -> RunConfig:
    """The configuration an interrupted run was started with (saved beside its results)."""
    path = Path(out) / f"{run_id}.config.json"
    if not path.exists():
        raise SdbenchError(f"--resume {run_id}: no saved configuration at {path}")
    return replace(run_config(json.loads(path.read_text())), resume=run_id, out=out)


def run_config(raw: dict) -> RunConfig:
    """A RunConfig from its saved JSON (dataclasses.asdict), older files' missing settings filled in."""
    raw = dict(raw)
    raw["sampling"] = SamplingConfig(**raw["sampling"])
    raw["drafts"] = tuple(raw["drafts"])
    raw["depths"] = tuple(raw.get("depths", ()))
    raw.setdefault("turns", 1)  # a config of an older sdbench, with no turns: first turns only
    for key in ("request_rates", "concurrencies"):
        raw[key] = tuple(raw.get(key, ()))
    raw["gammas"] = tuple(raw.get("gammas", ()))
    if isinstance(raw.get("probe"), bool):  # a config of an older sdbench, whose probe was on or off
        raw["probe"] = "auto" if raw["probe"] else "never"
    return RunConfig(**raw)
