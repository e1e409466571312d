"""A PostgreSQL server of the tests' own, for `tune --storage postgresql://…` (tests/test_tune_postgres.py).

The server binaries are an installed PostgreSQL's (Debian's package, which `make test` installs where a machine
has none and runs as root: `make postgres-server`). The server gets a fresh temporary folder (data, log and unix
socket), a free loopback port and a password for TCP connections, and is stopped and removed at the end. As root
(CI, this project's machines) it runs as the `postgres` user, since PostgreSQL refuses to run as root; that user
cannot enter pytest's own temporary folders (private to their owner), hence a folder of its own.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

USER = "sdbench"
PASSWORD = "tune-test"
SERVICE_USER = "postgres"  # the account Debian's package creates to run its server
DEBIAN = Path("/usr/lib/postgresql")


def server_binaries() -> Path | None:
    """The folder holding initdb, pg_ctl and postgres: the one on PATH, else Debian's newest version's."""
    on_path = shutil.which("initdb")
    folders = [Path(on_path).resolve().parent] if on_path else []
    versions = [p for p in DEBIAN.glob("*/bin") if p.parent.name.isdigit()] if DEBIAN.is_dir() else []
    folders += sorted(versions, key=lambda p: int(p.parent.name), reverse=True)
    return next((f for f in folders if all((f / n).is_file() for n in ("initdb", "pg_ctl", "postgres"))), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One PostgreSQL server: `start()`, `stop()` (and start again: the same data, port and password), `remove()`."""

    def __init__(self, binaries: Path):
        self.binaries = binaries
        self.folder = Path(tempfile.mkdtemp(prefix="sdbench-postgres-"))
        self.data, self.log = self.folder / "data", self.folder / "server.log"
        self.port = free_port()
        self.account = pwd.getpwnam(SERVICE_USER) if os.geteuid() == 0 else None
        if self.account is not None:
            os.chown(self.folder, self.account.pw_uid, self.account.pw_gid)

    def _run(self, program: str, *args: str) -> None:
        as_user = ({"user": self.account.pw_uid, "group": self.account.pw_gid, "extra_groups": []}
                   if self.account is not None else {})
        done = subprocess.run([str(self.binaries / program), *args], capture_output=True, text=True, timeout=120,
                              cwd=self.folder, **as_user)
        if done.returncode:
            log = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{program} {' '.join(args)} failed ({done.returncode}):\n{done.stdout}{done.stderr}"
                               f"{log}")

    def start(self) -> None:
        if not (self.data / "PG_VERSION").exists():
            secret = self.folder / "password"
            secret.write_text(PASSWORD + "\n")
            if self.account is not None:
                os.chown(secret, self.account.pw_uid, self.account.pw_gid)
            self._run("initdb", "-D", str(self.data), "-U", USER, f"--pwfile={secret}", "--auth-local=trust",
                      "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync")
        # durability off: a test's server holds nothing worth an fsync; a clean stop still keeps every commit
        options = (f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o", options, "start")

    def stop(self) -> None:
        """A fast shutdown: every client's connection is ended, as a restarted or stopped server ends them."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def remove(self) -> None:
        try:
            if self.running():
                self.stop()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def url(self, database: str = "postgres", password: str = PASSWORD, port: int | None = None,
            scheme: str = "postgresql") -> str:
        return f"{scheme}://{USER}:{password}@127.0.0.1:{port or self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; returns its URL."""
        import psycopg

        name = f"tune_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user=USER, password=PASSWORD, dbname="postgres",
                             autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {name}")
        return self.url(name)
