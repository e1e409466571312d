"""The MagicDec paper on this machine: Sadhukhan, Chen et al., "MagicDec: Breaking the Latency-Throughput
Tradeoff for Long Context Generation with Speculative Decoding" (arXiv 2408.11049, ICLR 2025).

What it runs, on one loaded pair (the target, and a small draft: by default the target's int8 copy on a CPU):
1. The cost profile of `predict magicdec` over batch sizes x contexts (caches filled with random values, no
   prefill): the target's step T_T, its verification of gamma + 1 tokens T_V, its own step through a sparse
   cache of each budget T_D (self-speculation); and the small draft's step with a dense and a compressed cache.
2. Real runs on PG-19 prompts of exact lengths, each beside plain decoding of the same batch: `magicdec` with
   both KV selectors (StreamingLLM, SnapKV) and `draft` with the small draft through a StreamingLLM cache, at
   one budget and lookahead, over batch sizes x prompt lengths. The acceptance rate per (selector, budget,
   prompt length) is fitted to these runs; the measured speedup is plain decoding's time per token over the
   strategy's in the decode phase (the cost model has no prefill).
3. The cost model on the profile with the measured acceptance rates: predicted speedup per (batch, context),
   the interpolated critical sequence length per batch size, predicted against measured at the run points.
Then each claim gets its verdict (magicdec_claims.py) and the figures are drawn (magicdec_figures.py).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace

import pandas as pd
from rich.progress import Progress

from sdbench.analysis.costs import (alphas_from_results, critical_lengths, crossing_lengths, predictions, profile,
                                    with_alphas)
from sdbench.commands import run as run_module  # the module: tests replace run.RunHarness
from sdbench.commands.reproduce.common import Report, ReproduceConfig, environment_facts
from sdbench.commands.reproduce.magicdec_claims import judge, kv_share
from sdbench.commands.reproduce.magicdec_figures import cost_figure, speedup_figure, tradeoff_figure
from sdbench.config import RunConfig
from sdbench.engine.formulas import mean_accepted_length
from sdbench.engine.state import needed_capacity
from sdbench.models.loading import pair as pair_module  # the module: tests replace pair.load_pair
from sdbench.reporting import results  # the module: tests replace results.read_results

TITLE = ("MagicDec: Breaking the Latency-Throughput Tradeoff for Long Context Generation with Speculative Decoding "
         "(Sadhukhan, Chen et al., arXiv 2408.11049, ICLR 2025)")
DATASET = "pg19"
# (strategy, KV selector) of the real runs: self-speculation with each selector, the small draft compressed
CONFIGS = (("magicdec", "streamingllm"), ("magicdec", "snapkv"), ("draft", "streamingllm"))
PROVISIONAL_ALPHA = 0.7  # the runs' lookahead is picked on the profile before any run has measured acceptance


@dataclass(frozen=True)
class MagicDecPlan:
    batches: tuple[int, ...]  # profile: batch sizes
    contexts: tuple[int, ...]  # profile: context lengths (the runs' prompt lengths are profiled too)
    budgets: tuple[int, ...]  # profile: sparse-cache budgets of self-speculation
    gammas: tuple[int, ...]  # profile: lookaheads verified
    run_batches: tuple[int, ...]  # real runs: batch sizes (each one of `batches`)
    prompt_lens: tuple[int, ...]  # real runs: prompt lengths (one batch of PG-19 prompts each)
    max_new_tokens: int
    budget: int  # real runs: the sparse cache's budget (one of `budgets`, below every prompt length)
    gamma: int  # real runs: the lookahead when the profile cannot pick one (see `pick_gamma`)
    reps: int  # profile: each step time the median of this many calls (after one warm-up call)


QUICK = MagicDecPlan((1, 2, 4, 8), (256, 1024, 2048, 4096), (64, 256), (1, 2, 3, 4), (1, 4), (256, 1536), 12, 64, 2, 4)
FULL = MagicDecPlan((1, 2, 4, 8, 16), (256, 512, 1024, 2048, 4096, 8192), (64, 128, 256, 512), (1, 2, 3, 4), (1, 4, 8),
            (256, 1024, 2048), 24, 128, 2, 5)


@dataclass(frozen=True)
class Run:
    """One real run: a strategy beside plain decoding on one batch of prompts of one length."""

    strategy: str
    selector: str
    batch: int
    prompt_len: int
    path: str  # its results (Parquet)


def reproduce(cfg: ReproduceConfig, folder, console) -> Report:
    plan = QUICK if cfg.quick else FULL
    draft = cfg.small_draft
    profiles, runs, seconds = measure(cfg, plan, draft, folder / "runs", console)
    alphas = run_alphas(runs)
    predicted = predict_all(profiles, alphas)
    summary = run_summary(runs, alphas, predicted)
    claims = judge(profiles, predicted, summary, plan.budget)
    figures = [speedup_figure(predicted, summary), tradeoff_figure(summary), cost_figure(profiles, plan.budget)]
    tables = {"magicdec-profile": profile_frame(profiles), "magicdec-predictions": _frame(predicted),
              "magicdec-runs": summary, "magicdec-critical": critical_frame(predicted)}
    setup = setup_facts(cfg, plan, draft, summary, seconds, folder)
    return Report("magicdec", TITLE, claims, tables, figures, setup, notes(cfg, draft, profiles, plan))


# ---- the measurements ------------------------------------------------------------------------------------


def run_configs(cfg: ReproduceConfig, plan: MagicDecPlan, draft: str, out, gamma: int | None = None) -> list[tuple]:
    """((strategy, selector, batch, prompt length), RunConfig) for every real run, the three configurations of
    one (batch, prompt length) one after another; at lookahead `gamma` (default the plan's)."""
    planned = []
    for batch in plan.run_batches:
        for length in plan.prompt_lens:
            base = RunConfig(target=cfg.target, dataset=DATASET, prompt_len=length, limit=batch, batch_size=batch,
                             max_new_tokens=plan.max_new_tokens, gammas=(gamma or plan.gamma,), device=cfg.device,
                             dtype=cfg.dtype, out=str(out))
            for strategy, selector in CONFIGS:
                if strategy == "magicdec":
                    run = replace(base, strategy="magicdec", options={"kv": selector, "budget": str(plan.budget)})
                else:
                    run = replace(base, strategy="draft", drafts=(draft,),
                                  options={"draft_kv": selector, "budget": str(plan.budget)})
                planned.append(((strategy, selector, batch, length), run))
    return planned


def measure(cfg: ReproduceConfig, plan: MagicDecPlan, draft: str, out, console) -> tuple[dict, list[Run], dict]:
    """Load the pair once, profile it, pick the runs' lookahead on the profile, then every real run on the
    same pair; returns (profiles, runs, wall seconds of the profile and of the runs)."""
    # every setting is checked before the models load
    checked = [run_module.RunHarness(run, console) for _, run in run_configs(cfg, plan, draft, out)]
    loader = next(b for b in checked if b.cfg.strategy == "draft")  # its pair holds the small draft
    native = {name: why for b in checked for name, why in b.plan.native().items()}  # MagicDec's runs too
    pair = pair_module.load_pair(loader.cfg, loader.device, loader.dtype, console, native)
    t0 = time.perf_counter()
    profiles = profile_grid(pair, plan, grid_contexts(plan, pair.max_positions), console)
    gamma = pick_gamma(profiles, plan)
    t1 = time.perf_counter()
    console.print(f"profiled in {t1 - t0:.0f} s; the runs' lookahead gamma = {gamma} (best predicted at batch "
                  f"{max(plan.run_batches)}, {max(plan.prompt_lens)}-token context with alpha = {PROVISIONAL_ALPHA})",
                  highlight=False)
    planned, runs = run_configs(cfg, plan, draft, out, gamma), []
    for i, ((strategy, selector, batch, length), run) in enumerate(planned):
        console.print(f"run {i + 1}/{len(planned)}: {strategy} ({selector}, budget {plan.budget}), batch {batch}, "
                      f"{length}-token prompts", highlight=False)
        runs.append(Run(strategy, selector, batch, length, str(run_module.RunHarness(run, console, pair=pair).run())))
    return profiles, runs, {"profile": t1 - t0, "runs": time.perf_counter() - t1}


def pick_gamma(profiles: dict, plan: MagicDecPlan) -> int:
    """The lookahead of the best predicted self-speculation at the runs' budget, largest batch and longest
    prompt, with a provisional alpha; the plan's when the profile has no such point."""
    batch, context = max(plan.run_batches), max(plan.prompt_lens)
    rows = [r for p in profiles["target"] if (p.batch, p.context) == (batch, context)
            for r in predictions(p, PROVISIONAL_ALPHA) if r["budget"] == plan.budget]
    return max(rows, key=lambda r: r["predicted_speedup"])["gamma"] if rows else plan.gamma


def grid_contexts(plan: MagicDecPlan, max_positions: int) -> tuple[int, ...]:
    """The profiled contexts with the runs' prompt lengths, each within the model's positions."""
    room = max_positions - (needed_capacity(0, 0, max(plan.gammas)))
    return tuple(sorted({min(s, room) for s in (*plan.contexts, *plan.prompt_lens)}))


def profile_grid(pair, plan: MagicDecPlan, contexts, console) -> dict:
    """{"target": [Profile], "draft": [Profile]}: the target's T_T, T_V, T_D per budget, and the small draft's
    dense step (its `target_s`) and compressed step at the runs' budget (its `draft_s`), at every grid point."""
    draft = pair.drafts[0]
    found = {"target": [], "draft": []}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("profiling step costs", total=len(plan.batches) * len(contexts))
        for batch in plan.batches:
            for context in contexts:
                found["target"].append(profile(pair.target, batch, context, plan.gammas, plan.budgets, plan.reps, 1))
                if draft is not pair.target:
                    found["draft"].append(profile(draft, batch, context, (), (plan.budget,), plan.reps, 1))
                progress.advance(task)
    if draft is pair.target:  # the small draft is the target itself: its steps are the target's
        found["draft"] = list(found["target"])
    return found


def profile_frame(profiles: dict):
    """The profile in long form: model, step (dense / verify / sparse), batch, context, gamma, budget, ms."""
    rows = []
    for model, found in profiles.items():
        for p in found:
            at = {"model": model, "batch": p.batch, "context": p.context}
            rows.append({**at, "step": "dense", "gamma": None, "budget": None, "ms": p.target_s * 1e3})
            rows += [{**at, "step": "verify", "gamma": g, "budget": None, "ms": s * 1e3} for g, s in p.verify_s.items()
                     if model == "target"]
            rows += [{**at, "step": "sparse", "gamma": None, "budget": b, "ms": s * 1e3} for b, s in p.draft_s.items()]
    return pd.DataFrame(rows, columns=["model", "step", "batch", "context", "gamma", "budget", "ms"])


# ---- acceptance, predictions and the runs' summary --------------------------------------------------------


def run_alphas(runs: list[Run]) -> dict[str, dict]:
    """strategy -> {(selector, budget, prompt length): alpha} fitted to the real runs."""
    return {s: alphas_from_results([r.path for r in runs if r.strategy == s], strategy=s)
            for s in dict.fromkeys(r.strategy for r in runs)}


def predict_all(profiles: dict, alphas: dict[str, dict]) -> list[dict]:
    """The predicted speedup at every profiled (batch, context, gamma, budget) for each measured configuration:
    self-speculation (magicdec) per selector, and the small draft through its compressed cache (its own T_D,
    the target's T_T and T_V). Only budgets a run measured an acceptance rate for are predicted."""
    drafts = {(p.batch, p.context): p for p in profiles["draft"]}
    rows = []
    for strategy, measured in alphas.items():
        for p in profiles["target"]:
            if strategy != "magicdec":
                p = replace(p, draft_s=drafts[(p.batch, p.context)].draft_s)
            made = with_alphas(predictions(p, math.nan), measured, math.nan)
            rows += [{**r, "strategy": strategy} for r in made if r["selector"] != "-"]
    return rows


def decode_rates(rows) -> tuple[float, float]:
    """(seconds per token, batch tokens per second) of the decode phase without the drafter's one-off setup
    (`setup_s`: the small draft's own prefill belongs with the prefill, as the paper counts it): per batch,
    wall - ttft - setup over the tokens after each row's first; seconds per token is the mean over rows."""
    per_token, seconds, tokens = [], 0.0, 0.0
    for _, g in rows.groupby("batch_id"):
        setup = g["setup_s"].fillna(0.0).iloc[0] if "setup_s" in g else 0.0
        decode = float(g["wall_s"].iloc[0] - g["ttft_s"].iloc[0] - setup)
        after_first = (g["new_tokens"] - 1).clip(lower=0)
        per_token += [decode / n for n in after_first if n > 0]
        seconds, tokens = seconds + decode, tokens + float(after_first.sum())
    mean = sum(per_token) / len(per_token) if per_token else math.nan
    return mean, tokens / seconds if seconds > 0 else math.nan


def run_summary(runs: list[Run], alphas: dict[str, dict], predicted: list[dict]):
    """One row per real run: plain decoding and the strategy side by side (latency per token, throughput), the
    fitted alpha, the measured speedup (decode phase) and the one predicted at the run's setting.

    Every run at one (batch, prompt length) decodes the same prompts beside its own plain decoding; plain
    decoding's latency and throughput there are the median over those runs (one batch of a dozen tokens is
    noisy, and one slow baseline would otherwise decide a comparison), `run_speedup` is against the run's own."""
    index = {(r["strategy"], r["selector"], r["batch"], r["context"], r["gamma"], r["budget"]): r for r in predicted}
    rows = []
    for run in runs:
        df = results.read_results([run.path])
        plain, spec = df[df["role"] == "baseline"], df[df["role"] == "strategy"]
        params = json.loads(spec["params"].iloc[0])
        budget, gamma = int(params["budget"]), int(params["gamma"])
        (plain_s, plain_tps), (spec_s, spec_tps) = decode_rates(plain), decode_rates(spec)
        pred = index.get((run.strategy, run.selector, run.batch, run.prompt_len, gamma, budget), {})
        rows.append({
            "batch": run.batch, "prompt_len": run.prompt_len, "strategy": run.strategy, "selector": run.selector,
            "budget": budget, "gamma": gamma, "alpha": alphas[run.strategy].get((run.selector, budget, run.prompt_len)),
            "mean_accepted_len": mean_accepted_length(spec["new_tokens"].sum(), spec["steps"].sum(), len(spec)),
            "run_plain_latency_ms": plain_s * 1e3, "latency_ms": spec_s * 1e3, "run_plain_throughput": plain_tps,
            "throughput": spec_tps, "run_speedup": plain_s / spec_s,
            "predicted_speedup": pred.get("predicted_speedup", math.nan),
            "setup_ms": float(spec.groupby("batch_id")["setup_s"].first().fillna(0.0).sum() * 1e3),
            "wall_speedup": float(spec["tokens_per_s"].mean() / plain["tokens_per_s"].mean()),
            "dataset": str(df["dataset"].iloc[0]), "path": run.path})
    frame = pd.DataFrame(rows)
    point = frame.groupby(["batch", "prompt_len"])
    frame.insert(6, "plain_latency_ms", point["run_plain_latency_ms"].transform("median"))
    frame.insert(7, "plain_throughput", point["run_plain_throughput"].transform("median"))
    frame.insert(8, "measured_speedup", frame["plain_latency_ms"] / frame["latency_ms"])
    return frame


def critical_frame(predicted: list[dict]):
    """Per batch size: where self-speculation's best predicted speedup crosses 1 (interpolated in log context)
    and the first profiled context that wins."""
    spec = [r for r in predicted if r["strategy"] == "magicdec"]
    if not spec:
        return pd.DataFrame(columns=["batch", "crossing", "length", "first_winning_context"])
    first = critical_lengths(spec)
    return pd.DataFrame([{"batch": b, "crossing": kind, "length": float(length), "first_winning_context": first[b]}
                         for b, (kind, length) in crossing_lengths(spec).items()])


def _frame(rows: list[dict]):
    return pd.DataFrame(rows)


# ---- notes and setup ------------------------------------------------------------------------------------


def notes(cfg: ReproduceConfig, draft: str, profiles: dict, plan: MagicDecPlan) -> list[str]:
    out = ["Latency per token and throughput are of the decode phase without the drafter's one-off setup (the "
           "small draft's own prefill of the prompt, the sparse cache's compression, SnapKV's scoring pass; column "
           f"setup_ms), as the paper counts a draft's prefill with the prefill: over {plan.max_new_tokens - 1} tokens "
           "it would otherwise dominate. The rows' tpot_s and wall_speedup keep it."]
    if draft == cfg.target:
        out.append(f"The small draft is the target itself ({cfg.target}): no smaller model or int8 copy was "
                   "available for this device and dtype, so its dense step is the target's.")
    elif draft.endswith("@int8"):
        out.append(f"The small draft is {draft}, the target's dynamic-int8 copy: as deep as the target, cheaper "
                   "matrix products only, standing in for the paper's much smaller draft models.")
    slower = [p for p in profiles["target"] for b, s in p.draft_s.items() if s > p.target_s]
    if slower:
        worst = max(slower, key=lambda p: max(p.draft_s.values()) / p.target_s)
        out.append(f"The sparse draft step was slower than the full step at {len(slower)} profiled point(s) here "
                   f"(worst: batch {worst.batch}, context {worst.context}: {max(worst.draft_s.values()) * 1e3:.1f} ms "
                   f"against {worst.target_s * 1e3:.1f} ms).")
    share = kv_share(profiles)
    if share:
        out.append("Share of the target step that grows with context, by batch size: "
                   + ", ".join(f"B={b}: {v:.0%}" for b, v in share.items()) + ".")
    return out


def setup_facts(cfg: ReproduceConfig, plan: MagicDecPlan, draft: str, summary, seconds: dict, folder) -> dict:
    facts = environment_facts(cfg)
    facts.update({
        "target": cfg.target, "small draft": draft, "quick": cfg.quick,
        "profile": f"batch {list(plan.batches)} x context {list(plan.contexts)} (and the prompt lengths), budgets "
                   f"{list(plan.budgets)}, gamma {list(plan.gammas)}, median of {plan.reps} calls per step",
        "real runs": f"batch {list(plan.run_batches)} x prompt length {list(plan.prompt_lens)}, one batch each, "
                     f"{plan.max_new_tokens} new tokens, budget {plan.budget}, greedy",
        "configurations": ", ".join(f"{s} ({k})" for s, k in CONFIGS),
        "lookahead": f"gamma {', '.join(map(str, sorted(set(summary['gamma']))))} (best predicted on the profile with "
                     f"alpha = {PROVISIONAL_ALPHA})",
        **{f"{phase} wall (s)": round(s, 1) for phase, s in seconds.items()},
        "data": ", ".join(sorted(set(summary["dataset"]))), "runs": str(folder / "runs"), "folder": str(folder),
    })
    return facts
