"""What `bench` times apart from its systems, for the carry-over's predictions (`analysis/carry.py`): the target's
and draft's step costs (v and c), each of sdbench's drafting systems' round as its loop drafts it (c per draft, a
block head's whole round) and its proposer's setup per request (s), and a round's host work beyond a plain step's
(h); and the roofline's bandwidth (`analysis/bandwidth.py`), held to the fastest plain decoding measured beside it.

All of a prompt's probes run in one interleaved pass (`median_times`), each forward and round once per repetition,
so that each cost's ratio to the one-token forward is taken from calls that ran side by side: a drift of the
machine's speed between separate passes would otherwise land in the ratios (it moved c by 18 % between two such
passes of one bench)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from functools import partial

import torch

from sdbench.analysis.bandwidth import Bandwidth, with_decodings
from sdbench.analysis.costs import host_costs, median_times, verdict_fns
from sdbench.engine.state import needed_capacity
from sdbench.forward_step import Step


REPS = 7  # each probe's timed repetitions per prompt (after two untimed): a round probe costs a prefill and setup


@dataclass(frozen=True)
class OwnCosts:
    """What the carry-over predicts sdbench's own rows with beyond v: by system key, c (a block drafter's whole
    round, else per draft) and s; h for every round; the keys of block drafters (one forward a round, whatever g)."""

    draft: dict = field(default_factory=dict)
    setup: dict = field(default_factory=dict)
    host: float = 0.0
    blocks: frozenset = frozenset()


@dataclass(frozen=True)
class StepCosts:
    """`step_costs`' medians over the prompts, in target one-token forwards: v(k) = T(k) / T(1) for every width k
    from 1 to gamma + 1 (a round verifies as many as it drafted, plus one) and the draft model's c (fast path), and
    sdbench's own drafting systems' costs."""

    verify: dict
    draft: float
    own: OwnCosts = OwnCosts()

    def at(self, width: int) -> float:
        """v(width), e.g. v(gamma + 1): a verification of a whole chain's lookahead."""
        return self.verify[width]


def step_costs(runner, draft, systems: list, prompts: list[list[int]], gamma: int, widest: int = 0) -> StepCosts:
    """Each prompt's probes in one interleaved pass (`prompt_costs`), then per cost the median over the prompts of
    its ratio to that prompt's one-token forward (s: the mean, as a request's setup adds up). systems: bench's;
    those of sdbench's own loop that draft (a key other than plain decoding's) get own costs. widest: the widest
    verification to time beyond gamma + 1 (a token tree's nodes and its root)."""
    mine = {s.key: s for s in systems if isinstance(getattr(s, "key", None), tuple) and hasattr(s, "round_probe")
            and s.key[0] != "autoregressive"}
    widths = range(2, max(gamma + 1, widest) + 1)
    each = [prompt_costs(runner, draft, mine, p, gamma, widths) for p in prompts]

    def median(cost) -> float:
        return statistics.median(cost(t) / t["target"] for t in each)

    own = OwnCosts({k: median(lambda t, k=k, s=s: t[(k, "drafting")] / (1 if s.block else max(t[(k, "drafts")], 1)))
                    for k, s in mine.items()},
                   {k: statistics.mean(t[(k, "setup")] / t["target"] for t in each) for k in mine},
                   statistics.median(host_costs(t, [gamma], t["target"])[gamma] for t in each),
                   frozenset(k for k, s in mine.items() if s.block))
    verify = {1: 1.0, **{k: median(lambda t, k=k: t[("verify", k)]) for k in widths}}
    return StepCosts(verify, median(lambda t: t["draft"]), own)


def prompt_costs(runner, draft, systems: dict, prompt: list[int], gamma: int, widths: range) -> dict:
    """At the prompt's end, interleaved (`median_times`): the target's forward over one token ("target") and over
    each k of `widths` (("verify", k), as a verification sees them), the draft's over one ("draft"), the verdict on
    gamma drafts and on none (`verdict_fns`), and each system's round probe ((key, "drafting"), (key, "drafts"),
    (key, "setup"): `SdbenchSystem.round_probe`)."""
    caches = {}
    for name, r in (("target", runner), ("draft", draft)):
        caches[name] = r.new_cache(1, needed_capacity(len(prompt), 0, max(widths)))
        r.prefill(caches[name], [prompt])
    ids = {k: torch.tensor([(prompt * k)[-k:]]) for k in (1, *widths)}  # each ending at the prompt's last token

    def forward(r, cache, k: int):
        return lambda: r.run(cache, Step(ids[k], [len(prompt)]))

    logits = forward(runner, caches["target"], gamma + 1)()
    fns = {"target": forward(runner, caches["target"], 1), "draft": forward(draft, caches["draft"], 1),
           **{("verify", k): forward(runner, caches["target"], k) for k in widths},
           **verdict_fns(logits, [gamma]), **{k: partial(s.round_probe, prompt) for k, s in systems.items()}}
    try:
        return median_times(fns, runner.device, reps=REPS)
    finally:
        runner.release(caches["target"])
        draft.release(caches["draft"])


def roofline_read(probe: Bandwidth, results: list, weight_bytes: int, engines_differ: bool) -> Bandwidth:
    """The roofline's bandwidth: the probe's, or the fastest plain decoding's read of the target's weights where
    faster (sdbench's, an engine's at the same weights; not an engine's own K-quant mix, which reads fewer bytes
    than sdbench's float copy of it)."""
    reads = {m.system: m.rounds.tokens_per_s * weight_bytes for m in results
             if not m.failed and m.key is not None and m.key[0] == "autoregressive" and m.rounds is not None
             and not (engines_differ and m.engine is not None)}
    return with_decodings(probe, reads)


def is_block(drafter) -> bool:
    """A drafter whose one forward drafts a round's block (drafting/block.py)."""
    from sdbench.drafting.block import BlockDrafter

    return isinstance(drafter, BlockDrafter)
