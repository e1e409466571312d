"""The one decode loop: propose -> verify -> commit -> rewind -> observe -> record.

Every strategy runs through `generate`; plain decoding is the proposer that proposes nothing.
"""

from __future__ import annotations

import torch

from sdbench.config import SamplingConfig
from sdbench.errors import SdbenchError
from sdbench.metrics import BatchResult, Marks, RowStats, now
from sdbench.sampling import choose, verify
from sdbench.strategies.base import Proposer


class DecodeState:
    """The committed sequences of a batch. tokens [B, capacity] on the host; row b is tokens[b, :lengths[b]]."""

    def __init__(self, prompts: list[list[int]], max_new_tokens: int, capacity: int, eos_ids,
                 sampling: SamplingConfig, generator: torch.Generator | None):
        self.batch = len(prompts)
        self.capacity = capacity
        self.tokens = torch.zeros(self.batch, capacity, dtype=torch.long)
        for b, p in enumerate(prompts):
            self.tokens[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        self.prompt_lengths = [len(p) for p in prompts]
        self.lengths = list(self.prompt_lengths)
        self.done = [False] * self.batch
        self.max_new_tokens = max_new_tokens
        self.eos = frozenset(eos_ids)
        self.sampling = sampling
        self.generator = generator

    def row(self, b: int) -> torch.Tensor:
        return self.tokens[b, : self.lengths[b]]

    def last_tokens(self) -> torch.Tensor:  # [B]
        return self.tokens[torch.arange(self.batch), torch.tensor(self.lengths) - 1]

    def room(self, b: int) -> int:
        """Tokens row b can still commit: what is left of its budget (which its caches always hold); 0 once done."""
        if self.done[b]:
            return 0
        return min(self.max_new_tokens - (self.lengths[b] - self.prompt_lengths[b]), self.capacity - self.lengths[b])

    def lookahead(self, gamma: int) -> int:
        """gamma capped to the most drafts any active row can still commit: no round drafts past the budget."""
        return min(gamma, max((self.room(b) for b in range(self.batch)), default=0))

    def generated(self, b: int) -> list[int]:
        return self.tokens[b, self.prompt_lengths[b] : self.lengths[b]].tolist()

    def commit(self, b: int, new: list[int]) -> int:
        """Append tokens to row b, stopping at EOS or the token budget; returns how many were kept."""
        room = self.max_new_tokens - (self.lengths[b] - self.prompt_lengths[b])
        new = new[:room]
        for i, t in enumerate(new):
            if t in self.eos:
                new = new[: i + 1]
                self.done[b] = True
                break
        n0 = self.lengths[b]
        self.tokens[b, n0 : n0 + len(new)] = torch.tensor(new, dtype=torch.long)
        self.lengths[b] = n0 + len(new)
        if self.lengths[b] - self.prompt_lengths[b] >= self.max_new_tokens:
            self.done[b] = True
        return len(new)


def needed_capacity(prompts: list[list[int]], max_new_tokens: int, lookahead: int) -> int:
    """KV slots a generation may write: the longest prompt, the new tokens, one step's drafts, and slack."""
    return max(len(p) for p in prompts) + max_new_tokens + lookahead + 2


def generate(target, proposer: Proposer, prompts: list[list[int]], *, max_new_tokens: int,
             sampling: SamplingConfig, eos_ids=(), generator: torch.Generator | None = None,
             capacity: int = 0) -> BatchResult:
    """Decode a batch of prompts with the target, drafting through `proposer`.

    capacity: the least KV length to allocate (a warm-up passes the longest batch's, so that static-shape
    caches and their CUDA graphs are made during the warm-up and reused by the measured batches)."""
    if max_new_tokens < 1:
        raise SdbenchError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    capacity = max(capacity, needed_capacity(prompts, max_new_tokens, proposer.max_lookahead))
    state = DecodeState(prompts, max_new_tokens, capacity, eos_ids, sampling, generator)
    rows = [RowStats() for _ in prompts]

    t_start = now(target.device)
    cache = target.new_cache(state.batch, capacity)
    try:
        return _run(target, proposer, state, prompts, cache, rows, t_start)
    finally:  # caches go back for reuse by the next generation when shapes are static (CUDA graphs),
        # in the order they were taken, so that each is taken again for the same role with its graphs
        target.release(cache)
        proposer.end()


def _run(target, proposer, state: DecodeState, prompts, cache, rows: list[RowStats], t_start: float) -> BatchResult:
    dev, sampling, generator = target.device, state.sampling, state.generator
    first, _ = choose(target.prefill(cache, prompts), sampling, generator)
    for b, t in enumerate(first.tolist()):
        state.commit(b, [t])
    ttft = now(dev) - t_start
    state.target_cache = cache  # self-speculation builds its sparse draft cache from the target's prefill
    state.device = dev  # proposers that time their own phases synchronise on it (metrics.now)
    t0 = now(dev)
    proposer.begin(state)
    setup = now(dev) - t0
    for r in rows:  # the draft's own prefill (or cache compression) is drafting cost too
        r.draft_s += setup

    marks = Marks(dev)
    while not all(state.done):
        t0 = marks.mark()
        proposal = proposer.propose(state)
        t1 = marks.mark()
        verdict, n_draft = _verify(target, cache, state, proposal)
        t2 = marks.mark()
        # the round's one wait for the device: the verdict (and the drafts) to the host
        accepted, nxt = verdict.accepted.tolist(), verdict.next_token.tolist()
        drafts = proposal.tokens.tolist() if proposal is not None else [[]] * state.batch
        draft_s, verify_s = marks.seconds(t0, t1), marks.seconds(t1, t2)
        committed = [0] * state.batch  # per row: drafts committed (an EOS or the budget may cut accepted ones)
        for b in range(state.batch):
            if state.done[b]:
                continue
            kept = state.commit(b, drafts[b][: accepted[b]] + [nxt[b]])
            committed[b] = min(accepted[b], kept)
            rows[b].add_step(n_draft[b], committed[b], draft_s, verify_s, rejected=accepted[b] < n_draft[b])
        proposer.observe(state, torch.tensor(committed), proposal)

    wall = now(dev) - t_start
    return BatchResult([state.generated(b) for b in range(state.batch)], state.prompt_lengths, rows, wall, ttft,
                       [proposer.row_stats(b) for b in range(state.batch)])


def _verify(target, cache, state: DecodeState, proposal):
    """One target forward over [last committed token, drafts...] per row, then the acceptance rule.

    The target cache holds every committed token but the last; writing from there overwrites whatever a
    rejected draft left behind, which is the whole of rewinding.
    """
    last = state.last_tokens()[:, None]
    if proposal is None:
        draft = torch.zeros(state.batch, 0, dtype=torch.long)
        n_draft = torch.zeros(state.batch, dtype=torch.long)
        probs = None
    else:
        # drafts stay where the proposer made them (a model's on its device: no wait here); lengths are on the host,
        # cut to what each row can still commit (recorded so: the proposer observes the cut lengths too)
        room = torch.tensor([state.room(b) for b in range(state.batch)])
        proposal.lengths = torch.minimum(proposal.lengths.cpu(), room)
        draft, n_draft, probs = proposal.tokens, proposal.lengths, proposal.probs
        width = int(n_draft.max()) if len(n_draft) else 0
        if width < draft.shape[1]:  # never verify padding: rows drafted at most `width` real tokens
            draft = draft[:, :width]
            probs = probs[:, :width] if probs is not None else None
    start = [n - 1 for n in state.lengths]
    logits = target.forward(cache, torch.cat([last.to(draft.device), draft], 1), start)  # [B, G+1, V]
    dev = logits.device
    verdict = verify(draft.to(dev), n_draft.to(dev), probs, logits, state.sampling, state.generator)
    return verdict, n_draft.tolist()
