"""Expected-speedup formulas beyond the i.i.d. basics, each in one place.

The i.i.d. acceptance model itself (Omega(gamma, alpha), the fitted alpha, the predicted speedup) is
sdbench/engine/iid_model.py, since decoding uses it; here are its inverse and its variance, a polybasic chain's
time per token and insertion conditions, and the expected latency of SI and DSI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sdbench.engine.iid_model import expected_tokens_per_step


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
# round costs T'_j + C_c with C_c = (N_c / L_c)(T_c + C_{j+1}) (c's rounds over the old lower chain's blocks,
# whose cost per block is unchanged) and commits L'_j tokens. T'_j is level j's forward over c's blocks: on
# a CPU a forward's time grows with the tokens it verifies, so it is not T_j. The insertion pays iff
#
#     (T'_j + (N_c / L_c)(T_c + C_{j+1})) / L'_j  <  (T_j + C_{j+1}) / L_j,
#
# i.e. iff level j's gain in accepted length L'_j / L_j exceeds the growth of its round's cost. For j = 0
# both sides are the two chains' times per token; for j >= 1 this holds as long as level j's block size N_j
# stays the same (its overshoot past mu_j can change a little).
#
# Inserting c under the bottom drafter b (level k) makes b a verifier of c's blocks: b's tokens still follow
# b's own distribution, but its block is now N_b >= mu_b tokens rather than gamma, so the acceptance of the
# level j = k - 1 above it changes too. The comparison moves up one level: a level-j token costs
# (T_j + b_k T_k) / L_j before and (T'_j + (N_b / L'_b)(T'_b + b_c T_c)) / L'_j after, which for k = 1 are the
# two chains' times per token.


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

    def level_token_cost(self, i: int) -> float:
        """(T_i + C_{i+1}) / L_i: seconds per token level i (0..k-1) commits; for i = 0, time_per_token."""
        return (self.costs[i] + self.block_cost(i + 1)) / self.accepted[i]

    def time_per_token(self) -> float:
        """tau = (T_0 + C_1) / L_0: seconds per committed token."""
        return self.level_token_cost(0)

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


def insertion_times(level_cost: float, below_cost: float, accepted: float, level_cost_new: float,
                    cand_cost: float, cand_accepted: float, cand_block: float,
                    accepted_new: float) -> tuple[float, float]:
    """(old, new) seconds per token of level j when model c is inserted just below it; it pays iff new < old.

    Old chain: level_cost T_j, below_cost C_{j+1} (one block of the lower chain), accepted L_j. New chain:
    level_cost_new T'_j (level j's forward over c's blocks), cand_cost T_c, cand_accepted L_c (c's rounds over
    the lower chain's blocks), cand_block N_c, accepted_new L'_j.
    """
    old = (level_cost + below_cost) / accepted
    new = (level_cost_new + cand_block / cand_accepted * (cand_cost + below_cost)) / accepted_new
    return old, new


def paper_insertion_times(level_cost: float, accepted: float, accepted_new: float, cand_cost: float,
                          cand_accepted: float, bottom_cost: float | None = None) -> tuple[float, float]:
    """(old, new) of the polybasic paper's insertion condition (its Theorem 3.2): inserting model c just below
    level j pays iff new < old.

    It compares the terms of the paper's time per token, sum_{i<k} T_i / L_i + b_k T_k / L_{k-1}, that the
    insertion changes: level j's T_j / L_j becomes T_j / L'_j + T_c / L_c, and when c lands directly above the
    bottom drafter the bottom's term b_k T_k (bottom_cost) moves from level j's accepted length to c's:

        T_j / L'_j + T_c / L_c (+ b_k T_k / L_c)  <  T_j / L_j (+ b_k T_k / L_j).

    A model's forward time is its own constant there (T_j on both sides), and each level's tokens are taken as
    committed once by the level above (no N_i / L_i rounds per block), which is where `insertion_times` is
    more exact.
    """
    bottom = bottom_cost or 0.0
    old = (level_cost + bottom) / accepted
    new = level_cost / accepted_new + (cand_cost + bottom) / cand_accepted
    return old, new


def paper_bottom_insertion_times(level_cost: float, accepted: float, accepted_new: float, bottom_block: float,
                                 bottom_cost_new: float, bottom_accepted_new: float,
                                 cand_block: float) -> tuple[float, float]:
    """(old, new) of the paper's insertion condition when model c goes under the bottom drafter b, which then
    verifies c's blocks instead of drafting; it pays iff new < old. Level j is the one above b.

    The terms of the simple form that change: level j's T_j / L_j plus the bottom's b_k T_k / L_j
    (bottom_block: the drafter's forwards per block times its forward) become T_j / L'_j, b's own verifying
    term T'_b / L'_b (bottom_cost_new: b's forward as a verifier, which the new chain measures) and c's
    b_c T_c / L'_b (cand_block):

        T_j / L'_j + (T'_b + b_c T_c) / L'_b  <  (T_j + b_k T_k) / L_j.

    T_j is level j's own constant on both sides, as in `paper_insertion_times`.
    """
    old = (level_cost + bottom_block) / accepted
    new = level_cost / accepted_new + (bottom_cost_new + cand_block) / bottom_accepted_new
    return old, new


def accepted_length_variance(alpha: float, gamma: int) -> float:
    """Variance of the tokens one verification commits (bonus included) when each of gamma drafts is accepted
    independently with probability alpha: L = 1 + min(J, gamma) with P(J >= j) = alpha^j. The reference for a
    measured variance: above it, acceptances come in runs (the text has easy and hard stretches)."""
    if gamma <= 0 or math.isnan(alpha):
        return 0.0 if gamma <= 0 else math.nan
    probs = [(1.0 - alpha) * alpha**j for j in range(gamma)] + [alpha**gamma]  # P(min(J, gamma) = j)
    mean = sum(p * (j + 1) for j, p in enumerate(probs))
    return max(sum(p * (j + 1) ** 2 for j, p in enumerate(probs)) - mean * mean, 0.0)


# ---- SI and DSI: expected latency per token (the DSI simulator checks the event simulation against these) ----


def si_latency_per_token(a: float, c: float, k: int) -> float:
    """Speculative inference, in target forwards per token: k drafts (c each) and one verification per
    iteration, which commits Omega(k, a) tokens."""
    return (k * c + 1.0) / expected_tokens_per_step(a, k)


def dsi_workers_needed(c: float, k: int) -> int:
    """Target workers DSI needs so that drafting never waits: a verification (1) must finish before the
    drafter has filled that many more chunks of k drafts (k * c each): ceil(1 / (k c))."""
    return max(1, math.ceil(1.0 / (k * c) - 1e-9))


def dsi_window_starts(c: float, k: int, count: int, workers: int | None = None) -> list[float]:
    """When the verifications of one DSI cycle start, in target forwards from the cycle's start.

    Index 0 is the verification of the bare committed prefix, sent at once; index i >= 1 is the i-th window of
    k drafts. A window goes out once it is drafted and a worker is free:

        s_0 = 0,   s_i = max(s_{i-1} + k c,  s_{i-N} + 1)   (the second term only for i >= N)

    The drafter pauses while a drafted window waits for a worker, so window i is drafted k c after window i - 1
    went out; with N workers at most N verifications overlap, so verification i starts only once verification
    i - N (1 target forward) has finished. With N >= ceil(1 / (k c)) workers (or workers=None) the second term
    never binds and s_i = i k c, the paper's count. Returns s_0 .. s_count.
    """
    starts = [0.0]
    for i in range(1, count + 1):
        start = starts[i - 1] + k * c
        if workers is not None and i >= workers:
            start = max(start, starts[i - workers] + 1.0)
        starts.append(start)
    return starts


RENEWAL_TERMS = 20_000  # explicit terms of the DSI renewal sum; a linear tail covers the rest (a close to 1)


def renewal_terms(a: float) -> int:
    """Terms of the renewal sum that carry weight (a^J >= 1e-16), at most RENEWAL_TERMS."""
    if a <= 0.0:
        return 0
    return min(RENEWAL_TERMS, int(math.log(1e-16) / math.log(a)) + 1)


def dsi_latency_per_token(a: float, c: float, k: int, bonus: bool = True, workers: int | None = None) -> float:
    """Distributed speculative inference, in target forwards per token (renewal form).

    A cycle ends at the first rejected draft: J drafts are accepted with probability (1 - a) a^J and the
    cycle commits J + 1 tokens. The target's token after them comes from the verification of the window of k
    drafts holding draft J (its bonus position; with bonus=False, as in the DSI paper, from the window holding
    draft J + 1), window m = ceil(J / k), which ends at s_m + 1 with s_m from `dsi_window_starts`: m k c with
    enough workers, later when `workers` is fewer than ceil(1 / (k c)). A verification of the bare committed
    prefix always runs beside, so a cycle never costs more than plain decoding's J + 1:

        latency per token = (1 - a) * sum_J (1 - a) a^J min(s_m(J) + 1, J + 1)

    With every draft accepted (a = 1) the windows stream at the pace of the drafter or of the workers,
    whichever is slower: p = min(max(c, 1 / (N k)), 1) (just min(c, 1) with enough workers). Past T =
    RENEWAL_TERMS terms (a within ~0.2% of 1) a cycle's cost grows at that pace, cost_J = cost_T + p (J - T),
    whose tail sums to a^(T+1) (cost_T + p / (1 - a)).
    """
    pace = min(c if workers is None else max(c, 1.0 / (workers * k)), 1.0)
    if a >= 1.0:
        return pace
    terms = renewal_terms(a)
    starts = dsi_window_starts(c, k, math.ceil((terms + 1) / k), workers)
    cost = last = 0.0
    for j in range(terms + 1):
        window = math.ceil((j if bonus else j + 1) / k)
        last = min(starts[window] + 1.0, j + 1.0)
        cost += (1.0 - a) * a**j * last
    cost += a ** (terms + 1) * (last + pace / (1.0 - a))
    return cost * (1.0 - a)  # over E[J + 1] = 1 / (1 - a) tokens per cycle
