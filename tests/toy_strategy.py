"""A whole new strategy in one file: a drafter that proposes the last committed token repeated, the
fixed-lookahead proposer that drafts through it, and its declaration. `test_toy_strategy.py` registers it with
one line (`register(RepeatStrategy)`, what the decorator on a shipped declaration does) and runs it through the
one decode loop like any shipped strategy."""

from __future__ import annotations

import torch

from sdbench.engine.state import Proposal
from sdbench.strategies.base import FixedLookahead
from sdbench.strategies.spec import Strategy, need_gamma


class RepeatDrafter:
    name = "repeat"

    def begin(self, state) -> None:
        pass

    def catch_up(self, ctx, lengths) -> int:
        return 0

    def draft(self, ctx, lengths, limits) -> Proposal:
        last = ctx[torch.arange(len(lengths)), torch.tensor(lengths) - 1]  # [B]
        tokens = last[:, None].expand(-1, max(limits, default=0))
        return Proposal(tokens.clone(), torch.tensor(limits, dtype=torch.long))

    def end(self) -> None:
        pass


class Repeat(FixedLookahead):
    name = "repeat"

    def __init__(self, gamma: int):
        super().__init__(RepeatDrafter(), gamma)


class RepeatStrategy(Strategy):
    name = "repeat"
    help = "the last token, repeated"
    proposer = Repeat

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        need_gamma(cls.name, gamma)
