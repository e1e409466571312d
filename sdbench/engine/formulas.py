"""The formulas of engine/metrics.py's definitions, over plain numbers: accepted length and acceptance (sdbench's,
Spec-Bench's and vLLM's), rates and the time per output token."""

from __future__ import annotations

import math


def mean_accepted_length(new_tokens: float, steps: float, rows: int = 1) -> float:
    """Tokens committed per step: every token but each row's first (the prefill's) comes from a step. Over
    several rows, their new tokens and steps summed."""
    return (new_tokens - rows) / steps if steps else math.nan


def acceptance_rate(accepted: int, drafted: int) -> float:
    return accepted / drafted if drafted else math.nan


def specbench_mean_accepted_tokens(accepted: float, steps: float) -> float:
    """Spec-Bench's "#Mean accepted tokens" (evaluation/speed.py): the mean over every step of all prompts of
    the step's accepted drafts + 1. From sdbench's counts: (accepted + steps) / steps. It equals sdbench's
    mean accepted length unless an EOS or the budget cut a step; Spec-Bench also counts a step's accepted
    drafts past the cut, which sdbench does not record, so on such runs Spec-Bench itself would print a little
    more."""
    return (accepted + steps) / steps if steps else math.nan


def vllm_mean_acceptance_length(accepted: float, drafts: float) -> float:
    """vLLM's "Mean acceptance length" (v1 spec-decode metrics): 1 + accepted / num_drafts, where num_drafts
    counts only the steps that proposed at least one token (drafted_per_position[0] here). A step with no
    draft (a prompt-lookup miss) is left out, where sdbench's mean accepted length counts it as 1 token."""
    return 1.0 + accepted / drafts if drafts else math.nan


def vllm_draft_acceptance_rate(accepted: float, drafted: float) -> float:
    """vLLM's "Draft acceptance rate": accepted / drafted tokens, the same ratio as sdbench's acceptance rate."""
    return acceptance_rate(accepted, drafted)


def rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else math.nan


def time_per_output_token(after_first: float, new_tokens: int) -> float:
    """The time after an answer's first token over the tokens after it (in after_first's unit); NaN for an
    answer of one token, which has no token after its first to time (vLLM records 0 there)."""
    return after_first / (new_tokens - 1) if new_tokens > 1 else math.nan


def decode_time_per_token(answers) -> float:
    """`time_per_output_token` over (after_first, new_tokens) pairs: their times after the first token over their
    tokens after it, each summed over the answers of two tokens or more; NaN where there is none."""
    timed = [(s, n) for s, n in answers if n > 1]
    if not timed:
        return math.nan
    return time_per_output_token(sum(s for s, _ in timed), 1 + sum(n - 1 for _, n in timed))


def combined_speedup(tokens, speedups) -> float:
    """Rows' own speedups taken together as their summed tokens over their summed times are: each row's n tokens
    take n / s of plain decoding's time for them, so the rows give sum(n) / sum(n / s), a token-weighted harmonic
    mean (the plain mean of the rows' speedups overstates the whole whenever they differ). Rows without a finite
    positive speedup or tokens are left out; NaN when none is left."""
    pairs = [(n, s) for n, s in zip(tokens, speedups) if n > 0 and math.isfinite(s) and s > 0]
    if not pairs:
        return math.nan
    return sum(n for n, _ in pairs) / sum(n / s for n, s in pairs)


def speedup_bound(accepted_length: float, t1: float = math.nan, t_verify: float = math.nan,
                  workers: int = 1) -> float:
    """The most a speculative speedup over plain decoding can be. A round commits accepted_length tokens on
    average (the target's own included) and costs at least one verifying forward, which costs at least a plain
    step: so at most L × T(1) / T(verify) where both step costs were measured apart from the timed rounds
    (t1: one target forward over one token; t_verify: over the round's tokens), and never above L. With W target
    workers verifying at once (DSI), W times that. NaN without an accepted length."""
    if not (math.isfinite(accepted_length) and accepted_length > 0):
        return math.nan
    ratio = t1 / t_verify if math.isfinite(t1) and math.isfinite(t_verify) and t_verify > 0 else 1.0
    return accepted_length * min(1.0, ratio) * max(1, workers)
