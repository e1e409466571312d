"""The check's steps on MagicDec's costs at LLAMA_8B's shape: step costs over batch x context through the graphs
(`analysis/costs.profile`, each point checked for a fall back to the eager forward), the cost model on them
(`costs.predictions`), and one real MagicDec run in the paper's regime (`commands/run.RunHarness`) beside its
prediction at the same point."""

from __future__ import annotations

import math
import warnings

import pandas as pd

from sdbench.analysis.costs import crossing_lengths, memory_plan, predictions, profile
from sdbench.analysis.theory import alpha_from_tokens_per_step
from sdbench.commands import run as run_module  # the module: tests replace run.RunHarness
from sdbench.commands.gpucheck.plan import LLAMA_8B, Ctx, Section, free, prompts_of_tokens
from sdbench.commands.gpucheck.sections import _lossless_claim
from sdbench.commands.predict import NATIVE_NEEDED
from sdbench.commands.reproduce.common import FAILS, HOLDS, UNTESTABLE, Claim
from sdbench.config import RunConfig
from sdbench.engine.formulas import mean_accepted_length
from sdbench.models.loading import pair as pair_module  # the module: tests replace pair.load_pair
from sdbench.models.loading.memory import GIB
from sdbench.reporting import results  # the module: tests replace results.read_results

FALLBACK = "eager forward"  # what `ModelRunner.disable_graphs`' warning says
PREDICTION_TOLERANCE = 0.25  # |predicted / measured - 1| within which the cost model is said to predict a run


def on_graphs(runner, asked: bool, fn) -> tuple[object, dict]:
    """fn(), and whether `runner`'s forwards stayed on the graphs: a capture that fails or disagrees turns the
    runner's graphs off with a RuntimeWarning, caught here. Returns (fn's result, the columns that record it:
    path, graphs_asked, graphs, fell_back, fallback)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        out = fn()
    reason = "; ".join(str(w.message) for w in caught if FALLBACK in str(w.message))
    held = bool(runner.graphs)
    path = "cuda graphs" if held else ("eager (fell back)" if asked else "static shapes, no capture")
    return out, {"path": path, "graphs_asked": asked, "graphs": held, "fell_back": asked and not held,
                 "fallback": reason}


def timed_point(runner, batch: int, context: int, sizes, asked: bool) -> tuple[list[dict], object]:
    """`costs.profile` at one point, and whether its forwards stayed on the graphs (`on_graphs`), recorded on the
    point's rows. Returns (rows: the target step, each verification width, each sparse budget; the Profile)."""
    p, graphs = on_graphs(runner, asked, lambda: profile(runner, batch, context, sizes.gammas, sizes.budgets,
                                                         reps=sizes.reps))
    common = {"batch": batch, "context": context, **graphs}
    rows = [dict(common, kind="target", ms=p.target_s * 1e3)]
    rows += [dict(common, kind="verify", gamma=g, ms=t * 1e3) for g, t in p.verify_s.items()]
    rows += [dict(common, kind="draft", budget=b, ms=t * 1e3) for b, t in p.draft_s.items()]
    return rows, p


def step_costs(ctx: Ctx) -> list[Section]:
    """Step costs at LLAMA_8B's shape over the sizes' batch x context grid, smallest first, dense and sparse,
    through the graphs; the points that do not fit (or find no time left) recorded as not measured, with why.
    Then the cost model's predicted speedup at every measured point with the sizes' alpha."""
    s, dev, dt = ctx.sizes, ctx.torch_device, ctx.torch_dtype
    found = memory_plan(LLAMA_8B, dt, dev, s.batches, s.contexts, max(s.gammas))
    # static: the graphs' maths on a CPU; the fit is memory_plan's, point by point
    runner = pair_module.load_models([LLAMA_8B], dev, dt, ctx.console, native={LLAMA_8B: NATIVE_NEEDED},
                                     static=True, fit=False)[LLAMA_8B].runner
    asked = bool(runner.graphs)
    points = sorted(found.fits, key=lambda p: (p[0] * p[1], p))
    rows, predicted, late = [], [], []
    for i, (b, c) in enumerate(points, 1):  # one line a point: progress that a log file keeps too
        if ctx.left() <= 0:
            late.append((b, c))
            continue
        point, profile = timed_point(runner, b, c, s, asked)
        rows += point
        predicted += [dict(r, alpha=s.alpha) for r in predictions(profile, s.alpha)]
        free(dev)
        ctx.console.print(f"  step costs {i}/{len(points)}: batch {b}, context {c}: target {point[0]['ms']:.2f} ms, "
                          f"{point[0]['path']}", highlight=False)
    del runner
    free(dev)
    rows += [{"batch": b, "context": c, "kind": "not measured", "fallback": "",
              "why": f"does not fit: {need / GIB:.1f} GiB of KV cache and buffers beside the weights"}
             for (b, c), need in sorted(found.too_big.items())]
    rows += [{"batch": b, "context": c, "kind": "not measured", "fallback": "",
              "why": "the part's time budget was spent"} for b, c in late]
    frame = pd.DataFrame(rows)
    costs = Section("step-costs", frame, [_fallback_claim(frame, asked)],
                    notes=[n for n in (found.line(), _late_line(late)) if n])
    if asked and frame.get("fell_back", pd.Series(dtype=bool)).fillna(False).astype(bool).any():
        first = frame[frame["fell_back"].fillna(False).astype(bool)].iloc[0]
        costs.failures.append(f"step costs: CUDA graphs fell back to the eager forward from batch {first['batch']}, "
                              f"context {first['context']} onwards ({first['fallback'] or 'graphs off'})")
    return [costs, _predict_section(ctx, pd.DataFrame(predicted))]


