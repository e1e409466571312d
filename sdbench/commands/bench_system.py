"""sdbench's own system in `bench`: a decoding through sdbench's loop (its measured calls add their rounds for the
carry-over), and the probes the carry-over predicts its rows with: its proposer's setup and one round's drafting,
each as the loop runs it (`bench_costs.own_costs`)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from sdbench.config import SamplingConfig
from sdbench.engine.clock import now
from sdbench.engine.counters import Rounds
from sdbench.engine.loop import generate
from sdbench.engine.metrics import host_s


@dataclass
class SdbenchSystem:
    """fn(prompt ids, budget or None for max_new) -> new ids through sdbench's decode loop. Measured calls (budget
    None) add their rounds after the first token to `rounds` (the carry-over's acceptance and decode time).
    capacity: one KV length for every prompt, so that a static-shape (CUDA-graph) runner captures its graphs
    during the warm-up and replays them for every measured prompt. key: (strategy, drafter) for the carry-over."""

    runner: object
    proposer_factory: object
    max_new: int
    eos: list[int]
    capacity: int
    key: tuple[str, str | None] = ("autoregressive", None)
    rounds: Rounds = field(default_factory=Rounds)
    block: bool = False  # a block head: one forward drafts its round (the carry-over's c is that round's)
    after_first: float = field(default=math.nan, init=False)  # seconds its last call ran after its first token

    def _decoded(self, prompt: list[int], budget: int | None):
        return generate(self.runner, self.proposer_factory(), [prompt], max_new_tokens=budget or self.max_new,
                        sampling=SamplingConfig(), eos_ids=self.eos, capacity=self.capacity)

    def setup_s(self, prompt: list[int]) -> float:
        """The proposer's setup on the prompt, as the loop times it, in a decoding of one token (no round)."""
        return self._decoded(prompt, 1).setup_s

    def drafting(self, prompt: list[int], reps: int = 3, warmup: int = 1) -> tuple[float, int]:
        """(seconds, drafts) of one round's drafting after the prompt's first token, as the loop runs it: the
        proposer's propose on the started state (the draft's catch-up forward included), the median over `reps`
        decodings after `warmup` (each from its own prefill and setup: a head drafts once from the states it was
        given), and the drafts it proposed."""
        times, drafted = [], []

        def propose(target, proposer, state, rows) -> None:
            t0 = now(state.device)
            proposal = proposer.propose(state)
            times.append(now(state.device) - t0)
            drafted.append(0 if proposal is None else int(proposal.lengths.max()))

        for _ in range(warmup + reps):
            generate(self.runner, self.proposer_factory(), [prompt], max_new_tokens=self.max_new,
                     sampling=SamplingConfig(), eos_ids=self.eos, capacity=self.capacity, rounds=propose)
        return statistics.median(times[warmup:]), drafted[-1]

    def stats(self, prompt: list[int]):
        """One untimed decoding's row of counters (its per-position acceptance: `bench_carry.replayed_acceptance`)."""
        return self._decoded(prompt, None).rows[0]

    def __call__(self, prompt: list[int], budget: int | None) -> list[int]:
        res = self._decoded(prompt, budget)
        out, row = res.output_ids[0], res.rows[0]
        self.after_first = res.wall_s - res.ttft_s
        if budget is None and len(out) > 1:
            spec = self.key[0] != "autoregressive"
            self.rounds.add(len(out) - 1, res.wall_s - res.ttft_s, row.steps if spec else len(out) - 1,
                            row.drafted, row.accepted, res.setup_s, host_s(row))
        return out
