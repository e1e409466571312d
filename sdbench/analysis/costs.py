"""Step costs on this machine, and MagicDec's cost model on them.

A short profiling pass (`profile`) times, for each batch size B and context length S, one target decode step
T_T(B, S), one draft step through a sparse cache T_D(B, S, budget) and one verification of gamma + 1 tokens
T_V(B, S, gamma). The caches are filled with random values: the time of a forward does not depend on them, and
no prefill of S tokens is needed. The predicted speedup is
    Omega(gamma, alpha) / (gamma * T_D / T_T + T_V / T_T)
and the critical sequence length for a batch size is where the best (gamma, budget) is predicted to start
beating plain decoding: the shortest profiled S that wins (`critical_lengths`), and the length where the
predicted speedup crosses 1, interpolated in log S between the grid points around it (`crossing_lengths`).
alpha can be fitted per (KV selector, budget, prompt length) to earlier runs (`alphas_from_results`), and each
prediction then takes the alpha of its selector and budget at the measured prompt length nearest its context.

`measured_costs` times one draft and one target forward at the models' own shapes after a real prompt (what
`predict speedup --target` and `simulate dsi --target` use), and the verdict on gamma drafts beyond a plain
step's (`verdict_fns`, `host_costs`: a round's host work the forwards leave out).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field

import torch

from sdbench.analysis.theory import alpha_from_tokens_per_step
from sdbench.config import SamplingConfig
from sdbench.engine.clock import now
from sdbench.engine.formulas import mean_accepted_length
from sdbench.engine.iid_model import predicted_speedup
from sdbench.engine.state import Proposal, needed_capacity
from sdbench.engine.step import accept
from sdbench.errors import SdbenchError
from sdbench.forward_step import Step
from sdbench.kv.sparse import filled_for_profile
from sdbench.models.loading import loader
from sdbench.models.forward.graphs import CAPACITY_STEP, TREE_SPARE
from sdbench.models.loading.memory import plan, refuse_beyond_memory
from sdbench.models.loading.names import with_weights
from sdbench.models.loading.pair import device_and_dtype, load_models
from sdbench.models.loading.shapes import parameter_count
from sdbench.reporting import results  # the module: tests replace results.read_results


@dataclass(frozen=True)
class Profile:
    batch: int
    context: int
    target_s: float  # T_T: one decode step, full cache
    verify_s: dict  # gamma -> T_V: one forward over gamma + 1 tokens, full cache
    draft_s: dict  # budget -> T_D: one decode step through a sparse cache of that budget


class Parts(dict):
    """What a call given to `median_times` returns when it times its own parts (seconds, or counts, by name)."""


def median_times(fns: dict, device, reps: int = 5, warmup: int = 2) -> dict:
    """Each call's median time over `reps`, the calls interleaved (every one once per repetition, after `warmup`
    rounds of them all): a burst of other work on the machine then slows every call it overlaps, not one, so
    the ratios between them (what the cost models use) stay honest. A call that returns `Parts` timed its own
    parts: their medians are kept as (key, part) instead of the call's time."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict = {}
    for _ in range(reps):
        for key, fn in fns.items():
            t0 = now(device)
            got = fn()
            t = now(device) - t0
            for part, value in (got.items() if isinstance(got, Parts) else [(None, t)]):
                times.setdefault(key if part is None else (key, part), []).append(value)
    return {key: statistics.median(t) for key, t in times.items()}


