"""DFlash's forward (Chen, Liang, Liu 2026; z-lab `DFlashDraftModel`, speculators `DFlashDraftModel`): a few
Qwen3 decoder layers that fill a block of tokens in one non-causal forward, conditioned on the target.

Context: the target's states of every committed token before the block (several layers joined, engine/hidden.py)
are projected once, c = hidden_norm(fc(states)), and every draft layer l keeps k_norm(k_proj_l(c)), rotated at
the token's position, and v_proj_l(c) as its keys and values there: the head's cache holds the context in this
form, written as the target commits tokens. Block: the anchor (the last committed token, whose target state is
not known yet) followed by block_size - 1 mask tokens, at the anchor's position onward, embedded with the
target's embedding; each layer's queries, keys and values of the block come from the block's own states, and
every block token sees the whole context and the whole block (no causal order inside the block). The block's
output, after the head's final norm, goes through the target's own output head (or the head's draft vocabulary,
mapped by d2t). Block slot i (i >= 1) drafts the token at the anchor's position + i; with `anchor_drafts`
(speculators' sample_from_anchor) slot i drafts the token one further, so slot 0 drafts too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sdbench.kv.cache import DenseKVCache, StepIndex, additive
from sdbench.models.forward.families import soft_cap
from sdbench.models.forward.rotary import Rotary, rope
from sdbench.models.heads.eagle import layer_config, on_target_vocab, rms_norm, target_ids


class BlockStep(StepIndex):
    """A block of T tokens per row at slots start[b] .. start[b] + T - 1, each seeing every slot before the
    row's block ends: the context and its whole block, whatever order inside it."""

    def causal_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """[B, 1, T, kv_len] additive (a block drafter's layers have no window)."""
        if None not in self._masks:
            keys = torch.arange(self.kv_len, device=self.positions.device)[None, None, :]
            ends = self.positions[:, -1:, None]  # [B, 1, 1] the row's last block slot
            allowed = (keys <= ends).expand(-1, self.T, -1)
            self._masks[None] = additive(allowed[:, None], dtype)
        return self._masks[None]


