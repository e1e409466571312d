"""An engine's server as a child process: started on a free loopback port, waited for within a bound, and always
stopped (at the end of a run, on an error, on Ctrl-C); on Linux it also dies with sdbench, whatever kills sdbench
(SIGKILL, the out-of-memory killer), through the parent-death signal."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sdbench.errors import SdbenchError
from sdbench.servers.client import reachable

READY_TIMEOUT_S = 600.0  # loading a 1.5B model's F32 weights, or vLLM's start-up, on a small CPU
STOP_TIMEOUT_S = 15.0


class EngineFailed(SdbenchError):
    """An engine's server never became ready, exited, or answered with an error."""

    exit_code = 1


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies


def die_with(parent: int):
    """A child's pre-exec step: SIGTERM to it when the process that started it dies (Linux; elsewhere nothing),
    and an exit at once if that process is already gone (it died between the fork and this call)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def free_port() -> int:
    """A loopback port nothing listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def last_line(log: Path) -> str:
    """The log's last non-empty line (what a dying server said last), or ''."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


@dataclass
class Server:
    """One engine server: `start()` runs `command` (its output to `log`) and returns once GET `health` answers 200;
    `stop()` ends its process group. The command holds `{port}`, filled with the port it listens on."""

    name: str
    command: list[str]
    log: Path
    health: str = "/health"
    port: int | None = None  # None: a free one
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout: float = READY_TIMEOUT_S
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, on_wait=None) -> "Server":
        """on_wait(seconds waited): progress while the server loads."""
        if self.port is None:
            self.port = free_port()
        elif port_taken(self.port):
            raise EngineFailed(f"{self.name}: port {self.port} is taken; give another with --engine-port, or "
                               "leave it out for a free one")
        argv = [part.replace("{port}", str(self.port)) for part in self.command]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            try:
                self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env={**os.environ, **self.env}, start_new_session=True,
                                             preexec_fn=die_with(os.getpid()))
            except OSError as err:
                raise EngineFailed(f"{self.name}: cannot start {argv[0]}: {err.strerror}") from None
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                said = last_line(self.log)
                why = (f"port {self.port} is taken" if "address already in use" in said.lower()
                       else said or f"exit status {self.proc.returncode}")
                raise EngineFailed(f"{self.name}: the server exited before it was ready: {why} (log: {self.log})")
            if reachable(self.url, self.health):
                return self
            waited = time.monotonic() - t0
            if waited > self.ready_timeout:
                self.stop()
                raise EngineFailed(f"{self.name}: the server was not ready after {self.ready_timeout:.0f} s "
                                   f"(log: {self.log})")
            if on_wait is not None:
                on_wait(waited)
            time.sleep(0.25)

    def check_alive(self, grace: float = 0.0) -> None:
        """Raise EngineFailed if the process has exited (a server that died mid-run); grace: seconds to wait for an
        exit under way (a connection that broke as the server died)."""
        if self.proc is None:
            return
        if grace:
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is not None:
            raise EngineFailed(f"{self.name}: the server exited mid-run (status {self.proc.returncode}): "
                               f"{last_line(self.log) or 'no output'} (log: {self.log})")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, STOP_TIMEOUT_S)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
