"""The MagicDec paper's claims, each judged on the cost profile and the real runs measured here.

Inputs: `profiles` ({"target": [Profile], "draft": [Profile]}, as `costs.profile` times them: the small
draft's dense step is its `target_s`, its compressed step its `draft_s`), `predicted` (rows of
`costs.with_alphas` with a "strategy" key) and `summary` (one row per real run, see magicdec.run_summary).
"""

from __future__ import annotations

import math

import numpy as np

from sdbench.analysis.costs import crossing_lengths
from sdbench.commands.reproduce.common import FAILS, UNTESTABLE, Claim, verdict

FLAT = 0.25  # a step growing by at most this share from the shortest to the longest context counts as flat
RISE_SLACK = 0.02  # a series "rises" when it ends higher and never drops more than this share from one step
MEMORY_BOUND = 0.5  # the premise of the batch claims: context's share of the target step at the largest batch
PICK_TOLERANCE = 0.05  # the predicted best configuration counts as right within this share of the measured best


def judge(profiles: dict, predicted: list[dict], summary, budget: int) -> list[Claim]:
    return [claim_bottleneck(profiles), claim_draft_flat(profiles), claim_critical(profiles, predicted, summary),
            claim_tradeoff(summary), claim_small_draft(profiles, budget), claim_picks_best(summary),
            claim_headline(summary)]


def rises(values, slack: float = RISE_SLACK) -> bool:
    """The series ends above where it starts and no step drops by more than `slack` of the value before it."""
    values = list(values)
    return len(values) > 1 and values[-1] > values[0] and all(b >= a * (1 - slack) for a, b in zip(values, values[1:]))


def kv_share(profiles: dict) -> dict[int, float]:
    """Per batch size, the share of the target step that grows with context, (T_T(Smax) - T_T(Smin)) / T_T(Smax),
    on the least-squares line of T_T against S over every profiled context (reading the cache is linear in S;
    the line keeps one noisy point from deciding)."""
    share = {}
    for batch in sorted({p.batch for p in profiles["target"]}):
        points = sorted((p.context, p.target_s) for p in profiles["target"] if p.batch == batch)
        if len(points) < 2:
            continue
        s, t = np.array(points, dtype=float).T
        slope, base = np.polyfit(s, t, 1)
        share[batch] = float(slope * (s[-1] - s[0]) / (base + slope * s[-1]))
    return share


def self_spec_best(predicted: list[dict]) -> dict[int, dict[int, float]]:
    """{context: {batch: best predicted self-speculation speedup over gamma, budget and selector}}."""
    best: dict[int, dict[int, float]] = {}
    for r in predicted:
        if r["strategy"] == "magicdec" and not math.isnan(r["predicted_speedup"]):
            per = best.setdefault(r["context"], {})
            per[r["batch"]] = max(per.get(r["batch"], 0.0), r["predicted_speedup"])
    return best


def _growth(found: list, batch: int, cost, shortest: int | None = None) -> tuple[float, int, int]:
    """cost(p) at the longest context over cost(p) at the shortest (or `shortest`) context, at one batch size;
    cost may return None where a point lacks it. Returns (growth, from, to)."""
    points = sorted(((p.context, cost(p)) for p in found if p.batch == batch), key=lambda t: t[0])
    points = [(c, v) for c, v in points if v is not None and (shortest is None or c >= shortest)]
    if len(points) < 2:
        return math.nan, 0, 0
    return points[-1][1] / points[0][1], points[0][0], points[-1][0]


def claim_bottleneck(profiles: dict) -> Claim:
    share = kv_share(profiles)
    text = ", ".join(f"B={b}: {v:.0%}" for b, v in share.items())
    contexts = sorted({p.context for p in profiles["target"]})
    return Claim(
        "The bottleneck shifts to the KV cache as batch size and context grow: the share of the target's step that "
        "grows with context rises with batch size",
        f"(T_T(S={contexts[-1]}) - T_T(S={contexts[0]})) / T_T(S={contexts[-1]}) on a line fitted over "
        f"{len(contexts)} contexts: {text}",
        verdict(rises(share.values())), "the profile of the target's decode step measured here",
        value=list(share.values())[-1] if share else None, where="Section 3 (analysis); KV loading vs batch")


