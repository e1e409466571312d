"""The i.i.d. acceptance model (the model of Leviathan et al.), used while decoding.

Speculative decoding with lookahead gamma, where each drafted token is accepted independently with
probability alpha, commits per target verification

    Omega(gamma, alpha) = (1 - alpha^(gamma+1)) / (1 - alpha)

tokens on average (bonus token included). With a draft forward costing c target forwards and a verification
of gamma + 1 tokens costing v target forwards, the expected speedup over plain decoding is

    Omega(gamma, alpha) / (gamma * c + v),

or Omega(gamma, alpha) / (c + v) for a block drafter (DFlash), whose one forward drafts the whole block
(`draft_forwards`): its best gamma is the longest its acceptance still pays a wider verification for.

These few formulas sit in the engine because the metrics (a run's predicted speedup) and the adaptive
strategies (their choice of gamma and drafter) use them while decoding; the analysis built on them (polybasic
chains, SI and DSI latencies, the inverse of Omega) is sdbench/analysis/theory.py, above the engine.
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


def expected_tokens_given_drafts(alpha: float, drafted_per_position: list[int], rounds: int) -> float:
    """Omega over rounds that drafted different numbers of tokens (prompt lookup finding 0-gamma, a confidence cut
    verifying fewer): a round of n drafts commits 1 + alpha + ... + alpha^n on average, so rounds whose position j
    was drafted in d_j of them commit 1 + sum_j alpha^j d_j / rounds. With every round drafting gamma this is
    Omega(gamma, alpha); Omega at the mean drafts per round would overstate it, Omega being concave in gamma."""
    if not rounds or math.isnan(alpha):
        return math.nan
    return 1.0 + sum(alpha ** (j + 1) * d for j, d in enumerate(drafted_per_position)) / rounds


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


def draft_forwards(gamma: float, block: bool = False) -> float:
    """The draft forwards of a round of lookahead gamma: gamma, one per drafted token, or one for a block
    drafter."""
    return min(gamma, 1.0) if block else gamma


def predicted_speedup(alpha: float, gamma: float, draft_cost: float, verify_cost: float,
                      block: bool = False) -> float:
    """Omega(gamma, alpha) / (f * c + v) with f = `draft_forwards(gamma, block)`; c and v are in units of one
    plain target forward."""
    if math.isnan(alpha):
        return math.nan
    return round_speedup(expected_tokens_per_step(alpha, gamma), draft_forwards(gamma, block), draft_cost,
                         verify_cost)


def round_speedup(tokens_per_round: float, gamma: float, draft_cost: float, verify_cost: float) -> float:
    """Tokens a round commits over its cost in plain target forwards, gamma * c + v (gamma: the round's draft
    forwards): the speedup of rounds that commit `tokens_per_round` on average (Omega under the i.i.d. model, or
    as measured)."""
    denominator = gamma * draft_cost + verify_cost
    if not denominator > 0 or math.isnan(tokens_per_round):
        return math.nan
    return tokens_per_round / denominator
