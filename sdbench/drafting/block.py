"""Block drafters as drafters: one forward of the head drafts every position of a block (DFlash:
models/heads/dflash.py), so a round's drafting costs one forward whatever its lookahead.

The loop hands the drafter the target's states of the tokens each verification committed (`see`): they become
the head's context at once (written into its cache, over whatever an earlier block left in those slots). `draft`
then runs the block after each row's last committed token (the anchor, at position N - 1): slot i drafts the
token at N - 1 + i (with the anchor drafting too, N + i). Each position's token is chosen from that position's
logits (greedy: the likeliest; sampled: drawn from the warped distribution, which verification is given): in
DFlash from them alone, the head trained to fill the block jointly; in DSpark (models/heads/dspark.py) after a
bias from the token drafted before it, and with a predicted acceptance per slot, from which `confidence` cuts
the drafts a row verifies (a stopping rule on the drafts before each slot: lossless).
"""

from __future__ import annotations

import torch

from sdbench.engine.hidden import TargetStates
from sdbench.engine.sampling import choose
from sdbench.engine.state import DecodeState, Proposal


class BlockDrafter:
    """Drafts up to `head.most_drafts` tokens per row with one forward of a block head over its own cache (the
    context as the target committed it)."""

    tree = None  # a chain per row

    def __init__(self, head, name: str, layers: tuple[int, ...], confidence: float = 0.0):
        self.head, self.name, self.layers = head, name, layers
        self.confidence = confidence  # DSpark: verify a row's drafts while their predicted reach is at least this
        self.cache = None

    def begin(self, state: DecodeState) -> None:
        self.sampling, self.generator = state.sampling, state.generator
        self.cache = self.head.new_cache(state.batch, state.capacity)

    def see(self, states: TargetStates) -> None:
        self.head.context(self.cache, states.states, states.start)

    def draft(self, ctx: torch.Tensor, lengths: list[int], limits: list[int]) -> Proposal:
        k = max(limits, default=0)
        if k == 0:
            return Proposal.empty(len(lengths))
        if k > self.head.most_drafts:
            raise ValueError(f"a block drafts at most {self.head.most_drafts} tokens, {k} were asked for")
        rows = torch.arange(len(lengths))
        anchors = ctx[rows, torch.tensor(lengths) - 1]
        out = self.head.block(self.cache, anchors, [n - 1 for n in lengths])  # [B, block, H]
        drafted, probs, sure = self.head.chain(out, anchors, k, lambda lg: choose(lg, self.sampling, self.generator),
                                               self.confidence)
        counts = torch.tensor(limits, dtype=torch.long)
        if sure is not None and self.confidence > 0:
            counts = torch.minimum(counts, verified(sure.cpu(), self.confidence))
        return Proposal(torch.stack(drafted, 1), counts, None if self.sampling.greedy else torch.stack(probs, 1))

    def end(self) -> None:
        self.cache = None


def verified(sure: torch.Tensor, threshold: float) -> torch.Tensor:
    """The drafts [B] worth verifying per row from each slot's predicted acceptance sure [B, k]: the leading slots
    whose reach (the chance every draft up to it is accepted, the product of sure up to it) is at least
    `threshold`."""
    return (sure.double().cumprod(1) >= threshold).long().cumprod(1).sum(1)
