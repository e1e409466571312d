"""The polybasic paper on this machine: Wang, Li, Ma, Zheng, Chao, Xiao and Ji, "Polybasic Speculative Decoding
Through a Theoretical Perspective" (ICML 2025, arXiv 2510.26527).

What it runs, on one loaded target (every model loaded once):
1. Four systems on the same prompts: plain decoding, target <- ngram, target <- M and the three-model
   target <- M <- ngram, where M is the int8 copy of the target (or --draft). A short profiling pass per system
   reads each level's time per forward T, accepted length L and block size N, greedy, then once more under
   sampling (temperature 1) for the spread of the accepted length; the measured pass then decodes every
   prompt with the four systems interleaved prompt by prompt (`analysis.chain.profile_and_measure`).
2. Two insertions, each predicted from the profiles by sdbench's insertion condition and by the paper's
   Theorem 3.2 as sdbench reads it, then settled by the measured times: M under the target, above the n-gram
   bottom (target <- ngram becomes the three-model chain), and the n-gram under M (target <- M becomes it).
Then each claim gets its verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from sdbench.analysis.chain import (ChainRun, chain_config, insertion_verdict, load_chains, paper_verdict,
                                    profile_and_measure)
from sdbench.commands.reproduce.common import (UNTESTABLE, Claim, Figure, Report, ReproduceConfig,
                                               environment_facts, figure_png, grouped_bars, pyplot, verdict)
from sdbench.config import DEFAULT_GAMMA, SamplingConfig
from sdbench.data.prompts import encode_prompts
from sdbench.strategies.polybasic import NGRAM, parse_mu

TITLE = ("Polybasic Speculative Decoding Through a Theoretical Perspective (Ruilin Wang, Huixia Li, Yuexiao Ma, "
         "Xiawu Zheng, Fei Chao, Xuefeng Xiao, Rongrong Ji; ICML 2025, arXiv 2510.26527)")
TOLERANCE = 0.25  # |predicted / measured - 1| within which the time formula is said to predict a chain
CLOSE = 0.05  # a measured insertion outcome within this relative difference is close to one run's noise
IID_FLOOR = 1e-3  # below it independent acceptances are (almost) all-or-nothing: no ratio is taken
TEMPERATURE = 1.0  # the profiling pass under sampling, for the spread of the accepted length
SEED = 0


@dataclass(frozen=True)
class PolybasicPlan:
    datasets: tuple[str, ...]
    limit: int  # prompts per dataset in the measured pass
    max_new_tokens: int
    profile_prompts: int  # per dataset: the first ones, decoded for profile_tokens tokens
    profile_tokens: int
    gamma: int = DEFAULT_GAMMA  # the bottom's block
    mu: str = ""  # the middle level's threshold ("" = 2 * gamma)


QUICK = PolybasicPlan(("mt-bench",), limit=3, max_new_tokens=48, profile_prompts=2, profile_tokens=32)
FULL = PolybasicPlan(("mt-bench", "gsm8k", "humaneval"), limit=5, max_new_tokens=96, profile_prompts=1,
                     profile_tokens=64)


@dataclass(frozen=True)
class Insertion:
    candidate: str  # the model (or ngram) inserted
    under: str  # the level it goes under
    old: str  # system keys
    new: str
    at: int  # predict chain's --at in the old chain


def systems(cfg: ReproduceConfig) -> dict[str, list[str]]:
    """System key -> the drafts under the target, top down."""
    middle = cfg.small_draft
    return {"plain": [], "ngram": [NGRAM], "middle": [middle], "three": [middle, NGRAM]}


def insertions(cfg: ReproduceConfig) -> list[Insertion]:
    middle = systems(cfg)["middle"][0]
    return [Insertion(middle, cfg.target, "ngram", "three", 0), Insertion(NGRAM, middle, "middle", "three", 1)]


def reproduce(cfg: ReproduceConfig, folder, console) -> Report:
    plan = QUICK if cfg.quick else FULL
    runs, prompts = measure_systems(cfg, plan, console)
    chains = chains_frame(runs, cfg.target)
    inserted = insertions_frame(runs, insertions(cfg))
    spread = spread_frame(runs)
    claims = judge(chains, inserted, spread)
    figures = [times_figure(chains), spread_figure(spread)]
    tables = {"polybasic-chains": chains, "polybasic-insertions": inserted, "polybasic-spread": spread}
    return Report("polybasic", TITLE, claims, tables, figures, setup_facts(cfg, plan, prompts, folder),
                  notes(chains))


# ---- the measurements ------------------------------------------------------------------------------------


def measure_systems(cfg: ReproduceConfig, plan: PolybasicPlan, console) -> tuple[dict[str, ChainRun], dict[str, int]]:
    """Profile and measure the four systems (`systems`) on one loaded target; returns the runs by key and the
    prompts measured per dataset."""
    chains = systems(cfg)
    rc = chain_config(cfg.target, [c for c in chains.values() if c], plan.datasets[0], plan.limit,
                      plan.max_new_tokens, plan.gamma, plan.mu, SEED, cfg.device, cfg.dtype)
    pair, runners = load_chains(rc, console)
    encoded = {d: encode_prompts(replace(rc, dataset=d), pair)[1] for d in plan.datasets}
    profiling = [p for d in plan.datasets for p in encoded[d][: plan.profile_prompts]]
    measuring = [p for d in plan.datasets for p in encoded[d]]
    runs = {key: ChainRun(key, chain) for key, chain in chains.items()}
    profile_and_measure(pair, list(runs.values()), runners, profiling, measuring, plan.profile_tokens,
                        plan.max_new_tokens, plan.gamma, plan.mu, SamplingConfig(TEMPERATURE, seed=SEED), console)
    return runs, {d: len(encoded[d]) for d in plan.datasets}


def _levels(target: str, chain: list[str]) -> str:
    return " <- ".join([target, *chain])


def chains_frame(runs: dict[str, ChainRun], target: str):
    """Per system: per level (top down) ms per forward T, accepted length L, block size N; the predicted ms per
    token (sdbench's form, the paper's simple form), the measured one, the speedup and the losslessness."""
    plain = runs["plain"]
    rows = []
    for key, run in runs.items():
        c = run.costs
        simple = c.seed_time_per_token() if c else run.profile_forward_s
        rows.append({
            "system": key, "levels": _levels(target, run.chain),
            "T_ms": [round(t * 1e3, 3) for t in (c.costs if c else (run.profile_forward_s,))],
            "L": [round(a, 3) for a in (c.accepted if c else (1.0,))],
            "N": [round(n, 3) for n in (c.blocks if c else ())],
            "bottom_forwards": c.bottom_forwards if c else math.nan,
            "predicted_ms": run.predicted * 1e3, "simple_ms": simple * 1e3, "measured_ms": run.measured * 1e3,
            "draft_prefill_ms": run.prefill_s / max(run.tokens, 1) * 1e3, "tokens": run.tokens,
            "speedup": plain.measured / run.measured, "same_tokens": run.outputs == plain.outputs})
    frame = pd.DataFrame(rows)
    frame["error"] = frame["predicted_ms"] / frame["measured_ms"] - 1.0
    frame["simple_error"] = frame["simple_ms"] / frame["measured_ms"] - 1.0
    return frame


def insertions_frame(runs: dict[str, ChainRun], inserted: list[Insertion]):
    """Per insertion: both tests' (old, new) ms per token of the level they compare, and the measured chains."""
    rows = []
    for ins in inserted:
        old, new = runs[ins.old], runs[ins.new]
        s_old, s_new = insertion_verdict(old.costs, new.costs, ins.at)
        p_old, p_new = paper_verdict(old.costs, new.costs, ins.at)
        helped = new.measured < old.measured
        rows.append({
            "insertion": f"{ins.candidate} under {ins.under}", "candidate": ins.candidate, "under": ins.under,
            "at": ins.at, "old_system": ins.old, "new_system": ins.new,
            "sdbench_old_ms": s_old * 1e3, "sdbench_new_ms": s_new * 1e3, "sdbench_predicts_help": s_new < s_old,
            "paper_old_ms": p_old * 1e3, "paper_new_ms": p_new * 1e3, "paper_predicts_help": p_new < p_old,
            "measured_old_ms": old.measured * 1e3, "measured_new_ms": new.measured * 1e3, "measured_helped": helped,
            "sdbench_right": (s_new < s_old) == helped, "paper_right": (p_new < p_old) == helped})
    return pd.DataFrame(rows)