def profile(runner, batch: int, context: int, gammas, budgets, reps: int = 5, warmup: int = 2) -> Profile:
    """Time the three kinds of step at one (batch, context): each the median of `reps` calls after `warmup`.
    No gammas: no verification is timed (a draft model's own steps)."""
    dev = runner.device
    lookahead = max(gammas, default=1)
    capacity = needed_capacity(context, 0, lookahead)
    dense = runner.new_cache(batch, capacity)
    for t in dense.k + dense.v:
        t.normal_(0, 0.1)
    start = [context] * batch
    one = torch.zeros(batch, 1, dtype=torch.long)
    calls = {"target": lambda: runner.run(dense, Step(one, start))}
    for g in gammas:
        calls[("verify", g)] = lambda g=g: runner.run(dense, Step(torch.zeros(batch, g + 1, dtype=torch.long), start))
    for budget in budgets:
        if budget >= context:
            continue  # a budget at least the context is the full cache: no saving to model
        sink = min(16, budget // 2)
        sparse = filled_for_profile(runner, batch, context, sink, budget - sink, lookahead)
        calls[("draft", budget)] = lambda s=sparse: runner.run(s, Step(one, start))
    t = median_times(calls, dev, reps, warmup)
    return Profile(batch, context, t["target"], {g: t[("verify", g)] for g in gammas},
                   {key[1]: v for key, v in t.items() if key[0] == "draft"})


def predictions(p: Profile, alpha: float) -> list[dict]:
    """Predicted speedup for every (gamma, budget) profiled at this (batch, context)."""
    out = []
    for budget, t_d in p.draft_s.items():
        for gamma, t_v in p.verify_s.items():
            s = predicted_speedup(alpha, gamma, t_d / p.target_s, t_v / p.target_s)
            out.append({"batch": p.batch, "context": p.context, "gamma": gamma, "budget": budget,
                        "target_ms": p.target_s * 1e3, "draft_ms": t_d * 1e3, "verify_ms": t_v * 1e3,
                        "predicted_speedup": s})
    return out


def critical_lengths(rows: list[dict]) -> dict[int, int | None]:
    """Per batch size, the shortest profiled context whose best predicted speedup exceeds 1."""
    best: dict[tuple[int, int], float] = {}
    for r in rows:
        key = (r["batch"], r["context"])
        best[key] = max(best.get(key, 0.0), r["predicted_speedup"])
    found: dict[int, int | None] = {}
    for (batch, context), s in sorted(best.items()):
        found.setdefault(batch, None)
        if s > 1.0 and found[batch] is None:
            found[batch] = context
    return found


def alphas_from_results(paths: list[str], strategy: str = "magicdec",
                        console=None) -> dict[tuple[str, int, int], float]:
    """Acceptance rate per (selector, budget, prompt length), fitted (Omega inverted) to earlier runs' accepted
    lengths: magicdec's, or those of `strategy` "draft" with a sparse draft cache (--set draft_kv=...). A run's
    prompt length is the mean prompt of its rows (one --prompt-len gives one); runs at the same selector,
    budget and length are pooled, gammas included."""
    df = results.read_results(paths)
    rows = df[(df["role"] != "baseline") & (df["strategy"] == strategy)]
    random = rows["weights"].astype(object).eq("random").fillna(False).astype(bool) if "weights" in rows else None
    if random is not None and random.any():  # a random model's acceptance says nothing of a real one's
        rows = rows[~random]
        if console is not None:
            console.print(f"note: --from: {int(random.sum())} {strategy} row(s) with random weights left out of the "
                          "fitted alpha", highlight=False)
        if rows.empty:
            raise SdbenchError(f"--from: every {strategy} row has random weights (MODEL@random), whose acceptance "
                               "says nothing of a real model: give --alpha, or runs of a real model")
    pooled: dict[tuple[str, int, int], list[float]] = {}
    for (_, params), group in rows.groupby(["run_id", "params"]):
        p = json.loads(params)
        steps = group["steps"].sum()
        if not steps or not p.get("gamma") or "budget" not in p:  # a dense draft cache has no budget
            continue
        mean_len = mean_accepted_length(group["new_tokens"].sum(), steps, len(group))
        key = (str(p.get("kv", p.get("draft_kv", "streamingllm"))), int(p["budget"]),
               int(round(group["prompt_tokens"].mean())))
        # weight each run by its steps: the pooled alpha is the one its rounds support
        a = alpha_from_tokens_per_step(float(mean_len), int(p["gamma"]))
        acc = pooled.setdefault(key, [0.0, 0.0])
        acc[0] += a * steps
        acc[1] += steps
    return {k: total / steps for k, (total, steps) in pooled.items()}


def alpha_for(measured: dict[tuple[str, int, int], float], selector: str, budget: int, context: int) -> float | None:
    """The measured alpha for a selector and budget at the prompt length nearest to `context` (in ratio);
    None when that selector was not measured at that budget."""
    lengths = [n for (s, b, n) in measured if s == selector and b == budget]
    if not lengths:
        return None
    nearest = min(lengths, key=lambda n: abs(math.log(max(n, 1) / max(context, 1))))
    return measured[(selector, budget, nearest)]


def with_alphas(rows: list[dict], measured: dict[tuple[str, int, int], float], alpha: float) -> list[dict]:
    """Each predicted row once per selector measured at its budget (the draft step costs the same for both
    selectors; only the acceptance differs), its alpha from `alpha_for`; a budget no run measured keeps the
    given alpha, with selector '-'."""
    selectors = sorted({s for s, _, _ in measured})
    out = []
    for r in rows:
        found = [(s, alpha_for(measured, s, r["budget"], r["context"])) for s in selectors]
        for selector, a in [(s, a) for s, a in found if a is not None] or [("-", alpha)]:
            out.append({**r, "selector": selector, "alpha": a,
                        "predicted_speedup": predicted_speedup(a, r["gamma"], r["draft_ms"] / r["target_ms"],
                                                               r["verify_ms"] / r["target_ms"])})
    return out


def crossing_lengths(rows: list[dict]) -> dict[int, tuple[str, float | None]]:
    """Per batch size, where the best predicted speedup crosses 1 over the profiled contexts, interpolated
    linearly in log context between the two grid points around the first crossing. Returns (kind, length):
    ("at", S) for a crossing, ("below", S0) when the shortest context already wins, ("above", Smax) when none
    does."""
    best: dict[int, dict[int, float]] = {}
    for r in rows:
        per = best.setdefault(r["batch"], {})
        per[r["context"]] = max(per.get(r["context"], 0.0), r["predicted_speedup"])
    found = {}
    for batch, per in sorted(best.items()):
        points = sorted(per.items())
        if points[0][1] > 1.0:
            found[batch] = ("below", points[0][0])
            continue
        found[batch] = ("above", points[-1][0])
        for (s0, v0), (s1, v1) in zip(points, points[1:]):
            if v0 <= 1.0 < v1:
                t = (1.0 - v0) / (v1 - v0)
                found[batch] = ("at", math.exp(math.log(s0) + t * (math.log(s1) - math.log(s0))))
                break
    return found


def memory_plan(target: str, dtype, device, batches, contexts, gamma: int):
    """Which (batch, context) points' caches fit beside the model's weights in the free memory (`memory.MemoryPlan`),
    estimated from the config before anything is allocated; a model whose weights alone do not fit is refused."""
    config = loader.load_config(target)
    params = parameter_count(config, cached=True) or 0
    static = device.type == "cuda"  # static-shape caches keep room for a tree graph's padding, rounded up
    step, spare = (CAPACITY_STEP, TREE_SPARE) if static else (1, 0)

    def capacity(context: int) -> int:
        return -(-(needed_capacity(context, 0, gamma) + spare) // step) * step

    points = [(b, s) for b in batches for s in contexts]
    found = plan(config, params, dtype, device, points, capacity, gamma + 1)
    refuse_beyond_memory([target], found.weights, found.free, dtype, device, "nothing can be profiled")
    return found


@dataclass(frozen=True)
class StepCosts:
    """Costs measured at the models' shapes: c one draft step over one target step, verify[gamma] one
    verification of gamma + 1 tokens over one target step, and the target step itself in seconds."""

    c: float
    verify: dict
    target_s: float
    host: dict = field(default_factory=dict)  # gamma -> h: the verdict on gamma drafts beyond a plain step's


def measured_costs(target: str, draft: str, gammas, context: int, device: str, dtype: str, console) -> StepCosts:
    """Step costs for `predict speedup` and `simulate dsi`, measured at the models' shapes (MODEL@random works):
    each the median of a few forwards at the end of a `context`-token prompt of random ids, through the fast
    path."""
    if context < 1:
        raise SdbenchError(f"--context {context}: must be at least 1")
    dev, dt = device_and_dtype(device, dtype)
    cpu = dev.type == "cpu"
    target, draft = with_weights(target, dtype, cpu), with_weights(draft, dtype, cpu)
    needs = "timing the step costs"
    models = load_models([target, draft], dev, dt, console, native={target: needs, draft: needs})
    runners = {name: got.runner for name, got in models.items()}
    with console.status("timing"):
        prompt = torch.randint(0, runners[target].vocab_size, (context,), generator=torch.Generator().manual_seed(0))
        caches = {}
        for name, r in runners.items():
            caches[name] = r.new_cache(1, needed_capacity(context, 0, max(gammas)))
            r.prefill(caches[name], [prompt.tolist()])

        def forward(name: str, width: int):
            return lambda: runners[name].run(caches[name], Step(prompt[None, -width:], [context]))
        # the draft's step, the target's and its verifications interleaved: their ratios are what is used
        wide = forward(target, max(gammas) + 1)()
        t = median_times({draft: forward(draft, 1), target: forward(target, 1),
                          **{("verify", g): forward(target, g + 1) for g in gammas}, **verdict_fns(wide, gammas)},
                         dev)
    return StepCosts(t[draft] / t[target], {g: t[("verify", g)] / t[target] for g in gammas}, t[target],
                     host_costs(t, gammas, t[target]))


def verdict_fns(logits: torch.Tensor, gammas) -> dict:
    """For `median_times`: ("verdict", g) -> the greedy verdict on g drafts over a verification's logits[:, :g + 1]
    (logits [1, >= max(gammas) + 1, V]), read back to the host as the decode loop reads it; g = 0 too, a plain
    step's."""
    greedy = SamplingConfig()

    def verdict(g: int):
        drafts = Proposal(torch.zeros(1, g, dtype=torch.long), torch.tensor([g]))
        return lambda: accept(drafts, logits[:, : g + 1], greedy, None)

    return {("verdict", g): verdict(g) for g in sorted({0, *gammas})}


def host_costs(t: dict, gammas, target_s: float) -> dict:
    """gamma -> h: the verdict on gamma drafts beyond a plain step's (`verdict_fns`' times in t), over the target's
    one-token forward; 0 where the two medians' noise puts the wider verdict below the plain one."""
    return {g: max(0.0, t[("verdict", g)] - t[("verdict", 0)]) / target_s for g in gammas}
