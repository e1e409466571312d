"""The levels of a polybasic chain below the target: a bottom drafter and the verifying levels above it.

Every level answers `produce(ctx, lens, active, sampling, generator, room) -> Block`: a block of at most
room[b] tokens (what row b can still commit; None: no limit) continuing each row's context ctx[b, :lens[b]],
distributed as that level's own model would sample them (for the bottom drafter by construction; for a
verifying level because its speculative rounds are lossless). Rows with active[b] False may get anything;
their tokens are never used.

ctx is a scratch buffer [B, W] shared down the chain: a verifying level writes the tokens it has accepted so
far at ctx[b, lens[b]:] before asking the level below for more, so each level sees the context as it stands at
its own height. Whatever lies beyond a level's lens is scratch for it.

A model level's KV cache is position-indexed, like the target's, and kept in step with the context it is
asked about by a `CachedPrefix` (kv/prefix.py), as every drafting model's is: whatever the levels above
accepted or corrected, it keeps the keys of the longest prefix it wrote that agrees with that context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sdbench.kv.prefix import CachedPrefix
from sdbench.metrics import now
from sdbench.sampling import probs_from_logits, verify
from sdbench.strategies.draft import draft_tokens
from sdbench.strategies.ngram import lookup


@dataclass
class Block:
    tokens: torch.Tensor  # [B, G] long, on the producing model's device (entries past lengths[b] are padding)
    lengths: torch.Tensor  # [B] long: real tokens per row
    probs: torch.Tensor | None = None  # [B, G, V] the producing level's distribution at each token; None = one-hot


@dataclass
class LevelStats:
    """One generation's counters for a level. Forwards and their time are the batch's; the rest are per row.

    rounds/committed: this level's own verifications (a verifying level only) and the tokens they committed,
    accepted drafts plus the correction or bonus token. proposals/proposed/accepted: the blocks this level
    handed up, their tokens, and how many of those the level above accepted.
    """

    batch: int
    forwards: int = 0
    forward_s: float = 0.0
    calls: int = 0  # blocks produced for the whole batch
    prefill_s: float = 0.0  # the level's own prefill of the prompts (not a forward of the chain's rounds)
    rounds: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    proposals: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self):
        for name in ("rounds", "committed", "proposals", "proposed", "accepted"):
            setattr(self, name, [0] * self.batch)

    def handed_up(self, b: int, proposed: int, accepted: int) -> None:
        self.proposals[b] += 1
        self.proposed[b] += proposed
        self.accepted[b] += accepted

    def verified(self, b: int, accepted: int) -> None:
        self.rounds[b] += 1
        self.committed[b] += accepted + 1

    def record(self, b: int, level: int, model: str) -> dict:
        """Row b's figures (JSON-able); mean_accepted_len is None for a level that verifies nothing."""
        rounds, proposals = self.rounds[b], self.proposals[b]
        return {
            "level": level, "model": model, "forwards": self.forwards, "forward_s": self.forward_s,
            "prefill_s": self.prefill_s,
            "blocks": self.calls, "rounds": rounds, "committed": self.committed[b],
            "mean_accepted_len": self.committed[b] / rounds if rounds else None,
            "proposals": proposals, "proposed": self.proposed[b], "accepted": self.accepted[b],
            "acceptance_rate": self.accepted[b] / self.proposed[b] if self.proposed[b] else None,
        }


class NGramLevel:
    """Prompt lookup as the bottom of a chain: up to gamma tokens per block, one-hot (deterministic)."""

    def __init__(self, gamma: int, max_ngram: int, min_ngram: int):
        self.label = "ngram"
        self.gamma, self.max_ngram, self.min_ngram = gamma, max_ngram, min_ngram

    def begin(self, batch: int, capacity: int, prompts: list[list[int]]) -> None:
        self.stats = LevelStats(batch)

    def end(self) -> None:
        pass

    def produce(self, ctx, lens, active, sampling, generator, room=None) -> Block:
        room = _unbounded(lens) if room is None else room
        t0 = now()
        tokens = torch.zeros(len(lens), self.gamma, dtype=torch.long)
        lengths = torch.zeros(len(lens), dtype=torch.long)
        for b, n in enumerate(lens):
            if active[b]:
                found = lookup(ctx[b, :n].numpy(), min(self.gamma, room[b]), self.max_ngram, self.min_ngram)
                tokens[b, : len(found)] = torch.from_numpy(found)
                lengths[b] = len(found)
        # the level above verifies no padding when nothing longer was found
        block = Block(tokens[:, : int(lengths.max()) if len(lengths) else 0], lengths)
        self.stats.forwards += 1
        self.stats.forward_s += now() - t0
        self.stats.calls += 1
        return block