def spread_frame(runs: dict[str, ChainRun]):
    """Per system, verifying level and mode (greedy, sampling): rounds, mean and variance of the tokens a round
    commits, the variance of independent acceptances at that mean, their ratio and the coefficient of variation."""
    rows = []
    for key, run in runs.items():
        for mode, levels in run.spread.items():
            for i, s in enumerate(levels):
                rows.append({"system": key, "level": i, "model": s.model, "below": run.chain[i], "mode": mode,
                             "rounds": s.rounds, "mean": s.mean, "var": s.var, "iid_var": s.iid_var,
                             "var_over_iid": s.var / s.iid_var if s.iid_var > IID_FLOOR else math.nan,
                             "cv": math.sqrt(s.var) / s.mean if s.mean > 0 else math.nan})
    return pd.DataFrame(rows, columns=["system", "level", "model", "below", "mode", "rounds", "mean", "var",
                                       "iid_var", "var_over_iid", "cv"])


# ---- the claims ------------------------------------------------------------------------------------------


def judge(chains, inserted, spread) -> list[Claim]:
    return [claim_formula(chains), *(claim_insertion(row) for row in inserted.itertuples()),
            claim_stability(spread), claim_three_beats_two(chains), claim_lossless(chains), claim_speedup(chains)]


def claim_formula(chains) -> Claim:
    rows = chains[chains["system"] != "plain"]
    worst, worst_sd = float(rows["simple_error"].abs().max()), float(rows["error"].abs().max())
    measured = "; ".join(f"{r.levels}: measured {r.measured_ms:.1f} ms/token, paper's form {r.simple_ms:.1f} "
                         f"({r.simple_error:+.0%}), sdbench's {r.predicted_ms:.1f} ({r.error:+.0%})"
                         for r in rows.itertuples())
    return Claim(
        "The inference time of a multi-model system follows from each model's forward time T_i and accepted "
        "length L_i: sum_i T_i / L_i (+ the bottom's b T_k / L_(k-1)) per token",
        measured, verdict(worst <= TOLERANCE),
        f"within {TOLERANCE:.0%} of the measured time per token counts as predicted, judged on the paper's form; "
        "sdbench's form also counts each middle level's N_i / L_i rounds per block and the rejected work "
        f"(worst {worst_sd:.0%}); T, L, N from the short profiling pass, the measured time includes the lower "
        "levels' prefill", value=worst, where="Section 3: optimal inference time")