def claim_draft_flat(profiles: dict) -> Claim:
    """At the largest batch, every budget's T_D from the shortest context above the budget to the longest."""
    found = profiles["target"]
    batch = max(p.batch for p in found)
    budgets = sorted({b for p in found for b in p.draft_s})
    draft = {b: _growth(found, batch, lambda p, b=b: p.draft_s.get(b)) for b in budgets}
    draft = {b: g for b, g in draft.items() if not math.isnan(g[0])}  # a budget profiled at one context only
    target = {b: _growth(found, batch, lambda p: p.target_s, shortest=lo) for b, (_, lo, _) in draft.items()}
    worst = max((g for g, _, _ in draft.values()), default=math.nan)
    grows = min((g for g, _, _ in target.values()), default=math.nan)
    measured = (f"at batch {batch}: T_D grows " + ", ".join(f"{g:.2f}x (budget {b}, S {lo}->{hi})" for b, (g, lo, hi)
                                                          in draft.items())
                + f"; T_T grows {grows:.2f}x or more over the same contexts")
    claim = "A sparse-KV draft step stays flat as the context grows while the target's step grows"
    if not grows > 1 + FLAT:
        return Claim(claim, measured, UNTESTABLE, f"the target's own step grows by less than {FLAT:.0%} over the "
                     "profiled contexts: nothing for the draft to stay flat against", value=worst)
    return Claim(claim, measured, verdict(worst <= 1 + FLAT), f"flat means growing by at most {FLAT:.0%}",
                 value=worst, where="Section 4 (StreamingLLM draft, fixed budget)")


def claim_critical(profiles: dict, predicted: list[dict], summary) -> Claim:
    best = self_spec_best(predicted)
    contexts = sorted(best)
    rising = {s: rises(best[s][b] for b in sorted(best[s])) for s in contexts}
    critical = next((s for i, s in enumerate(contexts) if all(rising[t] for t in contexts[i:])), None)
    crossing = crossing_lengths([r for r in predicted if r["strategy"] == "magicdec"])
    cross = ", ".join(f"B={b}: {_crossing(kind, length)}" for b, (kind, length) in crossing.items())
    top = contexts[-1] if contexts else 0
    at_top = ", ".join(f"B={b}: {v:.2f}x" for b, v in sorted(best.get(top, {}).items()))
    measured = (f"predicted best at S={top}: {at_top}; rises with batch size from S={critical if critical else '-'}; "
                f"speedup crosses 1 at S = {cross}")
    spec = summary[summary["strategy"] == "magicdec"]
    covered = sorted(L for L in set(spec["prompt_len"]) if critical is not None and L >= critical)
    ok_runs = True
    for length in covered:
        got = spec[spec["prompt_len"] == length].groupby("batch")["measured_speedup"].max().sort_index()
        ok_runs &= rises(got.values) or len(got) < 2
        measured += f"; measured at {length}: " + ", ".join(f"B={b}: {v:.2f}x" for b, v in got.items())
    claim = ("Beyond a critical sequence length, speculative decoding's speedup grows with batch size (interpolated "
             "critical length per batch size)")
    share = kv_share(profiles)
    if share and list(share.values())[-1] < MEMORY_BOUND:
        return Claim(claim, measured, UNTESTABLE, f"the premise is absent: the context's share of the target step "
                     f"at the largest batch is {list(share.values())[-1]:.0%} (< {MEMORY_BOUND:.0%}), the profile "
                     "never reaches the KV-bound regime", value=critical)
    if critical is None:
        return Claim(claim, measured, FAILS, "on this profile the best predicted speedup does not rise with batch "
                     "size at the longest contexts", value=None)
    why = ("predicted on the profile and measured on the real runs" if covered else
           f"predicted on the profile; the real runs' prompt lengths are all below S={critical}")
    return Claim(claim, measured, verdict(ok_runs), why if ok_runs else "predicted on the profile, but the real "
                 "runs' speedup does not rise with batch size there", value=critical, where="Section 3; Figure 1")


def _crossing(kind: str, length: float) -> str:
    return {"at": f"{length:.0f}", "below": f"<= {length:.0f}", "above": f"> {length:.0f}"}[kind]


