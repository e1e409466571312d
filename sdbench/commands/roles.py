"""Roles: the configurations a run decodes every batch with (the baseline, the strategy at each --gamma, the
configurations a strategy brings along to be compared with), planned once; and the one step that decodes a
batch, or serves a load point, with every role in turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

from sdbench.busy import Busy, Window
from sdbench.env import peak_memory, reset_peak_memory
from sdbench.strategies import BuildContext, Proposer
from sdbench.strategies.autoregressive import Autoregressive

BASELINE = "baseline"
R = TypeVar("R")
T = TypeVar("T")


@dataclass(frozen=True)
class Role:
    """One configuration of a run, and what its rows record of it."""

    name: str  # the `role` column: "baseline", "strategy" ("strategy-N" with several --gamma), "compare-LABEL"
    proposer: Proposer
    strategy: str  # the `strategy` column: the name the user asked for (a preset's), or a compared one's
    drafts: tuple[str, ...] = ()  # the `draft` column's names

    @property
    def is_baseline(self) -> bool:
        return self.name == BASELINE

    def params(self) -> dict:
        return self.proposer.params()


def baseline_role() -> Role:
    return Role(BASELINE, Autoregressive(), "autoregressive")


def plan_roles(planned, pair, drafts: tuple[str, ...]) -> list[Role]:
    """The strategy's roles: one per lookahead it runs at, then the configurations it brings for comparison,
    once each however many lookaheads bring them. planned: the run's `commands.plan.Planned` strategy (its
    settings checked once, by the plan)."""
    made = [v for g in planned.gammas for v in _configurations(planned, pair, g)]
    own = [v.proposer for v in made if not v.label]
    names = ["strategy"] if len(own) == 1 else [f"strategy-{i + 1}" for i in range(len(own))]
    roles = [Role(name, proposer, planned.choice.name, drafts) for name, proposer in zip(names, own)]
    compared: dict[str, Role] = {}
    for v in made:
        if v.label:
            name = f"compare-{v.label}"
            compared.setdefault(name, Role(name, v.proposer, v.strategy, (v.drafts,) if v.drafts else ()))
    return roles + list(compared.values())


def compared_roles(compared, pair, drafts: tuple[str, ...]) -> list[Role]:
    """The roles of the strategies `run --compare` measures beside the strategy: each one's own configuration
    (not those it would bring for comparison), as role compare-NAME. compared: `commands.plan.Planned`s."""
    roles = []
    for c in compared:
        own = next(v.proposer for v in _configurations(c, pair, c.gammas[0]) if not v.label)
        roles.append(Role(f"compare-{c.choice.name}", own, c.choice.name, drafts))
    return roles


def _configurations(planned, pair, gamma: int) -> list:
    """A planned strategy's configurations at one lookahead, built from its checked settings."""
    return planned.declared.configurations(BuildContext(pair.target, pair.drafts, gamma, dict(planned.settings),
                                                        pair.tokenizer))


@dataclass(frozen=True)
class Measured(Generic[R]):
    """What one role's decode returned, the peak memory it reached and how busy others kept the machine meanwhile."""

    role: Any  # a run's Role, or bench's system
    result: R
    memory: tuple[int | None, str]  # (bytes, kind) as sdbench.env.peak_memory
    busy: Busy = Busy()  # other processes' and the hypervisor's share of the cores during the decode (sdbench/busy.py)


class EveryRole(Generic[T]):
    """The one interleaved measurement: one batch decoded (or one load point served) with every role in turn, each
    one's peak memory and the machine's use by others measured on their own. The roles are a run's (`Role`: its
    baseline first when one runs, whose answers are what later turns continue) or `bench`'s systems, one prompt at a
    time."""

    def __init__(self, roles: list[T], device: str):
        self.roles, self.device = roles, device

    def measure(self, decode: Callable[[T], R], started: Callable[[T], None] = lambda role: None,
                done: Callable[[T], None] = lambda role: None) -> list[Measured[R]]:
        """decode(role) for every role in order, started(role) before its peak-memory window opens and done(role)
        after it closes."""
        measured = []
        for role in self.roles:
            started(role)
            reset_peak_memory(self.device)
            with Window() as window:
                result = decode(role)
            measured.append(Measured(role, result, peak_memory(self.device), window.busy))
            done(role)
        return measured

    @staticmethod
    def baseline(measured: list[Measured[R]]) -> R | None:
        return next((m.result for m in measured if m.role.is_baseline), None)


@dataclass(frozen=True)
class Measuring:
    """What a run measures with once its models are loaded: the pair, every role over it, and what every row
    of the run records alike (reporting.rows.RunFields)."""

    pair: Any  # models.loading.pair.Pair
    every: EveryRole
    fields: Any  # reporting.rows.RunFields
