"""`sdbench tune`: an Optuna study over a strategy's own search space, measured by real runs.

With several strategies (`--strategy draft --strategy eagle --strategy ngram`) one study chooses among them: each
trial draws a strategy, then that strategy's own settings (named `STRATEGY.NAME`, so two strategies' `gamma` stay
two parameters) — the draft choice among draft models, trained heads and n-gram lookup, measured alike.

Each trial is one `RunHarness` run over the same seeded prompt subset, with the settings the strategy's
`search_space` draws (commands/tune_space.py); the model pair is loaded once and shared by every trial. The
objective is the speedup over plain decoding measured beside the trial on the same prompts, or the strategy's
tokens/s. Losslessness is a constraint, not a score: a trial whose output differs from plain greedy decoding
fails, so it can never be best. The running objective after each batch feeds a pruner that stops trials starting
clearly worse than the finished ones (commands/tune_trial.py).

Studies live in Optuna storage (SQLite under the output folder by default, any Optuna URL otherwise), named
after target, strategy, data set and hardware fingerprint: an interrupted tune resumes, several machines
can work on one study, and an H100's numbers never mix with a laptop's. What a study keeps of its trials, and
the preset written from the best, are in commands/trials.py.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from dataclasses import replace
from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState
from rich.console import Console
from rich.text import Text

from sdbench.commands.plan import capped_gammas, plan
from sdbench.commands.run import RunHarness
from sdbench.commands.studies import (INTERRUPTED, STORAGE_ERRORS, TrialSeeded, counted, guarding, heartbeat,
                                      next_trial, opening, safe_url)
from sdbench.commands.studies import storage as study_storage
from sdbench.commands.trials import (best_table, best_trials, describe, doubts, objective_value, record_trial,
                                     write_preset, write_trials)
from sdbench.commands.tune_space import draw_among
from sdbench.commands.tune_trial import ClearlyWorse, Feed, Lossy, NoPrune
from sdbench.config import OBJECTIVES, TuneConfig
from sdbench.data.prompts import encode_prompts
from sdbench.engine.tree import is_tree_setting
from sdbench.env import environment
from sdbench.errors import Interrupted, SdbenchError
from sdbench.models.loading.pair import device_and_dtype, load_pair
from sdbench.paths import output_dir
from sdbench.presets import shipped_dir, user_dir
from sdbench.reporting.writer import RunWriter
from sdbench.strategies import heads_for, strategy, strategy_registry
from sdbench.strategies.spec import SearchContext, tree_growers, tree_settings

# what must not change between sessions of one study, or its trials would not be comparable
STUDY_SETTINGS = ("objective", "limit", "max_new_tokens", "batch_size", "seed", "prompt_len", "dtype", "repeats",
                  "drafts", "heads", "trees", "fast", "held")
# settings a study records only away from their default, so that studies begun before they existed still match
UNRECORDED = {"trees": False, "fast": True, "held": {}}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


class Tuner:
    """One tuning session over one study."""

    def __init__(self, cfg: TuneConfig, console: Console | None = None, pair=None, pruner=None, write: bool = True):
        """write: write the best trial as a preset (a schedule's bucket studies leave that to the schedule)."""
        if cfg.objective not in OBJECTIVES:
            raise SdbenchError(f"--objective {cfg.objective}: use one of {', '.join(OBJECTIVES)}")
        if cfg.trials < 1:
            raise SdbenchError(f"--trials must be at least 1 (got {cfg.trials})")
        self.cfg, self.console, self.pair, self.pruner, self.write = cfg, console or Console(), pair, pruner, write
        self._plan_strategies()
        if cfg.trees:
            self._check_trees()
        run = self.run
        self.device, self.dtype = device_and_dtype(run.device, run.dtype)
        self.hardware = environment(str(self.device), run.dtype)["hardware"]
        # a search over tree shapes is a study of its own: the chain-only study keeps its trials apart
        searched = self.strategy + ("-trees" if cfg.trees else "")
        self.study_name = cfg.study or "-".join(("sdbench", slug(run.target), searched, slug(run.dataset),
                                                 slug(self.hardware)))
        self.folder = Path(run.out) / "tune" / slug(self.study_name)
        self.preset_name = cfg.preset or slug(f"tuned-{self.strategy}-{run.target}")
        self.preset_path = user_dir() / f"{self.preset_name}.yaml"  # never the shipped folder
        self._check_preset()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        # what the user got wrong fails now, before any model loads: a strategy with nothing to tune, then a
        # storage URL, then a study begun with other settings
        self._check_spaces()
        self._storage = self._open_storage()
        self._refuse_other_settings()

    def _plan_strategies(self) -> None:
        """Each strategy asked for planned (and checked) on its own; the study's run is the first's, with every
        strategy's drafts."""
        cfg = self.cfg
        asked = cfg.strategies or (cfg.run.strategy,)
        twice = [a for i, a in enumerate(asked) if a in asked[:i]]
        if twice:
            raise SdbenchError(f"--strategy {twice[0]} is given twice")
        heads = heads_for(tuple(asked), cfg.run.target, cfg.heads)
        self.runs = [plan(replace(cfg.run, strategy=a, gammas=(1,), options={"head": heads[a][0]} if heads[a] else {}))
                     for a in asked]
        if not self.runs[0].cfg.sampling.greedy:
            raise SdbenchError("sdbench tune decodes greedily: losslessness is checked token for token")
        bases = tuple(p.choice.base for p in self.runs)
        same = [b for i, b in enumerate(bases) if b in bases[:i]]
        if same:
            raise SdbenchError(f"--strategy: two of {', '.join(asked)} are strategy '{same[0]}'; tune it once")
        drafts = tuple(dict.fromkeys(d for p in self.runs for d in p.cfg.drafts))
        self.run, self.strategies = replace(self.runs[0].cfg, drafts=drafts, options={}), bases
        self.strategy = "+".join(bases)  # one strategy's name, or the names of those chosen among
        self.heads_of = {p.choice.base: heads[a] for a, p in zip(asked, self.runs)}
        self.heads = tuple(dict.fromkeys(h for hs in self.heads_of.values() for h in hs))

    def _check_spaces(self) -> None:
        """Each strategy's search space drawn once (at the configured lengths; the trials draw at the prompts'
        own): one that fails to draw fails now, and so does --trees where no space draws a tree shape."""
        searching = []
        for base in self.strategies:
            trial = optuna.create_study().ask()
            draw_among((base,), trial, self.spaces(self.run.prompt_len or 0))
            shaping = tree_settings(strategy(base))
            searching += [base] if any(is_tree_setting(p) or p in shaping for p in trial.params) else []
        if self.cfg.trees and not searching:  # trees declared, but the search space draws none
            raise SdbenchError(f"--trees: the search space of {', '.join(self.strategies)} draws no tree shape yet")

    def spaces(self, prompt_tokens: int) -> dict[str, SearchContext]:
        """Each strategy's search context: the draft candidates, the lengths, its own head candidates, and
        whether tree shapes are searched (`--trees`)."""
        return {b: SearchContext(tuple(self.run.drafts), prompt_tokens, self.run.max_new_tokens, self.heads_of[b],
                                 self.cfg.trees)
                for b in self.strategies}

    def _check_trees(self) -> None:
        """--trees needs a strategy that grows token trees among those tuned."""
        growers = tree_growers()
        if not any(b in growers for b in self.strategies):
            raise SdbenchError(f"--trees: {', '.join(self.strategies)} grow{'s' if len(self.strategies) == 1 else ''}"
                               f" no token tree; the strategies that do are {', '.join(growers)}")

    def _check_preset(self) -> None:
        if self.preset_name in strategy_registry:
            raise SdbenchError(f"--preset {self.preset_name}: that is a strategy's name; choose another")
        for path in (self.preset_path, shipped_dir() / self.preset_path.name):  # nor hide a shipped one
            if path.exists() and "tuned" not in (yaml.safe_load(path.read_text()) or {}):
                raise SdbenchError(f"--preset {self.preset_name}: {path} is a hand-written preset; "
                                   "choose another name")

    def storage(self) -> str:
        if self.cfg.storage:
            return self.cfg.storage
        return f"sqlite:///{(output_dir(self.run.out) / 'tune.db').resolve()}"

    def _open_storage(self) -> optuna.storages.RDBStorage:
        with opening(self.storage()):
            return study_storage(self.storage())

    def open_study(self) -> optuna.Study:
        with opening(self.storage()):
            study = optuna.create_study(study_name=self.study_name, storage=self._storage, direction="maximize",
                                        pruner=self.pruner or ClearlyWorse(), load_if_exists=True)
            # each trial seeded by its number: processes sharing the study, or resuming it, draw anew
            study.sampler = TrialSeeded(self.run.sampling.seed)
            if self.cfg.held:  # the parameters a schedule's later bucket keeps as its first bucket chose them
                with warnings.catch_warnings():  # "experimental" since Optuna 2.4, and unchanged
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    study.sampler = optuna.samplers.PartialFixedSampler(dict(self.cfg.held), study.sampler)
            self._check_settings(study)
        return study

    def _refuse_other_settings(self) -> None:
        """A study begun with other settings refused now, before any model loads (open_study checks again: it
        may be begun meanwhile)."""
        with opening(self.storage()):
            try:
                study = optuna.load_study(study_name=self.study_name, storage=self._storage)
            except KeyError:  # no such study yet
                return
            self._check_settings(study, record=False)

    def _check_settings(self, study: optuna.Study, record: bool = True) -> None:
        """Refuse a study begun with other settings; record this session's in a new one (`record`)."""
        run = self.run
        mine = {"objective": self.cfg.objective, "limit": run.limit, "max_new_tokens": run.max_new_tokens,
                "batch_size": run.batch_size, "seed": run.sampling.seed, "prompt_len": run.prompt_len,
                "dtype": run.dtype, "repeats": run.repeats, "drafts": list(run.drafts),
                **({"heads": list(self.heads)} if self.heads else {}),  # absent: older studies still match
                **{k: v for k, v in (("trees", self.cfg.trees), ("fast", run.fast), ("held", dict(self.cfg.held)))
                   if v != UNRECORDED[k]}}
        saved = study.user_attrs.get("settings")
        if saved is None:
            if record:
                study.set_user_attr("settings", mine)
                study.set_user_attr("hardware", self.hardware)
                study.set_user_attr("strategies", list(self.strategies))
            return
        for key in STUDY_SETTINGS:
            was, now = (saved.get(key, UNRECORDED.get(key)), mine.get(key, UNRECORDED.get(key)))
            if was != now:
                raise SdbenchError(f"study {self.study_name} was tuned with {key}={was}, not {now}: resume it with "
                                   "the same settings, or name a new one with --study")

    def tune(self) -> optuna.Study:
        pair = self.pair or self.load()
        self.runners = dict(zip(self.run.drafts, pair.drafts))
        _, encoded = encode_prompts(self.run, pair)
        space = self.spaces(max(len(e) for e in encoded))
        study = self.open_study()
        with guarding(self.storage()):  # the database lost from here on: one line, and a rerun resumes
            return self._tune(study, pair, space)

    def _tune(self, study: optuna.Study, pair, space: dict[str, SearchContext]) -> optuna.Study:
        if len(self.strategies) > 1:  # each strategy is measured once before the sampler weighs them
            for base in self.strategies:
                study.enqueue_trial({"strategy": base}, skip_if_exists=True)
        self.console.print(f"study {self.study_name} in {safe_url(self.storage())}", highlight=False)
        reference = self._reference(pair) if self.cfg.objective == "tokens" else None
        started = time.monotonic()

        def out_of_time() -> bool:
            return self.cfg.timeout is not None and time.monotonic() - started > self.cfg.timeout

        while (trial := next_trial(study, self.cfg.trials, out_of_time)) is not None:
            self._trial(study, trial, pair, space, reference)
        if out_of_time():
            self.console.print(f"--timeout {self.cfg.timeout:g}s reached")
        write_trials(study, self.folder / "trials" / "trials.parquet")
        self.console.print(best_table(study, self.cfg.objective))
        if self.write:
            self._write_preset(study)
        return study

    def load(self):
        """The pair this study's runs decode with (on the native runner where any strategy needs it)."""
        needed = {model: why for p in self.runs for model, why in p.native().items()}
        return load_pair(self.run, self.device, self.dtype, self.console, needed)

    def _reference(self, pair) -> dict:
        """Plain greedy outputs of the subset, for trials run without a baseline beside them."""
        cfg = replace(self.run, strategy="autoregressive", gammas=(0,), drafts=(), options={}, baseline=False,
                      out=str(self.folder / "reference"))
        with self.console.status("plain decoding for the lossless check"):
            feed = Feed(NoPrune(), "tokens", None)
            RunHarness(cfg, Console(quiet=True), pair=replace(pair, drafts=[]), on_batch=feed).run()
        return {(r["prompt_id"], r["turn"]): list(r["output_ids"]) for r in feed.rows if r["repeat"] == 0}

    def _trial(self, study: optuna.Study, trial, pair, space: dict[str, SearchContext], reference: dict | None) -> None:
        try:
            settings = draw_among(self.strategies, trial, space)
        except SdbenchError as e:
            return self._finish(study, trial, TrialState.FAIL, reason=str(e))
        # what the trial runs and records, and what a preset takes from it: the lookahead as the run caps it
        settings["gamma"] = capped_gammas((settings["gamma"],), self.run.max_new_tokens)[0]
        trial.set_user_attr("settings", settings)
        trial.set_user_attr("hardware", self.hardware)
        cfg = replace(self.run, strategy=settings.get("strategy", self.strategies[0]), drafts=tuple(settings["drafts"]),
                      gammas=(settings["gamma"],),
                      options=settings["options"], out=str(self.folder), baseline=self.cfg.objective == "speedup")
        feed = Feed(trial, self.cfg.objective, reference)
        quiet = Console(quiet=True)
        label = f"trial {trial.number}: {describe(settings)}"
        bench = None
        try:
            bench = RunHarness(cfg, quiet, pair=replace(pair, drafts=[self.runners[d] for d in settings["drafts"]]),
                          on_batch=feed)
            with self.console.status(label), heartbeat(study, trial):
                path = bench.run()
        except optuna.TrialPruned as e:
            return self._finish(study, trial, TrialState.PRUNED, feed, reason=str(e), label=label, aborted=bench)
        except Lossy as e:
            return self._finish(study, trial, TrialState.FAIL, feed, reason=str(e), label=label, aborted=bench)
        except (KeyboardInterrupt, Interrupted):
            self._interrupted(study, trial, feed, bench)
        except STORAGE_ERRORS:  # the database is gone: nothing to record the trial in (a rerun fails it)
            self._merge_aborted(trial, "the study's database was lost", bench)
            raise
        except SdbenchError as e:
            return self._finish(study, trial, TrialState.FAIL, feed, reason=str(e), label=label, aborted=bench)
        except Exception as e:  # a bug: record the trial as failed rather than running forever, then stop
            self._finish(study, trial, TrialState.FAIL, feed, reason=f"crashed: {type(e).__name__}: {e}",
                         label=label, aborted=bench)
            raise
        trial.set_user_attr("results", str(path))
        value = objective_value(feed.frame(), self.cfg.objective)
        if not math.isfinite(value):
            return self._finish(study, trial, TrialState.FAIL, feed, reason="no measurable objective", label=label)
        self._finish(study, trial, TrialState.COMPLETE, feed, value=value, label=label)

    def _interrupted(self, study, trial, feed, aborted) -> None:
        self._finish(study, trial, TrialState.FAIL, feed, reason=INTERRUPTED, aborted=aborted)
        raise Interrupted(f"interrupted: the study keeps its finished trials; run the same command again to "
                           f"resume it ({counted(study)}/{self.cfg.trials} done)")

    def _finish(self, study, trial, state, feed: Feed | None = None, value: float | None = None, reason: str = "",
                label: str = "", aborted: RunHarness | None = None) -> None:
        merged = self._merge_aborted(trial, reason, aborted)
        if merged is not None:
            trial.set_user_attr("results", str(merged))
        if feed is not None and feed.rows:
            record_trial(trial, feed.frame(), feed.objective, feed.batches)
        if reason:
            trial.set_user_attr("reason", reason)
        study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
        unit = "x" if self.cfg.objective == "speedup" else " tok/s"
        outcome = (f"{value:.3g}{unit}", "green") if state == TrialState.COMPLETE else (reason, "yellow")
        self.console.print(Text.assemble(f"{label or f'trial {trial.number}'} → ", outcome))

    def _merge_aborted(self, trial, reason: str, aborted: RunHarness | None) -> Path | None:
        """An aborted run leaves unmerged parts: merge its own (not any other: a process sharing the study may be
        writing its trial beside it) so its rows read as one file, marked as stopping where the trial did."""
        if aborted is None or aborted.run_id is None or not (self.folder / f"{aborted.run_id}.parts").is_dir():
            return None
        writer = RunWriter(self.folder, aborted.run_id)
        writer.mark_unfinished(f"tune trial {trial.number}: {reason}")
        return writer.finalize()

    def _write_preset(self, study: optuna.Study) -> None:
        best = best_trials(study)[:1]
        if not best:
            self.console.print("no trial completed losslessly: no preset written")
            return
        found = doubts(study, self.cfg.objective)
        write_preset(self.preset_path, self.preset_name, best[0].user_attrs["settings"].get("strategy", self.strategy),
                     best[0], study, self.cfg, self.run, found)
        said = "best settings" if not found else f"trial {best[0].number}'s settings (no claim: see above)"
        self.console.print(f"{said} → {self.preset_path} (run them with `sdbench run --strategy "
                           f"{self.preset_name}`)", highlight=False)


def tune(cfg: TuneConfig, console: Console | None = None, **kwargs) -> optuna.Study:
    """One study and its preset, at cfg's one batch size and prompt length (several make a schedule:
    commands/schedule.py)."""
    if len(cfg.batches) > 1 or len(cfg.prompt_lens) > 1:
        raise SdbenchError("several --batch sizes or --prompt-len lengths make a schedule: commands/schedule.py")
    cfg = replace(cfg, run=replace(cfg.run, batch_size=(cfg.batches or (cfg.run.batch_size,))[0],
                                   prompt_len=(cfg.prompt_lens or (cfg.run.prompt_len,))[0]))
    return Tuner(cfg, console, **kwargs).tune()
