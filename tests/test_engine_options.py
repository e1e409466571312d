"""Engine options refused in one line before anything loads (ports that are no ports, lists with empty items), and
a server sdbench starts dying with sdbench whatever kills it (the parent-death signal), on the stand-in server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.references import tiny_model_dir

FAKE = Path(__file__).with_name("fake_engine.py")


@pytest.mark.parametrize("args, said", [
    (["--engine-port", "0"], "--engine-port 0: give a port from 1 to 65533 (3 servers start there"),
    (["--engine-port", "70000"], "--engine-port 70000: give a port from 1 to 65533"),
    (["--engine-port", "65534"], "--engine-port 65534: give a port from 1 to 65533"),
    (["--engine-port", "-1"], "--engine-port -1: give a port"),
])
def test_bench_refuses_a_port_that_is_no_port_in_one_line(capsys, tmp_path, monkeypatch, args, said):
    """Plain decoding, n-gram and draft servers start on --engine-port and the two after it: all three must be real
    ports. Refused before the engine is even looked for (it is not installed here)."""
    monkeypatch.setenv("SDBENCH_ENGINES", str(tmp_path / "none"))
    code, _, err = run_cli(capsys, "bench", "--engine", "vllm", *args)
    assert code != 0 and said in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_run_refuses_a_port_that_is_no_port_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SDBENCH_ENGINES", str(tmp_path / "none"))
    code, _, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--strategy", "autoregressive",
                           "--engine-port", "0", "--out", str(tmp_path / "out"))
    # the baseline's plain decoding and the strategy's: two servers, two ports
    assert code != 0 and "--engine-port 0: give a port from 1 to 65534 (2 servers" in err and "Traceback" not in err, err


@pytest.mark.parametrize("command, args, said", [
    ("run", ["--strategy", "ngram", "--compare", "suffix,,"], "--compare suffix,,: an empty item"),
    ("run", ["--strategy", "ngram", "--compare", ",suffix"], "--compare ,suffix: an empty item"),
    ("bench", ["--engine", "vllm,"], "--engine vllm,: an empty item"),
    ("tune", ["--strategy", "ngram,,draft"], "--strategy ngram,,draft: an empty item"),
    ("run", ["--strategy", "adaptive", "--set", "compare=1,,2"], "--set compare 1,,2: an empty item"),
])
def test_a_list_with_an_empty_item_is_refused_as_across_is(capsys, tmp_path, command, args, said):
    code, _, err = run_cli(capsys, command, *args, "--out", str(tmp_path / "out"))
    assert code != 0 and said in err and "Traceback" not in err, err


PARENT = """
import sys, time
from pathlib import Path
from sdbench.servers.process import Server
server = Server("stand-in", [sys.executable, sys.argv[1], "--model", sys.argv[2], "--port", "{port}"],
                Path(sys.argv[3])).start()
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by whoever adopted it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_server_dies_with_sdbench_even_when_sdbench_is_killed(tmp_path):
    """SIGKILL leaves sdbench no chance to stop its servers: the kernel's parent-death signal must end them."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(FAKE), str(tiny_model_dir(tmp_path / "tiny")),
                               str(tmp_path / "server.log")], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parent.parent)
    server_pid = None
    try:
        server_pid = int(parent.stdout.readline())
        assert not _gone(server_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while not _gone(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(server_pid), "the server outlived the sdbench that started it"
    finally:
        parent.kill()
        if server_pid is not None and not _gone(server_pid):
            os.kill(server_pid, signal.SIGKILL)

