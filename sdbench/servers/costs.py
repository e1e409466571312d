"""An engine's own step costs, measured through its server: the time of a forward over k new tokens after a cached
prefix (what a verification of k - 1 drafts is), by the engine's own account (`Engine.probe`), for k = 1 .. γ + 1;
and the same of the draft model in its own plain server. Their ratios are the costs of the carry-over
prediction (`analysis/carry.py`)."""

from __future__ import annotations

import statistics

from sdbench.errors import SdbenchError

PREFIX = 256  # tokens of the cached prefix: whole blocks of any prefix cache whose block size divides 256
REPEATS = 5  # probes per width, interleaved over the widths; the median is kept


def probe_capacity(gamma: int) -> int:
    """The context a server needs for the probes: the prefix, γ + 1 new tokens and the one it generates."""
    return PREFIX + gamma + 2


class CostsUnknown(SdbenchError):
    """The engine's step costs could not be measured (its prefix cache recomputed the prefix, say)."""


def prefix_from(prompts: list[list[int]]) -> list[int]:
    """PREFIX tokens of the prompts' own ids, repeated as needed: a context like the measured one."""
    pool = [t for p in prompts for t in p]
    if not pool:
        raise CostsUnknown("no prompt tokens to probe with")
    return (pool * (PREFIX // len(pool) + 1))[:PREFIX]


def forward_seconds(engine, url: str, prefix: list[int], widths, repeats: int = REPEATS) -> dict[int, float]:
    """{k: the engine's median seconds for a forward over k new tokens after `prefix`}. Consecutive probes start
    their new tokens with different ids, so that each reuses the prefix and recomputes only its own k tokens; a
    probe that computed another count is refused (the engine's cache did not hold the prefix)."""
    starts = list(dict.fromkeys(prefix))  # distinct ids, one to open each probe's new tokens
    if len(starts) < 2:
        raise CostsUnknown("the prompts hold fewer than two distinct tokens")
    count = 0

    def probe(k: int) -> float:
        nonlocal count
        new = [starts[count % len(starts)]] + prefix[1:k]
        count += 1
        seconds, computed = engine.probe(url, prefix + new)
        if computed != k:
            raise CostsUnknown(f"{engine.name} computed {computed} prompt tokens where {k} followed a prefix it had "
                               "cached: its prefix cache did not hold the prefix")
        return seconds

    engine.probe(url, prefix + [starts[0]])  # the prefix into the cache
    count = 1
    for k in widths:  # each width once unmeasured: a first forward at a new width may compile or allocate
        probe(k)
    times: dict[int, list[float]] = {k: [] for k in widths}
    for _ in range(repeats):
        for k in widths:
            times[k].append(probe(k))
    return {k: statistics.median(v) for k, v in times.items()}


def target_costs(engine, url: str, prompts: list[list[int]], gamma: int) -> tuple[dict[int, float], float]:
    """({k: T(k) / T(1)} for k = 1 .. gamma + 1, T(1) in seconds) of the model the server at `url` serves."""
    target = forward_seconds(engine, url, prefix_from(prompts), range(1, gamma + 2))
    one = target[1]
    if not one > 0:
        raise CostsUnknown(f"{engine.name} reported {one} s for a one-token forward")
    return {k: t / one for k, t in target.items()}, one


def draft_costs(engine, draft_url: str, prompts: list[list[int]], gamma: int,
                target_one: float) -> tuple[float, dict[int, float]]:
    """(c: the draft's one-token forward over the target's (`target_one` s), {k: the draft's forward over k tokens
    over its own one-token forward} for k = 1 .. gamma + 1), on the draft's own plain server at `draft_url`."""
    verify, one = target_costs(engine, draft_url, prompts, gamma)
    return one / target_one, verify