class DFlashHead:
    """DFlash's draft layers over a target runner (its embedding and output head)."""

    def __init__(self, head, target):
        self.target, self.device, self.dtype = target, target.device, target.dtype
        cfg = layer_config(head, layers=head.config.get("num_hidden_layers", 1))
        self.eps, self.n_layers = cfg.rms_norm_eps, cfg.num_hidden_layers
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.block_size, self.mask_token_id = head.block_size, head.mask_token_id
        self.first = 0 if head.anchor_drafts else 1  # the block slot of the first draft
        self.scale = float(head.config.get("input_embedding_scale", 1.0))
        self.multiplier = float(head.config.get("output_multiplier", 1.0))
        self.softcap = float(head.config.get("final_logit_softcapping") or 0.0)
        self.w = {k: v.to(self.device, self.dtype) for k, v in head.weights.items() if k not in ("d2t", "t2d")}
        self.rotary = Rotary(cfg, self.device, self.dtype)
        self.to_target = target_ids(head, self.device)

    @property
    def most_drafts(self) -> int:
        """The tokens one block drafts."""
        return self.block_size - self.first

    def new_cache(self, batch: int, capacity: int) -> DenseKVCache:
        """The head's cache for contexts of up to `capacity` tokens, with room for a block after the last."""
        capacity += self.block_size
        self.rotary.reserve(capacity)
        return DenseKVCache(self.n_layers, batch, self.n_kv, self.head_dim, capacity, self.dtype, self.device)

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def _keys(self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Layer `layer`'s keys [B, Hk, T, D] (normed, rotated by cos, sin) and values [B, Hk, T, D] of states
        x [B, T, H]."""
        B, T, _ = x.shape
        p = f"layers.{layer}.self_attn."
        k = rms_norm(self._linear(p + "k_proj", x).view(B, T, self.n_kv, self.head_dim), self.w[p + "k_norm.weight"],
                     self.eps)
        v = self._linear(p + "v_proj", x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return rope(k.transpose(1, 2), cos, sin), v

    def _rotation(self, step: StepIndex):
        return next(iter(self.rotary.for_forward(step.rotated, step.kv_len).values()))

    @torch.inference_mode()
    def context(self, cache, states: torch.Tensor, start: list[int]) -> None:
        """Write the context of target states [B, T, k*H] (row b's at positions start[b] + t) into every layer's
        keys and values."""
        c = rms_norm(self._linear("fc", states.to(self.dtype)), self.w["hidden_norm.weight"], self.eps)
        step = StepIndex(start, c.shape[1], self.device)
        cos, sin = self._rotation(step)
        for layer in range(self.n_layers):
            cache.update(layer, *self._keys(layer, c, cos, sin), step)

    @torch.inference_mode()
    def block(self, cache, anchors: torch.Tensor, start: list[int]) -> torch.Tensor:
        """The block after anchors [B] (row b's at position start[b], its context before it in the cache): the
        head's final-norm output [B, block_size, H] at every block slot."""
        B = anchors.shape[0]
        tokens = torch.full((B, self.block_size), self.mask_token_id, dtype=torch.long, device=self.device)
        tokens[:, 0] = anchors.to(self.device)
        embedding = self.target.model.get_input_embeddings().weight  # z-lab's: unscaled, times its own scale
        h = (F.embedding(tokens, embedding) * self.scale).to(self.dtype)
        step = BlockStep(start, self.block_size, self.device)
        rotation = self._rotation(step)
        for layer in range(self.n_layers):
            p = f"layers.{layer}."
            x = rms_norm(h, self.w[p + "input_layernorm.weight"], self.eps)
            h = h + self._around(p + "attention_conv", x, lambda x: self._attention(layer, x, cache, step, rotation))
            x = rms_norm(h, self.w[p + "post_attention_layernorm.weight"], self.eps)
            h = h + self._around(p + "mlp_conv", x, lambda x: self._linear(
                p + "mlp.down_proj", F.silu(self._linear(p + "mlp.gate_proj", x)) * self._linear(p + "mlp.up_proj", x)))
        return rms_norm(h, self.w["norm.weight"], self.eps)

    def _around(self, name: str, x: torch.Tensor, sublayer) -> torch.Tensor:
        """A sublayer (attention or MLP) over the block's normed states x [B, block, H] (DFlash 2 convolves its input
        and output along the block: dflash2.py)."""
        return sublayer(x)

    def _attention(self, layer: int, x: torch.Tensor, cache, step: BlockStep, rotation) -> torch.Tensor:
        B, T, _ = x.shape
        p = f"layers.{layer}.self_attn."
        q = self._linear(p + "q_proj", x).view(B, T, self.n_heads, self.head_dim)
        q = rope(rms_norm(q, self.w[p + "q_norm.weight"], self.eps).transpose(1, 2), *rotation)
        keys, values, mask = cache.update(layer, *self._keys(layer, x, *rotation), step)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv)
        return self._linear(p + "o_proj", o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    @torch.inference_mode()
    def chain(self, out: torch.Tensor, anchors: torch.Tensor, k: int, pick, stop: float = 0.0):
        """The drafts of the block's first k drafting slots, from its outputs out [B, block, H] (anchors [B]: the
        rows' anchors), each picked by `pick` (logits [B, V] -> tokens [B], probs [B, V] or None) from its own
        slot's logits alone: the tokens and the probs per slot, and each slot's confidence [B, k] (DFlash has
        none: None; nor a confidence to stop on, `stop`)."""
        tokens, probs = zip(*(pick(self.logits(out[:, self.first + i])) for i in range(k)))
        return list(tokens), list(probs), None

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits [..., Vd] of block outputs [..., H]: the target's head, or the head's own draft vocabulary (times
        z-lab's `output_multiplier`, then soft-capped at its `final_logit_softcapping`)."""
        logits = self.target.logits(out) if "lm_head.weight" not in self.w else F.linear(out, self.w["lm_head.weight"])
        logits = logits.float() if self.multiplier == 1.0 else logits.float() * self.multiplier
        return soft_cap(logits, self.softcap)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary [..., V] (eagle.py `on_target_vocab`)."""
        return on_target_vocab(self.draft_logits(out), self.to_target, self.target.vocab_size)
