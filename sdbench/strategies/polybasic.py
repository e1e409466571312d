"""Polybasic speculative decoding: a chain of drafters under the target, each verifying the one below.

`--draft` is given from the top down: `--target T --draft A --draft B --draft ngram` is the chain
T <- A <- B <- ngram. The bottom (a model, or prompt lookup) drafts `--gamma` tokens per block. Every level
in between runs speculative rounds over the blocks from below, with the same lossless acceptance rule as the
target (`sdbench.engine.sampling.verify`), until it has accumulated at least mu tokens, and hands them all up as one
block. The target verifies the block of the level directly below it in the one decode loop; this proposer
only runs the chain beneath.

Why handing up a middle level's own distribution is lossless. Write q_A for the distribution of the level
directly below the target. A's rounds are speculative sampling with A as the verifier, so, given the tokens
before it, each token A commits is distributed exactly as q_A, whichever level below drafted it and whether
it was an accepted draft or A's own correction. How many tokens A hands up is decided from what happened
before each position (a round ends at a rejection; A stops once it holds mu tokens), never from the token at
that position. To the target, A is therefore an ordinary autoregressive draft with per-token distribution
p = q_A, and the target's rule min(1, q(x) / p(x)) with the residual norm(max(0, q - p)) makes the output
follow the target's q exactly. The same argument applies at every height, so the proposal's `probs` are the
distribution of the level directly below the target after its own verification, not the bottom drafter's.

Settings: `--gamma` is the bottom's block (the only level that drafts a fixed number of tokens); `--set mu=8`
sets the threshold of every level in between, and `--set mu=16,8` one per level from the top down (the order
of --draft). By default the level just above the bottom waits for 2 * gamma tokens and each level above it
for twice the mu of the level below, so each verification sees a longer block than the one below.
`max_ngram`/`min_ngram` configure a prompt-lookup bottom.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sdbench.engine.state import DecodeState, Proposal
from sdbench.engine.step import Round
from sdbench.errors import SdbenchError
from sdbench.drafting.ngram import check_ngram
from sdbench.stats_record import StatsRecord
from sdbench.strategies.base import Proposer
from sdbench.strategies.chain_levels import LevelRecord, LevelStats, ModelLevel, NGramLevel
from sdbench.strategies.spec import BuildContext, Option, Strategy, need_gamma, register

NGRAM = "ngram"


def parse_mu(text: str, levels: int, gamma: int) -> list[int]:
    """mu per verifying level, top-down. '' = defaults (2 * gamma just above the bottom, doubling upwards)."""
    if levels == 0:
        if text.strip():
            raise SdbenchError("--set mu applies to the levels between the target and the bottom drafter; a chain "
                               "of one draft has none (add a --draft)")
        return []
    if not text.strip():
        return [gamma * 2 ** (levels - i) for i in range(levels)]
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise SdbenchError(f"--set mu={text}: expected whole numbers, one or one per middle level") from None
    if len(values) == 1:
        values = values * levels
    if len(values) != levels or min(values) < 1:
        raise SdbenchError(f"--set mu={text}: expected one value >= 1, or {levels} (one per middle level, "
                           "from the top down)")
    return values


def check_chain(drafts: tuple[str, ...], gamma: int, mu: str = "", max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Raise on an impossible chain (drafts: the --draft names, top down); mu per middle level, top down."""
    need_gamma("polybasic", gamma)
    if not drafts:
        raise SdbenchError("strategy 'polybasic' needs --draft, once per level from the top down "
                           "(e.g. --draft MIDDLE --draft ngram)")
    if NGRAM in drafts[:-1]:
        raise SdbenchError("--draft ngram can only be the last (bottom) level of a polybasic chain: prompt "
                           "lookup drafts but cannot verify")
    check_ngram("polybasic", max_ngram, min_ngram)
    return parse_mu(mu, len(drafts) - 1, gamma)


