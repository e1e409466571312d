"""Optuna studies that several `sdbench tune` processes (on one machine or many) work on at once.

- Storage: Optuna's RDB storage. SQLite is the default (one file under the output folder): every write is a
  short transaction and a writer that finds the file locked waits up to SQLITE_TIMEOUT_S for its turn
  instead of failing at once (SQLite's default is 5 s). Tested here with two processes on one study. For
  machines that share no disk use a database server's URL: SQLite's locking is only safe on a local disk.
  PostgreSQL goes through psycopg 3 (the `postgres` extra): a `postgresql://` or `postgres://` URL gets its
  SQLAlchemy dialect (`postgresql+psycopg://`) whatever driver SQLAlchemy would pick by default, and a server
  that does not answer fails the connection after CONNECT_TIMEOUT_S. Processes started together on a new
  database race to create Optuna's tables: the losers open it again. Tested with two and three processes on a
  real PostgreSQL server (tests/test_tune_postgres.py).
- The database lost mid-study (a server restarted or down, a network cut) stops the process with one line
  (StorageLost). Its running trial is left running: a process still connected, or the same command run again,
  fails it once its heartbeat is GRACE_S old and runs another in its place, so nothing is counted twice.
- Exactly N trials: a process takes a trial (Optuna numbers trials atomically in the database), then counts
  the trials ahead of it: counted finished ones plus those still running. If N are already done or under
  way, its trial is not needed: it is closed at once as failed with reason NOT_NEEDED, which no count or
  table treats as a trial, and the process waits for the running ones (one of them may yet fail to count).
- A process killed mid-trial (SIGKILL, a lost machine) leaves its trial RUNNING. Each running trial records
  a heartbeat every HEARTBEAT_S, the first one as soon as it is taken; one silent for GRACE_S is marked failed
  by the next process that looks (`reason`: STOPPED) and, like an interrupted trial, does not count toward N:
  another trial takes its place. Optuna never calls a trial with no heartbeat at all stale, so a process
  killed between taking a trial and its first beat would leave it running forever and every other process
  waiting on it: such a trial, started more than GRACE_S ago, is failed the same way here.
- Each trial draws its own settings: the sampler is seeded afresh for every trial from the run's seed and the
  trial's number, which the database hands out once (TrialSeeded). Processes started together on one study
  therefore draw as one process would, not each the same settings; a resumed study's new trials draw anew; one
  process with a given seed on a fresh study draws the same random start (TPE's first 10 trials) every time.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import warnings
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Iterator

import numpy as np
import optuna
from optuna.storages._rdb import models
from optuna.trial import TrialState
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError, SQLAlchemyError

from sdbench.errors import SdbenchError

SQLITE_TIMEOUT_S = 120
CONNECT_TIMEOUT_S = 10
HEARTBEAT_S = 2
GRACE_S = 10
INTERRUPTED = "interrupted"
NOT_NEEDED = "not needed: the study had its trials done or under way"
STOPPED = "stopped mid-trial: its process died (no heartbeat)"
UNCOUNTED = (INTERRUPTED, NOT_NEEDED, STOPPED)
# what Optuna's RDB storage raises when its database fails under it (it wraps SQLAlchemy's errors in the first)
STORAGE_ERRORS = (optuna.exceptions.StorageInternalError, SQLAlchemyError)
POSTGRES_EXTRA = "pip install 'sdbench[postgres]'"


class StorageLost(SdbenchError):
    """The study's database failed mid-study; the study keeps what it had and the same command resumes it."""

    exit_code = 1


