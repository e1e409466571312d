"""An MTP module's forward (DeepSeek-V3's multi-token prediction as Qwen3-Next, Qwen3.5 and MiMo ship it; speculators
`MTPDraftModel`, vLLM's `mtp` method): x = input_proj(cat(token_layernorm(e), hidden_layernorm(h))) of the next
token's embedding e and the state h it follows (the target's final-norm state, or the module's own output fed
back), one decoder layer over x (its input norm, attention, post-attention norm, MLP, residuals as the target's
own layers), o = final_layernorm(its output), fed back and read by the target's own head: logits = head(o). The
module keeps its own position-indexed KV cache, as an EAGLE head does, and drafts through EAGLE's drafter (a
chain, a token tree, or EAGLE-2's dynamic tree).

A module read from a model's own checkpoint (mtp_native.py) differs by layout: DeepSeek-V3's and GLM-4.5's feed
back the layer's output before the final norm and read their logits through their own `shared_head`; theirs and
MiMo's zero the embedding at position 0 (as vLLM does). A layer of a type this forward does not compute (multi-head
latent attention, a mixture of experts) runs as the library's own module (mtp_layer.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from sdbench.kv.cache import StepIndex
from sdbench.models.heads.eagle import EagleHead, rms_norm
from sdbench.models.heads.mtp_load import DENSE_TYPES
from sdbench.models.heads.mtp_layer import LAYER
from sdbench.models.heads.mtp_native import DEEPSEEK


class MTPHead(EagleHead):
    """An MTP module over a target runner (its embedding and head)."""

    def __init__(self, head, target):
        kind = head.config.get("model_type", "qwen3")
        own = replace(head, weights={k: v for k, v in head.weights.items() if not k.startswith(LAYER)}) \
            if kind not in DENSE_TYPES else head  # the library's layer holds its own weights: cast once, there
        super().__init__(own, target)
        self.layout = head.layout
        self.library = None
        if own is not head:
            from sdbench.models.heads.mtp_layer import library_layer  # the library's modules: only this needs them

            index = head.config.get("num_hidden_layers", 0)
            like = getattr(getattr(target, "model", None), "config", None)  # the target's library settings
            self.library = library_layer(kind, head.config, index, head.weights, head.name, self.dtype, self.device,
                                         like)

    def new_cache(self, batch: int, capacity: int):
        if self.library is None:
            return super().new_cache(batch, capacity)
        from sdbench.models.heads.mtp_layer import SlotCache

        return SlotCache(batch, capacity)

    def _embed(self, tokens: torch.Tensor, step: StepIndex) -> torch.Tensor:
        e = super()._embed(tokens, step)
        if not self.layout:
            return e
        return e.masked_fill((step.positions == 0).to(e.device)[..., None], 0)  # as vLLM: nothing at position 0

    def _inputs(self, e: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self._linear("input_proj", torch.cat((rms_norm(e, self.w["token_layernorm.weight"], self.eps),
                                                  rms_norm(states, self.w["hidden_layernorm.weight"], self.eps)), -1))
        if self.library is not None:  # the library's layer applies its own input norm
            return x, x
        return rms_norm(x, self.w["input_layernorm.weight"], self.eps), x

    def _layer(self, attn_in: torch.Tensor, residual: torch.Tensor, cache, step: StepIndex) -> torch.Tensor:
        if self.library is None:
            return super()._layer(attn_in, residual, cache, step)
        layer, rotary = self.library
        cache.step = step
        return layer(residual, attention_mask=step.causal_mask(self.dtype), cache=cache,
                     position_embeddings=rotary(residual, step.rotated))

    def _output(self, h: torch.Tensor) -> torch.Tensor:
        if self.layout == DEEPSEEK:  # fed back before the norm; the logits normalise it (_logits)
            return h
        return rms_norm(h, self.w["final_layernorm.weight"], self.eps)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.layout != DEEPSEEK:
            return self.target.logits(out)
        normed = rms_norm(out, self.w["final_layernorm.weight"], self.eps)
        own = self.w.get("lm_head.weight")  # shared_head.head: the target's own head where the checkpoint has none
        return self.target.logits(normed) if own is None else F.linear(normed, own).float()
