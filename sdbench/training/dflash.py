"""A DFlash head being fitted: its parameters under the speculators format's names, and its block forward
written over whole sequences at once.

The forward is the one `models/heads/dflash.py` drafts with. For a chain rooted at position q (the last
position whose target state the head has), the block is anchored at q + 1: slot 0 holds token q + 1, slots
1..n hold the mask token, slot s sits at position q + 1 + s. Every slot attends to the context (the projected
target states of positions 0..q) and to its own block, in no order; slot s predicts token q + 1 + s, so step
k = s - 1 predicts token q + k + 2, as EAGLE-3's step k does, and is labelled the same way (the target's own
choice there, eagle3.py `chain_labels`). A fit computes the blocks of a sample of each batch's roots
(`roots_per_batch`, as speculators samples anchors); an evaluation computes every root's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sdbench.models.forward.rotary import Rotary, rope
from sdbench.models.heads.eagle import rms_norm
from sdbench.training.eagle3 import chain_labels, draft_map, vocab_maps

ROOTS_PER_BATCH = 256  # the blocks a fitting step computes: a sample of its batch's labelled roots


class _Layer(nn.Module):
    """One Qwen3 decoder layer's parameters (its attention with per-head q and k norms)."""

    def __init__(self, H: int, Hq: int, Hk: int, D: int, inter: int):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(H, Hq * D, bias=False), nn.Linear(H, Hk * D, bias=False)
        self.v_proj, self.o_proj = nn.Linear(H, Hk * D, bias=False), nn.Linear(Hq * D, H, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(H, inter, bias=False), nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)
        self.q_norm, self.k_norm = nn.Parameter(torch.ones(D)), nn.Parameter(torch.ones(D))
        self.input_layernorm, self.post_attention_layernorm = nn.Parameter(torch.ones(H)), nn.Parameter(torch.ones(H))

    def named(self) -> dict[str, torch.Tensor]:
        """The layer's weights under the library's (and speculators') names."""
        attn = {f"self_attn.{n}.weight": getattr(self, n).weight for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        mlp = {f"mlp.{n}.weight": getattr(self, n).weight for n in ("gate_proj", "up_proj", "down_proj")}
        return {**attn, **mlp, "self_attn.q_norm.weight": self.q_norm, "self_attn.k_norm.weight": self.k_norm,
                "input_layernorm.weight": self.input_layernorm,
                "post_attention_layernorm.weight": self.post_attention_layernorm}


class DFlashTrainee(nn.Module):
    """DFlash's trainable part over the target's frozen embedding.

    layer: the draft layers' config (a transformers Qwen3Config at the target's attention shape, its
    num_hidden_layers the draft's); draft_ids, init_head: as Eagle3Trainee's; mask_token_id: the token its
    drafted slots hold; block_size: the block it drafts with (its fit unrolls block_size - 1 steps)."""

    def __init__(self, layer, embedding: torch.Tensor, draft_ids: torch.Tensor, init_head: torch.Tensor,
                 n_states: int, mask_token_id: int, block_size: int):
        super().__init__()
        H = layer.hidden_size
        self.layer_config, self.eps, self.mask_token_id = layer, layer.rms_norm_eps, mask_token_id
        self.block_size = block_size
        self.roots_per_batch = ROOTS_PER_BATCH
        self.n_heads, self.n_kv = layer.num_attention_heads, layer.num_key_value_heads
        self.head_dim = getattr(layer, "head_dim", None) or H // self.n_heads
        self.fc = nn.Linear(n_states * H, H, bias=False)
        self.hidden_norm, self.norm = nn.Parameter(torch.ones(H)), nn.Parameter(torch.ones(H))
        self.layers = nn.ModuleList(_Layer(H, self.n_heads, self.n_kv, self.head_dim, layer.intermediate_size)
                                    for _ in range(layer.num_hidden_layers))
        self.lm_head = nn.Parameter(init_head.detach().float().clone())
        for lin in (m for m in self.modules() if isinstance(m, nn.Linear)):
            nn.init.normal_(lin.weight, std=layer.initializer_range)
        self.register_buffer("embedding", embedding.detach(), persistent=False)
        self.register_buffer("draft_ids", draft_ids.long(), persistent=False)
        self.register_buffer("to_draft", draft_map(draft_ids, embedding.shape[0]), persistent=False)
        self.rotary = Rotary(layer, torch.device("cpu"), torch.float32)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., h, n, D] rotated at positions [..., n] (the leading dims shared)."""
        top = int(positions.max()) + 1
        self.rotary.reserve(top)
        flat = positions.reshape(-1, positions.shape[-1])
        cos, sin = next(iter(self.rotary.for_forward(flat, top).values()))  # [N, 1, n, D]
        shape = (*positions.shape[:-1], 1, positions.shape[-1], cos.shape[-1])
        return rope(x, cos.reshape(shape).to(x.dtype), sin.reshape(shape).to(x.dtype))

    def _heads(self, proj: nn.Linear, x: torch.Tensor, n: int) -> torch.Tensor:
        """proj(x) [..., T, n*D] as [..., n, T, D]."""
        return proj(x).unflatten(-1, (n, self.head_dim)).transpose(-2, -3)

    def steps(self, tokens: torch.Tensor, states: torch.Tensor, n_steps: int,
              roots: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Draft-vocabulary logits of block slot k + 1 (step k) for every chain root, [B, T, Vd] each; or, given
        roots [R, 2] (row, position) pairs, for those alone, [R, Vd] each. tokens [B, T] (padding past a row's
        length), states [B, T, n_states * H] the target's."""
        B, T = tokens.shape
        every = roots is None
        if every:
            roots = torch.stack(torch.meshgrid(torch.arange(B), torch.arange(T), indexing="ij"), -1).flatten(0, 1)
        roots = roots.to(tokens.device)
        out = self.read(self.blocks(tokens, states, n_steps, roots), tokens, roots)  # [R, S - 1, Vd]
        if every:
            out = out.unflatten(0, (B, T))
        return list(out.unbind(-2))

    def read(self, hidden: torch.Tensor, tokens: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
        """The draft-vocabulary logits [R, n, Vd] of the roots' drafting slots' final-norm outputs hidden [R, n, H]."""
        return F.linear(hidden, self.lm_head)

    def blocks(self, tokens: torch.Tensor, states: torch.Tensor, n_steps: int, roots: torch.Tensor) -> torch.Tensor:
        """The final-norm outputs [R, n_steps, H] of the drafting slots of each root's block (roots [R, 2])."""
        B, T = tokens.shape
        row, q = roots.unbind(1)
        S = n_steps + 1  # the block: the anchor and n_steps mask tokens
        c = rms_norm(self.fc(states), self.hidden_norm, self.eps)  # [B, T, H] the context
        block = torch.full((len(q), S), self.mask_token_id, dtype=torch.long, device=tokens.device)
        block[:, 0] = F.pad(tokens[:, 1:], (0, 1))[row, q]  # root q's anchor: token q + 1
        h = F.embedding(block, self.embedding).to(c.dtype)  # [R, S, H]
        at = q[:, None] + 1 + torch.arange(S, device=tokens.device)  # [R, S] the slots' positions
        base = torch.arange(T, device=tokens.device)
        for layer in self.layers:
            kc = self._rope(rms_norm(self._heads(layer.k_proj, c, self.n_kv), layer.k_norm, self.eps),
                            base.expand(B, T))  # [B, Hk, T, D]
            vc = self._heads(layer.v_proj, c, self.n_kv)
            h = h + self._attention(layer, rms_norm(h, layer.input_layernorm, self.eps), kc, vc, row, q, at)
            g = rms_norm(h, layer.post_attention_layernorm, self.eps)
            h = h + layer.down_proj(F.silu(layer.gate_proj(g)) * layer.up_proj(g))
        return rms_norm(h[:, 1:], self.norm, self.eps)

    def _attention(self, layer: _Layer, x: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, row: torch.Tensor,
                   q_at: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """x [R, S, H] the roots' blocks, normed; kc, vc [B, Hk, T, D] the context's keys and values; row, q_at [R]
        each root's row and position, at [R, S] its slots' positions. Each row's roots attend to its context up to
        their position and to their own block."""
        group, scale = self.n_heads // self.n_kv, self.head_dim ** -0.5
        q = self._rope(rms_norm(self._heads(layer.q_proj, x, self.n_heads), layer.q_norm, self.eps), at)
        kb = self._rope(rms_norm(self._heads(layer.k_proj, x, self.n_kv), layer.k_norm, self.eps), at)
        vb = self._heads(layer.v_proj, x, self.n_kv)  # q [R, Hq, S, D]; kb, vb [R, Hk, S, D]
        kb, vb = kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1)
        T = kc.shape[2]
        o = torch.empty_like(q)
        for b in row.unique().tolist():  # a row's roots share its context
            mine = (row == b).nonzero().squeeze(1)
            ck, cv = kc[b].repeat_interleave(group, 0), vc[b].repeat_interleave(group, 0)  # [Hq, T, D]
            to_ctx = torch.einsum("rhsd,hjd->rhsj", q[mine], ck) * scale  # [R_b, Hq, S, T]
            sees = torch.arange(T, device=q.device)[None, :] <= q_at[mine][:, None]  # key j <= root
            to_ctx = to_ctx.masked_fill(~sees[:, None, None, :], float("-inf"))
            to_block = q[mine] @ kb[mine].transpose(-1, -2) * scale  # [R_b, Hq, S, S]
            p = torch.cat((to_ctx, to_block), -1).float().softmax(-1).to(q.dtype)
            o[mine] = torch.einsum("rhsj,hjd->rhsd", p[..., :T], cv) + p[..., T:] @ vb[mine]
        return layer.o_proj(o.transpose(1, 2).flatten(-2))  # [R, S, H]

    def labels(self, pred: torch.Tensor, n_steps: int, lengths: torch.Tensor) -> list[torch.Tensor]:
        """Each step's labels [B, T] in draft ids (-100: ignored), as EAGLE-3's (`chain_labels`)."""
        return chain_labels(self.to_draft, pred, n_steps, lengths)

    def weights(self) -> dict[str, torch.Tensor]:
        """The parameters under the speculators format's names (with d2t and t2d)."""
        w = {"fc.weight": self.fc.weight, "hidden_norm.weight": self.hidden_norm, "norm.weight": self.norm,
             "lm_head.weight": self.lm_head}
        for i, layer in enumerate(self.layers):
            w.update({f"layers.{i}.{k}": v for k, v in layer.named().items()})
        w = {k: v.detach().clone().contiguous() for k, v in w.items()}
        return {**w, **vocab_maps(self.draft_ids, self.embedding.shape[0])}