def claim_tradeoff(summary) -> Claim:
    length = int(summary["prompt_len"].max())
    spec = summary[(summary["strategy"] == "magicdec") & (summary["prompt_len"] == length)]
    claim = "Speculative decoding improves throughput and latency together for long prompts"
    spec = spec.dropna(subset=["measured_speedup"])
    if spec.empty:
        return Claim(claim, "no MagicDec run at the longest prompt length", UNTESTABLE, "nothing was measured there")
    best = spec.loc[spec.groupby("batch")["measured_speedup"].idxmax()].sort_values("batch")
    ok = bool(((best["throughput"] > best["plain_throughput"]) & (best["latency_ms"] < best["plain_latency_ms"])).all())
    measured = "; ".join(f"B={r.batch} ({r.selector}): {r.throughput:.1f} vs {r.plain_throughput:.1f} tokens/s, "
                         f"{r.latency_ms:.1f} vs {r.plain_latency_ms:.1f} ms/token" for r in best.itertuples())
    return Claim(claim, f"MagicDec (best selector) against plain decoding at {length}-token prompts: {measured}",
                 verdict(ok), "decode phase of the real runs, every batch size measured; at one batch size both follow "
                 "from the time per token, across batch sizes see the trade-off figure",
                 value=float(best["measured_speedup"].min()), where="Figure (throughput vs latency)")


def claim_small_draft(profiles: dict, budget: int) -> Claim:
    found = profiles["draft"]
    batch = max(p.batch for p in found)
    dense, lo, hi = _growth(found, batch, lambda p: p.target_s)
    compressed, clo, _ = _growth(found, batch, lambda p: p.draft_s.get(budget))
    top = next((p for p in found if p.batch == batch and p.context == hi), None)
    ratio = top.target_s / top.draft_s[budget] if top is not None and budget in top.draft_s else math.nan
    measured = (f"at batch {batch}, S={hi}: dense {top.target_s * 1e3:.1f} ms against compressed (budget {budget}) "
                f"{top.draft_s.get(budget, math.nan) * 1e3:.1f} ms per draft step ({ratio:.2f}x); from S={lo} the "
                f"dense step grows {dense:.2f}x, the compressed one {compressed:.2f}x (from S={clo})"
                if top is not None else "no draft profile")
    claim = ("A small draft with a full KV cache pays its own KV loading at long context and large batch; "
             "compressing its cache removes that cost")
    if not dense > 1 + FLAT:
        return Claim(claim, measured, UNTESTABLE, f"the draft's dense step grows by less than {FLAT:.0%} over the "
                     "profiled contexts: it never pays for its KV cache here", value=ratio)
    ok = ratio > 1 + FLAT and compressed <= 1 + FLAT
    return Claim(claim, measured, verdict(ok), f"dense over compressed above {1 + FLAT:.2f}x, and the compressed step "
                 f"flat (within {FLAT:.0%})", value=ratio, where="Section 4 (small draft with a compressed cache)")


def claim_picks_best(summary) -> Claim:
    right, points = 0, []
    for (batch, length), g in summary.groupby(["batch", "prompt_len"]):
        g = g.dropna(subset=["predicted_speedup", "measured_speedup"])
        if len(g) < 2:
            continue
        picked, best = g.loc[g["predicted_speedup"].idxmax()], g.loc[g["measured_speedup"].idxmax()]
        ok = picked["measured_speedup"] >= (1 - PICK_TOLERANCE) * best["measured_speedup"]
        right += ok
        points.append(f"B={batch}, S={length}: predicted {_name(picked)}, measured best {_name(best)} "
                      f"({picked['measured_speedup']:.2f}x vs {best['measured_speedup']:.2f}x)")
    claim = ("The cost model picks the best drafting strategy (selector, self-speculation or a small draft) for a "
             "batch size and context")
    if not points:
        return Claim(claim, "no run point with two predicted configurations", UNTESTABLE,
                     "no acceptance rate was measured for two configurations at one point")
    return Claim(claim, f"{right} of {len(points)} run points: " + "; ".join(points), verdict(right == len(points)),
                 f"right when the predicted best measured within {PICK_TOLERANCE:.0%} of the measured best",
                 value=right / len(points), where="Section 4 (choosing the draft)")


def _name(row) -> str:
    return f"{row['strategy']}/{row['selector']}"


def claim_headline(summary) -> Claim:
    runs = summary.dropna(subset=["measured_speedup"])
    top = runs.loc[runs["measured_speedup"].idxmax()] if len(runs) else None
    measured = (f"best measured here: {top['measured_speedup']:.2f}x ({_name(top)}, batch {int(top['batch'])}, "
                f"{int(top['prompt_len'])}-token prompts)" if top is not None else "no speedup measured")
    return Claim("Up to 2x (LLaMA-2-7B-32K) and 2.51x (Llama-3.1-8B) speedup at batch sizes 32-256 on 8 A100 GPUs",
                 measured, UNTESTABLE, "those models, batch sizes and GPUs are not available here",
                 value=float(top["measured_speedup"]) if top is not None else None, where="Abstract")
