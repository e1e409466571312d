"""The levels of a polybasic chain below the target: a bottom drafter and the verifying levels above it.

Every level answers `produce(ctx, lens, active, room) -> Proposal`: at most room[b] tokens (what row b can
still commit) continuing each row's context ctx[b, :lens[b]], distributed as that level's own model would
sample them (for the bottom drafter by construction; for a verifying level because its speculative rounds are
lossless). Rows with active[b] False may get anything; their tokens are never used.

ctx is a scratch buffer [B, W] shared down the chain: a verifying level commits the tokens it has accepted so
far at ctx[b, lens[b]:] before asking the level below for more, so each level sees the context as it stands at
its own height. Whatever lies beyond a level's lens is scratch for it.

The bottom is a drafter (drafting/), and a verifying level drafts through the same model drafter: its KV cache
is kept in step with the context it is asked about, whatever the levels above accepted, corrected or rewound.
A verifying level's rounds are the one verify-and-commit step (engine/step.py), as the target's are.
Forward times are taken without waiting for the device (engine/clock.Spans) and settled by `settle` once
the decode loop's round has reached the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from sdbench.drafting.model import ModelDrafter
from sdbench.drafting.ngram import NGramDrafter
from sdbench.engine.clock import Spans
from sdbench.engine.formulas import acceptance_rate, mean_accepted_length
from sdbench.engine.sampling import probs_from_logits
from sdbench.engine.state import DecodeState, Proposal
from sdbench.engine.step import verify_and_commit
from sdbench.stats_record import StatsRecord


def _json(x: float):
    """NaN (no rounds) as None in the JSON-able per-level record."""
    return None if math.isnan(x) else x


@dataclass(frozen=True)
class LevelRecord(StatsRecord):
    """One level's figures for one row (`LevelStats.record`): forwards, their time and the level's blocks are
    the batch's; the rest are the row's. A rate is None for a level that verifies (or hands up) nothing."""

    level: int = 0  # 0: the target
    model: str = ""
    forwards: int = 0
    forward_s: float = 0.0
    prefill_s: float = 0.0  # the level's own prefill of the prompts
    blocks: int = 0  # blocks produced for the whole batch
    rounds: int = 0  # this level's own verifications (a verifying level only)
    committed: int = 0  # tokens those rounds committed, bonus or correction included
    mean_accepted_len: float | None = None
    committed_sq: int = 0  # sum over rounds of (tokens committed)^2
    accepted_len_var: float | None = None
    proposals: int = 0  # blocks this level handed up
    proposed: int = 0  # their tokens
    accepted: int = 0  # of those, accepted by the level above
    acceptance_rate: float | None = None


@dataclass
class LevelStats:
    """One generation's counters for a level. Forwards and their time are the batch's; the rest are per row.

    rounds/committed: this level's own verifications (a verifying level only) and the tokens they committed,
    accepted drafts plus the correction or bonus token; committed_sq: the sum of squares of the tokens each
    round committed, from which the variance of the accepted length follows (the polybasic paper's Theorem 3.3
    compares it under sampling and greedy decoding). proposals/proposed/accepted: the blocks this level
    handed up, their tokens, and how many of those the level above accepted.
    """

    batch: int
    forwards: int = 0
    forward_s: float = 0.0
    calls: int = 0  # blocks produced for the whole batch
    prefill_s: float = 0.0  # the level's own prefill of the prompts (not a forward of the chain's rounds)
    rounds: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    committed_sq: list[int] = field(default_factory=list)  # sum over rounds of (tokens committed)^2
    proposals: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self):
        for name in ("rounds", "committed", "committed_sq", "proposals", "proposed", "accepted"):
            setattr(self, name, [0] * self.batch)

    def handed_up(self, b: int, proposed: int, accepted: int) -> None:
        self.proposals[b] += 1
        self.proposed[b] += proposed
        self.accepted[b] += accepted

    def verified(self, b: int, accepted: int) -> None:
        self.rounds[b] += 1
        self.committed[b] += accepted + 1
        self.committed_sq[b] += (accepted + 1) ** 2

    def record(self, b: int, level: int, model: str) -> LevelRecord:
        """Row b's figures."""
        rounds, proposals = self.rounds[b], self.proposals[b]
        return LevelRecord(
            level=level, model=model, forwards=self.forwards, forward_s=self.forward_s, prefill_s=self.prefill_s,
            blocks=self.calls, rounds=rounds, committed=self.committed[b],
            mean_accepted_len=_json(mean_accepted_length(self.committed[b], rounds, rows=0)),
            committed_sq=self.committed_sq[b],
            accepted_len_var=_json(length_variance(self.committed[b], self.committed_sq[b], rounds)),
            proposals=proposals, proposed=self.proposed[b], accepted=self.accepted[b],
            acceptance_rate=_json(acceptance_rate(self.accepted[b], self.proposed[b])),
        )


def length_variance(total: float, total_sq: float, rounds: float) -> float:
    """Variance of the tokens committed per round (bonus included) from their sum and sum of squares over
    `rounds` rounds (population variance: the rounds are all there is); NaN without a round."""
    if not rounds:
        return math.nan
    mean = total / rounds
    return max(total_sq / rounds - mean * mean, 0.0)