def claim_insertion(row) -> Claim:
    def said(helps: bool) -> str:
        return "help" if helps else "hurt"

    change = row.measured_new_ms / row.measured_old_ms - 1.0
    measured = (f"paper's form {row.paper_new_ms:.1f} vs {row.paper_old_ms:.1f} ms -> {said(row.paper_predicts_help)}"
                f"; sdbench's {row.sdbench_new_ms:.1f} vs {row.sdbench_old_ms:.1f} ms -> "
                f"{said(row.sdbench_predicts_help)}; measured {row.measured_old_ms:.1f} -> {row.measured_new_ms:.1f} "
                f"ms/token ({change:+.0%}): it {'helped' if row.measured_helped else 'hurt'}")
    why = (f"holds when the paper's form called the measured outcome; sdbench's form "
           f"{'called it right' if row.sdbench_right else 'got it wrong'}")
    if abs(change) < CLOSE:
        why += f" (the measured difference is under {CLOSE:.0%}: close to one run's noise)"
    return Claim(f"Theorem 3.2: adding a model pays exactly when its condition holds — {row.insertion}",
                 measured, verdict(bool(row.paper_right)), why, value=change, where="Theorem 3.2")


def claim_stability(spread) -> Claim:
    claim = ("Speculative sampling stabilises token acceptance: the accepted length per verification varies less "
             "under speculative sampling than under greedy decoding")
    keys = ["system", "level", "model", "below"]
    both = spread[spread["mode"] == "greedy"].merge(spread[spread["mode"] == "sampling"], on=keys,
                                                    suffixes=("_g", "_s"))
    if both.empty:
        return Claim(claim, "no sampling pass", UNTESTABLE, "the profiling pass ran greedy only")
    lower = both["var_s"] < both["var_g"]
    measured = "; ".join(
        f"{r.model} over {r.below} ({r.system}): var {r.var_g:.2f} greedy, {r.var_s:.2f} sampling (mean "
        f"{r.mean_g:.2f}, {r.mean_s:.2f}; var / independent {_ratio(r.var_over_iid_g)}, "
        f"{_ratio(r.var_over_iid_s)})" for r in both.itertuples())
    return Claim(
        claim, measured, verdict(bool(lower.all())),
        f"holds when sampling's variance is below greedy's at every verifying level ({int(lower.sum())} of "
        f"{len(lower)} here). The theorem itself models sampling's acceptances as independent at one rate (a "
        "capped geometric length); var / independent is each mode's variance over that model's at the same "
        "mean. Sampling also lowers the mean, which by itself moves the variance",
        value=float(lower.mean()), where="Theorem 3.3")