class Polybasic(Proposer):
    name = "polybasic"

    def __init__(self, drafts: list, gamma: int, mu: str = "", max_ngram: int = 3, min_ngram: int = 1,
                 target_name: str = "target"):
        """drafts: the chain from the top down; each a ModelRunner, or 'ngram' (only at the bottom)."""
        self.mus = parse_mu(mu, len(drafts) - 1, gamma)
        super().__init__(gamma)
        self.ngram = (max_ngram, min_ngram)
        bottom = drafts[-1]
        level = NGramLevel(gamma, max_ngram, min_ngram) if isinstance(bottom, str) else ModelLevel(bottom, gamma=gamma)
        self.levels = [level]  # bottom first while building, top first afterwards
        reach = gamma  # the longest block a level can hand up
        for runner, mu in zip(reversed(drafts[:-1]), reversed(self.mus)):
            level = ModelLevel(runner, below=level, mu=mu)
            self.levels.append(level)
            reach += mu  # mu - 1 held, then one more round: a full block from below plus a bonus token
        self.levels.reverse()
        self.top, self.reach = self.levels[0], reach
        self.target_name = target_name

    @property
    def max_lookahead(self) -> int:
        return self.reach

    def begin(self, state: DecodeState) -> None:
        # the chain's own caches get room for the scratch tokens each level writes past the committed ones
        capacity = state.capacity + 4 * self.reach + 8
        self.ctx = torch.zeros(state.batch, capacity, dtype=torch.long)
        self.ctx[:, : state.capacity] = state.tokens
        self.top.begin(DecodeState(self.ctx, state.lengths, state.limits, sampling=state.sampling,
                                   generator=state.generator, device=state.device))
        self.target = LevelStats(state.batch)

    def propose(self, state: DecodeState) -> Proposal:
        self.ctx[:, : state.capacity] = state.tokens
        room = [state.room(b) for b in range(state.batch)]  # no level drafts past what a row can still commit
        return self.top.produce(self.ctx, list(state.lengths), [not d for d in state.done], room)

    def observe(self, state: DecodeState, proposal: Proposal | None, rnd: Round) -> None:
        self.target.forward_s += rnd.verify_s  # the target's verification, as the loop timed it
        self.target.forwards += 1
        self.target.calls += 1
        for b in range(state.batch):
            if rnd.active[b]:
                self.target.verified(b, rnd.committed[b])
                self.top.stats.handed_up(b, rnd.drafted[b], rnd.committed[b])
        for level in self.levels:
            level.settle()

    def end(self) -> None:
        for level in self.levels:
            level.end()

    def params(self) -> dict:
        chain = [level.label for level in self.levels]
        out = {"gamma": self.gamma, "mu": self.mus, "chain": chain}
        if chain[-1] == NGRAM:
            out.update(max_ngram=self.ngram[0], min_ngram=self.ngram[1])
        return out

    def row_stats(self, b: int) -> dict:
        """PolybasicRowStats: per level, top (the target, level 0) down, forwards and their time (the batch's),
        this row's verification rounds and mean accepted length (bonus included), and its blocks handed up."""
        for level in self.levels:  # a generation whose first token was its last had no round to settle them
            level.settle()
        levels = [self.target.record(b, 0, self.target_name)]
        levels += [level.stats.record(b, i + 1, level.label) for i, level in enumerate(self.levels)]
        return PolybasicRowStats(levels).to_dict()


@dataclass(frozen=True)
class PolybasicRowStats(StatsRecord):
    """One row's strategy_stats under polybasic: a LevelRecord per level, top (the target) down."""

    levels: list[LevelRecord] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"levels": [level.to_dict() for level in self.levels]}

    @classmethod
    def from_dict(cls, data) -> "PolybasicRowStats":
        return cls([LevelRecord.from_dict(level) for level in (data or {}).get("levels") or []])


@register
class PolybasicStrategy(Strategy):
    name = "polybasic"
    help = "a chain of drafters (--draft from the top down, ngram allowed at the bottom), each verifying the one below"
    aliases = ("chain",)
    options = (
        Option("mu", "", "tokens a middle level accumulates before handing them up: one value, or one per "
                         "middle level from the top down (default: 2*gamma above the bottom, doubling upwards)", str),
        Option("max_ngram", 3, "longest suffix to match when the bottom is ngram"),
        Option("min_ngram", 1, "shortest suffix to match when the bottom is ngram"),
    )
    needs_draft = True
    proposer = Polybasic

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        check_chain(drafts, gamma, **options)

    @classmethod
    def search_space(cls, trial, space) -> tuple:
        """gamma, and one mu for the middle levels; the --draft list is the chain, kept whole and in order."""
        gamma = trial.suggest_int("gamma", 1, 8)
        options = {"mu": str(trial.suggest_int("mu", 1, 16))} if len(space.drafts) > 1 else {}
        return gamma, options, tuple(space.drafts)

    @classmethod
    def build(cls, ctx: BuildContext) -> Polybasic:
        return Polybasic(list(ctx.drafts), ctx.gamma, target_name=getattr(ctx.target, "name", "") or "target",
                         **ctx.options)