def _late_line(late) -> str | None:
    if not late:
        return None
    return (f"not measured, the part's time budget spent: {len(late)} point(s) from batch {late[0][0]}, "
            f"context {late[0][1]}")


def _fallback_claim(frame, asked: bool, what: str = "step-cost") -> Claim:
    claim = f"no {what} point fell back from the CUDA graphs to the eager forward"
    measured = frame[frame["kind"] != "not measured"]
    points = measured[["batch", "context"]].drop_duplicates()
    if measured.empty:
        return Claim(claim, "no point measured", UNTESTABLE, "no point fitted beside the weights, or no time was left")
    if not asked:
        return Claim(claim, f"{len(points)} points on the static path, no capture", UNTESTABLE,
                     "no CUDA device: the static-shape forward (the graphs' maths) ran without capture; fell_back is "
                     "recorded per point all the same")
    fell = measured[measured["fell_back"].astype(bool)][["batch", "context"]].drop_duplicates()
    said = f"{len(points) - len(fell)} of {len(points)} points on the graphs"
    return Claim(claim, said, HOLDS if fell.empty else FAILS, "" if fell.empty else "see the fallback column")


def _predict_section(ctx: Ctx, frame) -> Section:
    """The predictions, and where MagicDec is predicted to win at the run's budget (best gamma) per batch."""
    s = ctx.sizes
    if frame.empty:
        return Section("predict", frame, notes=["no point was measured: nothing to predict"])
    at_budget = frame[frame["budget"] == s.run_budget]
    best = at_budget.groupby(["batch", "context"])["predicted_speedup"].max()
    wins = best[best > 1.0]
    crossings = crossing_lengths(at_budget.to_dict("records")) if len(at_budget) else {}
    said = "; ".join(f"batch {b}: {_crossing(kind, n)}" for b, (kind, n) in sorted(crossings.items()))
    measured = (f"predicted to win at {len(wins)} of {len(best)} points (alpha {s.alpha}, budget {s.run_budget}, "
                f"best gamma); critical context per batch: {said or '-'}")
    verdict, why = ctx.verdict_or_untestable(len(wins) > 0)
    claim = Claim(f"{LLAMA_8B}: MagicDec is predicted to beat plain decoding somewhere on the grid (large batch, "
                  "long context: the paper's regime)", measured, verdict, why)
    return Section("predict", frame, [claim])


def _crossing(kind: str, length: float) -> str:
    return {"at": f"{length:.0f} tokens", "below": f"below {length:.0f}", "above": f"none up to {length:.0f}"}[kind]


# ---- one MagicDec run in the paper's regime, and its prediction -----------------------------------------------


