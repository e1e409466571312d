"""DFlash 2's forward (z-lab `DFlash2DraftModel`, speculators `DFlash2DraftModel`): DFlash's block (dflash.py) with
local convolutions around every sublayer and a candidate selector reading the block slot by slot.

Convolutions: around each layer's attention and MLP, the normed input x [B, block, H] is convolved along the
block before the sublayer and the sublayer's output after it, each with a causal kernel of `conv_kernel_size`
taps over the block's slots (slot s reads slots s, s - 1, ...; nothing before the block's first slot) whose
weights are a learned base per channel plus a dynamic part per group of `conv_group_size` channels, projected
from x at that slot (one projection gives both the input's and the output's dynamic parts).

Selector: slot s's draft logits over the target's head (`unary`) keep their top `selector_top_k` candidates,
each rescored by adding (P[prev] * W h_s) . S[candidate], with prev the token before the slot (the anchor, then
each slot's draft), h_s the slot's final-norm output, P and S the predecessor and successor codebooks and W the
hidden projection; every other token is out (-inf). Each draft is chosen from those scores, so it sees the one
before it; the draft distribution verification is given is the one it was drawn from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sdbench.models.heads.dflash import DFlashHead


def convolve(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group: int) -> torch.Tensor:
    """x [B, T, H] convolved causally along T (zeros before the first slot): out[t] = sum over taps o of
    (base[o] + dynamic[t, o] per group) * x[t - o]; dynamic [B, T, kernel, H / group], base [kernel, H]."""
    B, T, H = x.shape
    groups = H // group
    blocks = x.view(B, T, groups, group)
    out = torch.zeros_like(blocks)
    for o in range(base.shape[0]):
        shifted = blocks if o == 0 else F.pad(blocks[:, :T - o], (0, 0, 0, 0, o, 0))
        out = out + (base[o].view(1, 1, groups, group) + dynamic[:, :, o, :, None]) * shifted
    return out.view(B, T, H)


class DFlash2Head(DFlashHead):
    """DFlash's block with DFlash 2's convolutions and candidate selector over a target runner."""

    def __init__(self, head, target):
        super().__init__(head, target)
        self.kernel, self.group = head.markov["conv_kernel_size"], head.markov["conv_group_size"]
        self.top_k = head.markov["selector_top_k"]

    def _around(self, name: str, x: torch.Tensor, sublayer) -> torch.Tensor:
        B, T, H = x.shape
        dynamic = self._linear(f"{name}.kernel_projection", x).view(B, T, 2, self.kernel, H // self.group)
        base = self.w[f"{name}.base_kernel"]
        y = sublayer(convolve(x, dynamic[:, :, 0], base[0], self.group))
        return convolve(y, dynamic[:, :, 1], base[1], self.group)

    def scores(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """A slot's draft logits [B, V]: its top candidates rescored by the selector given the token before it prev
        [B], every other token at -inf; h [B, H] the slot's output."""
        unary = self.logits(h)
        top, candidates = unary.topk(self.top_k, dim=-1)
        p = "candidate_selector."
        context = F.embedding(prev.to(self.device), self.w[p + "predecessor_codebook"]) * self._linear(
            p + "hidden_projection", h)  # [B, r]
        moved = (context[:, None, :] * F.embedding(candidates, self.w[p + "successor_codebook"])).sum(-1)
        return torch.full_like(unary, float("-inf")).scatter(1, candidates, top + moved.float())

    @torch.inference_mode()
    def chain(self, out: torch.Tensor, anchors: torch.Tensor, k: int, pick, stop: float = 0.0):
        """As DFlashHead.chain, each slot's logits the selector's scores given the token drafted before it."""
        prev, tokens, probs = anchors.to(self.device), [], []
        for s in range(self.first, self.first + k):
            token, p = pick(self.scores(out[:, s], prev))
            tokens.append(token)
            probs.append(p)
            prev = token
        return tokens, probs, None