class TrialSeeded(optuna.samplers.BaseSampler):
    """Optuna's TPE sampler with a seed of each trial's own, `trial_seed(seed, trial.number)`, in place of one
    seed per process: a process's draws then depend on which trials it takes, not on how many it has drawn."""

    def __init__(self, seed: int):
        self.seed = seed
        self._samplers: dict[int, optuna.samplers.TPESampler] = {}  # by trial number, while the trial runs

    def _of(self, trial) -> optuna.samplers.TPESampler:
        if trial.number not in self._samplers:
            self._samplers[trial.number] = optuna.samplers.TPESampler(seed=trial_seed(self.seed, trial.number))
        return self._samplers[trial.number]

    def before_trial(self, study, trial) -> None:
        self._of(trial).before_trial(study, trial)

    def infer_relative_search_space(self, study, trial):
        return self._of(trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self._of(trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self._of(trial).sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study, trial, state, values) -> None:
        self._of(trial).after_trial(study, trial, state, values)
        del self._samplers[trial.number]


def trial_seed(seed: int, number: int) -> int:
    """The sampler's seed for trial `number` of a run seeded `seed`: the pair mixed into 32 bits (numpy's
    SeedSequence), so that neighbouring seeds do not draw each other's trials one place apart (as seed + number
    would)."""
    return int(np.random.SeedSequence([seed % 2**64, number]).generate_state(1)[0])


def database_url(url: str) -> str:
    """The URL SQLAlchemy is given: PostgreSQL's plain schemes through psycopg 3, the driver sdbench installs
    (SQLAlchemy 2.0 reads a plain `postgresql://` as psycopg2, and no version reads `postgres://`)."""
    scheme, sep, rest = url.partition("://")
    return f"postgresql+psycopg://{rest}" if sep and scheme in ("postgresql", "postgres") else url


def safe_url(url: str) -> str:
    """The storage URL without its password, fit for logs."""
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)


