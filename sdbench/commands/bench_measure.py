"""`bench`'s one measuring loop: each prompt through every system in turn, every call timed alike (its start,
when its first new token was available and its end: `reporting/latency.py`), an engine that fails left out.
"""

from __future__ import annotations

import math

from sdbench.commands.bench_table import SystemMeasurement
from sdbench.commands.roles import EveryRole
from sdbench.engine.clock import now
from sdbench.reporting.latency import Call
from sdbench.servers.client import EngineReplyError
from sdbench.servers.process import EngineFailed


def measure_systems(systems: list, prompts: list[list[int]], repeats: int, device, status, weights) -> list[SystemMeasurement]:
    """Each prompt through every system in turn (`EveryRole`, as `run` measures its roles), `repeats` times:
    drift in the machine's speed then falls on all systems alike instead of on whichever ran last. weights(fast)
    readies the models' weights before a system's clock starts (the fast path's packed ones or plain ones); the
    systems on plain weights run first for each prompt, so the weights change twice a prompt.
    An engine's system whose server fails is marked failed and left out from then on; the others go on.
    """
    results = [SystemMeasurement(name, fast, engine=getattr(fn, "totals", None), source=fn)
               for name, fn, fast in systems]
    every = EveryRole(sorted(results, key=lambda m: m.fast), str(device))
    ready = lambda m: weights(m.fast)  # noqa: E731 - the same readying before every system's call
    every.measure(lambda m: _call(m, prompts[0], 4, device), started=ready)  # warm-up, not counted
    for r in range(repeats):
        for m in results:
            m.tokens.append(0)
            m.seconds.append(0.0)
        for i, p in enumerate(prompts):
            status.update(f"measuring: repeat {r + 1}/{repeats}, prompt {i + 1}/{len(prompts)}")
            for got in every.measure(lambda m: _call(m, p, None, device), started=ready):
                if got.result is None:
                    continue
                m, (t0, t1, out) = got.role, got.result
                m.seconds[-1] += t1 - t0
                m.tokens[-1] += len(out)
                m.load.append((got.busy, t1 - t0))
                m.calls.append(Call(r, t0, t1 - _after_first(m.source), t1, len(out)))
                if r == 0:
                    m.outputs.append(out)
    return results


def _call(m: SystemMeasurement, prompt: list[int], budget: int | None, device) -> tuple | None:
    """(start, end, output ids) of one system's call on a prompt, or None once its engine has failed."""
    if m.failed:
        return None
    t0 = now(device)
    try:
        out = m.source(prompt, budget)
    except (EngineFailed, EngineReplyError) as err:
        if m.engine is None:
            raise
        m.failed = str(err)
        return None
    t1 = now(device)
    if hasattr(m.source, "settle"):  # an engine's server still busy after its reply: waited out, untimed
        m.source.settle()
    return t0, t1, out


def _after_first(fn) -> float:
    """Seconds a system's last measured call ran after its first new token, by the clock that saw that token: an
    engine's stream (its last reply), else the system's own `after_first` (sdbench's decode loop, transformers'
    streamer); NaN for a system that keeps none."""
    totals = getattr(fn, "totals", None)
    if totals is not None:
        reply = totals.replies[-1] if totals.replies else None
        return math.nan if reply is None or reply.ttft is None else reply.seconds - reply.ttft
    return getattr(fn, "after_first", math.nan)
