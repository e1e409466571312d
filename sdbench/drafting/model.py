"""A drafting model: its own KV cache (dense, or a fixed-budget sparse view), kept in step with the context."""

from __future__ import annotations

import torch

from sdbench.drafting.prefix import CachedPrefix
from sdbench.engine.runner import Runner
from sdbench.engine.sampling import choose
from sdbench.engine.state import DecodeState, Proposal
from sdbench.kv.cache import set_prompt_lengths
from sdbench.kv.sparse import SparseSpec, compress


def draft_tokens(runner, cache, prefix: CachedPrefix, ctx: torch.Tensor, lens: list[int], gamma: int, sampling,
                 generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gamma tokens per row continuing ctx[b, :lens[b]], drawn from the model one at a time.

    One forward feeds each row's context the cache has not seen (one token, or two after a fully accepted
    step, or more after an idle spell) and gives the first draft; then one forward per further draft.
    Returns tokens [B, gamma] on the model's device and, under sampling, the draft distributions [B, gamma, V].
    Nothing here waits for the device: the tokens the cache was fed are read back lazily (CachedPrefix)."""
    prefix.agree(ctx, lens)
    feed, start, todo = prefix.unseen(ctx, lens)
    logits = runner.forward(cache, feed, start, at=torch.tensor(todo) - 1)
    prefix.wrote(feed, start)
    drafted, probs = [], []
    for i in range(gamma):
        x, p = choose(logits, sampling, generator)
        drafted.append(x)
        probs.append(p)
        if i + 1 < gamma:
            logits = runner.forward(cache, x[:, None], [n + i for n in lens])[:, 0]
    tokens = torch.stack(drafted, 1)  # left on the device: drafting never waits for it
    prefix.wrote(tokens[:, : gamma - 1], list(lens))  # the last draft is not fed: it has no successor yet
    return tokens, None if sampling.greedy else torch.stack(probs, 1)


class ModelDrafter:
    """Drafts autoregressively with its own KV cache, kept in step with the context by a `CachedPrefix`: each
    draft first feeds the context tokens the cache has not seen (one, or two when every draft was accepted),
    then drafts. Whatever the verifier accepted, corrected or rewound, the cache keeps the longest prefix
    that agrees with the context.

    sparse: draft through a fixed-budget sparse view of the prompt's keys (StreamingLLM or SnapKV), sized for
    `lookahead` drafts per round; self_speculation: the runner is the target, whose prefilled cache is
    compressed instead of prefilling again."""

    def __init__(self, runner: Runner, sparse: SparseSpec | None = None, lookahead: int = 1, self_speculation: bool = False):
        self.runner, self.sparse, self.lookahead = runner, sparse, lookahead
        self.self_speculation = self_speculation
        self.name = getattr(runner, "name", "") or "model"
        self.cache = None

    def begin(self, state: DecodeState) -> None:
        fed = [n - 1 for n in state.lengths]  # the prompts: the first generated token is fed by the first step
        prompts = [state.row(b)[: fed[b]].tolist() for b in range(state.batch)]
        self.sampling, self.generator = state.sampling, state.generator
        self.prefix = CachedPrefix(state.batch, state.capacity)
        if self.sparse is None:
            self.cache = self.runner.new_cache(state.batch, state.capacity)
            set_prompt_lengths(self.cache, fed)  # also where the first draft feeds a prompt instead
            if min(fed) > 0:  # else nothing to prefill for some row: the first draft feeds every row's context
                self.runner.prefill(self.cache, prompts)
                self.prefix.holds(state.tokens, fed)
            return
        self.prefix.holds(state.tokens, fed)
        if self.self_speculation:
            full = state.target_cache
        else:
            full = self.runner.new_cache(state.batch, max(len(p) for p in prompts) + 1)
            self.runner.prefill(full, prompts)
        self.cache = compress(self.runner, full, fed, state.tokens, self.sparse, self.lookahead)
        if full is not state.target_cache:
            self.runner.release(full)

    def begin_rows(self, state: DecodeState, rows: list[int]) -> None:
        """Each joining row's prompt prefilled alone into its row of the (dense) draft cache."""
        if self.sparse is not None:
            raise NotImplementedError("a sparse draft cache is compressed from a whole batch's prompts")
        for b in rows:
            fed = state.lengths[b] - 1  # the prompt: the first generated token is fed by the first draft
            self.runner.prefill(self.cache.row(b), [state.row(b)[:fed].tolist()])
            self.prefix.holds_row(b, state.tokens[b], fed)

    def catch_up(self, ctx: torch.Tensor, lengths: list[int]) -> int:
        self.prefix.agree(ctx, lengths)
        return max(n - f for n, f in zip(lengths, self.prefix.fed))

    def draft(self, ctx: torch.Tensor, lengths: list[int], limits: list[int]) -> Proposal:
        k = max(limits, default=0)
        if k == 0:
            return Proposal.empty(len(lengths))
        tokens, probs = draft_tokens(self.runner, self.cache, self.prefix, ctx, lengths, k, self.sampling,
                                     self.generator)
        return Proposal(tokens, torch.tensor(limits, dtype=torch.long), probs)

    def score(self, ctx: torch.Tensor, lengths: list[int], block: torch.Tensor) -> torch.Tensor:
        """For a model that also verifies (a middle level of a polybasic chain): one forward over each row's
        unseen context and then block [B, G]; logits [B, G+1, V] at the context's last token and at each block
        token."""
        self.prefix.agree(ctx, lengths)
        tokens, start, todo = self.prefix.unseen(ctx, lengths, block)
        at = (torch.tensor(todo) - 1)[:, None] + torch.arange(block.shape[1] + 1)  # [B, G+1]
        logits = self.runner.forward(self.cache, tokens, start, at=at)
        self.prefix.wrote(tokens, start)
        return logits

    def end(self) -> None:
        if self.cache is not None:
            self.runner.release(self.cache)
            self.cache = None
