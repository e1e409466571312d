"""Where a strategy's greedy output first left the baseline's, and whether that was a tie or a real divergence.

Under greedy decoding every strategy must reproduce plain decoding token for token. In low precision the
target's two best logits can be equal, or within rounding of each other, at some position: a verification
forward (several tokens at once) and the baseline's one-token forward round differently, so either may pick
either token, and from there on the outputs differ although neither decoded wrongly. At the first differing
position i the prefix (prompt plus the first i output tokens) is the same on both sides, so the target is run
once more over it, and the gap between its largest logit and the lower of the two chosen tokens' logits is
measured. Within TIE_ULPS units in the last place of the model's dtype at the largest logit's magnitude, it is
a tie; beyond, a real divergence, which only a bug can cause.
"""

from __future__ import annotations

import math

import torch

from sdbench.engine.state import needed_capacity

TIE_ULPS = 4  # rounding a forward of another shape can move a logit by in the model's dtype


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (a length counts); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tie_tolerance(top: float, dtype: torch.dtype) -> float:
    """The largest logit gap that rounding in `dtype` explains, at a largest logit of `top`."""
    return TIE_ULPS * torch.finfo(dtype).eps * max(abs(top), 1.0)


@torch.inference_mode()
def judge(target, prompt: list[int], expected: list[int], got: list[int]) -> tuple[str, float] | None:
    """None when got == expected (the baseline's output); else ("tie" | "real", the logit gap at the first
    differing position). target: the ModelRunner both were decoded with."""
    i = first_difference(expected, got)
    if i is None:
        return None
    if i >= min(len(expected), len(got)):  # one stopped early: not a choice between two tokens
        return "real", math.nan
    context = list(prompt) + list(expected[:i])
    cache = target.new_cache(1, needed_capacity(len(context), 0, 0))
    try:
        logits = target.prefill(cache, [context])[0].float()  # [V]
    finally:
        target.release(cache)
    top = float(logits.max())
    gap = top - float(logits[[expected[i], got[i]]].min())
    return ("tie" if gap <= tie_tolerance(top, target.dtype) else "real"), gap


def judged_output(target, prompt: list[int], expected: list[int] | None, got: list[int], greedy: bool):
    """judge() where it applies: under greedy decoding, with the baseline's output known and the target's weights
    loaded here (through an engine none are); else None."""
    if not greedy or expected is None or target is None:
        return None
    return judge(target, prompt, expected, got)
