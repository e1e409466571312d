"""`sdbench predict speedup`: expected tokens per step and speedup of draft-model SD under the i.i.d.
acceptance model (engine/iid_model.py), from given costs or costs measured at the models' shapes."""

from __future__ import annotations

from rich.table import Table

from sdbench.engine.iid_model import expected_tokens_per_step, predicted_speedup
from sdbench.errors import SdbenchError


def run_speedup(alpha: float, gammas: tuple[int, ...], draft_cost: float, verify_cost: float, console, *,
                target: str | None, draft: str | None, context: int, device: str, dtype: str,
                block: bool = False, overhead: float = 0.0) -> None:
    """The table for the given costs, or, with `target`, for the costs measured at its shape and the draft's
    (the draft defaulting to the target; the overhead then the measured verdict's, `analysis/costs.py`). block: the
    drafter drafts a whole block in one forward (its cost c is that forward's, paid once per round); overhead: a
    round's cost beyond its forwards, in target forwards."""
    if block and target is not None:
        raise SdbenchError("--block with --target: the costs measured are a draft model's, one forward per token; "
                           "give a block head's --draft-cost (a `run --strategy dflash` row's draft time per round)")
    if target is not None:
        from sdbench.analysis.costs import measured_costs  # torch and the model loaders: only --target needs them

        costs = measured_costs(target, draft or target, gammas, context, device, dtype, console)
        console.print(f"costs measured at {context} tokens of context: draft cost c = {costs.c:.3f} "
                      f"({draft or target} / {target})", highlight=False)
        console.print(_speedup_rows_table(alpha, gammas, costs.c, costs.verify, costs.host))
        return
    console.print(speedup_table(alpha, gammas, draft_cost, verify_cost, block, overhead))


def speedup_table(alpha: float, gammas: tuple[int, ...], draft_cost: float, verify_cost: float,
                  block: bool = False, overhead: float = 0.0):
    """A rich table of Omega and the predicted speedup for each gamma, a round costing gamma c + v + overhead
    (block: c + v + overhead, one draft forward per round); the best gamma marked."""
    if not 0.0 <= alpha <= 1.0 or draft_cost < 0 or verify_cost <= 0 or overhead < 0:
        raise SdbenchError("need 0 <= --alpha <= 1, --draft-cost >= 0, --verify-cost > 0 and --overhead >= 0")
    rows = [(g, expected_tokens_per_step(alpha, g),
             predicted_speedup(alpha, g, draft_cost, verify_cost + overhead, block)) for g in gammas]
    best = max(rows, key=lambda r: r[2])[0]
    drafter = ", a block drafter (one draft forward per round)" if block else ""
    extra = f", overhead={overhead}" if overhead else ""
    table = Table(title=f"alpha={alpha}, draft cost={draft_cost}, verify cost={verify_cost}{extra}{drafter}")
    for col in ("gamma", "tokens/step", "speedup"):
        table.add_column(col, justify="right")
    for g, omega, s in rows:
        table.add_row(f"{g}{' *' if g == best else ''}", f"{omega:.2f}", f"{s:.2f}x")
    return table


def _speedup_rows_table(alpha: float, gammas: tuple[int, ...], draft_cost: float, verify: dict, host: dict):
    """The table for measured costs: per gamma its verification's cost and its verdict's beyond a plain step's."""
    rows = [(g, expected_tokens_per_step(alpha, g), verify[g], host[g],
             predicted_speedup(alpha, g, draft_cost, verify[g] + host[g])) for g in gammas]
    best = max(rows, key=lambda r: r[4])[0]
    table = Table(title=f"alpha={alpha}, draft cost={draft_cost:.3f}, verify cost and overhead per gamma as measured")
    for col in ("gamma", "tokens/step", "verify cost", "overhead", "speedup"):
        table.add_column(col, justify="right")
    for g, omega, v, h, s in rows:
        table.add_row(f"{g}{' *' if g == best else ''}", f"{omega:.2f}", f"{v:.2f}", f"{h:.3f}", f"{s:.2f}x")
    return table
