"""Where a run decodes: sdbench's own loop over the models it loads, or an engine's server (`--engine`). The
run's harness (`commands/run.py`) asks its backend for the pair, the roles, the servers that must run while it
measures and what a row records of its memory, and never branches on the engine itself.
"""

from __future__ import annotations

import contextlib

from sdbench.commands.roles import Measured, Role, baseline_role
from sdbench.commands.run_engine import engine_pair, engine_servers, run_engine, run_roles
from sdbench.config import RunConfig
from sdbench.data.prompts import run_positions
from sdbench.models.loading.pair import Pair, load_pair


class Local:
    """sdbench's own decode loop: the models loaded here, the baseline beside the strategy's roles, no server."""

    engine = None  # what rows record in `engine`: none

    def load(self, harness) -> Pair:
        return load_pair(harness.cfg, harness.device, harness.dtype, harness.console, harness.plan.native())

    def roles(self, harness, pair: Pair) -> list[Role]:
        """Every role of the run, the baseline first when one runs."""
        return [baseline_role()] * harness.cfg.baseline + harness.plan_roles(pair)

    def servers(self, harness, roles: list[Role], pair: Pair, lookahead: int):
        return contextlib.nullcontext()

    def memory(self, measured: Measured) -> tuple[int | None, str]:
        return measured.memory


class Engine:
    """An engine's server decodes every role (commands/run_engine.py): only the target's tokenizer and config
    are loaded, the servers run while the harness measures, and a row's memory is not this process's."""

    def __init__(self, engine):
        self.engine = engine

    def load(self, harness) -> Pair:
        return engine_pair(harness.cfg, harness.console)

    def roles(self, harness, pair: Pair) -> list[Role]:
        return run_roles(harness.cfg, self.engine, harness.choice.base, harness.console)

    def servers(self, harness, roles: list[Role], pair: Pair, lookahead: int):
        """The engine's servers for the roles, running until the block ends."""
        return engine_servers(harness.cfg, roles, run_positions(harness.cfg, pair, lookahead), harness.console)

    def memory(self, measured: Measured) -> tuple[int | None, str]:
        return None, "engine_server"


def backend_for(cfg: RunConfig) -> Local | Engine:
    """The backend a run's --engine names (sdbench's own loop without one)."""
    engine = run_engine(cfg)
    return Local() if engine is None else Engine(engine)