def _ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def claim_three_beats_two(chains) -> Claim:
    by = chains.set_index("system")
    three, two = by.loc["three"], by.loc[["ngram", "middle"]]
    best = two["measured_ms"].idxmin()
    ratio = two.loc[best, "measured_ms"] / three["measured_ms"]
    return Claim(
        "A three-model system is faster than the dualistic draft-target one",
        f"{three['levels']}: {three['measured_ms']:.1f} ms/token; best two-model chain {two.loc[best, 'levels']}: "
        f"{two.loc[best, 'measured_ms']:.1f} ms/token ({ratio:.2f}x); plain decoding "
        f"{by.loc['plain', 'measured_ms']:.1f}",
        verdict(ratio > 1.0), "measured on the same prompts, the systems interleaved prompt by prompt",
        value=float(ratio), where="experiments")


def claim_lossless(chains) -> Claim:
    rows = chains[chains["system"] != "plain"]
    differ = [r.levels for r in rows.itertuples() if not r.same_tokens]
    measured = (f"every chain's output identical to plain decoding, token for token ({len(rows)} chains, "
                f"{int(chains.loc[chains['system'] == 'plain', 'tokens'].iloc[0])} tokens after the first each)"
                if not differ else f"outputs differ from plain decoding for {', '.join(differ)}")
    return Claim("The output distribution is preserved (lossless)", measured, verdict(not differ),
                 "greedy decoding in the measured pass must give plain decoding's tokens; under sampling sdbench's "
                 "tests check the target's distribution on tiny models (chi-square)", value=float(len(differ)),
                 where="abstract; method")


def claim_speedup(chains) -> Claim:
    rows = chains[chains["system"] != "plain"]
    best = rows.loc[rows["speedup"].idxmax()]
    target = chains.loc[chains["system"] == "plain", "levels"].iloc[0]
    return Claim(
        "3.31-4.43x speedups on 7B targets (LLaMA2-Chat 7B, LLaMA3-8B, Vicuna-7B, Qwen2-7B)",
        f"best here: {best['levels']} {best['speedup']:.2f}x over plain decoding", UNTESTABLE,
        f"those 7B targets, their drafters and the GPUs they ran on are not available here; the target here is "
        f"{target}, on this machine", value=float(best["speedup"]), where="abstract; experiments")


