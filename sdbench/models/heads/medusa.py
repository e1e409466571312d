"""Medusa-1's heads (Cai et al., 2024): head k is `medusa_num_layers` residual blocks x + SiLU(W x + b), then its
own vocabulary projection, over the target's final-norm state; head k proposes the token k + 1 ahead of the one
the target's own head proposes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sdbench.models.heads.load import Head


class MedusaHead:
    def __init__(self, head: Head, target):
        self.n_heads = int(head.config["medusa_num_heads"])
        self.depth = int(head.config.get("medusa_num_layers", 1))
        self.w = {k: v.to(target.device, target.dtype) for k, v in head.weights.items()}
        self.vocab_size = self.w[f"0.{self.depth}.weight"].shape[0]

    @torch.inference_mode()
    def logits(self, k: int, h: torch.Tensor) -> torch.Tensor:
        """Head k's logits [B, V] (float32) from final states [B, H]."""
        for j in range(self.depth):
            h = h + F.silu(F.linear(h, self.w[f"{k}.{j}.linear.weight"], self.w.get(f"{k}.{j}.linear.bias")))
        return F.linear(h, self.w[f"{k}.{self.depth}.weight"]).float()
