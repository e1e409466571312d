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
from dataclasses import dataclass


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


def shrunk_alpha(accepted: float, rejections: float, prior: float, weight: float) -> float:
    """fit_alpha with `weight` pseudo-trials at rate `prior` added: the posterior mean under a Beta prior.

    Every drafted token that reached verification is a Bernoulli trial (accepted, or the one rejection of its
    step), so a prior worth `weight` trials keeps a handful of observations from swinging the estimate to 0 or 1.
    """
    total = accepted + rejections + weight
    return (accepted + weight * prior) / total if total > 0 else prior


def tokens_per_second(alpha: float, gamma: float, draft_s: float, verify_s: float, hit: float = 1.0) -> float:
    """Expected committed tokens per second of one round that asks for gamma drafted tokens.

    A draft is found with probability `hit` (always for a model; prompt lookup can come up empty, and the
    round is then a plain step), so the round commits 1 + hit * (Omega(gamma, alpha) - 1) tokens in
    draft_s + verify_s seconds.
    """
    seconds = draft_s + verify_s
    if not seconds > 0 or math.isnan(alpha):
        return math.nan
    return (1.0 + hit * (expected_tokens_per_step(alpha, gamma) - 1.0)) / seconds


def alpha_from_tokens_per_step(tokens_per_step: float, gamma: int) -> float:
    """The acceptance rate whose Omega(gamma, alpha) equals a measured mean accepted length (bisection;
    Omega is increasing in alpha)."""
    if gamma <= 0 or math.isnan(tokens_per_step):
        return math.nan
    target = min(max(tokens_per_step, 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, gamma) < target else (lo, mid)
    return (lo + hi) / 2


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


# ---- polybasic chains ------------------------------------------------------------------------------------
#
# A chain of levels 0 (the target) .. k (the bottom drafter). The bottom drafts a block (gamma forwards of a
# model, or one n-gram lookup); every level i in 0 .. k-1 verifies blocks from level i+1, one forward per
# round, committing L_i tokens per round on average (accepted drafts plus its own correction or bonus token,
# so L_i >= 1). A middle level i (1 .. k-1) hands up a block of N_i tokens once it holds at least mu_i, so it
# runs N_i / L_i rounds per block. With T_i the time of one forward of level i, one block of level i costs
#
#     C_k = b_k T_k                                     (b_k: bottom forwards per block: gamma, or 1)
#     C_i = (N_i / L_i) (T_i + C_{i+1})                 (1 <= i < k: its rounds, each a forward and a block)
#
# and each target round costs T_0 + C_1 and commits L_0 tokens, so the time per committed token is
#
#     tau = (T_0 + C_1) / L_0 = sum_i f_i T_i,   f_0 = 1 / L_0,  f_i = f_{i-1} N_i / L_i,  f_k = f_{k-1} b_k
#
# with f_i the forwards of level i per committed token. Dropping the factors N_i / L_{i-1} (as if every
# token a level produced were committed once by the level above: no rejected work, no bonus tokens) gives
# the simpler form of the polybasic paper's time for N tokens divided by N:
#     sum_{i<k} T_i / L_i + b_k T_k / L_{k-1}.
#
# Inserting a model c between levels j and j+1. Because each verification is lossless, level j's blocks
# follow level j's own distribution whatever is below it, so the acceptance above j does not change: only
# the cost of a level-j token does. Old: a level-j round costs T_j + C_{j+1} and commits L_j tokens. New: the
# round costs T_j + C_c with C_c = (N_c / L_c)(T_c + C_{j+1}) (c's rounds over the old lower chain's blocks,
# whose cost per block is unchanged) and commits L'_j tokens. The insertion pays iff
#
#     (T_j + (N_c / L_c)(T_c + C_{j+1})) / L'_j  <  (T_j + C_{j+1}) / L_j,
#
# i.e. iff level j's gain in accepted length L'_j / L_j exceeds the growth of its round's cost. For j = 0
# both sides are the chain's time per token; for j >= 1 this holds as long as level j's block size N_j stays
# the same (its overshoot past mu_j can change a little).


@dataclass(frozen=True)
class ChainCosts:
    """What the chain formula needs, levels top (0, the target) down to the bottom k."""

    costs: tuple[float, ...]  # T_0 .. T_k: seconds per forward (the bottom's: per lookup for n-gram)
    accepted: tuple[float, ...]  # L_0 .. L_{k-1}: tokens committed per verification round, bonus included
    blocks: tuple[float, ...]  # N_1 .. N_{k-1}: tokens per block handed up by each middle level
    bottom_forwards: float  # b_k: forwards of the bottom per block (gamma for a model, 1 for a lookup)

    def __post_init__(self):
        k = len(self.costs) - 1
        if k < 1 or len(self.accepted) != k or len(self.blocks) != k - 1:
            raise ValueError("a chain of k+1 levels needs k+1 costs, k accepted lengths and k-1 block sizes")

    def block_cost(self, i: int) -> float:
        """C_i: seconds for level i (1..k) to produce one block for the level above."""
        k = len(self.costs) - 1
        if i == k:
            return self.bottom_forwards * self.costs[k]
        return self.blocks[i - 1] / self.accepted[i] * (self.costs[i] + self.block_cost(i + 1))

    def time_per_token(self) -> float:
        """tau = (T_0 + C_1) / L_0: seconds per committed token."""
        return (self.costs[0] + self.block_cost(1)) / self.accepted[0]

    def forwards_per_token(self) -> list[float]:
        """f_0 .. f_k: forwards of each level per committed token (sum of f_i T_i = time_per_token)."""
        f = [1.0 / self.accepted[0]]
        for i in range(1, len(self.costs) - 1):
            f.append(f[-1] * self.blocks[i - 1] / self.accepted[i])
        return f + [f[-1] * self.bottom_forwards]

    def seed_time_per_token(self) -> float:
        """The simpler form without the N_i / L_{i-1} factors: sum_{i<k} T_i / L_i + b_k T_k / L_{k-1}."""
        k = len(self.costs) - 1
        upper = sum(t / a for t, a in zip(self.costs[:k], self.accepted))
        return upper + self.bottom_forwards * self.costs[k] / self.accepted[k - 1]


def insertion_times(level_cost: float, below_cost: float, accepted: float, cand_cost: float,
                    cand_accepted: float, cand_block: float, accepted_new: float) -> tuple[float, float]:
    """(old, new) seconds per token of level j when model c is inserted just below it; it pays iff new < old.

    level_cost T_j; below_cost C_{j+1} (the old lower chain's block); accepted L_j (old); cand_cost T_c;
    cand_accepted L_c (c's rounds over the old lower chain's blocks); cand_block N_c; accepted_new L'_j.
    """
    old = (level_cost + below_cost) / accepted
    new = (level_cost + cand_block / cand_accepted * (cand_cost + below_cost)) / accepted_new
    return old, new


def alpha_from_tokens_per_step(tokens_per_step: float, gamma: float) -> float:
    """The acceptance rate alpha whose Omega(gamma, alpha) equals a measured mean tokens per step (bisection;
    Omega grows with alpha). NaN when the figures allow no alpha (gamma <= 0, or outside [1, gamma + 1])."""
    if not gamma > 0 or not 1.0 <= tokens_per_step <= gamma + 1.0:
        return math.nan
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if expected_tokens_per_step(mid, gamma) < tokens_per_step else (low, mid)
    return (low + high) / 2


# ---- distributed speculative inference (DSI) -----------------------------------------------------------
# Latencies below are in units of one target forward; c is one draft forward in the same unit and k the
# lookahead (drafted tokens per verification). Plain decoding costs 1 per token.


def si_latency_per_token(alpha: float, c: float, k: int) -> float:
    """Sequential speculative inference: each iteration drafts k tokens (k·c) then verifies (1), and commits
    Omega(k, alpha) tokens on average."""
    return (k * c + 1.0) / expected_tokens_per_step(alpha, k)


def dsi_workers_needed(c: float, k: int) -> int:
    """Target workers DSI needs so that no verification waits for one: a verification of k drafts starts every
    k·c and lasts 1, so ceil(1 / (k·c)) run at once (the DSI paper's bound)."""
    if not c > 0 or k < 1:
        raise ValueError("need c > 0 and k >= 1")
    return max(1, math.ceil(1.0 / (k * c) - 1e-9))


def dsi_latency_per_token(alpha: float, c: float, k: int, *, bonus: bool = True, tol: float = 1e-12) -> float:
    """Expected DSI latency per token with enough target workers (renewal argument over rejections).

    A segment runs from one rejection to the next. With J drafts accepted before the rejected one
    (P(J = j) = alpha^j (1 - alpha)) it commits J + 1 tokens. Verifications of each window of k drafts run
    concurrently while drafting goes on, so the segment ends when the window that decides position J returns:
    after w·k·c of drafting plus one target forward. A verification of the bare committed prefix, always
    running beside the drafts, bounds the segment by plain decoding, J + 1 forwards. Hence
        cost(J) = min(w(J)·k·c + 1, J + 1),   latency per token = E[cost(J)] / E[J + 1].
    w(J) = ceil(J / k) when a fully accepted window's bonus token already decides the next window's first
    draft (`bonus`, as sdbench's orchestrator does); ceil((J + 1) / k) counts as the DSI paper's simulator.
    """
    if not 0.0 <= alpha <= 1.0 or c < 0 or k < 1:
        raise ValueError("need 0 <= alpha <= 1, c >= 0 and k >= 1")
    if alpha >= 1.0:
        return min(c, 1.0)  # nothing is ever rejected: the drafter or the plain chain sets the pace
    import numpy as np

    n = 1 if alpha == 0.0 else min(int(math.log(tol) / math.log(alpha)) + 2, 10_000_000)
    j = np.arange(n, dtype=np.float64)
    p = (1.0 - alpha) * np.power(alpha, j)
    windows = np.ceil(j / k) if bonus else np.ceil((j + 1) / k)
    cost = np.minimum(windows * k * c + 1.0, j + 1.0)
    return float((p * cost).sum() / p.sum() * (1.0 - alpha))