class NGramLevel:
    """Prompt lookup as the bottom of a chain: up to gamma tokens per block, one-hot (deterministic)."""

    def __init__(self, gamma: int, max_ngram: int, min_ngram: int):
        self.label = "ngram"
        self.gamma = gamma
        self.drafter = NGramDrafter(max_ngram, min_ngram)
        self.spans = Spans()

    def begin(self, state: DecodeState) -> None:
        self.stats = LevelStats(state.batch)

    def end(self) -> None:
        pass

    def settle(self) -> None:
        self.stats.forward_s += self.spans.settle()

    def produce(self, ctx: torch.Tensor, lens: list[int], active: list[bool], room: list[int]) -> Proposal:
        t0 = self.spans.start()
        limits = [min(self.gamma, r) if a else 0 for a, r in zip(active, room)]
        block = self.drafter.draft(ctx, lens, limits)  # trimmed: the level above verifies no padding
        self.spans.stop(t0)
        self.stats.forwards += 1
        self.stats.calls += 1
        return block


class ModelLevel:
    """A model in the chain. With no level below it drafts gamma tokens autoregressively; with one, it runs
    speculative rounds over the blocks from below until each active row has accumulated at least mu tokens."""

    def __init__(self, runner, below=None, gamma: int = 0, mu: int = 0):
        self.runner, self.below, self.gamma, self.mu = runner, below, gamma, mu
        self.label = runner.name or "model"
        self.drafter = ModelDrafter(runner)
        self.spans = Spans(runner.device)
        self.prefill = Spans(runner.device)

    def begin(self, state: DecodeState) -> None:
        """Prefill every row but its last token (the next forward feeds it, as in the loop)."""
        self.stats = LevelStats(state.batch)
        self.sampling, self.generator = state.sampling, state.generator
        t0 = self.prefill.start()
        self.drafter.begin(state)
        self.prefill.stop(t0)
        if self.below is not None:
            self.below.begin(state)

    def end(self) -> None:
        self.drafter.end()

    def settle(self) -> None:
        self.stats.prefill_s += self.prefill.settle()
        self.stats.forward_s += self.spans.settle()

    def produce(self, ctx: torch.Tensor, lens: list[int], active: list[bool], room: list[int]) -> Proposal:
        self.stats.calls += 1
        if self.below is None:
            return self._draft(ctx, lens, active, room)
        return self._refine(ctx, lens, active, room)

    # ---- the bottom: autoregressive drafting ------------------------------------------------------------
    def _draft(self, ctx: torch.Tensor, lens: list[int], active: list[bool], room: list[int]) -> Proposal:
        limits = [min(self.gamma, r) if a else 0 for a, r in zip(active, room)]  # never past the room
        t0 = self.spans.start()
        block = self.drafter.draft(ctx, lens, limits)  # nothing when no row has room: the level above adds its own
        self.spans.stop(t0)
        self.stats.forwards += block.tokens.shape[1]  # one forward per drafted token (the first also catches up)
        return block

    # ---- a verifying level --------------------------------------------------------------------------------
    def _refine(self, ctx: torch.Tensor, lens: list[int], active: list[bool], room: list[int]) -> Proposal:
        """Speculative rounds over blocks from below until every active row holds at least mu tokens, or its
        whole room: the level below drafts at most what leaves room for this level's own token, so no block
        handed up ever exceeds the room.

        Each round commits, per row, the accepted prefix of the block plus this level's correction or bonus
        token, by the same step as the target's; under sampling the tokens then follow this level's model
        distribution, and the block handed up carries that distribution (this level's q at each token).
        """
        base = list(lens)
        rows = DecodeState(ctx, base, [n + r for n, r in zip(base, room)], sampling=self.sampling,
                           generator=self.generator, device=self.runner.device)
        goal = [min(self.mu, r) for r in room]
        kept: list[list[torch.Tensor]] = [[] for _ in base]  # per row: [a+1, V] distributions per round
        while True:
            hungry = [active[b] and rows.lengths[b] - base[b] < goal[b] for b in range(len(base))]
            if not any(hungry):
                break
            left = [r - (n - s) - 1 for r, n, s in zip(room, rows.lengths, base)]  # this round's own token needs one
            block = self.below.produce(ctx, list(rows.lengths), hungry, left)
            block = Proposal(block.tokens, block.lengths * torch.tensor(hungry, dtype=torch.long), block.probs)
            t0 = self.spans.start()
            logits = self.drafter.score(ctx, rows.lengths, block.tokens)  # [B, G+1, V]
            self.spans.stop(t0)
            self.stats.forwards += 1
            rnd = verify_and_commit(rows, block, logits, self.sampling, self.generator, active=hungry)
            q = None if self.sampling.greedy else probs_from_logits(logits, self.sampling)
            for b in range(len(base)):
                if hungry[b]:
                    a = rnd.accepted[b]
                    if q is not None:
                        kept[b].append(q[b, : a + 1])
                    self.stats.verified(b, a)
                    self.below.stats.handed_up(b, rnd.drafted[b], a)
        return _block_from(ctx, base, rows.lengths, kept)


def _block_from(ctx, base: list[int], lens: list[int], kept) -> Proposal:
    sizes = [n - s for s, n in zip(base, lens)]
    width = max(sizes)
    tokens = torch.zeros(len(sizes), width, dtype=torch.long)
    for b, (s, k) in enumerate(zip(base, sizes)):
        tokens[b, :k] = ctx[b, s : s + k]
    probs = None
    parts = [torch.cat(k) for k in kept if k]
    if parts:
        probs = parts[0].new_zeros(len(sizes), width, parts[0].shape[-1])
        for b, k in enumerate(kept):
            if k:
                probs[b, : sizes[b]] = torch.cat(k)
    return Proposal(tokens, torch.tensor(sizes, dtype=torch.long), probs)