def magicdec_run(ctx: Ctx) -> Section:
    """`run --strategy magicdec` at LLAMA_8B's shape, one batch of prompts of the sizes' context, beside plain
    decoding of the same batch (lossless check, costs), then `predict magicdec`'s profile at the same point:
    the speedup predicted with the given alpha and with the run's own, against the measured one."""
    s = ctx.sizes
    unfit = _run_does_not_fit(ctx)
    if unfit:
        return Section("magicdec", pd.DataFrame([{"kind": "not run", "why": unfit}]),
                       [Claim(f"magicdec at {LLAMA_8B}: lossless", "not run", UNTESTABLE, unfit)], notes=[unfit])
    prompts = prompts_of_tokens(ctx.work / "long-prompts.jsonl", LLAMA_8B, s.run_batch, s.run_context)
    cfg = RunConfig(target=LLAMA_8B, strategy="magicdec", dataset=str(prompts), limit=s.run_batch,
                    batch_size=s.run_batch, max_new_tokens=s.run_tokens, gammas=(s.run_gamma,),
                    options={"budget": str(s.run_budget)}, device=ctx.device, dtype=s.dtype, out=str(ctx.work / "runs"))
    bench = run_module.RunHarness(cfg, ctx.console)
    ctx.console.print(f"magicdec at {LLAMA_8B}: batch {s.run_batch}, ~{s.run_context}-token prompts, budget "
                      f"{s.run_budget}, gamma {s.run_gamma}, {s.run_tokens} new tokens", highlight=False)
    pair = pair_module.load_pair(bench.cfg, bench.device, bench.dtype, ctx.console, bench.plan.native())
    try:
        df = results.read_results([str(run_module.RunHarness(cfg, ctx.console, pair=pair).run())])
        asked = bench.device.type == "cuda" and bool(getattr(pair.target, "fast", False))
        held = bool(getattr(pair.target, "graphs", False))
        context = int(round(df["prompt_tokens"].mean()))
        rows = _run_rows(df) + _predicted_rows(ctx, pair.target, df, context)
    finally:
        del pair
        free(bench.device)
    frame = pd.DataFrame([dict(r, batch=s.run_batch, context=context, gamma=s.run_gamma, budget=s.run_budget,
                               graphs_asked=asked, graphs=held, fell_back=asked and not held) for r in rows])
    checks = [_lossless_claim(f"magicdec at batch {s.run_batch}, {context} tokens", df),
              _prediction_claim(ctx, frame)]
    section = Section("magicdec", frame, checks, [c.why for c in checks[:1] if c.verdict == FAILS])
    if asked and not held:
        section.failures.append("magicdec run: CUDA graphs fell back to the eager forward (see the warning above)")
    return section


def _run_does_not_fit(ctx: Ctx) -> str | None:
    """Why the run's point does not fit beside the weights (`costs.memory_plan`), or None when it does."""
    s = ctx.sizes
    found = memory_plan(LLAMA_8B, ctx.torch_dtype, ctx.torch_device, (s.run_batch,), (s.run_context + s.run_tokens,),
                        s.run_gamma)
    return None if found.fits else f"magicdec run not made: {found.line()}"


def _run_rows(df) -> list[dict]:
    """Per role: the run's means, and the decode phase's speedup (plain decoding's time per token over the
    strategy's, as `reproduce magicdec` measures it: the cost model has no prefill)."""
    base_tpot = float(df[df["role"] == "baseline"]["tpot_s"].mean())
    out = []
    for role, group in df.groupby("role", sort=False):
        tpot = float(group["tpot_s"].mean())
        out.append({"kind": f"run: {role}", "rows": len(group), "prompt_tokens": float(group["prompt_tokens"].mean()),
                    "tokens_per_s": float(group["tokens_per_s"].mean()), "tpot_ms": tpot * 1e3,
                    "ttft_s": float(group["ttft_s"].mean()),
                    "mean_accepted_len": float(mean_accepted_length(group["new_tokens"].sum(), group["steps"].sum(),
                                                                    len(group))),
                    "speedup": base_tpot / tpot if tpot > 0 else math.nan})
    return out


def _predicted_rows(ctx: Ctx, runner, df, context: int) -> list[dict]:
    """The cost model at the run's point: steps profiled through the run's own runner, alpha as given and as
    fitted to the run's accepted length."""
    s = ctx.sizes
    with ctx.console.status("profiling the run's point for the cost model"):
        p = profile(runner, s.run_batch, context, (s.run_gamma,), (s.run_budget,), reps=s.reps)
    strategy = df[df["role"] == "strategy"]
    run_alpha = alpha_from_tokens_per_step(float(mean_accepted_length(strategy["new_tokens"].sum(),
                                                                      strategy["steps"].sum(), len(strategy))),
                                           s.run_gamma)
    out = []
    for label, alpha in (("predicted: alpha given", s.alpha), ("predicted: alpha of the run", run_alpha)):
        for r in predictions(p, alpha):
            out.append({"kind": label, "alpha": alpha, "speedup": r["predicted_speedup"], "target_ms": r["target_ms"],
                        "draft_ms": r["draft_ms"], "verify_ms": r["verify_ms"]})
    return out


def _prediction_claim(ctx: Ctx, frame) -> Claim:
    measured = frame[frame["kind"] == "run: strategy"]["speedup"].iloc[0]
    own = frame[frame["kind"] == "predicted: alpha of the run"]["speedup"].iloc[0]
    given = frame[frame["kind"] == "predicted: alpha given"]["speedup"].iloc[0]
    said = (f"measured {measured:.2f}x (decode phase); predicted {own:.2f}x with the run's alpha, {given:.2f}x with "
            f"alpha {ctx.sizes.alpha}")
    verdict, why = ctx.verdict_or_untestable(abs(own / measured - 1) <= PREDICTION_TOLERANCE)
    return Claim(f"the cost model predicts the run's speedup within {PREDICTION_TOLERANCE:.0%} (with the run's alpha)",
                 said, verdict, why)
