"""`bench`'s carry-over: for every speculative system, sdbench's and each engine's, the decode speedup predicted from
sdbench's acceptance on the same prompts and the system's own engine's step costs, beside the one it measured
(`analysis/carry.py` defines the three numbers; `servers/costs.py` measures an engine's costs)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from sdbench.analysis.carry import EngineCosts, carry
from sdbench.commands.bench_costs import StepCosts
from sdbench.engine.counters import BLOCK, CHAIN
from sdbench.reporting.carry import Carried
from sdbench.reporting.cells import ratio
from sdbench.reporting.positions import PositionAcceptance, position_matrix
from sdbench.servers.client import EngineReplyError
from sdbench.servers.costs import CostsUnknown, draft_costs, target_costs
from sdbench.servers.engines import SDBENCH
from sdbench.servers.process import EngineFailed

LOOKUP = "ngram"  # the strategy whose drafter is a lookup: c = 0
REPLAYED = ("draft", "dflash", "dspark")  # drafters that draft every round: an engine can replay their acceptance


def acceptance_rates(counts: list[tuple[list[int], list[int]]], gamma: int) -> tuple[float, ...]:
    """Per-position acceptance as an engine replays it (`EngineRole.synthetic`): the marginal rates
    (`reporting/positions.py`: the rounds that committed their first j + 1 drafts over the rounds that drafted),
    summed over (accepted, drafted) per-position counts of every prompt, gamma values (0 past the last drafted
    position)."""
    accepted = position_matrix([a for a, _ in counts], gamma).sum(axis=0)
    drafted = position_matrix([d for _, d in counts], gamma).sum(axis=0)
    return tuple(float(r) for r in np.nan_to_num(PositionAcceptance(accepted, drafted).marginal))


def replayed_acceptance(systems: list, prompts: list[list[int]], gamma: int) -> dict:
    """(strategy, drafter) -> per-position acceptance of each of sdbench's systems whose drafter drafts every round
    (REPLAYED), from one untimed greedy pass over the prompts: greedy decoding is deterministic, so it is the
    acceptance the measured pass has, known before the engines start (systems: bench's, on their own weights)."""
    rates = {}
    for s in systems:
        key = getattr(s, "key", None)
        if key is None or key[0] not in REPLAYED or key in rates:
            continue
        counts = [(row.accepted_per_position, row.drafted_per_position) for row in (s.stats(p) for p in prompts)]
        rates[key] = acceptance_rates(counts, gamma)
    return rates


def carry_over(results: list, plain, engines: list, prompts: list[list[int]], gamma: int, costs: StepCosts,
               status=None) -> tuple[list[Carried], list[str]]:
    """(the carry-over rows, a line for each speculative system left without one). results: `bench`'s measurements
    systems; plain: sdbench's own plain decoding on its fastest path among them; engines: every EngineSystem
    started (the draft's cost-only servers too); costs: sdbench's own (`bench_costs.step_costs`): v(k) = T(k) /
    T(1) for k up to gamma + 1, the draft model's c, and its own rows' c, h and s (a key they lack: the draft
    model's c, no overhead)."""
    ours = {m.key: m for m in results if m.engine is None and m.key is not None and not m.failed}
    rows, unknown = _own_rows(ours, plain, costs), []
    found = {id(m.source): m for m in results if m.engine is not None}  # an engine system's measurement
    for name in dict.fromkeys(s.engine.name for s in engines):
        mine = [s for s in engines if s.engine.name == name]
        measured = [(s, found[id(s)]) for s in mine if s.measured and id(s) in found]
        base = next((m for s, m in measured if not s.role.speculative and not m.failed), None)
        speculative = [(s, m) for s, m in measured if s.role.speculative and not m.failed]
        if base is None or not speculative:
            continue
        if status is not None:
            status.update(f"measuring {name}'s step costs through its server")
        try:
            verify, one = target_costs(base.source.engine, base.source.url, prompts, gamma)
            draft_server = next((s for s in mine if s.role.costs_only), None)
            # no draft server: the target drafts for itself, at its own costs
            c_draft, draft_verify = ((1.0, {}) if draft_server is None else
                                     draft_costs(draft_server.engine, draft_server.url, prompts, gamma, one))
        except (CostsUnknown, EngineReplyError, EngineFailed) as err:
            unknown.append(f"{name}: its step costs were not measured, so its systems have no carry-over row: {err}")
            continue
        for s, m in speculative:
            reference = ours.get(s.key)
            if reference is None:
                unknown.append(f"{m.system}: sdbench measured no {s.key[0]} with the same drafter to carry over")
                continue
            model = s.role.strategy == "draft"
            theirs = EngineCosts(verify, _draft_cost(s.role.strategy, c_draft), one, draft_verify if model else {},
                                 s.engine.draft_round if model else CHAIN)
            rows.append(with_spread(carry(m.system, name, m.rounds, base.rounds, theirs, reference.rounds), m, base))
    heads = [r.system for r in rows if r.draft != r.draft]  # NaN: a trained head's step cost
    if heads:
        unknown.append(f"{', '.join(heads)}: no predicted speedup, as a trained head's own forward (c) is timed alone by "
                       "neither bench nor an engine's server; their tokens and drafts per round and measured speedups "
                       "are their own")
    return rows, unknown


def _own_rows(ours: dict, plain, costs: StepCosts) -> list[Carried]:
    """The carry-over rows of sdbench's own speculative systems (ours: by key), at sdbench's own costs."""
    if plain is None:
        return []
    own, rows = costs.own, []
    for key, m in ours.items():
        if key[0] == "autoregressive":
            continue
        sdbench = EngineCosts(costs.verify, own.draft.get(key, _draft_cost(key[0], costs.draft)),
                              round=BLOCK if key in own.blocks else CHAIN, host=own.host if key in own.draft else 0.0,
                              setup=own.setup.get(key, 0.0))
        rows.append(with_spread(carry(m.system, SDBENCH, m.rounds, plain.rounds, sdbench, m.rounds), m, plain))
    return rows


def with_spread(row: Carried, m, plain) -> Carried:
    """The row with the lowest and highest decode speedup of one repeat: m's time per token after the first over
    its plain decoding's in the same repeat (`SystemMeasurement.repeat_tpots`), where two repeats or more have one."""
    known = [x for x in (ratio(p, t) for t, p in zip(m.repeat_tpots(), plain.repeat_tpots())) if math.isfinite(x)]
    return replace(row, measured_low=min(known), measured_high=max(known)) if len(known) > 1 else row


def _draft_cost(strategy: str, model_c: float) -> float:
    """c of a strategy's drafter: 0 for a lookup, the draft model's measured c, unknown (NaN) for a trained head,
    whose step neither side measures alone."""
    return 0.0 if strategy == LOOKUP else model_c if strategy == "draft" else float("nan")
