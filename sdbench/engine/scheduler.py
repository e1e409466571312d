"""Requests arriving over time, served by continuous batching at step granularity.

The decode loop (engine/loop.py) consults a `Scheduler` between rounds: rows that finished (EOS or budget) leave
their slot, and requests that have arrived take the free slots, first come first served, lowest slot first.
Arrivals are in wall-clock time: a request's arrival is an offset from the moment serving starts, and when no
request is running and the next has not arrived yet, the scheduler sleeps until it does (idle time passes as it
would for a server, and counts in every latency measured from an arrival). A request that arrives while a round
runs joins after that round: the granularity of admission is one decode step.

Nothing here runs a model: the loop prefills a joining request into its slot, tells the proposer, and hands the
scheduler the times at which each request's tokens were committed.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from sdbench.engine.counters import RowStats


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Offsets (seconds) at which n requests arrive: a Poisson process of `rate` requests/s drawn from `seed`
    (exponential gaps, the first request at 0, as vLLM's benchmark sends its first at once), or all at 0 when
    rate is inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


@dataclass
class Request:
    """One request and what serving it recorded. Times are seconds from the start of serving."""

    index: int  # position in the submitted list
    prompt: list[int]
    arrival_s: float
    max_new_tokens: int
    scheduled_s: float = math.nan  # its prefill began (it left the queue)
    prefill_s: float = 0.0  # its own prefill and first token (the target's), on the loop's clock
    token_s: list[float] = field(default_factory=list)  # when each chunk of its tokens was committed
    chunk_tokens: list[int] = field(default_factory=list)  # tokens committed in each chunk
    output_ids: list[int] = field(default_factory=list)
    stats: RowStats = field(default_factory=RowStats)
    extras: dict = field(default_factory=dict)  # the proposer's row_stats() as the request left

    def committed(self, at: float, tokens: int) -> None:
        if tokens > 0:
            self.token_s.append(at)
            self.chunk_tokens.append(tokens)


class Scheduler:
    """Slots of a running batch and the queue of requests waiting for one.

    clock/sleep: injectable for tests; both in seconds."""

    def __init__(self, requests: list[Request], slots: int, clock=time.perf_counter, sleep=time.sleep):
        self.waiting = deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
        self.requests = list(requests)
        self.running: list[Request | None] = [None] * slots
        self.clock, self.sleep = clock, sleep
        self.t0 = None
        self.idle_s = 0.0  # time slept waiting for an arrival with nothing running
        self.width_varied: int | None = None  # as `BatchResult.width_varied`, once served

    @property
    def slots(self) -> int:
        return len(self.running)

    def start(self) -> None:
        self.t0 = self.clock()

    def elapsed(self) -> float:
        return self.clock() - self.t0

    @property
    def finished(self) -> bool:
        return not self.waiting and all(r is None for r in self.running)

    def leaving(self, done: list[bool]) -> list[int]:
        """Slots whose request finished (done: the decode state's per-row flags)."""
        return [b for b, r in enumerate(self.running) if r is not None and done[b]]

    def leave(self, b: int, output_ids: list[int], extras: dict) -> None:
        req, self.running[b] = self.running[b], None
        req.output_ids, req.extras = output_ids, extras

    def joining(self) -> list[tuple[int, Request]]:
        """(slot, request) for each arrived request that a free slot takes now; with nothing running and
        nothing arrived, first sleeps until the next arrival."""
        if self.waiting and all(r is None for r in self.running):
            t = t0 = self.elapsed()
            while t < self.waiting[0].arrival_s:  # a sleep may end a little early: until it has arrived
                self.sleep(self.waiting[0].arrival_s - t)
                t = self.elapsed()
            self.idle_s += t - t0
        joins = []
        for b, r in enumerate(self.running):
            if r is None and self.waiting and self.waiting[0].arrival_s <= self.elapsed():
                self.running[b] = self.waiting.popleft()
                joins.append((b, self.running[b]))
        return joins
