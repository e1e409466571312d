"""The one judge of a greedy output that left the one it is held to: where it first left it, and whether that was a
tie or a real divergence. run, load points and bench call it; tune, sweep and compare read its verdict from the rows.

Under greedy decoding every strategy must reproduce plain decoding token for token. Where both sides computed every
step past the prompts' prefill with the same width-invariant arithmetic (sdbench's fused CPU steps over its own
products: a row's logits are the bits of its token decoded alone; `BatchResult.width_varied` is 0 on both sides),
nothing but a bug can part them: any difference is real, whatever the logits. Elsewhere the two sides' arithmetic
truly differs — a verification forward over several tokens against a one-token forward on a path whose products are
chosen per shape (the library's forward, oneDNN, cuBLAS, torch's attention), an engine against the library's
generate — and the target's two best logits can be within rounding of each other at some position, where either
side may pick either token and neither decoded wrongly. At the first differing position i the prefix (prompt plus
the first i output tokens) is the same on both sides, so the target is run once more over it, and the gap between
its largest logit and the lower of the two chosen tokens' logits is measured. Within TIE_ULPS rounding steps of the
arithmetic (`rounding`: its dtype's epsilon, or the step of 8-bit activations) at the largest logit's magnitude it
is a tie; beyond, real.
"""

from __future__ import annotations

import math

import torch

from sdbench.engine.state import needed_capacity
from sdbench.models.loading.names import BLOCK_TYPES, ENGINE_TYPES

TIE_ULPS = 4  # rounding steps a forward of another shape can move a logit by
INT8_STEP = 2.0**-7  # relative rounding of 8-bit block activations (a block's scale is its largest |x| / 127)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (a length counts); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def same_arithmetic(*results) -> bool:
    """Every result's (`engine.counters.BatchResult`) target steps past its prefill ran width-invariant, so that
    their rows are one arithmetic: then no tolerance applies between them."""
    return all(invariant(r) is True for r in results)


def invariant(result) -> bool | None:
    """Whether a decoding's (`BatchResult`, a served `Scheduler`) every target step past its prefill ran
    width-invariant; None where not known here (another process verified: DSI; an engine)."""
    varied = getattr(result, "width_varied", None)
    return None if varied is None else varied == 0


def rounding(runner) -> float:
    """The relative rounding step of a runner's arithmetic: 8-bit activations on a block copy's fast path, else its
    dtype's epsilon."""
    if runner.block_activations() == "int8":
        return INT8_STEP
    return torch.finfo(runner.dtype).eps


def engine_rounding(dtype: str) -> float:
    """The relative rounding step of an engine serving weights of type `dtype`: 8-bit activations for a block or
    K-quant type, else no finer than float16 (llama.cpp's KV cache)."""
    if dtype in BLOCK_TYPES or dtype in ENGINE_TYPES:
        return INT8_STEP
    return max(torch.finfo(torch.float16).eps, torch.finfo(getattr(torch, dtype, torch.float32)).eps)


def tie_tolerance(top: float, step: float) -> float:
    """The largest logit gap that rounding in steps of `step` (relative) explains, at a largest logit of `top`."""
    return TIE_ULPS * step * max(abs(top), 1.0)


@torch.inference_mode()
def judge(target, prompt: list[int], expected: list[int], got: list[int], exact: bool = False,
          step: float | None = None) -> tuple[str, float] | None:
    """None when got == expected; else ("tie" | "real", the target's logit gap at the first differing position).
    target: the runner whose logits judge; exact: both sides ran one width-invariant arithmetic (any difference is
    real); step: the arithmetic's rounding step where not the target's own (`rounding`)."""
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
    if exact:
        return "real", gap
    return ("tie" if gap <= tie_tolerance(top, rounding(target) if step is None else step) else "real"), gap


def judged_output(target, prompt: list[int], expected: list[int] | None, got: list[int], greedy: bool,
                  exact: bool = False):
    """judge() where it applies: under greedy decoding, with the baseline's output known and the target's weights
    loaded here (through an engine none are); else None."""
    if not greedy or expected is None or target is None:
        return None
    return judge(target, prompt, expected, got, exact)
