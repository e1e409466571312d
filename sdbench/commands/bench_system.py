"""sdbench's own system in `bench`: a decoding through sdbench's loop (its measured calls add their rounds for the
carry-over), and the probes the carry-over predicts its rows with: its proposer's setup and one round's drafting,
each as the loop runs it (`round_probe`, timed by `bench_costs.step_costs`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sdbench.analysis.costs import Parts
from sdbench.config import SamplingConfig
from sdbench.engine.clock import now
from sdbench.engine.counters import Rounds
from sdbench.engine.loop import generate, some_rounds
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
    # its measured calls' target forwards past the prefill that ran otherwise than width-invariant (kv/cache.py
    # `varied`): 0, each row was its token's bits decoded alone; None, some call's was not known
    varied: int | None = field(default=0, init=False)

    def _decoded(self, prompt: list[int], budget: int | None):
        return generate(self.runner, self.proposer_factory(), [prompt], max_new_tokens=budget or self.max_new,
                        sampling=SamplingConfig(), eos_ids=self.eos, capacity=self.capacity)

    def round_probe(self, prompt: list[int]) -> Parts:
        """One decoding stopped after its second round, each round the loop's own: the drafts ("drafts") and the
        drafting ("drafting": the draft's catch-up forward, sampling and host work included) of the second round,
        a steady one, and the proposer's setup on the prompt ("setup": a draft model's prefill; with what the first
        round's drafting spent beyond the second's, such as a head's reading of the prompt's states, which it does
        in its first round). `bench_costs.step_costs` times it beside the target's forwards."""
        seen = []

        def two_rounds(target, proposer, state, rows) -> None:
            for _ in range(2):
                if all(state.done):
                    break
                before = rows[0].draft_s, rows[0].drafted
                some_rounds(target, proposer, state, rows, 1)
                seen.append((rows[0].draft_s - before[0], rows[0].drafted - before[1]))

        res = generate(self.runner, self.proposer_factory(), [prompt], max_new_tokens=self.max_new,
                       sampling=SamplingConfig(), eos_ids=self.eos, capacity=self.capacity, rounds=two_rounds)
        if not seen:  # done at its first token (a budget of one, an end-of-sequence first): no round to time
            return Parts(drafting=0.0, drafts=0, setup=res.setup_s)
        first, (drafting, drafts) = seen[0], seen[-1]
        return Parts(drafting=drafting, drafts=drafts, setup=res.setup_s + max(first[0] - drafting, 0.0))

    def stats(self, prompt: list[int]):
        """One untimed decoding's row of counters (its per-position acceptance: `bench_carry.replayed_acceptance`)."""
        return self._decoded(prompt, None).rows[0]

    def __call__(self, prompt: list[int], budget: int | None) -> list[int]:
        res = self._decoded(prompt, budget)
        out, row = res.output_ids[0], res.rows[0]
        self.after_first = res.wall_s - res.ttft_s
        if budget is None:
            self.varied = None if None in (self.varied, res.width_varied) else self.varied + res.width_varied
        if budget is None and len(out) > 1:
            spec = self.key[0] != "autoregressive"
            self.rounds.add(len(out) - 1, res.wall_s - res.ttft_s, row.steps if spec else len(out) - 1,
                            row.drafted, row.accepted, res.setup_s, host_s(row), row.verified_widths if spec else None)
        return out
