"""`sdbench tune` in processes of their own on one named study: the "machines" of the shared-study tests
(tests/test_tune.py on SQLite, tests/test_tune_postgres.py on a PostgreSQL server), on the embedded SmolLM2 with
the cheapest settings (`ngram`, one prompt, a few new tokens)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from sdbench.commands.studies import TrialSeeded
from sdbench.commands.tune_space import draw
from sdbench.strategies.spec import SearchContext

REPO = Path(__file__).resolve().parent.parent


def tune_process(home, out, trials: int, max_new: int = 4, storage: str | None = None, *more: str):
    """`sdbench tune` on the study "shared": in `storage`, else in SQLite under `out`; presets go to
    `home`/strategies; stdout and stderr together on `.stdout`. `more`: further options. One thread each: several
    such processes share the machine's cores, and more threads than cores slow every one of them down."""
    env = {**os.environ, "SDBENCH_CONFIG": str(home), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "sdbench", "tune", "--strategy", "ngram", "--limit", "1", "--max-new-tokens",
            str(max_new), "--trials", str(trials), "--study", "shared", "--device", "cpu", "--out", str(out),
            *(["--storage", storage] if storage else []), *more]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stored_trials(out=None, study: str = "shared", storage=None):
    """The study's trials as stored: in `storage` (a URL or an Optuna storage), else in SQLite under `out`."""
    return optuna.load_study(study_name=study, storage=storage or f"sqlite:///{out / 'tune.db'}").get_trials()


def trials_or_none(out=None, study: str = "shared", storage=None):
    try:
        return stored_trials(out, study, storage)
    except Exception:  # the study is not created yet
        return []


def wait_until(condition, procs, what: str, timeout: float = 600):
    """Poll `condition()` until it returns something true, which is returned; a process that exits first, or
    the deadline (a hang guard only), fails the test with the processes' output."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            logs = "\n".join(p.communicate()[0][-2000:] for p in procs)
            pytest.fail(f"{what} never happened:\n{logs}")
        time.sleep(0.1)
    return found


def own_trials(log: str) -> set[int]:
    """The trials a process ran itself: it prints "trial N: SETTINGS → RESULT" for each."""
    return {int(n) for n in re.findall(r"^trial (\d+): .* → ", log, re.MULTILINE)}


def seeded_draws(trials, seed: int) -> tuple[dict[int, dict], dict[int, dict]]:
    """(what the trials of an n-gram study that drew settings drew, by number; what `seed` draws for the same
    numbers on a fresh study of one process). While fewer than 10 trials have finished, Optuna's TPE draws each
    trial at random, and sdbench's sampler from the trial's own seed: the two agree whichever process took which
    trial. With one seed per process, processes started together drew each other's settings, not these."""
    drew = {t.number: t.params for t in trials if t.params}
    alone = optuna.create_study(sampler=TrialSeeded(seed))
    expected = {}
    for _ in range(max(drew, default=-1) + 1):
        trial = alone.ask()
        draw("ngram", trial, SearchContext())
        expected[trial.number] = trial.params
        alone.tell(trial, state=TrialState.FAIL)  # unfinished for TPE: each trial drawn at random
    return drew, {n: expected[n] for n in drew}
