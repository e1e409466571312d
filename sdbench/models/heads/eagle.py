"""The EAGLE head's forward: one decoder layer over the target's hidden states and the next token's embedding,
with its own position-indexed KV cache (kv/cache.py), so that it rewinds with the target as a draft model does.

EAGLE-1 (Li et al., 2024; vLLM `llama_eagle.py`): x = fc(cat(e, h)) with e the token's embedding and h the
target's final-norm state (or the head's own output, fed back); the layer has no input norm; its output o is
both fed back and read by the target's own head: logits = target_head(o).

EAGLE-3 (Li et al., 2025; vLLM `llama_eagle3.py`, speculators `Eagle3DraftModel`): x = fc(cat(h_a, h_b, h_c))
of three target layers' inputs (the head's own output o is fed back as x, unprojected); the layer's attention
reads cat(input_layernorm(e), hidden_norm(x)), its residual is x (hidden_norm(x) with `norm_before_residual`);
o = its output before the final norm, fed back; draft logits = lm_head(norm(o)) over the draft vocabulary,
whose token i is target token i + d2t[i].
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from sdbench.engine.tree import Tree
from sdbench.models.heads.load import EAGLE1, EAGLE3, Head
from sdbench.kv.cache import DenseKVCache, StepIndex, additive
from sdbench.models.forward.rotary import Rotary, rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalised in float32, scaled in the input's dtype."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def layer_config(head: Head, layers: int = 1):
    """The head's decoder layers' library config (for their rotary embedding): Llama unless it names another
    type."""
    from transformers import AutoConfig  # slow to import; only a head needs it here

    cfg = {k: v for k, v in head.config.items() if k not in ("architectures", "draft_vocab_size", "auto_map")}
    cfg["num_hidden_layers"] = layers
    return AutoConfig.for_model(cfg.pop("model_type", "llama"), **cfg)


class TreeLevel(StepIndex):
    """One level of a token tree fed to the head: nodes `nodes` of `tree` (the level's, M of them; or of each
    row's own tree, trees of one size whose nodes `nodes` share a depth: a dynamic tree), each row's tree placed
    after its first start[b] slots as the verifier places its own (node j at slot start[b] + j, rotated at
    start[b] - 1 + depth[j]). A node sees the slots before start[b], its ancestors' slots (written by earlier
    levels) and its own; no other tree slot, whatever an earlier round left there."""

    def __init__(self, start: list[int], tree: Tree | Sequence[Tree], nodes: tuple[int, ...],
                 device: torch.device):
        trees = [tree] * len(start) if isinstance(tree, Tree) else list(tree)
        N, M = len(trees[0]), len(nodes)
        self.start, self.T, self.uniform = start, M, False  # slots start[b] + node: not one run from start[b]
        self.kv_len = max(start) + N
        first = torch.tensor(start, device=device)[:, None]  # [B, 1]
        at = torch.tensor(nodes, device=device)
        self.positions = first + at  # [B, M] the slots written
        depth = torch.tensor([t.depth for t in trees], device=device)  # [B, N]
        self._rotated = first - 1 + depth[:, at]  # [B, M]
        node = torch.arange(self.kv_len, device=device)[None] - first  # [B, S]: a slot's node, < 0 before the tree
        sees = torch.stack([t.ancestors for t in trees]).to(device)[:, at]  # [B, M, N]
        inside = (node >= 0) & (node < N)
        seen = sees.gather(2, node.clamp(0, N - 1)[:, None].expand(-1, M, -1))  # [B, M, S]
        self.allowed = (node < 0)[:, None] | (inside[:, None] & seen)
        self._masks = {}

    @property
    def rotated(self) -> torch.Tensor:
        return self._rotated

    def causal_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """[B, 1, M, kv_len] additive (the head's one layer has no window)."""
        if dtype not in self._masks:
            self._masks[dtype] = additive(self.allowed[:, None], dtype)
        return self._masks[dtype]


class EagleHead:
    """EAGLE-1 or EAGLE-3 over a target runner (its embedding, and for EAGLE-1 its head)."""

    def __init__(self, head: Head, target):
        self.kind, self.target = head.kind, target
        self.device, self.dtype = target.device, target.dtype
        cfg = layer_config(head)
        self.eps = cfg.rms_norm_eps
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden_size = cfg.hidden_size
        self.w = {k: v.to(self.device, self.dtype) for k, v in head.weights.items() if k not in ("d2t", "t2d")}
        self.rotary = Rotary(cfg, self.device, self.dtype)
        self.norm_before_residual = head.norm_before_residual
        self.to_target = target_ids(head, self.device)
        self.vocab_size = target.vocab_size if self.to_target is None else len(self.to_target)  # the tokens it drafts

    def new_cache(self, batch: int, capacity: int) -> DenseKVCache:
        self.rotary.reserve(capacity)
        return DenseKVCache(1, batch, self.n_kv, self.head_dim, capacity, self.dtype, self.device)

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w.get(f"{name}.bias"))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        own = self.w.get("embed_tokens.weight")
        return self.target.embed(tokens) if own is None else F.embedding(tokens.to(self.device), own)

    @torch.inference_mode()
    def forward(self, cache, tokens: torch.Tensor, states: torch.Tensor, start: list[int],
                at: torch.Tensor | None, tree: Tree | Sequence[Tree] | None = None,
                nodes: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] at positions start[b] + t, each with the state it follows: states [B, T, S] (the
        target's, or the head's own output fed back). Returns, at in-chunk indices at [B], the logits over the
        target's vocabulary [B, V] (float32) and the head's output [B, H] to feed back (at [B, k]: [B, k, V] and
        [B, k, H]); at None: at every token, [B, T, V] and [B, T, H]. tree: the tokens are its nodes `nodes` (one
        level of it; a sequence: row b's tree is tree[b]), the tree placed after start[b] slots (`TreeLevel`), each
        seeing the context and its own ancestors only."""
        T = tokens.shape[1]
        step = StepIndex(start, T, self.device) if tree is None else TreeLevel(start, tree, nodes, self.device)
        attn_in, residual = self._inputs(self._embed(tokens, step), states.to(self.dtype))
        h = self._layer(attn_in, residual, cache, step)
        rows = torch.arange(h.shape[0], device=h.device)
        out = self._output(h if at is None else h[rows if at.dim() == 1 else rows[:, None], at.to(h.device)])
        return self._logits(out), out  # out [B, (T,) H]

    def _embed(self, tokens: torch.Tensor, step: StepIndex) -> torch.Tensor:
        """The embeddings of a forward's tokens (at the step's positions)."""
        return self.embed(tokens)

    def _layer(self, attn_in: torch.Tensor, residual: torch.Tensor, cache, step: StepIndex) -> torch.Tensor:
        """The decoder layer's output from its attention input and residual."""
        h = residual + self._attention(attn_in, cache, step)
        return h + self._mlp(rms_norm(h, self.w["post_attention_layernorm.weight"], self.eps))

    def _inputs(self, e: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's attention input and residual from the tokens' embeddings e and the states they follow."""
        if self.kind == EAGLE1:
            x = self._linear("fc", torch.cat((e, states), -1))
            return x, x
        x = states if states.shape[-1] == self.hidden_size else self._linear("fc", states)
        hn = rms_norm(x, self.w["hidden_norm.weight"], self.eps)
        attn_in = torch.cat((rms_norm(e, self.w["input_layernorm.weight"], self.eps), hn), -1)
        return attn_in, (hn if self.norm_before_residual else x)

    def _output(self, h: torch.Tensor) -> torch.Tensor:
        """The layer's output as fed back (EAGLE: as it is)."""
        return h

    def _attention(self, x: torch.Tensor, cache, step: StepIndex) -> torch.Tensor:
        B, T, _ = x.shape
        Hq, Hk, D = self.n_heads, self.n_kv, self.head_dim
        q = self._linear("self_attn.q_proj", x).view(B, T, Hq, D)
        k = self._linear("self_attn.k_proj", x).view(B, T, Hk, D)
        v = self._linear("self_attn.v_proj", x).view(B, T, Hk, D).transpose(1, 2)
        if "self_attn.q_norm.weight" in self.w:  # a Qwen3 layer: per head, before the rotation
            q = rms_norm(q, self.w["self_attn.q_norm.weight"], self.eps)
            k = rms_norm(k, self.w["self_attn.k_norm.weight"], self.eps)
        cos, sin = next(iter(self.rotary.for_forward(step.rotated, step.kv_len).values()))
        q, k = rope(q.transpose(1, 2), cos, sin), rope(k.transpose(1, 2), cos, sin)  # [B, H, T, D]
        keys, values, mask = cache.update(0, k, v, step)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=Hq != Hk)
        return self._linear("self_attn.o_proj", o.transpose(1, 2).reshape(B, T, Hq * D))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.silu(self._linear("mlp.gate_proj", x))
        return self._linear("mlp.down_proj", gate * self._linear("mlp.up_proj", x))

    def draft_logits(self, out: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: logits over the draft vocabulary [..., Vd] of the head's outputs [..., H]."""
        return F.linear(rms_norm(out, self.w["norm.weight"], self.eps), self.w["lm_head.weight"]).float()

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary [..., V]: a draft-vocabulary token i at target id i + d2t[i], every
        target token outside the draft vocabulary at -inf (vLLM's `compute_logits`)."""
        if self.kind == EAGLE1:
            return self.target.logits(out)
        return on_target_vocab(self.draft_logits(out), self.to_target, self.target.vocab_size)


def target_ids(head: Head, device: torch.device) -> torch.Tensor | None:
    """The target id of each token of a head's draft vocabulary (token i is target token i + d2t[i]); None: the
    head drafts over the target's own ids."""
    d2t = head.weights.get("d2t")
    return None if d2t is None else (d2t.long() + torch.arange(len(d2t))).to(device)


def on_target_vocab(logits: torch.Tensor, to_target: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """Draft-vocabulary logits [..., Vd] placed at their target ids [..., V] (`target_ids`), every target token
    outside the draft vocabulary at -inf (vLLM's `compute_logits`); as they are without a draft vocabulary."""
    if to_target is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab), float("-inf"))
    full[..., to_target] = logits
    return full


__all__ = ["EagleHead", "TreeLevel", "rms_norm", "on_target_vocab", "target_ids", "EAGLE1", "EAGLE3"]
