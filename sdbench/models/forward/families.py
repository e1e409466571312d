"""Which runner serves a model, and how a native family's decoder differs from Llama's, from its config alone
(before any weight loads).

- native: sdbench's own forward (`models/forward/runner.py`), position-indexed caches, sparse caches, CUDA graphs;
- generic: the library's own forward and cache behind the runner's interface (every other causal LM);
- refused: what neither can run (not a decoder-only causal LM), with the reason.

A native family is Llama's layer loop with a few named differences (`Family`): where the norms sit, which
kind of norm it is, scales and soft-caps, fused projections, q/k norms. The runner reads its family once,
when it is built; the layer loop itself is shared.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# a layer's norms as (attention input, attention output, MLP input, MLP output): the decoder layer's
# attribute names, None where the family has none
PRE_NORMS = ("input_layernorm", None, "post_attention_layernorm", None)  # Llama: before each block
SANDWICH = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
POST_NORMS = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")  # OLMo2: after each block


@dataclass(frozen=True)
class Family:
    """How a decoder differs from Llama's (defaults: Llama). Scales are None where Llama has none, so that a
    Llama-family forward does no extra work."""

    norms: tuple[str | None, str | None, str | None, str | None] = PRE_NORMS
    rms_norm: bool = True  # every norm is Llama's RMSNorm (weight * x / rms): the fast path may run it as one op
    qk_norm: str | None = None  # "head": per head, before rotary (Qwen3, Gemma3); "all": over the whole q and
    # k projections, before splitting heads (OLMo2)
    qkv: str | None = None  # attribute of a fused q/k/v projection (Phi-3); None: q_proj, k_proj, v_proj
    attn_scale: float | None = None  # query-key scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention logits -> cap * tanh(logits / cap) (Gemma2/3)
    final_softcap: float | None = None  # the same on the output logits
    embed_scale: float | None = None  # embeddings times this (Granite; Gemma's scale is its embedding module's)
    residual_scale: float | None = None  # each block's output times this before the residual add (Granite)
    logits_divisor: float | None = None  # output logits divided by this (Granite)


def soft_cap(x, cap: float | None):
    """cap * tanh(x / cap): logits soft-capped as Gemma2/3 and z-lab's DFlash drafts cap them (x as it is for a cap
    of None or 0)."""
    import torch

    return torch.tanh(x / cap) * cap if cap else x


def _gemma2(c) -> Family:
    return Family(norms=SANDWICH, rms_norm=False, attn_scale=c.query_pre_attn_scalar**-0.5,
                  attn_softcap=c.attn_logit_softcapping, final_softcap=c.final_logit_softcapping)


_FAMILIES = {  # model_type -> its Family, from its config
    "llama": lambda c: Family(),
    "mistral": lambda c: Family(),
    "qwen2": lambda c: Family(),
    "qwen3": lambda c: Family(qk_norm="head"),
    "mixtral": lambda c: Family(),  # MoE blocks: the library's own module, which returns the block's output
    "qwen2_moe": lambda c: Family(),
    "qwen3_moe": lambda c: Family(qk_norm="head"),
    "starcoder2": lambda c: Family(rms_norm=False),  # LayerNorm with bias; a plain c_fc/c_proj MLP
    "phi3": lambda c: Family(qkv="qkv_proj"),  # a fused gate_up_proj too (the MLP module's own)
    "granite": lambda c: Family(attn_scale=c.attention_multiplier, embed_scale=c.embedding_multiplier,
                                residual_scale=c.residual_multiplier, logits_divisor=c.logits_scaling),
    "olmo2": lambda c: Family(norms=POST_NORMS, qk_norm="all"),
    "gemma2": _gemma2,
    "gemma3_text": lambda c: replace(_gemma2(c), qk_norm="head"),
}

NATIVE = tuple(_FAMILIES)  # model_type values the native runner computes exactly


def family(config) -> Family:
    """The native family of a config (whose model_type is in NATIVE)."""
    return _FAMILIES[config.model_type](config)


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
