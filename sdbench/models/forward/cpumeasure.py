"""How the CPU fast path measures its choices, and the override that sets them instead.

Two choices are measured on this machine: whether to pack a model and into which layout
(`models/forward/cpuchoice.py`), and the vocabulary head's product per width (`models/forward/cpuhead.py`). Each
times products with `timed`, over at least STREAM_BYTES of weight (`streamed_rows`): one small weight timed again
and again would sit in a large L3 and time the cache, not the memory a forward streams from.

`SDBENCH_CPU_FAST` (FAST_ENV) overrides the measurements: `fast_mode` reads it.
"""

from __future__ import annotations

import os
import time

import torch

from sdbench.errors import SdbenchError
from sdbench.models.forward.cpupacked import KERNEL

FAST_ENV = "SDBENCH_CPU_FAST"  # measure (default) | kernel | packed | plain | compiled: an override of the measurement
MODES = ("measure", KERNEL, "packed", "plain", "compiled")
STREAM_BYTES = 512 * 2**20  # the least weight each path is timed over (more than a large L3 holds)


def fast_mode() -> str:
    """FAST_ENV's value: measure (the default), plain, kernel (sdbench's products), packed (oneDNN's), or compiled
    (packed, steps compiled: `models/forward/cpucompile.py`)."""
    mode = os.environ.get(FAST_ENV, "measure").strip().lower() or "measure"
    if mode not in MODES:
        raise SdbenchError(f"{FAST_ENV}={mode}: use {', '.join(MODES[:-1])} or {MODES[-1]}")
    return mode


def streamed_rows(weight: torch.Tensor) -> int:
    """Rows of a [V, H] weight to time a product on: STREAM_BYTES of them (at least 8192), or all."""
    return min(weight.shape[0], max(8192, STREAM_BYTES // (weight.shape[1] * weight.element_size())))


def timed(fn, reps: int = 5) -> float:
    """Best of `reps` calls of fn(), in seconds, after one warm-up call: on a shared machine the slowest calls
    measure the other jobs, the fastest the product."""
    with torch.inference_mode():
        fn()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best
