"""What `sdbench tune` draws: processes joining one study each draw settings of their own, a resumed study
draws anew, and one process with a given --seed on a fresh study draws the same settings every time.

The trials here draw their settings and measure nothing (`drawing`), over n-gram's search space with γ widened to
a million values (`WIDE`). There a sampler that draws at random repeats no setting unless it must: none is forced
until the trials outnumber the values, and by chance any two of these few trials (at most 45 pairs) share a γ
with probability 45/1e6 at most. A sampler that repeats its draws across processes or sessions repeats here."""

from __future__ import annotations

import multiprocessing
import time

import optuna
import pytest
from rich.console import Console

from sdbench.commands.tune import Tuner
from sdbench.commands.tune_space import draw_among
from sdbench.config import RunConfig, SamplingConfig, TuneConfig
from sdbench.data import Prompt, tasks
from sdbench.models.loading.pair import Pair
from sdbench.strategies.ngram import NGramStrategy

WIDE = 10**6  # γ's values in the widened space
STARTUP = 10  # Optuna's TPE draws at random (each trial on its own) until this many trials have finished


@pytest.fixture
def pair(target):
    return Pair(target, None, [], eos=[], max_positions=1024)


@pytest.fixture(autouse=True)
def drawing(tmp_path, monkeypatch):
    """Trials that record what they drew and are told 1.0 after a short pause (so that processes sharing a
    study take turns); one prompt of ids; presets in tmp_path; γ drawn from WIDE values."""
    def trial(self, study, trial, pair, space, reference):
        trial.set_user_attr("settings", draw_among(self.strategies, trial, space))
        time.sleep(0.2)
        study.tell(trial, 1.0)

    monkeypatch.setattr(Tuner, "_trial", trial)
    monkeypatch.setattr(tasks, "load_prompts", lambda *a, **k: [Prompt("p0", "c", ("",), (5, 6, 7, 5, 6, 7))])
    monkeypatch.setattr(NGramStrategy, "search_space", classmethod(lambda cls, trial, space: (
        trial.suggest_int("gamma", 1, WIDE), {})))
    monkeypatch.setenv("SDBENCH_CONFIG", str(tmp_path / "home"))


def session(tmp_path, pair, out: str, trials: int, seed: int = 0, study: str = "fleet", cls=Tuner) -> Tuner:
    """One `tune` session (a machine): its own output folder, the study in tmp_path/tune.db."""
    run = RunConfig(target="tiny", strategy="ngram", device="cpu", out=str(tmp_path / out), limit=1,
                    max_new_tokens=4, drafts=(), sampling=SamplingConfig(seed=seed))
    cfg = TuneConfig(run, trials=trials, storage=f"sqlite:///{tmp_path / 'tune.db'}", study=study)
    return cls(cfg, Console(quiet=True), pair=pair, write=False)


def draws(study: optuna.Study) -> dict[int, int]:
    """γ drawn by each trial that drew, by trial number (a trial "not needed" draws nothing)."""
    return {t.number: t.params["gamma"] for t in study.get_trials() if "gamma" in t.params}


def stored(tmp_path, study: str = "fleet") -> optuna.Study:
    return optuna.load_study(study_name=study, storage=f"sqlite:///{tmp_path / 'tune.db'}")


def repeats(drawn: dict[int, int]) -> int:
    """Draws beyond the first of each value, less those the space forces (more trials than values)."""
    values = list(drawn.values())
    return len(values) - len(set(values)) - max(0, len(values) - WIDE)


def fleet(tmp_path, pair, count: int, trials: int) -> None:
    """`count` tune processes started together on one study. Forked, each builds its own session (storage
    connection, study, sampler) and waits, once it has opened the study, until all have: as processes started
    together do while they load their models. Each trial draws and pauses: nothing here runs a model."""
    context = multiprocessing.get_context("fork")
    ready = context.Barrier(count)

    class Together(Tuner):
        def open_study(self) -> optuna.Study:
            study = super().open_study()
            ready.wait(timeout=120)
            return study

    procs = [context.Process(target=lambda i=i: session(tmp_path, pair, f"out{i}", trials, cls=Together).tune())
             for i in range(count)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)  # a hang guard only
        if p.exitcode is None:
            p.kill()
    assert [p.exitcode for p in procs] == [0] * count


@pytest.mark.parametrize("count, trials", [(2, 4), (3, 6)])
def test_processes_joining_one_study_each_draw_their_own_settings(tmp_path, pair, count, trials):
    fleet(tmp_path, pair, count, trials)
    study = stored(tmp_path)
    done = [t for t in study.get_trials() if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == trials
    assert len({t.user_attrs["worker"] for t in done}) == count  # every process ran trials of the study
    drawn = draws(study)
    assert repeats(drawn) == 0, drawn
    # and each trial drew what one process alone draws for its number, whichever process took it
    assert max(drawn) < STARTUP  # (where Optuna's TPE is still at random: its draws do not follow the values)
    alone = session(tmp_path, pair, "alone", max(drawn) + 1, study="alone").tune()
    assert {n: draws(alone)[n] for n in drawn} == drawn


def test_a_resumed_study_draws_anew_and_as_one_uninterrupted_session(tmp_path, pair):
    first = draws(session(tmp_path, pair, "out", 3).tune())
    resumed = draws(session(tmp_path, pair, "out", 6).tune())
    assert list(resumed) == [0, 1, 2, 3, 4, 5] and {n: resumed[n] for n in first} == first  # the first kept
    assert repeats(resumed) == 0, resumed  # the new draws repeat none of the first session's
    straight = draws(session(tmp_path, pair, "other", 6, study="straight").tune())
    assert straight == resumed


def test_one_process_with_a_seed_draws_the_same_settings_on_a_fresh_study(tmp_path, pair):
    runs = [draws(session(tmp_path, pair, name, 4, seed=seed, study=name).tune())
            for name, seed in (("a", 7), ("b", 7), ("c", 8))]
    assert runs[0] == runs[1] and repeats(runs[0]) == 0
    assert runs[2] != runs[0] and not set(runs[2].values()) & set(runs[0].values())  # another seed, other draws