class ModelLevel:
    """A model in the chain. With no level below it drafts gamma tokens autoregressively; with one, it runs
    speculative rounds over the blocks from below until each active row has accumulated at least mu tokens."""

    def __init__(self, runner, below=None, gamma: int = 0, mu: int = 0):
        self.runner, self.below, self.gamma, self.mu = runner, below, gamma, mu
        self.label = runner.name or "model"

    def begin(self, batch: int, capacity: int, prompts: list[list[int]]) -> None:
        """Prefill every prompt but its last token (the next forward feeds it, as in the loop)."""
        self.stats = LevelStats(batch)
        self.cache = self.runner.new_cache(batch, capacity)
        self.prefix = CachedPrefix(batch, capacity)
        if min(len(p) for p in prompts) > 1:
            t0 = now(self.runner.device)
            self.runner.prefill(self.cache, [p[:-1] for p in prompts])
            self.stats.prefill_s = now(self.runner.device) - t0
            ctx = torch.zeros(batch, max(len(p) for p in prompts), dtype=torch.long)
            for b, p in enumerate(prompts):
                ctx[b, : len(p)] = torch.tensor(p, dtype=torch.long)
            self.prefix.holds(ctx, [len(p) - 1 for p in prompts])
        if self.below is not None:
            self.below.begin(batch, capacity, prompts)

    def end(self) -> None:
        if getattr(self, "cache", None) is not None:
            self.runner.release(self.cache)
            self.cache = None

    def produce(self, ctx, lens, active, sampling, generator, room=None) -> Block:
        room = _unbounded(lens) if room is None else room
        self.stats.calls += 1
        if self.below is None:
            return self._draft(ctx, lens, active, sampling, generator, room)
        return self._refine(ctx, lens, active, sampling, generator, room)

    # ---- forwards -----------------------------------------------------------------------------------------
    def _feed(self, ctx, lens, block: torch.Tensor) -> torch.Tensor:
        """One forward over each row's unseen context and then block [B, G]; logits [B, G+1, V] at the
        context's last token and at each block token."""
        t0 = now(self.runner.device)
        self.prefix.agree(ctx, lens)
        tokens, start, todo = self.prefix.unseen(ctx, lens, block)
        at = (torch.tensor(todo) - 1)[:, None] + torch.arange(block.shape[1] + 1)  # [B, G+1]
        logits = self.runner.forward(self.cache, tokens, start, at=at)
        self.prefix.wrote(tokens, start)
        self._count(t0)
        return logits

    def _count(self, t0: float, forwards: int = 1) -> None:
        """Forwards of this level from t0 to now: the projection to logits included."""
        self.stats.forward_s += now(self.runner.device) - t0
        self.stats.forwards += forwards

    # ---- the bottom: autoregressive drafting ------------------------------------------------------------
    def _draft(self, ctx, lens, active, sampling, generator, room) -> Block:
        gamma = min(self.gamma, max((r for r, a in zip(room, active) if a), default=0))  # never past the room
        if gamma == 0:  # no row has room for a draft: the level above adds its own token alone
            return Block(torch.zeros(len(lens), 0, dtype=torch.long), torch.zeros(len(lens), dtype=torch.long))
        t0 = now(self.runner.device)
        tokens, probs = draft_tokens(self.runner, self.cache, self.prefix, ctx, lens, gamma, sampling, generator)
        self._count(t0, gamma)  # one forward per drafted token (the first one also catches up)
        return Block(tokens, torch.tensor([min(gamma, r) for r in room], dtype=torch.long), probs)

    # ---- a verifying level --------------------------------------------------------------------------------
    def _refine(self, ctx, lens, active, sampling, generator, room) -> Block:
        """Speculative rounds over blocks from below until every active row holds at least mu tokens, or its
        whole room: the level below drafts at most what leaves room for this level's own token, so no block
        handed up ever exceeds the room.

        Each round commits, per row, the accepted prefix of the block plus this level's correction or bonus
        token, exactly as the target's loop does; under sampling the tokens then follow this level's model
        distribution, and the block handed up carries that distribution (this level's q at each token).
        """
        base, lens = list(lens), list(lens)
        goal = [min(self.mu, r) for r in room]
        kept: list[list[torch.Tensor]] = [[] for _ in lens]  # per row: [a+1, V] distributions per round
        while True:
            hungry = [active[b] and lens[b] - base[b] < goal[b] for b in range(len(lens))]
            if not any(hungry):
                break
            left = [r - (n - s) - 1 for r, n, s in zip(room, lens, base)]  # this round's own token needs one
            block = self.below.produce(ctx, lens, hungry, sampling, generator, left)
            logits = self._feed(ctx, lens, block.tokens)  # [B, G+1, V]
            dev = logits.device
            n_draft = block.lengths * torch.tensor(hungry, dtype=torch.long)
            verdict = verify(block.tokens.to(dev), n_draft.to(dev), block.probs, logits, sampling, generator)
            q = None if sampling.greedy else probs_from_logits(logits, sampling)
            accepted, nxt = verdict.accepted.tolist(), verdict.next_token.tolist()
            for b in range(len(lens)):
                if not hungry[b]:
                    continue
                a = accepted[b]
                new = block.tokens[b, :a].tolist() + [nxt[b]]
                ctx[b, lens[b] : lens[b] + a + 1] = torch.tensor(new, dtype=torch.long)
                lens[b] += a + 1
                if q is not None:
                    kept[b].append(q[b, : a + 1])
                self.stats.verified(b, a)
                self.below.stats.handed_up(b, int(n_draft[b]), a)
        return _block_from(ctx, base, lens, kept)


def _unbounded(lens: list[int]) -> list[int]:
    """No room limit (a level used on its own, outside the decode loop)."""
    return [1 << 30] * len(lens)


def _block_from(ctx, base: list[int], lens: list[int], kept) -> Block:
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
    return Block(tokens, torch.tensor(sizes, dtype=torch.long), probs)
