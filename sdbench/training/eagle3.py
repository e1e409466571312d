"""An EAGLE-3 head being fitted: its parameters under the speculators format's names, and the unrolled
training forward (EAGLE-3's "training-time test").

The forward is the one `models/heads/eagle.py` drafts with, written over whole sequences at once. For a chain
rooted at position q (the last position whose target state the head has), step 0 reads (token q + 1, target
states of q) at position q and predicts token q + 2; step k reads (token q + k + 1, the head's own step k - 1
output) at position q + k and predicts token q + k + 2. Step k's query attends to the step-0 keys of positions
0..q and to the keys of steps 1..k of its own chain — exactly the cache drafting holds when it reaches step k
(drafting/heads.py). The loss is the cross-entropy of each step against the target's own choice of that token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sdbench.models.heads.eagle import rms_norm
from sdbench.models.forward.rotary import Rotary, rope


class ChainTrainee(nn.Module):
    """One decoder layer unrolled as a chain drafts (the training-time test), for a head whose kind gives the
    layer's input (`first`, `inputs`, `_qkv`) and output (`_fed`, `_logits`): EAGLE-3's, P-EAGLE's, an MTP module's."""

    def _layer(self, layer, width: int) -> None:
        """The decoder layer's attention (its q, k, v projections reading `width` features), MLP and
        post-attention norm, at the attention shape of `layer` (a transformers config)."""
        H = layer.hidden_size
        self.layer_config, self.eps = layer, layer.rms_norm_eps
        self.n_heads, self.n_kv = layer.num_attention_heads, layer.num_key_value_heads
        self.head_dim = getattr(layer, "head_dim", None) or H // self.n_heads
        D, Hq, Hk = self.head_dim, self.n_heads, self.n_kv
        self.q_proj = nn.Linear(width, Hq * D, bias=False)
        self.k_proj = nn.Linear(width, Hk * D, bias=False)
        self.v_proj = nn.Linear(width, Hk * D, bias=False)
        self.o_proj = nn.Linear(Hq * D, H, bias=False)
        self.gate_proj = nn.Linear(H, layer.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, layer.intermediate_size, bias=False)
        self.down_proj = nn.Linear(layer.intermediate_size, H, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        self.rotary = Rotary(layer, torch.device("cpu"), torch.float32)

    def _init(self, *linears: nn.Linear) -> None:
        for lin in (*linears, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj,
                    self.down_proj):
            nn.init.normal_(lin.weight, std=self.layer_config.initializer_range)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, h, T, D] rotated at positions [B, T]."""
        self.rotary.reserve(int(positions.max()) + 1)
        cos, sin = next(iter(self.rotary.for_forward(positions, int(positions.max()) + 1).values()))
        return rope(x, cos.to(x.dtype), sin.to(x.dtype))

    def _heads(self, a: torch.Tensor, positions: torch.Tensor, q_norm=None, k_norm=None):
        """q, k, v [B, Hq, T, D] of the attention input a [B, T, width] (k and v repeated over each group), q and k
        normed per head where the layer has those norms (Qwen3), then rotated at positions [B, T]."""
        B, T, _ = a.shape
        q = self.q_proj(a).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(a).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(a).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if q_norm is not None:
            q, k = rms_norm(q, q_norm, self.eps), rms_norm(k, k_norm, self.eps)
        group = self.n_heads // self.n_kv
        k, v = k.transpose(1, 2).repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return self._rope(q.transpose(1, 2), positions), self._rope(k, positions), v

    def steps(self, tokens: torch.Tensor, states: torch.Tensor, n_steps: int,
              roots: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Logits [B, T, Vd] of each step for every chain root; tokens [B, T] (padding past a row's length), states
        [B, T, S] the target's. roots [R, 2] (row, position): logits [R, Vd] of those roots' chains alone (every
        chain is still computed, as each attends to the others' first steps; a head whose logits are its cost, an
        MTP module's full vocabulary, skips the rest: `roots_per_batch`)."""
        B, T = tokens.shape
        scale = self.head_dim ** -0.5
        x = self.first(states)
        base = torch.arange(T, device=tokens.device)
        causal = (base[None, :] <= base[:, None])  # [root q, key j]: j <= q
        keys0 = values0 = None
        chain_k, chain_v, out = [], [], []
        for step in range(n_steps):
            e, x = self.inputs(step, tokens, x)
            q, k, v, residual = self._qkv(x, e, (base + step).expand(B, T))
            if step == 0:
                keys0, values0 = k, v
            else:
                chain_k.append(k)
                chain_v.append(v)
            s0 = (q @ keys0.transpose(-1, -2)) * scale
            s0 = s0.masked_fill(~causal, float("-inf"))  # [B, Hq, T, T]
            own = [(q * ck).sum(-1, keepdim=True) * scale for ck in chain_k]  # [B, Hq, T, 1] each
            p = torch.cat([s0, *own], -1).float().softmax(-1).to(q.dtype)
            attn = p[..., :T] @ values0
            for j, cv in enumerate(chain_v):
                attn = attn + p[..., T + j: T + j + 1] * cv
            attn = attn.transpose(1, 2).reshape(B, T, -1)
            h = residual + self.o_proj(attn)
            g = rms_norm(h, self.post_attention_layernorm, self.eps)
            h = h + self.down_proj(F.silu(self.gate_proj(g)) * self.up_proj(g))
            x = self._fed(h)  # the next step feeds the head's own output back
            out.append(self._logits(x if roots is None else x[roots[:, 0], roots[:, 1]]))
        return out

    def inputs(self, step: int, tokens: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step`'s embedded tokens and states [B, T, H] at every root: token q + step + 1 (0 past the end)
        with x, the first states (step 0) or the step before's output."""
        nxt = F.pad(tokens[:, step + 1:], (0, step + 1))
        return F.embedding(nxt, self.embedding).to(x.dtype), x

    def labels(self, pred: torch.Tensor, n_steps: int, lengths: torch.Tensor) -> list[torch.Tensor]:
        """Each step's labels [B, T] in draft ids (-100: ignored): `chain_labels`."""
        return chain_labels(self.to_draft, pred, n_steps, lengths)


class Eagle3Trainee(ChainTrainee):
    """EAGLE-3's trainable part over a frozen target embedding.

    layer: the decoder layer's config (a transformers LlamaConfig at the target's attention shape);
    draft_ids: the target ids of the draft vocabulary, ascending [Vd]; init_head: the target's head rows for
    them [Vd, H] (the draft lm_head starts from them)."""

    def __init__(self, layer, embedding: torch.Tensor, draft_ids: torch.Tensor, init_head: torch.Tensor,
                 n_states: int = 3, norm_before_residual: bool = False):
        super().__init__()
        H = layer.hidden_size
        self._layer(layer, 2 * H)
        self.norm_before_residual = norm_before_residual
        self.fc = nn.Linear(n_states * H, H, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(H))
        self.hidden_norm = nn.Parameter(torch.ones(H))
        self.norm = nn.Parameter(torch.ones(H))
        self.lm_head = nn.Parameter(init_head.detach().float().clone())
        self._init(self.fc)
        self.register_buffer("embedding", embedding.detach(), persistent=False)
        self.register_buffer("draft_ids", draft_ids.long(), persistent=False)
        self.register_buffer("to_draft", draft_map(draft_ids, embedding.shape[0]), persistent=False)

    def first(self, states: torch.Tensor) -> torch.Tensor:
        return self.fc(states)

    def _qkv(self, x: torch.Tensor, e: torch.Tensor, positions: torch.Tensor):
        hn = rms_norm(x, self.hidden_norm, self.eps)
        attn_in = torch.cat((rms_norm(e, self.input_layernorm, self.eps), hn), -1)
        return *self._heads(attn_in, positions), (hn if self.norm_before_residual else x)

    def _fed(self, h: torch.Tensor) -> torch.Tensor:
        """The step's output as fed back (EAGLE-3: before the final norm)."""
        return h

    def _logits(self, fed: torch.Tensor) -> torch.Tensor:
        """The step's draft logits from its fed-back output."""
        return F.linear(rms_norm(fed, self.norm, self.eps), self.lm_head)

    def weights(self) -> dict[str, torch.Tensor]:
        """The parameters under the speculators format's names (with d2t and t2d)."""
        w = {"fc.weight": self.fc.weight, "norm.weight": self.norm, "lm_head.weight": self.lm_head}
        layer = {"self_attn.q_proj.weight": self.q_proj.weight, "self_attn.k_proj.weight": self.k_proj.weight,
                 "self_attn.v_proj.weight": self.v_proj.weight, "self_attn.o_proj.weight": self.o_proj.weight,
                 "mlp.gate_proj.weight": self.gate_proj.weight, "mlp.up_proj.weight": self.up_proj.weight,
                 "mlp.down_proj.weight": self.down_proj.weight, "input_layernorm.weight": self.input_layernorm,
                 "hidden_norm.weight": self.hidden_norm,
                 "post_attention_layernorm.weight": self.post_attention_layernorm}
        w.update({f"layers.0.{k}": v for k, v in layer.items()})
        w = {k: v.detach().clone().contiguous() for k, v in w.items()}
        return {**w, **vocab_maps(self.draft_ids, self.embedding.shape[0])}


def draft_map(draft_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[vocab] each target id's draft id (-100: not in the draft vocabulary)."""
    to_draft = torch.full((vocab,), -100, dtype=torch.long)
    to_draft[draft_ids.long()] = torch.arange(len(draft_ids))
    return to_draft


def chain_labels(to_draft: torch.Tensor, pred: torch.Tensor, n_steps: int, lengths: torch.Tensor) -> list[torch.Tensor]:
    """Each step's labels [B, T] in draft ids (-100: ignored) for chains rooted at every position q: step k's is
    the target's choice of token q + k + 2, i.e. its prediction at position q + k + 1 (pred [B, T], the target's
    argmax per position); to_draft: `draft_map`."""
    B, T = pred.shape
    roots = torch.arange(T, device=pred.device)[None, :]
    out = []
    for step in range(n_steps):
        at = roots + step + 1
        lab = to_draft[F.pad(pred[:, step + 1:], (0, step + 1))]
        out.append(lab.masked_fill(at >= lengths[:, None], -100))
    return out


def vocab_maps(draft_ids: torch.Tensor, vocab: int) -> dict[str, torch.Tensor]:
    """The speculators format's maps of a draft vocabulary: d2t (draft token i is target token i + d2t[i]) and t2d
    (which of the target's `vocab` tokens are drafted)."""
    ids = draft_ids.cpu()
    return {"d2t": ids - torch.arange(len(ids)), "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)}
