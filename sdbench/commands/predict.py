"""MagicDec's cost model on this machine: profile step times, predict speedup, find the critical length.

A short profiling pass times, for each batch size B and context length S, one target decode step T_T(B, S),
one draft step through a sparse cache T_D(B, S, budget) and one verification of gamma + 1 tokens
T_V(B, S, gamma). The caches are filled with random values: the time of a forward does not depend on
them, and no prefill of S tokens is needed. The predicted speedup is
    Omega(gamma, alpha) / (gamma * T_D / T_T + T_V / T_T)
and the critical sequence length for a batch size is the shortest profiled S at which the best
(gamma, budget) is predicted to beat plain decoding.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from sdbench.kv.sparse import filled_for_profile
from sdbench.engine.metrics import now
from sdbench.engine.state import needed_capacity
from sdbench.theory import predicted_speedup


@dataclass(frozen=True)
class Profile:
    batch: int
    context: int
    target_s: float  # T_T: one decode step, full cache
    verify_s: dict  # gamma -> T_V: one forward over gamma + 1 tokens, full cache
    draft_s: dict  # budget -> T_D: one decode step through a sparse cache of that budget


def median_time(fn, device, reps: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = now(device)
        fn()
        times.append(now(device) - t0)
    return statistics.median(times)


def profile(runner, batch: int, context: int, gammas, budgets) -> Profile:
    """Time the three kinds of step at one (batch, context)."""
    dev = runner.device
    capacity = needed_capacity(context, 0, max(gammas))
    dense = runner.new_cache(batch, capacity)
    for t in dense.k + dense.v:
        t.normal_(0, 0.1)
    start = [context] * batch
    one = torch.zeros(batch, 1, dtype=torch.long)
    target_s = median_time(lambda: runner.forward(dense, one, start), dev)
    verify_s = {g: median_time(lambda g=g: runner.forward(dense, torch.zeros(batch, g + 1, dtype=torch.long),
                                                           start), dev) for g in gammas}
    draft_s = {}
    for budget in budgets:
        if budget >= context:
            continue  # a budget at least the context is the full cache: no saving to model
        sink = min(16, budget // 2)
        sparse = filled_for_profile(runner, batch, context, sink, budget - sink, max(gammas))
        draft_s[budget] = median_time(lambda s=sparse: runner.forward(s, one, start), dev)
    return Profile(batch, context, target_s, verify_s, draft_s)


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


def alphas_from_results(paths: list[str]) -> dict[int, float]:
    """Acceptance rate per draft budget, fitted (Omega inverted) to earlier magicdec runs' accepted lengths."""
    import json

    from sdbench.reporting.results import read_results
    from sdbench.engine.metrics import mean_accepted_length
    from sdbench.theory import alpha_from_tokens_per_step

    df = read_results(paths)
    rows = df[(df["role"] != "baseline") & (df["strategy"] == "magicdec")]
    found: dict[int, float] = {}
    for params, group in rows.groupby("params"):
        p = json.loads(params)
        steps = group["steps"].sum()
        if steps and p.get("gamma"):
            mean_len = mean_accepted_length(group["new_tokens"].sum(), steps, len(group))
            found[int(p["budget"])] = alpha_from_tokens_per_step(float(mean_len), int(p["gamma"]))
    return found


def run_predict(target: str, batches, contexts, gammas, budgets, alpha: float, from_results, device: str,
                dtype: str, out: str | None, console, fast: bool = True) -> list[dict]:
    """`sdbench predict magicdec`: profile, then print the best settings and critical lengths.

    The steps are timed through the runner decoding would use (`fast`: CUDA graphs on a GPU), since on a GPU
    an eager step of a small model is launch-bound and would hide what the cache sizes cost."""
    import pandas as pd
    from rich.progress import Progress
    from rich.table import Table

    from sdbench.models.pair import resolve_device, resolve_dtype
    from sdbench.models.loader import load_model
    from sdbench.models.runner import ModelRunner

    dev = resolve_device(device)
    measured = alphas_from_results(from_results) if from_results else {}
    with console.status(f"loading {target}"):
        runner = ModelRunner(load_model(target, dev, resolve_dtype(dtype, dev)).model, target, fast=fast)
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("profiling", total=len(batches) * len(contexts))
        for b in batches:
            for s in contexts:
                p = profile(runner, b, s, gammas, budgets)
                for r in predictions(p, alpha):
                    a = measured.get(r["budget"], alpha)
                    r["alpha"] = a
                    r["predicted_speedup"] = predicted_speedup(a, r["gamma"], r["draft_ms"] / r["target_ms"],
                                                               r["verify_ms"] / r["target_ms"])
                    rows.append(r)
                progress.advance(task)
    df = pd.DataFrame(rows)
    best = df.loc[df.groupby(["batch", "context"])["predicted_speedup"].idxmax()] if len(df) else df
    table = Table(title=f"{target} on {dev}: best predicted (gamma, budget) per batch and context")
    for col in ("batch", "context", "T_T ms", "T_D ms", "T_V ms", "gamma", "budget", "alpha", "predicted"):
        table.add_column(col, justify="right")
    for r in best.to_dict("records"):
        table.add_row(str(r["batch"]), str(r["context"]), f"{r['target_ms']:.1f}", f"{r['draft_ms']:.1f}",
                      f"{r['verify_ms']:.1f}", str(r["gamma"]), str(r["budget"]), f"{r['alpha']:.2f}",
                      f"{r['predicted_speedup']:.2f}x")
    console.print(table)
    crit = Table(title="critical sequence length: shortest profiled context where self-speculation is predicted to win")
    crit.add_column("batch", justify="right")
    crit.add_column("critical context", justify="right")
    for b, s in critical_lengths(rows).items():
        crit.add_row(str(b), str(s) if s is not None else f"> {max(contexts)}")
    console.print(crit)
    if out:
        from sdbench.paths import output_dir

        path = output_dir(out) / f"predict-magicdec-{target.replace('/', '_')}.parquet"
        df.to_parquet(path)
        console.print(f"profile: {path}")
    return rows
