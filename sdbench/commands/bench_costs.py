"""What `bench` times apart from its systems: the target's and draft's step costs (v and c), a block head's round,
a round's host work beyond a plain step's (h) and each proposer's setup (s), for the carry-over's predictions
(`analysis/carry.py`); and the roofline's bandwidth (`analysis/bandwidth.py`), held to the fastest plain decoding
measured beside it."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from sdbench.analysis.bandwidth import Bandwidth, with_decodings
from sdbench.analysis.costs import host_costs, median_times, verdict_fns
from sdbench.engine.state import needed_capacity
from sdbench.forward_step import Step


def cost_ratios(runner, draft, prompts: list[list[int]], gamma: int) -> tuple[float, float]:
    """(T(gamma + 1 tokens) / T(1 token) of the target, one draft forward / one target forward), each the
    median over the prompts of forwards at the prompt's end, as a verification and a decode step see them."""
    verify, c = [], []
    for p in prompts:
        caches = {}
        for name, r in (("target", runner), ("draft", draft)):
            caches[name] = r.new_cache(1, needed_capacity(len(p), 0, gamma))
            r.prefill(caches[name], [p])
        one, wide = torch.tensor([p[-1:]]), torch.tensor([(p * (gamma + 1))[: gamma + 1]])
        t = median_times({"target": lambda: runner.run(caches["target"], Step(one, [len(p)])),
                          "draft": lambda: draft.run(caches["draft"], Step(one, [len(p)])),
                          "verify": lambda: runner.run(caches["target"], Step(wide, [len(p)]))}, runner.device)
        verify.append(t["verify"] / t["target"])
        c.append(t["draft"] / t["target"])
    return statistics.median(verify), statistics.median(c)


def roofline_read(probe: Bandwidth, results: list, weight_bytes: int, engines_differ: bool) -> Bandwidth:
    """The roofline's bandwidth: the probe's, or the fastest plain decoding's read of the target's weights where
    faster (sdbench's, an engine's at the same weights; not an engine's own K-quant mix, which reads fewer bytes
    than sdbench's float copy of it)."""
    reads = {m.system: m.rounds.tokens_per_s * weight_bytes for m in results
             if not m.failed and m.key is not None and m.key[0] == "autoregressive" and m.rounds is not None
             and not (engines_differ and m.engine is not None)}
    return with_decodings(probe, reads)


def host_cost(runner, prompts: list[list[int]], gamma: int) -> float:
    """h: the verdict on gamma drafts (the greedy acceptance over the verification's gamma + 1 logits, read back)
    beyond a plain step's (over its one), over the target's one-token forward; the median over the prompts of
    each timed on the target's own logits at the prompt's end."""
    out = []
    for p in prompts:
        cache = runner.new_cache(1, needed_capacity(len(p), 0, gamma))
        runner.prefill(cache, [p])
        one, wide = torch.tensor([p[-1:]]), torch.tensor([(p * (gamma + 1))[: gamma + 1]])
        logits = runner.run(cache, Step(wide, [len(p)]))
        t = median_times({"target": lambda: runner.run(cache, Step(one, [len(p)])), **verdict_fns(logits, [gamma])},
                         runner.device)
        runner.release(cache)
        out.append(host_costs(t, [gamma], t["target"])[gamma])
    return statistics.median(out)


@dataclass(frozen=True)
class OwnCosts:
    """What the carry-over predicts sdbench's own rows with beyond v: by system key, c (a block drafter's whole
    round, else per draft: `drafting_costs`) and s (`setup_costs`); h for every round (`host_cost`); the keys
    of block drafters (one forward a round, whatever g)."""

    draft: dict = field(default_factory=dict)
    setup: dict = field(default_factory=dict)
    host: float = 0.0
    blocks: frozenset = frozenset()


def own_costs(systems: list, runner, prompts: list[list[int]], gamma: int) -> OwnCosts:
    """`OwnCosts` of bench's systems (those of sdbench's own loop that draft: a key other than plain decoding's)."""
    mine = {s.key: s for s in systems if isinstance(getattr(s, "key", None), tuple) and hasattr(s, "drafting")
            and s.key[0] != "autoregressive"}
    one = {i: one_token_s(runner, p) for i, p in enumerate(prompts)}
    return OwnCosts(drafting_costs(mine, prompts, one), setup_costs(mine, prompts, one), host_cost(runner, prompts, gamma),
                    frozenset(k for k, s in mine.items() if s.block))


def one_token_s(runner, prompt: list[int]) -> float:
    """The target's one-token forward at the prompt's end, the median of a few."""
    cache = runner.new_cache(1, needed_capacity(len(prompt), 0, 1))
    runner.prefill(cache, [prompt])
    one = torch.tensor([prompt[-1:]])
    t = median_times({"target": lambda: runner.run(cache, Step(one, [len(prompt)]))}, runner.device)["target"]
    runner.release(cache)
    return t


def drafting_costs(systems: dict, prompts: list[list[int]], one: dict) -> dict:
    """c by key: one round's drafting as the system's loop runs it (`SdbenchSystem.drafting`: the draft's catch-up
    forward, sampling and host work included), a block drafter's whole round, any other's per draft, over the
    target's one-token forward at the same prompt (one[i], prompt i's); the median over the prompts."""
    out = {}
    for key, s in systems.items():
        ratios = []
        for i, p in enumerate(prompts):
            seconds, drafts = s.drafting(p)
            ratios.append(seconds / (1 if s.block else max(drafts, 1)) / one[i])
        out[key] = statistics.median(ratios)
    return out


def setup_costs(systems: dict, prompts: list[list[int]], one: dict, reps: int = 3) -> dict:
    """s by key: the proposer's setup per request (a draft model's prefill of the prompt, a head's reading of the
    prompt's states), timed by the decode loop itself on a one-token decoding (the setup and no round), over the
    target's one-token forward at the same prompt; the mean over the prompts of each prompt's median."""
    return {key: statistics.mean(statistics.median(s.setup_s(p) for _ in range(reps)) / one[i]
                                 for i, p in enumerate(prompts)) for key, s in systems.items()}


def is_block(drafter) -> bool:
    """A drafter whose one forward drafts a round's block (drafting/block.py)."""
    from sdbench.drafting.block import BlockDrafter

    return isinstance(drafter, BlockDrafter)
