"""Sliding-window attention: which layers slide and how far, decided from a model's config as the library's
modeling files decide it (transformers 5.x).

The rule (masking_utils' sliding_window_overlay on the causal mask): a query at position p of a layer with
window W sees the keys at positions k with p - W < k <= p: W keys, itself included.

Which layers:
- families whose modeling applies `config.sliding_window` to every layer and never reads `layer_types`
  (Mistral, Mixtral, StarCoder2, Phi-3, Qwen3-MoE): every layer, when it is set. MistralConfig has no
  `use_sliding_window` field: Mistral-7B-v0.1 ships 4096 and the library applies it;
- families that read `config.layer_types` (Qwen2/Qwen3: sliding only with `use_sliding_window`, from
  `max_window_layers` on; Qwen2-MoE; Gemma 2 and 3: alternating local/global layers): the layers typed
  "sliding_attention";
- families with no window in their modeling (Llama, ...): none, whatever the config carries.
"""

from __future__ import annotations

from sdbench.errors import SdbenchError

EVERY_LAYER = ("mistral", "mixtral", "starcoder2", "phi3", "phimoe", "qwen3_moe", "ministral3")
NO_WINDOW = ("llama", "granite", "olmo2", "gemma")
LAYER_KINDS = ("full_attention", "sliding_attention")


def layer_windows(config) -> list[int | None]:
    """Per layer, its window W (a query at p sees keys in (p - W, p]) or None (full causal attention)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None) or None  # Qwen2-MoE writes 0 for "off"
    model_type = getattr(config, "model_type", "")
    if model_type in NO_WINDOW:
        return [None] * n
    types = getattr(config, "layer_types", None)
    if model_type in EVERY_LAYER or types is None:
        return [window] * n
    unknown = sorted(set(types) - set(LAYER_KINDS))
    if unknown:
        raise SdbenchError(f"'{model_type}' has layers of type {', '.join(unknown)}, which sdbench's runner "
                           f"does not compute")
    return [window if t == "sliding_attention" else None for t in types[:n]]
