"""Medusa-1 heads being fitted: head k is residual blocks x + SiLU(W x + b) over the target's final-norm state,
then a vocabulary projection that starts as (and here stays) a copy of the target's own head, as Medusa-1
initialises it. Head k at position p predicts token p + k + 2 (models/heads/medusa.py drafts with the same
rule): its label is the target's own prediction at position p + k + 1."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MedusaTrainee(nn.Module):
    """n_heads heads of `depth` residual blocks each over a frozen copy of the target's head [V, H]. The blocks
    start at zero, so each head starts as the target's own head (Medusa-1's initialisation)."""

    def __init__(self, target_head: torch.Tensor, n_heads: int, depth: int = 1):
        super().__init__()
        V, H = target_head.shape
        self.n_heads, self.depth = n_heads, depth
        self.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(H, H) for _ in range(depth)) for _ in range(n_heads))
        for head in self.blocks:
            for lin in head:
                nn.init.zeros_(lin.weight)
                nn.init.zeros_(lin.bias)
        self.register_buffer("head", target_head.detach(), persistent=False)

    def steps(self, tokens: torch.Tensor, states: torch.Tensor, n_steps: int) -> list[torch.Tensor]:
        """Logits [B, T, V] of heads 0..n_steps-1 at every position; states [B, T, H] (final-norm)."""
        out = []
        for k in range(min(n_steps, self.n_heads)):
            h = states
            for lin in self.blocks[k]:
                h = h + F.silu(lin(h))
            out.append(F.linear(h, self.head.to(h.dtype)))
        return out

    def labels(self, pred: torch.Tensor, n_steps: int, lengths: torch.Tensor) -> list[torch.Tensor]:
        """Head k's labels [B, T]: the target's prediction at position p + k + 1 (-100 past a row's end)."""
        T = pred.shape[1]
        roots = torch.arange(T, device=pred.device)[None, :]
        return [F.pad(pred[:, k + 1:], (0, k + 1)).masked_fill(roots + k + 1 >= lengths[:, None], -100)
                for k in range(min(n_steps, self.n_heads))]

    def weights(self) -> dict[str, torch.Tensor]:
        """Medusa-1's names: `{k}.{j}.linear.*` for block j of head k, `{k}.{depth}.weight` its projection."""
        w = {}
        for k, head in enumerate(self.blocks):
            for j, lin in enumerate(head):
                w[f"{k}.{j}.linear.weight"] = lin.weight.detach().clone()
                w[f"{k}.{j}.linear.bias"] = lin.bias.detach().clone()
            w[f"{k}.{self.depth}.weight"] = self.head.detach().clone()
        return w
