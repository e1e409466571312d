"""A forward call as one value: `Step` holds everything one call of a runner's forward takes, built once by
the caller and read by whichever forward path the runner takes (eager, packed, compiled, CUDA graphs, the
library's own model for the generic runner).

A new input to the forward is a field here and a branch in the paths that honour it; the runners' signatures,
the engine and the drafters do not change. What belongs to a whole generation rather than to one call (each
row's prompt length, which decides a length-dependent rope's scaling) stays with the cache that prefill fills.

The module imports nothing of sdbench's: the engine, the caches (kv/) and the runners all build steps, so it sits
below them all; its `taps` is an engine/hidden.py `Taps` and its `tree` an engine/tree.py `TreeBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True)
class Step:
    """tokens [B, T] placed at positions start[b] + t.

    at: logits only at these in-chunk indices: [B] -> [B, V], [B, K] -> [B, K, V] (the vocabulary projection
    then runs only there). taps: the hidden states to keep too, of every token (engine/hidden.py). tree: the
    tokens are a token tree per row (engine/tree.py): node j in slot start[b] + j at position
    start[b] - 1 + depth, seeing the slots before start[b], its ancestors and itself."""

    tokens: torch.Tensor
    start: list[int]
    at: torch.Tensor | None = None
    taps: Any = None  # engine/hidden.py Taps, or None
    tree: Any = None  # engine/tree.py TreeBatch, or None

    def __post_init__(self):
        if len(self.start) != self.tokens.shape[0]:
            raise ValueError(f"a step of {self.tokens.shape[0]} rows was given {len(self.start)} start positions")
        if self.tree is not None:
            self.tree.check_tokens(self.tokens)

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def pick(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] at the step's `at` (x[b, at[b]] or x[b, at[b, k]]), or x whole without one."""
        if self.at is None:
            return x
        rows = torch.arange(x.shape[0], device=x.device)
        return x[rows if self.at.dim() == 1 else rows[:, None], self.at.to(x.device)]

    def part(self, lo: int, hi: int, start: list[int], taps: Any = None) -> "Step":
        """Tokens [:, lo:hi] placed from `start`, keeping into `taps`, with no `at` (a piece of a split forward,
        whose caller picks afterwards); a tree step is not split."""
        if self.tree is not None:
            raise ValueError("a tree step is not split into pieces")
        return Step(self.tokens[:, lo:hi], start, taps=taps)

    def row(self, b: int, taps: Any = None) -> "Step":
        """Row b alone, keeping into `taps` (a path that runs row by row gathers the rows' states itself); a
        tree's rows are placed by the path that splits them, so a tree step is not split here."""
        if self.tree is not None:
            raise ValueError("a tree step is split into rows by the path that places its trees")
        at = None if self.at is None else self.at[b : b + 1]
        return replace(self, tokens=self.tokens[b : b + 1], start=[self.start[b]], at=at, taps=taps)
