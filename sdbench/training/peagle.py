"""A P-EAGLE head being fitted: EAGLE-3's trainee (eagle3.py) whose steps past the first read the mask token and a
learned state (`mask_hidden`, the width of the target states it stands for) instead of the token drafted before
and the head's own output: what drafting/parallel.py feeds at its mask positions, so every step of a chain comes
out of one forward. Step k of the chain rooted at q sits at position q + k and attends to the context 0..q and
to its chain's steps before it, as EAGLE-3's does, and is labelled with the target's choice of token q + k + 2
(speculators' `PEagleDraftModel` fits the same positions from sampled anchors and depths)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sdbench.training.eagle3 import Eagle3Trainee


class PEagleTrainee(Eagle3Trainee):
    """EAGLE-3's trainee with the mask token and its learned state (Eagle3Trainee's arguments, and the mask)."""

    def __init__(self, *args, mask_token_id: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.mask_token_id = mask_token_id
        self.mask_hidden = nn.Parameter(0.02 * torch.randn(self.fc.in_features))

    def inputs(self, step: int, tokens: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if step == 0:
            return super().inputs(step, tokens, x)
        e = F.embedding(torch.tensor(self.mask_token_id, device=tokens.device), self.embedding)
        return e.to(x.dtype).expand(*tokens.shape, -1), self.fc(self.mask_hidden).expand(*tokens.shape, -1)

    def weights(self) -> dict[str, torch.Tensor]:
        return {**super().weights(), "mask_hidden": self.mask_hidden.detach().clone().reshape(1, 1, -1)}