def notes(chains) -> list[str]:
    by = chains.set_index("system")
    target_ms, middle_ms = by.loc["plain", "T_ms"][0], by.loc["middle", "T_ms"][1]
    if middle_ms < 0.8 * target_ms:
        return []
    return [f"The middle model's forward ({middle_ms:.1f} ms drafting) is not much cheaper than the target's "
            f"({target_ms:.1f} ms) on this machine, so a chain with it as a level pays nearly a target forward "
            "per drafted token; the paper's middle model is far cheaper than its 7B target."]


# ---- figures and setup -----------------------------------------------------------------------------------


def times_figure(chains) -> Figure:
    fig, ax = pyplot().subplots(figsize=(9, 4.5), constrained_layout=True)
    x = range(len(chains))
    grouped_bars(ax, x, [(label, chains[col]) for col, label in (("measured_ms", "measured"),
                                                                   ("predicted_ms", "sdbench's form"),
                                                                   ("simple_ms", "paper's form"))])
    ax.set_xticks(x, [str(s).replace(" <- ", "\n<- ") for s in chains["levels"]], fontsize=8)
    ax.set_ylabel("ms per token")
    ax.legend()
    ax.set_title("time per token: predicted from the profiling pass against measured")
    return Figure("polybasic-times", "Predicted (sdbench's form, the paper's simple form) against measured ms per "
                  "token, per system", figure_png(fig))


def spread_figure(spread) -> Figure:
    fig, ax = pyplot().subplots(figsize=(9, 4.5), constrained_layout=True)
    keys = list(dict.fromkeys(zip(spread["system"], spread["level"], spread["model"], spread["below"])))
    x = np.arange(len(keys))
    for i, mode in enumerate(("greedy", "sampling")):
        part = spread[spread["mode"] == mode].set_index(["system", "level", "model", "below"])
        var = [part.loc[k, "var"] if k in part.index else np.nan for k in keys]
        iid = [part.loc[k, "iid_var"] if k in part.index else np.nan for k in keys]
        ax.bar(x + (i - 0.5) * 0.4, var, 0.4, label=f"{mode}")
        ax.plot(x + (i - 0.5) * 0.4, iid, "k_", markersize=18, label="independent acceptances" if i else None)
    ax.set_xticks(x, [f"{m}\nover {b}\n({s})" for s, _, m, b in keys], fontsize=7)
    ax.set_ylabel("variance of tokens per round")
    ax.legend()
    ax.set_title("accepted length per verifying level: variance, greedy against sampling")
    return Figure("polybasic-spread", "Variance of the tokens a verification round commits, per verifying level, "
                  "greedy and sampling (black: independent acceptances at the same mean)", figure_png(fig))


def setup_facts(cfg: ReproduceConfig, plan: PolybasicPlan, prompts: dict[str, int], folder) -> dict:
    chains = systems(cfg)
    facts = environment_facts(cfg)
    facts.update({
        "target": cfg.target, "middle model": chains["middle"][0], "quick": cfg.quick,
        "systems": "; ".join(_levels(cfg.target, c) for c in chains.values()),
        "prompts measured": ", ".join(f"{d}: {n}" for d, n in prompts.items()) + " (first turn)",
        "max new tokens": plan.max_new_tokens,
        "profiling pass": f"{plan.profile_prompts} prompt(s) per dataset x {plan.profile_tokens} tokens, greedy, "
                          f"then sampling at temperature {TEMPERATURE}",
        "gamma (bottom block)": plan.gamma, "mu (middle level)": parse_mu(plan.mu, 1, plan.gamma)[0],
        "seed": SEED, "formula tolerance": TOLERANCE, "folder": str(folder),
    })
    return facts
