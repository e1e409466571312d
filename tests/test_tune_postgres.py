"""`sdbench tune --storage postgresql://…` on a real PostgreSQL server that the session starts (tests/postgres.py),
each test on a fresh database: two and three tune processes ("machines", each with its own output folder) make
exactly --trials trials of one study, each trial drawing the settings its own seed gives; one killed mid-trial
has its trial failed and replaced by the others; the server stopped mid-study stops tune with one line, and a
rerun resumes with nothing lost or counted twice; a session with other settings is refused; a server that
cannot be reached, a wrong password, a missing database or driver are one line before any model loads. In CI a
server that cannot start fails these tests."""

from __future__ import annotations

import importlib.util
import signal

import optuna
import pandas as pd
import pytest
from optuna.trial import TrialState

from sdbench.commands.studies import NOT_NEEDED, STOPPED, UNCOUNTED, database_url, reason, safe_url
from tests.conftest import run_cli, skip_unless_ci
from tests.postgres import PASSWORD, Server, free_port, server_binaries
from tests.test_cli import one_line_error
from tests.tune_processes import own_trials, seeded_draws, stored_trials, trials_or_none, tune_process, wait_until


@pytest.fixture(scope="session")
def postgres():
    if importlib.util.find_spec("psycopg") is None:
        skip_unless_ci("needs the `postgres` extra (psycopg)")
    binaries = server_binaries()
    if binaries is None:
        skip_unless_ci("needs a PostgreSQL server (`make postgres-server` installs Debian's as root)")
    server = Server(binaries)
    try:
        server.start()
        yield server
    finally:
        server.remove()


@pytest.fixture
def database(postgres) -> str:
    """A fresh database's URL, as a user writes it (`postgresql://`)."""
    return postgres.new_database()


def watching(url: str) -> optuna.storages.RDBStorage:
    """The test's own view of the study, reconnecting after the server restarts."""
    return optuna.storages.RDBStorage(database_url(url), engine_kwargs={"pool_pre_ping": True})


def machines(tmp_path, count: int, trials: int, url: str, max_new: int = 4):
    """`count` tune processes on the study "shared", each with its own home and output folder (no shared disk)."""
    return [tune_process(tmp_path / f"home{i}", tmp_path / f"out{i}", trials, max_new, url) for i in range(count)]


def pid(trial) -> int:
    return int(trial.user_attrs["worker"].rsplit(":", 1)[1])


def frozen_mid_trial(procs, store, first: int = 0):
    """A process frozen (SIGSTOP) in the middle of a trial numbered `first` or later: (trial number, process).
    The trial is seen running (its settings drawn), its process frozen, and the trial seen still running, so
    that what the test does next happens mid-trial however short a trial is."""
    def running():
        for t in trials_or_none(storage=store):
            if t.number >= first and t.state == TrialState.RUNNING and "settings" in t.user_attrs:
                return t.number, next(p for p in procs if p.pid == pid(t))

    while True:
        number, proc = wait_until(running, procs, f"a trial numbered {first} or later running")
        proc.send_signal(signal.SIGSTOP)
        if stored_trials(storage=store)[number].state == TrialState.RUNNING:
            return number, proc
        proc.send_signal(signal.SIGCONT)  # it finished in between: wait for the next one


def counted(trials) -> list:
    return [t for t in trials if reason(t) not in UNCOUNTED]


@pytest.mark.slow
@pytest.mark.parametrize("count, trials", [(2, 4), (3, 6)])
def test_processes_on_one_study_make_exactly_its_trials(tmp_path, database, count, trials):
    procs = machines(tmp_path, count, trials, database)  # started together: they race to create the tables too
    logs = [p.communicate(timeout=900)[0] for p in procs]  # a hang guard only
    assert [p.returncode for p in procs] == [0] * count, "\n".join(log[-2000:] for log in logs)
    stored = stored_trials(storage=database_url(database))
    done = counted(stored)
    assert len(done) == trials and all(t.state.is_finished() for t in stored)
    assert all(reason(t) == NOT_NEEDED for t in stored if t not in done)
    own = [own_trials(log) for log in logs]
    assert sum(map(bool, own)) >= 2, own  # the study was shared
    assert sum(map(len, own)) == len(set().union(*own)) and set().union(*own) == {t.number for t in done}, own
    drew, seeded = seeded_draws(stored, seed=0)  # the default --seed; each its own draws, not the others' again
    assert drew == seeded
    # each trial names the process that ran it, in the study and in every machine's trials.parquet
    assert all(t.number in own[[p.pid for p in procs].index(pid(t))] for t in done)
    table = pd.read_parquet(next((tmp_path / "out0" / "tune").glob("*/trials/trials.parquet")))
    assert len(table) == len(stored) and table["worker"].notna().all()


