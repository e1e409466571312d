"""Expected-speedup formulas, each in one place.

Speculative decoding with lookahead gamma, where each drafted token is accepted independently with
probability alpha (the i.i.d. model of Leviathan et al.), commits per target verification

    Omega(gamma, alpha) = (1 - alpha^(gamma+1)) / (1 - alpha)

tokens on average (bonus token included). With a draft forward costing c target forwards and a verification
of gamma + 1 tokens costing v target forwards, the expected speedup over plain decoding is

    Omega(gamma, alpha) / (gamma * c + v).
"""

from __future__ import annotations

import math


def expected_tokens_per_step(alpha: float, gamma: float) -> float:
    """Omega(gamma, alpha): mean tokens committed per verification (1.0 when gamma = 0)."""
    if gamma <= 0:
        return 1.0
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def fit_alpha(accepted: int, rejections: int) -> float:
    """Maximum-likelihood acceptance rate for truncated-geometric accepted lengths.

    A step that drafts n tokens and accepts k < n of them contributes alpha^k (1 - alpha); one that accepts
    all n contributes alpha^n. The likelihood peaks at accepted / (accepted + rejections).
    """
    total = accepted + rejections
    return accepted / total if total else math.nan


def predicted_speedup(alpha: float, gamma: float, draft_cost: float, verify_cost: float) -> float:
    """Omega(gamma, alpha) / (gamma * c + v); c and v are in units of one plain target forward."""
    denominator = gamma * draft_cost + verify_cost
    if not denominator > 0 or math.isnan(alpha):
        return math.nan
    return expected_tokens_per_step(alpha, gamma) / denominator


def speedup_table(alpha: float, gammas: tuple[int, ...], draft_cost: float, verify_cost: float):
    """A rich table of Omega and the predicted speedup for each gamma; the best gamma marked."""
    from rich.table import Table

    from sdbench.errors import SdbenchError

    if not 0.0 <= alpha <= 1.0 or draft_cost < 0 or verify_cost <= 0:
        raise SdbenchError("need 0 <= --alpha <= 1, --draft-cost >= 0 and --verify-cost > 0")
    rows = [(g, expected_tokens_per_step(alpha, g), predicted_speedup(alpha, g, draft_cost, verify_cost))
            for g in gammas]
    best = max(rows, key=lambda r: r[2])[0]
    table = Table(title=f"alpha={alpha}, draft cost={draft_cost}, verify cost={verify_cost}")
    for col in ("gamma", "tokens/step", "speedup"):
        table.add_column(col, justify="right")
    for g, omega, s in rows:
        table.add_row(f"{g}{' *' if g == best else ''}", f"{omega:.2f}", f"{s:.2f}x")
    return table
