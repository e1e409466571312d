"""Models: aliases, loading (alias, local folder, GGUF, hub id, embedded wheels) and the runner.

The alias registry imports nothing heavy; the loader (torch, transformers) is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sdbench.models.loading.aliases import EmbeddedModel, HubModel, model_registry

if TYPE_CHECKING:
    from sdbench.models.loading.loader import (
        LoadedModel,
        check_same_tokenizer,
        eos_token_ids,
        load_model,
        load_tokenizer,
        model_available,
    )

_LOADER_NAMES = {
    "LoadedModel",
    "check_same_tokenizer",
    "eos_token_ids",
    "load_model",
    "load_tokenizer",
    "model_available",
}

__all__ = ["EmbeddedModel", "HubModel", "model_registry", *sorted(_LOADER_NAMES)]


def __getattr__(name: str) -> Any:
    if name in _LOADER_NAMES:
        return getattr(importlib.import_module("sdbench.models.loading.loader"), name)
    raise AttributeError(f"module 'sdbench.models' has no attribute '{name}'")
