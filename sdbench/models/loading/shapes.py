"""A model's shape from its config alone, with no weight read: the config object from a config.json's dict,
the model built on the meta device (no memory, no values), its parameter count and a size label."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from sdbench.errors import SdbenchError
from sdbench.paths import cache_dir

_COUNTS = "parameter-counts.json"  # in cache_dir("models"): {hash of library version + config: parameters}

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


def config_from_dict(data: dict) -> "PretrainedConfig":
    """The transformers config a config.json holds (legacy keys such as rope_scaling read as the library does)."""
    from transformers import AutoConfig  # transformers: slow to import

    fields = dict(data)
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise SdbenchError("a model config without 'model_type' cannot be read")
    try:
        with quiet_library():
            return AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as err:
        raise SdbenchError(f"config of model type '{model_type}' could not be read: {err}") from err


def meta_model(config: "PretrainedConfig") -> "PreTrainedModel":
    """The causal LM this config describes, on the meta device: shapes and structure, no storage."""
    from transformers import AutoModelForCausalLM  # transformers: slow to import

    with torch.device("meta"), quiet_library():
        return AutoModelForCausalLM.from_config(config)


def random_model(config: "PretrainedConfig", device, dtype) -> "PreTrainedModel":
    """The model with random weights made directly on `device` in `dtype`: built on the meta device, given
    uninitialised storage there, then initialised as the library initialises a new model (buffers such as rotary
    tables and embedding scales included), never through a float32 copy on the CPU. For `MODEL@random`."""
    from transformers import AutoModelForCausalLM  # transformers: slow to import

    with torch.device("meta"), quiet_library():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device=device)
    model.initialize_weights()
    model.tie_weights()
    return model.eval().requires_grad_(False)


def shrink(config: "PretrainedConfig", layers: int = 2, hidden: int = 64, heads: int = 4,
           vocab: int | None = None) -> "PretrainedConfig":
    """A copy of the config at a small size, its family and every other field kept (rope type, windows,
    soft-caps, tied head, grouped-query ratio): for tests and rehearsals of real-shape commands on a CPU.
    Token ids the config names (pad, bos, eos) are folded into a smaller vocabulary as its tokenizer's are."""
    small = copy.deepcopy(config)
    q = getattr(small, "num_attention_heads", heads) or heads
    kv = getattr(small, "num_key_value_heads", None) or q
    sizes = {"num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
             "num_key_value_heads": max(1, heads * kv // q), "head_dim": hidden // heads,
             "intermediate_size": 2 * hidden, "ffn_dim": 2 * hidden, "word_embed_proj_dim": hidden,
             "moe_intermediate_size": hidden, "shared_expert_intermediate_size": hidden,
             "query_pre_attn_scalar": hidden // heads}
    for key, value in sizes.items():
        if getattr(small, key, None) is not None:
            setattr(small, key, value)
    for key in ("num_local_experts", "num_experts"):
        if getattr(small, key, None):
            setattr(small, key, min(getattr(small, key), 4))
    if getattr(small, "num_experts_per_tok", None):
        small.num_experts_per_tok = min(small.num_experts_per_tok, 2)
    if getattr(small, "layer_types", None):
        small.layer_types = list(small.layer_types)[:layers]
    if vocab is not None:
        small.vocab_size = vocab
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(small, key, None)
            if value is not None:
                setattr(small, key, [v % vocab for v in value] if isinstance(value, list) else value % vocab)
    return small


def parameter_count(config: "PretrainedConfig", cached: bool = False) -> int | None:
    """Parameters of the model (shared tensors such as a tied head counted once); None if no causal LM fits.

    cached: remember the count in sdbench's cache, keyed by the config and the library's version (building the
    model, and importing its family's code, takes ~0.1-1 s, and `list models` asks for every alias).
    """
    key = _count_key(config) if cached else None
    counts = _read_counts() if key else {}
    if key in counts:
        return counts[key]
    try:
        model = meta_model(config)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    n = sum(p.numel() for p in model.parameters())
    if key:
        counts[key] = n
        _write_counts(counts)
    return n


def size_label(n: int | None) -> str:
    """8_030_261_248 -> '8.0B', 999_885_952 -> '1.0B', 134_515_008 -> '135M'; '?' when unknown."""
    if n is None:
        return "?"
    if n >= 999.5e6:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.0f}M"


def _count_key(config: "PretrainedConfig") -> str:
    import transformers  # slow to import

    text = config.to_json_string(use_diff=False)
    return hashlib.sha256(f"{transformers.__version__}\n{text}".encode()).hexdigest()[:16]


def _counts_file() -> Path:
    return cache_dir("models") / _COUNTS


def _read_counts() -> dict[str, int]:
    try:
        return json.loads(_counts_file().read_text())
    except (OSError, ValueError):
        return {}


def _write_counts(counts: dict[str, int]) -> None:
    path = _counts_file()
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # written whole, then renamed: a reader never sees half a file
    try:
        tmp.write_text(json.dumps(counts, indent=0, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only cache costs time, not correctness


@contextlib.contextmanager
def quiet_library() -> Iterator[None]:
    """The library's warnings off inside the block: it warns about configs written by older versions of itself (the
    shipped configs are such) and, in assisted generation, about how it calls itself."""
    from transformers.utils import logging as hf_logging  # transformers: slow to import

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
