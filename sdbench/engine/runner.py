"""What decoding needs of a model: the `Runner` protocol. models/forward/runner.py's ModelRunner (sdbench's own
forward) and models/forward/generic.py's GenericRunner (the library's forward and cache) implement it; the engine,
drafters and strategies know a model only through it (a cache is the runner's own: kv/ for the native runner).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from sdbench.engine.hidden import Taps
from sdbench.forward_step import Step


class Runner(Protocol):
    name: str  # the model as the user named it
    model: Any  # the library's module the runner reads its weights from
    config: Any  # its configuration
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    fast: bool  # the fast forward path for the device is on (recorded with results)
    graphs: bool  # static steps are replayed as CUDA graphs
    static: bool  # static-shape forwards over pooled caches

    def new_cache(self, batch: int, capacity: int) -> Any:
        """An empty KV cache for `batch` rows of up to `capacity` positions each."""

    def new_sparse_cache(self, batch: int, n_static: int, window: torch.Tensor, lookahead: int) -> Any:
        """A fixed-budget sparse draft cache (native runner only)."""

    def release(self, cache: Any) -> None:
        """Give a cache back for reuse (static shapes), or nothing."""

    def prefill(self, cache: Any, prompts: list[list[int]], chunk: int | None = None,
                taps: Taps | None = None) -> torch.Tensor:
        """Write every prompt from position 0; logits [B, V] (float32) after each prompt's last token.
        taps: also keep the hidden states it names, of every prompt position (engine/hidden.py)."""

    def run(self, cache: Any, step: Step) -> torch.Tensor:
        """Logits [B, T, V] (float32) of one forward call (`forward_step.Step`: tokens [B, T] placed at
        start[b] + t, and whatever else the call asks for), only at its `at` when it has one. A tree step's
        trees (engine/tree.py, the verifying forward's `with_root()` trees) place node j in slot start[b] + j at
        position start[b] - 1 + depth, seeing the slots before start[b], its ancestors and itself; the cache's
        `keep_path(b, start, nodes)` then keeps the accepted path."""

    def tree_refusal(self, cache: Any, nodes: int | None = None) -> str | None:
        """Why tree forwards (a `Step` with a tree) cannot run over this cache, in one line, or None: asked
        before a tree-proposing run starts. nodes: the most nodes one tree forward will take."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embeddings [B, T, H] of tokens [B, T] (what a trained head reads beside the states)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's own head over final-norm hidden states [..., H]: logits [..., V] (float32)."""

    def share_plain(self) -> None:
        """Put the weights in the library's layout (to hand them to another process)."""

    def own_layout(self) -> None:
        """Put the weights in the layout this runner's forward reads, now (before a timed section)."""

    def library_forward(self) -> AbstractContextManager:
        """A context for the library's own forward over the model's weights (a library call), the runner's layout
        restored after."""

    def fast_path_note(self) -> str | None:
        """One line on which forward the fast path uses at this shape, or None off it."""
