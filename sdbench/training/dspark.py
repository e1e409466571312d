"""A DSpark head being fitted: DFlash's trainee (dflash.py) with DSpark's Markov head (vanilla: the bias W2 W1[prev]
on each drafting slot's logits, prev the token before the slot's) and its confidence head (sigmoid(w . [h; W1[prev]]
+ b), the slot's predicted acceptance), under speculators' names.

As speculators fits it, each slot's previous token is the data's (teacher forcing: the anchor for the first slot,
then the sequence's own tokens); decoding feeds the tokens the head drafted. The confidence head is fitted by
binary cross-entropy to whether the slot's draft is the target's own choice there (its greedy acceptance), a
target that does not carry gradient, beside the drafts' cross-entropy (`aux_loss`, added by fit.step_losses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sdbench.training.dflash import DFlashTrainee

MARKOV_RANK = 256  # speculators' default rank of the Markov head's W1 W2
CONFIDENCE_WEIGHT = 1.0  # the confidence loss beside the drafts' (speculators' confidence_head_alpha)


class DSparkTrainee(DFlashTrainee):
    """DSpark's trainable part over the target's frozen embedding (DFlashTrainee's arguments, and the rank)."""

    def __init__(self, *args, rank: int = MARKOV_RANK, **kwargs):
        super().__init__(*args, **kwargs)
        H, V = self.layer_config.hidden_size, self.embedding.shape[0]
        self.rank = rank
        self.markov_w1 = nn.Embedding(V, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, len(self.draft_ids), bias=False)
        self.confidence = nn.Linear(H + rank, 1)
        self.confidence_logits: list[torch.Tensor] = []  # the last `steps` call's, per step, shaped as its logits

    def steps(self, tokens: torch.Tensor, states: torch.Tensor, n_steps: int,
              roots: torch.Tensor | None = None) -> list[torch.Tensor]:
        """DFlashTrainee.steps with the Markov bias; keeps each step's confidence logits (`confidence_logits`)."""
        out = super().steps(tokens, states, n_steps, roots)
        sure = self._sure if roots is not None else self._sure.unflatten(0, tokens.shape)
        self.confidence_logits = list(sure.unbind(-1))
        return out

    def read(self, hidden: torch.Tensor, tokens: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
        row, q = roots.unbind(1)
        n = hidden.shape[1]
        at = q[:, None] + 1 + torch.arange(n, device=tokens.device)  # the token before step k's: q + 1 + k
        prev = F.pad(tokens, (0, n + 1))[row[:, None], at]  # [R, n]
        e = self.markov_w1(prev)
        self._sure = self.confidence(torch.cat((hidden, e), -1)).squeeze(-1)  # [R, n]
        return super().read(hidden, tokens, roots) + self.markov_w2(e)

    def aux_loss(self, logits: list[torch.Tensor], labels: list[torch.Tensor]) -> torch.Tensor:
        """The confidence head's loss on the last `steps` call: per labelled slot, BCE to its greedy acceptance."""
        terms = []
        for lg, lb, sure in zip(logits, labels, self.confidence_logits):
            keep = lb != -100
            if bool(keep.any()):
                hit = (lg.detach().argmax(-1) == lb).float()
                terms.append(F.binary_cross_entropy_with_logits(sure[keep].float(), hit[keep]))
        return CONFIDENCE_WEIGHT * torch.stack(terms).mean() if terms else torch.zeros(())

    def weights(self) -> dict[str, torch.Tensor]:
        w = {"markov_head.markov_w1.weight": self.markov_w1.weight,
             "markov_head.markov_w2.weight": self.markov_w2.weight,
             "confidence_head.proj.weight": self.confidence.weight, "confidence_head.proj.bias": self.confidence.bias}
        return {**super().weights(), **{k: v.detach().clone().contiguous() for k, v in w.items()}}