@pytest.mark.slow
def test_a_machine_killed_mid_trial_has_its_trial_failed_and_replaced_by_the_others(tmp_path, database):
    store = watching(database)
    procs = machines(tmp_path, 3, 4, database)
    number, victim = frozen_mid_trial(procs, store)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    others = [p for p in procs if p is not victim]
    logs = [p.communicate(timeout=900)[0] for p in others]  # a hang guard only
    assert [p.returncode for p in others] == [0, 0], "\n".join(log[-2000:] for log in logs)
    stored = stored_trials(storage=store)
    assert (stored[number].state, reason(stored[number])) == (TrialState.FAIL, STOPPED)
    assert pid(stored[number]) == victim.pid
    done = counted(stored)
    assert len(done) == 4 and all(t.state.is_finished() for t in stored)  # its place taken by another trial
    assert all(reason(t) == NOT_NEEDED for t in stored if t not in done and t.number != number)
    assert {t.number for t in done} <= set().union(*map(own_trials, logs))  # the survivors ran every counted one


def no_models(monkeypatch) -> None:
    from sdbench.models.loading import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(loader, "load_tokenizer", lambda *a, **k: pytest.fail("a tokenizer was loaded"))


def tune_in_process(capsys, tmp_path, url: str, *more: str):
    return run_cli(capsys, "tune", "--strategy", "ngram", "--limit", "1", "--max-new-tokens", "4", "--study",
                   "shared", "--device", "cpu", "--out", str(tmp_path / "here"), "--storage", url, *more)


@pytest.mark.slow
def test_the_server_stopped_mid_study_stops_tune_in_one_line_and_a_rerun_resumes(tmp_path, postgres, database,
                                                                                  capsys, monkeypatch):
    store = watching(database)
    proc = tune_process(tmp_path / "home", tmp_path / "out", 3, 4, database)
    number, _ = frozen_mid_trial([proc], store, first=1)
    first = stored_trials(storage=store)[0]
    postgres.stop()
    proc.send_signal(signal.SIGCONT)
    try:
        log = proc.communicate(timeout=300)[0]  # a hang guard only
        lines = [line for line in log.splitlines() if line.strip()]
        assert proc.returncode == 1 and "Traceback" not in log, log[-3000:]
        assert [line for line in lines if "error" in line.lower()] == [lines[-1]], log[-3000:]
        assert lines[-1].startswith(f"error: --storage {safe_url(database)}: lost the study's database (")
        assert lines[-1].endswith("run the same command again to resume it") and PASSWORD not in log
        no_models(monkeypatch)  # while the server is down, a new session says so before loading anything
        line = one_line_error(*tune_in_process(capsys, tmp_path, database, "--trials", "3")[::2])
        assert line.startswith(f"error: --storage {safe_url(database)}: ") and "refused" in line, line
        monkeypatch.undo()
    finally:
        postgres.start()
    rerun = tune_process(tmp_path / "home", tmp_path / "out", 3, 4, database)
    log = rerun.communicate(timeout=900)[0]
    assert rerun.returncode == 0, log[-3000:]
    stored = stored_trials(storage=store)
    assert (stored[0].state, stored[0].value) == (first.state, first.value)  # nothing lost
    assert number == 1 and (stored[1].state, reason(stored[1])) == (TrialState.FAIL, STOPPED)  # cut off: uncounted
    assert pid(stored[1]) == proc.pid and [t.number for t in counted(stored)] == [0, 2, 3]
    assert own_trials(log) == {2, 3}


@pytest.mark.slow
def test_a_session_with_other_settings_is_refused_in_one_line_before_any_model_loads(tmp_path, postgres, capsys,
                                                                                    monkeypatch):
    monkeypatch.setenv("SDBENCH_CONFIG", str(tmp_path / "home"))
    url = postgres.new_database().replace("postgresql://", "postgres://", 1)  # the other scheme users write
    code, out, err = tune_in_process(capsys, tmp_path, url, "--trials", "1")
    assert code == 0 and f"study shared in {safe_url(url)}" in out, err
    no_models(monkeypatch)  # refused before any model loads
    for other, said in ((["--limit", "2"], "limit=1, not 2"), (["--max-new-tokens", "5"], "max_new_tokens=4, not 5")):
        code, _, err = tune_in_process(capsys, tmp_path, url, "--trials", "2", *other)
        assert f"error: study shared was tuned with {said}: resume it with the same settings" in one_line_error(
            code, err)
    assert len(stored_trials(storage=database_url(url))) == 1  # the refused sessions ran nothing


@pytest.mark.parametrize("case", ["wrong port", "bad password", "no such database", "no driver"])
def test_a_database_that_cannot_be_opened_is_one_line_before_any_model_loads(tmp_path, postgres, capsys,
                                                                              monkeypatch, case):
    url, said = {"wrong port": (postgres.url(port=free_port()), "Connection refused"),
                 "bad password": (postgres.url(password="wrong"), 'password authentication failed for user "sdbench"'),
                 "no such database": (postgres.url("absent"), 'database "absent" does not exist'),
                 "no driver": (postgres.url(), "pip install 'sdbench[postgres]'")}[case]
    if case == "no driver":
        monkeypatch.setitem(__import__("sys").modules, "psycopg", None)  # as where the extra is not installed
    no_models(monkeypatch)
    line = one_line_error(*tune_in_process(capsys, tmp_path, url, "--trials", "1")[::2])
    assert line.startswith(f"error: --storage {safe_url(url)}: ") and said in line, line
    assert "wrong" not in line and PASSWORD not in line  # the password never printed
