"""An MTP module being fitted (the forward of models/heads/mtp.py, unrolled as EAGLE-3's chains are in
eagle3.py): step 0 reads (token q + 1, the target's final-norm state of q) at position q, each further step the
token after and the module's own output before it; every step is x = input_proj(cat(token_layernorm(e),
hidden_layernorm(h))), one Qwen3 decoder layer over x (speculators' MTP layer type), o = final_layernorm(its
output), fed back and read by the target's own head (frozen, not written). Each step is labelled with the
target's choice of token q + k + 2, over the target's whole vocabulary (an MTP module has no draft vocabulary).

speculators' `MTPDraftModel` fits every step teacher-forced over whole sequences (step k at position t attends to
step k's outputs at every position before t); here step k of a chain attends to the step-0 keys of its context
and to its own chain's earlier steps, the cache the module holds when it drafts (drafting/heads.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sdbench.models.heads.eagle import rms_norm
from sdbench.training.eagle3 import ChainTrainee

PREFIX = "mtp_layers.0."
ALL_ROOTS = 1 << 30  # `fit.step_losses` fits at most this many labelled roots per batch: all of them


class MTPTrainee(ChainTrainee):
    """One MTP module over the target's frozen embedding [V, H] and output head [V, H]; layer: its decoder layer's
    config (a transformers Qwen3Config at the target's attention shape)."""

    def __init__(self, layer, embedding: torch.Tensor, head: torch.Tensor):
        super().__init__()
        H = layer.hidden_size
        self._layer(layer, H)
        self.input_proj = nn.Linear(2 * H, H, bias=False)
        self.token_layernorm = nn.Parameter(torch.ones(H))
        self.hidden_layernorm = nn.Parameter(torch.ones(H))
        self.input_layernorm = nn.Parameter(torch.ones(H))
        self.q_norm = nn.Parameter(torch.ones(self.head_dim))
        self.k_norm = nn.Parameter(torch.ones(self.head_dim))
        self.norm = nn.Parameter(torch.ones(H))  # final_layernorm: train-head starts it as the target's final norm
        self._init(self.input_proj)
        self.register_buffer("embedding", embedding.detach(), persistent=False)
        self.register_buffer("head", head.detach(), persistent=False)
        self.register_buffer("to_draft", torch.arange(embedding.shape[0]), persistent=False)
        # a fitting step's logits only at the roots it fits (every answer position, none of the prompts'): the
        # full-vocabulary head is most of a step's cost
        self.roots_per_batch = ALL_ROOTS

    def first(self, states: torch.Tensor) -> torch.Tensor:
        return states

    def _qkv(self, x: torch.Tensor, e: torch.Tensor, positions: torch.Tensor):
        proj = self.input_proj(torch.cat((rms_norm(e, self.token_layernorm, self.eps),
                                          rms_norm(x, self.hidden_layernorm, self.eps)), -1))
        a = rms_norm(proj, self.input_layernorm, self.eps)
        return *self._heads(a, positions, self.q_norm, self.k_norm), proj

    def _fed(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.norm, self.eps)

    def _logits(self, fed: torch.Tensor) -> torch.Tensor:
        return F.linear(fed, self.head)

    def weights(self) -> dict[str, torch.Tensor]:
        """The parameters under the speculators MTP format's names (the embedding and head are the target's)."""
        w = {"input_proj.weight": self.input_proj.weight, "token_layernorm.weight": self.token_layernorm,
             "hidden_layernorm.weight": self.hidden_layernorm, "final_layernorm.weight": self.norm,
             "input_layernorm.weight": self.input_layernorm, "post_attention_layernorm.weight":
             self.post_attention_layernorm, "self_attn.q_norm.weight": self.q_norm,
             "self_attn.k_norm.weight": self.k_norm}
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w[f"self_attn.{name}.weight"] = getattr(self, name).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            w[f"mlp.{name}.weight"] = getattr(self, name).weight
        return {PREFIX + k: v.detach().clone().contiguous() for k, v in w.items()}
