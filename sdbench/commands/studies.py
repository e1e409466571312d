"""Optuna studies that several `sdbench tune` processes (on one machine or many) work on at once.

- Storage: Optuna's RDB storage. SQLite is the default (one file under the output folder): every write is a
  short transaction and a writer that finds the file locked waits up to SQLITE_TIMEOUT_S for its turn
  instead of failing at once (SQLite's default is 5 s). Tested here with two processes on one study. For
  machines that share no disk use a database server's URL (PostgreSQL, MySQL): SQLite's locking is only
  safe on a local disk.
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
"""

from __future__ import annotations

import threading
import time
import warnings
from contextlib import contextmanager
from datetime import datetime, timedelta

import optuna
from optuna.storages._rdb import models
from optuna.trial import TrialState
from sqlalchemy.exc import IntegrityError, OperationalError

SQLITE_TIMEOUT_S = 120
HEARTBEAT_S = 2
GRACE_S = 10
INTERRUPTED = "interrupted"
NOT_NEEDED = "not needed: the study had its trials done or under way"
STOPPED = "stopped mid-trial: its process died (no heartbeat)"
UNCOUNTED = (INTERRUPTED, NOT_NEEDED, STOPPED)


def storage(url: str) -> optuna.storages.RDBStorage:
    """The study's storage, with heartbeats for running trials (and patient locking under SQLite)."""
    engine = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if url.startswith("sqlite") else {}
    for attempt in range(3):
        try:
            with _quiet():
                return optuna.storages.RDBStorage(url, engine_kwargs=engine, heartbeat_interval=HEARTBEAT_S,
                                                  grace_period=GRACE_S)
        except (OperationalError, IntegrityError) as e:
            # processes started together on a new database race to create its tables: the loser finds
            # them made (or the version row written) and only has to open it again
            racing = "already exists" in str(e) or "UNIQUE constraint" in str(e)
            if not racing or attempt == 2:
                raise
            time.sleep(0.5)


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


@contextmanager
def heartbeat(study: optuna.Study, trial: optuna.Trial):
    """Record the trial's heartbeat every HEARTBEAT_S while the block runs."""
    done = threading.Event()
    store, trial_id = study._storage, trial._trial_id

    def beat() -> None:
        while True:
            store.record_heartbeat(trial_id)
            if done.wait(HEARTBEAT_S):
                return

    thread = threading.Thread(target=beat, name=f"sdbench-heartbeat-{trial.number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
