"""Trained heads as drafters: chain drafting (one candidate per position) from the target's hidden states.

The loop hands the drafter the target's states of the tokens each verification committed to the target's
cache (`see`, engine/hidden.py `TargetStates`); the next `draft` starts from them.

EAGLE: the head's cache position p holds the pair (token p + 1, the state of token p), so after a verification
that committed the tokens at positions s..N-2 to the target's cache (N: the committed length), the head feeds
those pairs, which overwrite whatever its own drafts left there (the whole of rewinding), and drafts from its
output at N - 2; each further draft feeds the drafted token with the head's own output.

Medusa (Cai et al., 2024): head k reads the target's final state of token N - 2 and proposes token N + k
(the target's own head proposed token N - 1); the heads need no cache.
"""

from __future__ import annotations

import torch

from sdbench.engine.hidden import TargetStates
from sdbench.engine.sampling import choose
from sdbench.engine.state import DecodeState, Proposal


class EagleDrafter:
    """Drafts with an EAGLE head (models/heads/eagle.py: its forward, over a KV cache of its own kept in step
    with the target's). layers: the target states it reads (engine/hidden.py)."""

    def __init__(self, head, name: str, layers: tuple[int, ...]):
        self.head, self.name, self.layers = head, name, layers
        self.cache, self.pending = None, None

    def begin(self, state: DecodeState) -> None:
        self.sampling, self.generator = state.sampling, state.generator
        self.cache = self.head.new_cache(state.batch, state.capacity)
        self.pending = None

    def see(self, states: TargetStates) -> None:
        self.pending = states

    def _feed(self, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending target states fed with the tokens that follow them; (logits [B, V], output [B, H]) at
        each row's last one."""
        ts = self.pending
        self.pending = None
        T = ts.states.shape[1]
        start = torch.tensor(ts.start)
        nxt = (start[:, None] + torch.arange(1, T + 1)).clamp(max=ctx.shape[1] - 1)  # past a row's count: padding
        at = (torch.tensor(ts.count) - 1).clamp(min=0)  # a row with nothing new (done) drafts nothing anyway
        return self.head.forward(self.cache, ctx.gather(1, nxt), ts.states, ts.start, at)

    def draft(self, ctx: torch.Tensor, lengths: list[int], limits: list[int]) -> Proposal:
        k = max(limits, default=0)
        if self.pending is None:
            raise RuntimeError("an EAGLE head drafts from the target's states, which the loop did not give")
        logits, out = self._feed(ctx)
        if k == 0:
            return Proposal.empty(len(lengths))
        drafted, probs = [], []
        zero = torch.zeros(len(lengths), dtype=torch.long)
        for i in range(k):
            x, p = choose(logits, self.sampling, self.generator)
            drafted.append(x)
            probs.append(p)
            if i + 1 < k:
                logits, out = self.head.forward(self.cache, x[:, None], out[:, None], [n - 1 + i for n in lengths],
                                                zero)
        tokens = torch.stack(drafted, 1)
        return Proposal(tokens, torch.tensor(limits, dtype=torch.long),
                        None if self.sampling.greedy else torch.stack(probs, 1))

    def end(self) -> None:
        self.cache = self.pending = None


class MedusaDrafter:
    """Drafts with Medusa-1 heads (models/heads/medusa.py) over the target's final state."""

    def __init__(self, head, name: str, layers: tuple[int, ...]):
        self.head, self.name, self.layers = head, name, layers
        self.last = None  # [B, H] each row's latest target state

    def begin(self, state: DecodeState) -> None:
        self.sampling, self.generator = state.sampling, state.generator
        self.last = None

    def see(self, states: TargetStates) -> None:
        dev = states.states.device
        count = torch.tensor(states.count, device=dev)
        h = states.states[torch.arange(len(count), device=dev), (count - 1).clamp(min=0)]
        if self.last is not None:  # rows with nothing new keep their state
            h = torch.where((count > 0)[:, None], h, self.last)
        self.last = h

    def draft(self, ctx: torch.Tensor, lengths: list[int], limits: list[int]) -> Proposal:
        k = max(limits, default=0)
        if k == 0:
            return Proposal.empty(len(lengths))
        drafted, probs = [], []
        for i in range(k):  # each head on its own: a chain whose positions are drawn independently
            x, p = choose(self.head.logits(i, self.last), self.sampling, self.generator)
            drafted.append(x)
            probs.append(p)
        return Proposal(torch.stack(drafted, 1), torch.tensor(limits, dtype=torch.long),
                        None if self.sampling.greedy else torch.stack(probs, 1))

    def end(self) -> None:
        self.last = None
