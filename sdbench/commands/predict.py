"""`sdbench predict magicdec`: MagicDec's cost model on this machine, as tables and a Parquet profile.

The profiling and the model are analysis/costs.py; this module checks what fits, loads the target, runs the
profile over the grid, prints the best settings and the critical lengths, and writes the profile.
"""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
from rich.progress import Progress
from rich.table import Table

from sdbench.analysis.costs import (alphas_from_results, critical_lengths, crossing_lengths, memory_plan,
                                    predictions, profile, with_alphas)
from sdbench.config import PredictMagicdecConfig
from sdbench.errors import SdbenchError
from sdbench.models.loading.names import is_random, with_weights
from sdbench.models.loading.pair import device_and_dtype, load_models
from sdbench.paths import output_dir

NATIVE_NEEDED = "profiling step costs over dense and sparse caches"  # why predict refuses the generic runner


def fitting_points(target: str, dtype, device, batches, contexts, gamma: int, console) -> list[tuple[int, int]]:
    """The points of `memory_plan` that fit, in grid order; one line names those left out."""
    found = memory_plan(target, dtype, device, batches, contexts, gamma)
    if found.line():
        console.print(f"note: {found.line()}", highlight=False, soft_wrap=True)
    if not found.fits:
        raise SdbenchError(f"{target}: no (batch, context) point fits beside the weights; try smaller --batch or "
                           "--context values")
    return [(b, s) for b in batches for s in contexts if (b, s) in found.fits]


def _crossing_text(kind: str, length: float) -> str:
    return {"at": f"{length:.0f}", "below": f"<= {length:.0f}", "above": f"> {length:.0f}"}[kind]


def print_alphas(measured: dict[tuple[str, int, int], float], console) -> None:
    table = Table(title="alpha fitted to the --from runs, per selector, budget and prompt length")
    for col in ("selector", "budget", "prompt tokens", "alpha"):
        table.add_column(col, justify="right")
    for (selector, budget, length), a in sorted(measured.items()):
        table.add_row(selector, str(budget), str(length), f"{a:.3f}")
    console.print(table)


def print_critical(rows: list[dict], contexts, console) -> None:
    """Per batch size: the first profiled context that wins, and the interpolated crossing."""
    crit = Table(title="critical sequence length: where self-speculation's best predicted speedup crosses 1")
    for col in ("batch", "first winning grid point", "interpolated"):
        crit.add_column(col, justify="right")
    first = critical_lengths(rows)
    for b, (kind, length) in crossing_lengths(rows).items():
        crit.add_row(str(b), str(first[b]) if first[b] is not None else f"> {max(contexts)}",
                     _crossing_text(kind, length))
    console.print(crit)


def run_predict(cfg: PredictMagicdecConfig, console) -> list[dict]:
    """`sdbench predict magicdec`: profile, then print the best settings and critical lengths.

    The steps are timed through the runner decoding would use (`fast`: CUDA graphs on a GPU), since on a GPU
    an eager step of a small model is launch-bound and would hide what the cache sizes cost."""
    dev, dt = device_and_dtype(cfg.device, cfg.dtype)
    cfg = replace(cfg, target=with_weights(cfg.target, cfg.dtype, dev.type == "cpu"))
    measured = alphas_from_results(list(cfg.from_results), console=console) if cfg.from_results else {}
    fits = fitting_points(cfg.target, dt, dev, cfg.batches, cfg.contexts, max(cfg.gammas), console)
    got = load_models([cfg.target], dev, dt, console, fast=cfg.fast, native={cfg.target: NATIVE_NEEDED},
                      fit=False)[cfg.target]  # fitting_points checked the fit, point by point
    loaded, runner = got.loaded, got.runner
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("profiling", total=len(fits))
        for b, s in fits:
            p = profile(runner, b, s, cfg.gammas, cfg.budgets)
            rows += with_alphas(predictions(p, cfg.alpha), measured, cfg.alpha)
            progress.advance(task)
    df = pd.DataFrame(rows).assign(weights=loaded.weights)
    if measured:
        print_alphas(measured, console)
    console.print(best_table(df, cfg.target, dev, caption=bool(measured) and is_random(cfg.target)))
    print_critical(rows, cfg.contexts, console)
    if cfg.out:
        path = output_dir(cfg.out) / f"predict-magicdec-{cfg.target.replace('/', '_')}.parquet"
        df.to_parquet(path)
        console.print(f"profile: {path}")
    return rows


def best_table(df, target: str, device, caption: bool) -> Table:
    """The best predicted (gamma, budget, selector) per batch and context; `caption`: say that alpha was
    measured with real weights while these costs come from the target's random ones."""
    best = df.loc[df.groupby(["batch", "context"])["predicted_speedup"].idxmax()] if len(df) else df
    table = Table(title=f"{target} on {device}: best predicted (gamma, budget, selector) per batch and context")
    if caption:
        table.caption = f"alpha measured with real weights; {target}'s own random weights decide only the costs"
    for col in ("batch", "context", "T_T ms", "T_D ms", "T_V ms", "gamma", "budget", "selector", "alpha",
                "predicted"):
        table.add_column(col, justify="right")
    for r in best.to_dict("records"):
        table.add_row(str(r["batch"]), str(r["context"]), f"{r['target_ms']:.1f}", f"{r['draft_ms']:.1f}",
                      f"{r['verify_ms']:.1f}", str(r["gamma"]), str(r["budget"]), r["selector"], f"{r['alpha']:.2f}",
                      f"{r['predicted_speedup']:.2f}x")
    return table
