"""Engine roles as measured systems: each role's server started (or the user's own at --engine-url), and one call per
prompt that returns the new token ids, as sdbench's and transformers' systems do, keeping the engine's replies."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from time import sleep

from sdbench.config import SamplingConfig
from sdbench.errors import SdbenchError
from sdbench.servers.client import EngineReplyError, post_stream, reachable
from sdbench.servers.engines import Engine, EngineRole, EngineTotals, Reply
from sdbench.servers.process import EngineFailed, Server


@dataclass
class EngineSystem:
    """fn(prompt ids, budget or None for max_new) -> new ids through one engine server. Replies to measured calls
    (budget None) are kept in `totals`; a warm-up's are not."""

    engine: Engine
    role: EngineRole
    name: str
    url: str
    max_new: int
    server: Server | None = None  # None: the user's own server
    totals: EngineTotals = field(default_factory=EngineTotals)

    def __post_init__(self) -> None:
        self.totals.engine, self.totals.gamma = self.engine.name, self.role.gamma

    @property
    def measured(self) -> bool:
        """A system `bench` times (not a server kept for its step costs alone)."""
        return not self.role.costs_only

    @property
    def key(self) -> tuple[str, str | None]:
        """(strategy, drafter) as sdbench's own system of the same decoding names it (`bench`'s carry-over)."""
        return self.role.strategy, self.role.draft if self.role.strategy != "ngram" else None

    def __call__(self, prompt: list[int], budget: int | None) -> list[int]:
        reply = self.ask(prompt, budget or self.max_new)
        if budget is None:
            self.totals.add(reply)
        return reply.tokens

    def settle(self) -> None:
        """Wait, untimed, until the server has stopped working after its reply (`Engine.busy_after_s`), so that
        whatever is measured next has the machine to itself."""
        if self.engine.busy_after_s:
            sleep(self.engine.busy_after_s)

    def ask(self, prompt: list[int], max_new: int, sampling: SamplingConfig | None = None) -> Reply:
        """One request: the engine's reply, its counters 0 where a speculative server drafted nothing; EngineFailed
        (with the server's last words where it died) when it fails."""
        if self.server is not None:
            self.server.check_alive()
        try:
            # the user's own server (--engine-url) may run any decoding: its counters are read whatever its role
            before = self.engine.counters(self.url) if self.role.speculative or self.server is None else None
            path, body = self.engine.request(prompt, max_new, sampling)
            reply = self.engine.reply(post_stream(self.url, path, body), self.url, before)
        except EngineReplyError as err:
            if self.server is not None:
                self.server.check_alive(grace=5.0)  # a server that died says so, with its last words
            raise EngineFailed(f"{self.name}: {err}") from None
        if self.role.speculative and reply.drafted is None:
            reply.drafted, reply.accepted = 0, 0  # a speculative server that drafted nothing for this prompt
        return reply


LAST_PORT = 65535


def check_engine_options(engine_: Engine | None, url: str | None, port: int | None, servers: int = 1) -> None:
    """--engine-url and --engine-port, refused in one line without an engine; a URL where no server answers; a
    first port whose `servers` ports (port, port + 1, …) are not all real ones."""
    if engine_ is None:
        if url or port is not None:
            raise SdbenchError("--engine-url and --engine-port go with --engine llama.cpp or --engine vllm")
        return
    if port is not None and not 1 <= port <= LAST_PORT + 1 - servers:
        more = f" ({servers} servers start there, one port each)" if servers > 1 else ""
        raise SdbenchError(f"--engine-port {port}: give a port from 1 to {LAST_PORT + 1 - servers}{more}, or leave "
                           "it out for free ones")
    if url is not None and not reachable(url, engine_.health):
        raise SdbenchError(f"--engine-url {url}: no server answers GET {engine_.health} there")


def engine_roles(engine: Engine, gamma: int, draft: str | None, autoregressive_only: bool,
                 heads: tuple[str, ...] = (), target: str | None = None, synthetic: dict | None = None) -> list[EngineRole]:
    """The roles `bench` measures through an engine: plain decoding, then (unless autoregressive only) the engine's
    n-gram and draft-model decoding at γ and each trained head; a role it cannot run is refused in one line. Then,
    where the engine can replay an acceptance (`Engine.synthetic`), each drafter of `synthetic` ((strategy, drafter)
    -> sdbench's per-position acceptance) once more at that acceptance. Last, where the draft model is not the
    target, plain decoding of the draft: a server for its step cost alone."""
    roles = [EngineRole("autoregressive")]
    if autoregressive_only:
        return roles
    roles += [EngineRole("ngram", gamma), EngineRole("draft", gamma, draft)]
    roles += [EngineRole(head_role(h), gamma, h) for h in heads]
    for role in roles:
        why = engine.refuse(role, target)
        if why is not None:
            raise SdbenchError(f"--engine {engine.name}: {why}")
    replay = synthetic if engine.synthetic and synthetic else {}
    roles += [EngineRole(r.strategy, gamma, r.draft, tuple(replay[r.strategy, r.draft]))
              for r in list(roles) if (r.strategy, r.draft) in replay]
    if draft is not None and draft != target:
        roles.append(EngineRole("autoregressive", 0, draft))
    return roles


def head_role(head: str) -> str:
    """The strategy that drafts with a head folder, by its config alone (an EAGLE head where it names no other)."""
    from sdbench.models.heads.load import config_kind
    from sdbench.strategies.spec import head_strategy

    return head_strategy(config_kind(head) or "eagle3").name


@contextlib.contextmanager
def engine_systems(engine: Engine, roles: list[EngineRole], target: str, dtype: str, capacity: int, threads: int,
                   max_new: int, log_dir: Path, url: str | None = None, port: int | None = None, status=None):
    """Yield one EngineSystem per role, each with its server started (one after another: each loads its weights),
    or one system for the server at `url`; every server started is stopped on leaving, whatever happened."""
    if url is not None:
        yield [EngineSystem(engine, EngineRole("autoregressive"), f"{engine.name} at {url}", url.rstrip("/"),
                            max_new)]
        return
    engine.check_installed()
    servers: list[Server] = []
    try:
        systems = []
        for i, role in enumerate(roles):
            name = engine.label(role, engine.served_dtype(role.model(target), dtype))
            argv = engine.command(target, role, dtype, capacity, threads)
            server = Server(name, argv, log_dir / f"{engine.folder}-{i}-{role.strategy}.log", engine.health,
                            port + i if port is not None else None, engine.server_env(threads))
            servers.append(server)
            if status is not None:
                status.update(f"starting {name} ({i + 1}/{len(roles)})")
            server.start(on_wait=None if status is None else
                         lambda s, n=name, k=i: status.update(f"starting {n} ({k + 1}/{len(roles)}): {s:.0f} s"))
            systems.append(EngineSystem(engine, role, name, server.url, max_new, server))
        yield systems
    finally:
        for server in servers:
            server.stop()