def storage(url: str) -> optuna.storages.RDBStorage:
    """The study's storage, with heartbeats for running trials (and patient locking under SQLite)."""
    url = database_url(url)
    engine = {}
    if url.startswith("sqlite"):
        engine = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    elif url.startswith("postgresql") and "connect_timeout" not in url:  # the URL's own wins
        engine = {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
    for attempt in range(5):
        try:
            with _quiet():
                return optuna.storages.RDBStorage(url, engine_kwargs=engine, heartbeat_interval=HEARTBEAT_S,
                                                  grace_period=GRACE_S)
        except (OperationalError, ProgrammingError, IntegrityError) as e:
            # processes started together on a new database race to create its tables: the loser finds them
            # made (SQLite, PostgreSQL: "already exists"), or its own creation collides with the winner's
            # (PostgreSQL: a duplicate key in its catalogue; the version row), and only has to open it again
            racing = isinstance(e, IntegrityError) or "already exists" in str(e)
            if not racing or attempt == 4:
                raise
            time.sleep(0.5)


def failure(e: BaseException) -> str:
    """The first line of the database's own message, under Optuna's and SQLAlchemy's wrappings."""
    while isinstance(e, (optuna.exceptions.StorageInternalError, ImportError)) and e.__cause__ is not None:
        e = e.__cause__
    e = getattr(e, "orig", None) or e  # SQLAlchemy's error wraps the driver's
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return lines[0].strip() if lines else type(e).__name__


@contextmanager
def opening(url: str) -> Iterator[None]:
    """Any problem opening the storage (a bad scheme, a missing driver, an unreachable server, a wrong password,
    no such database) as one line."""
    try:
        yield
    except ImportError as e:
        hint = f": {POSTGRES_EXTRA}" if database_url(url).startswith("postgresql+psycopg:") else ""
        raise SdbenchError(f"--storage {safe_url(url)}: a database driver is missing ({failure(e)}){hint}") from e
    except SdbenchError:
        raise
    except Exception as e:
        raise SdbenchError(f"--storage {safe_url(url)}: {failure(e)}") from e


@contextmanager
def guarding(url: str) -> Iterator[None]:
    """The database failing under a study in progress as one line (StorageLost)."""
    try:
        yield
    except STORAGE_ERRORS as e:
        raise StorageLost(f"--storage {safe_url(url)}: lost the study's database ({failure(e)}); the study keeps "
                          "its finished trials: run the same command again to resume it") from e


@contextmanager
def _quiet():
    """Optuna calls heartbeats experimental and expects them under Study.optimize (this module drives them)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage")
        yield


def reason(trial) -> str:
    """Why a trial did not complete ('' if it did). sdbench gives every trial it fails a reason; a failed
    trial without one was failed by Optuna for its missing heartbeat (a finished trial takes no more attributes)."""
    return trial.user_attrs.get("reason") or (STOPPED if trial.state == TrialState.FAIL else "")


def counted(study: optuna.Study) -> int:
    """Finished trials toward --trials; an interrupted, killed or unneeded one is not (it is tried again)."""
    finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL))
    return sum(reason(t) not in UNCOUNTED for t in finished)


def _ahead(study: optuna.Study, number: int | None = None) -> int:
    """Counted finished trials plus running ones (numbered below `number`, when given)."""
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    return counted(study) + sum(number is None or t.number < number for t in running)


def next_trial(study: optuna.Study, total: int, stop) -> optuna.Trial | None:
    """A trial to run, or None once `total` trials are counted (or `stop()` says so). Waits while the rest
    of the study is running in other processes."""
    while True:
        with _quiet():
            optuna.storages.fail_stale_trials(study)
        _fail_unborn(study)
        if counted(study) >= total or stop():
            return None
        if _ahead(study) < total:
            with _quiet():
                trial = study.ask()
                study._storage.record_heartbeat(trial._trial_id)  # at once: a trial with none is never stale
            if _ahead(study, trial.number) < total:
                trial.set_user_attr("worker", worker())  # which machine and process ran it (or lost it)
                return trial
            trial.set_user_attr("reason", NOT_NEEDED)
            study.tell(trial, state=TrialState.FAIL)
        time.sleep(HEARTBEAT_S)


def _fail_unborn(study: optuna.Study) -> None:
    """Fail running trials that never recorded a heartbeat and started over GRACE_S ago: their process died
    between taking them and its first beat, and Optuna's stale-trial check skips them. Failed without a reason,
    as Optuna fails a silent one, they read as STOPPED (`reason`)."""
    store = study._storage
    old = datetime.now() - timedelta(seconds=GRACE_S)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.datetime_start is None or t.datetime_start > old or _has_heartbeat(store, t._trial_id):
            continue
        try:
            store.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
        except (optuna.exceptions.UpdateFinishedTrialError, RuntimeError):
            pass  # another process failed it first


def _has_heartbeat(store, trial_id: int) -> bool:
    """Whether the trial ever recorded a heartbeat (Optuna's RDB storage has no public reader for it)."""
    store = getattr(store, "_backend", store)  # Optuna wraps an RDB storage in a cache
    if not isinstance(store, optuna.storages.RDBStorage):
        return True  # not one of ours: leave it to Optuna
    session = store.scoped_session()
    try:
        return models.TrialHeartbeatModel.where_trial_id(trial_id, session) is not None
    finally:
        session.close()


def worker() -> str:
    """This process, as HOST:PID."""
    return f"{socket.gethostname()}:{os.getpid()}"


@contextmanager
def heartbeat(study: optuna.Study, trial: optuna.Trial):
    """Record the trial's heartbeat every HEARTBEAT_S while the block runs. A beat the database refuses stops
    them, and the block's end raises its error: the trial must not be told finished by a process whose
    heartbeat lapsed (another may have failed it and run one in its place)."""
    done = threading.Event()
    store, trial_id = study._storage, trial._trial_id
    lost: list[Exception] = []

    def beat() -> None:
        while True:
            try:
                store.record_heartbeat(trial_id)
            except STORAGE_ERRORS as e:
                lost.append(e)
                return
            if done.wait(HEARTBEAT_S):
                return

    thread = threading.Thread(target=beat, name=f"sdbench-heartbeat-{trial.number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    if lost:
        raise lost[0]
