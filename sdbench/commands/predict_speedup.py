"""`sdbench predict speedup`: expected tokens per step and speedup of draft-model SD under the i.i.d.
acceptance model (engine/iid_model.py), from given costs or costs measured at the models' shapes."""

from __future__ import annotations

from rich.table import Table

from sdbench.engine.iid_model import expected_tokens_per_step, predicted_speedup
from sdbench.errors import SdbenchError


def run_speedup(alpha: float, gammas: tuple[int, ...], draft_cost: float, verify_cost: float, console, *,
                target: str | None, draft: str | None, context: int, device: str, dtype: str,
                block: bool = False) -> None:
    """The table for the given costs, or, with `target`, for the costs measured at its shape and the draft's
    (the draft defaulting to the target). block: the drafter drafts a whole block in one forward (its cost c is
    that forward's, paid once per round)."""
    if block and target is not None:
        raise SdbenchError("--block with --target: the costs measured are a draft model's, one forward per token; "
                           "give a block head's --draft-cost (a `run --strategy dflash` row's draft time per round)")
    if target is not None:
        from sdbench.analysis.costs import measured_costs  # torch and the model loaders: only --target needs them

        costs = measured_costs(target, draft or target, gammas, context, device, dtype, console)
        draft_cost, verify_cost = costs.c, costs.verify
        console.print(f"costs measured at {context} tokens of context: draft cost c = {draft_cost:.3f} "
                      f"({draft or target} / {target})", highlight=False)
    console.print(speedup_table(alpha, gammas, draft_cost, verify_cost, block))


def speedup_table(alpha: float, gammas: tuple[int, ...], draft_cost: float, verify_cost: float | dict,
                  block: bool = False):
    """A rich table of Omega and the predicted speedup for each gamma; the best gamma marked. verify_cost: one
    value, or one per gamma (measured: a wider verification costs more). block: one draft forward per round."""
    if isinstance(verify_cost, dict):
        return _speedup_rows_table(alpha, gammas, draft_cost, verify_cost)
    if not 0.0 <= alpha <= 1.0 or draft_cost < 0 or verify_cost <= 0:
        raise SdbenchError("need 0 <= --alpha <= 1, --draft-cost >= 0 and --verify-cost > 0")
    rows = [(g, expected_tokens_per_step(alpha, g), predicted_speedup(alpha, g, draft_cost, verify_cost, block))
            for g in gammas]
    best = max(rows, key=lambda r: r[2])[0]
    drafter = ", a block drafter (one draft forward per round)" if block else ""
    table = Table(title=f"alpha={alpha}, draft cost={draft_cost}, verify cost={verify_cost}{drafter}")
    for col in ("gamma", "tokens/step", "speedup"):
        table.add_column(col, justify="right")
    for g, omega, s in rows:
        table.add_row(f"{g}{' *' if g == best else ''}", f"{omega:.2f}", f"{s:.2f}x")
    return table


def _speedup_rows_table(alpha: float, gammas: tuple[int, ...], draft_cost: float, verify: dict):
    rows = [(g, expected_tokens_per_step(alpha, g), verify[g], predicted_speedup(alpha, g, draft_cost, verify[g]))
            for g in gammas]
    best = max(rows, key=lambda r: r[3])[0]
    table = Table(title=f"alpha={alpha}, draft cost={draft_cost:.3f}, verify cost per gamma as measured")
    for col in ("gamma", "tokens/step", "verify cost", "speedup"):
        table.add_column(col, justify="right")
    for g, omega, v, s in rows:
        table.add_row(f"{g}{' *' if g == best else ''}", f"{omega:.2f}", f"{v:.2f}", f"{s:.2f}x")
    return table
