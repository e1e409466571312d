"""Block drafters as drafters: one forward of the head drafts every position of a block (DFlash:
models/heads/dflash.py), so a round's drafting costs one forward whatever its lookahead.

The loop hands the drafter the target's states of the tokens each verification committed (`see`): they become
the head's context at once (written into its cache, over whatever an earlier block left in those slots). `draft`
then runs the block after each row's last committed token (the anchor, at position N - 1): slot i drafts the
token at N - 1 + i (with the anchor drafting too, N + i). Each position's token is chosen from that position's
logits alone (greedy: the likeliest; sampled: drawn from the warped distribution, which verification is given),
so the drafts of one block do not see each other: the head was trained to fill the block jointly.
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

    def __init__(self, head, name: str, layers: tuple[int, ...]):
        self.head, self.name, self.layers = head, name, layers
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
        logits = self.head.logits(out[:, self.head.first : self.head.first + k])  # [B, k, V]
        drafted, probs = zip(*(choose(logits[:, i], self.sampling, self.generator) for i in range(k)))
        return Proposal(torch.stack(drafted, 1), torch.tensor(limits, dtype=torch.long),
                        None if self.sampling.greedy else torch.stack(probs, 1))

    def end(self) -> None:
        self.cache = None
