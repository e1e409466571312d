"""Which runner serves a model, decided from its config alone (before any weight loads).

- native: sdbench's own forward (`models/runner.py`), position-indexed caches, sparse caches, CUDA graphs;
- generic: the library's own forward and cache behind the runner's interface (every other causal LM);
- refused: what neither can run (not a decoder-only causal LM), with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

NATIVE = ("llama", "mistral", "qwen2", "qwen3")  # model_type values the native runner computes exactly


@dataclass(frozen=True)
class Serving:
    runner: str  # "native" | "generic" | "refused"
    reason: str = ""  # why not native (generic) or why not at all (refused)


def serving(config) -> Serving:
    """The runner for a model with this (transformers) config."""
    model_type = getattr(config, "model_type", "")
    if model_type in NATIVE:
        return Serving("native")
    if getattr(config, "is_encoder_decoder", False):
        return Serving("refused", f"'{model_type}' is an encoder-decoder model; sdbench runs decoder-only causal LMs")
    return Serving("generic", f"the native runner does not compute '{model_type}'")
