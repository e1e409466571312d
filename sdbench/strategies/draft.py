"""Draft-model speculative decoding: a smaller model (or the target itself) drafts gamma tokens per step."""

from __future__ import annotations

import torch

from sdbench.errors import SdbenchError
from sdbench.kv.prefix import CachedPrefix
from sdbench.kv.sparse import SparseSpec, compress
from sdbench.sampling import choose
from sdbench.strategies.ngram import DRAFT_NAME
from sdbench.strategies.base import BuildContext, Option, Proposal, Proposer, need_gamma


def draft_tokens(runner, cache, prefix: CachedPrefix, ctx: torch.Tensor, lens: list[int], gamma: int, sampling,
                 generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gamma tokens per row continuing ctx[b, :lens[b]], drawn from the model one at a time (the drafting loop
    of every model draft: draft models, MagicDec, the bottom of a polybasic chain).

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


class DraftModel(Proposer):
    """Drafts autoregressively with its own KV cache, kept in step with the committed sequence by a
    `CachedPrefix`: each proposal first feeds the committed tokens the draft has not seen (one, or two when
    every draft was accepted), then drafts."""

    name = "draft"
    full_budget = "the draft runs as with a dense cache"  # what a budget covering the whole context amounts to
    options = (
        Option("draft_kv", "dense", "draft KV cache: dense, or a fixed-size sparse view: streamingllm, snapkv", str),
        Option("budget", 256, "sparse draft cache: tokens attended"),
        Option("sink", 16, "streamingllm: attention-sink tokens kept"),
        Option("window", 32, "snapkv: recent (observation) window"),
    )

    def __init__(self, runner, gamma: int, draft_kv: str = "dense", budget: int = 256, sink: int = 16,
                 window: int = 32):
        need_gamma(self.name, gamma)
        super().__init__(gamma)
        self.runner = runner
        self.sparse = None if draft_kv == "dense" else SparseSpec(draft_kv, budget, sink, window)

    def begin(self, state) -> None:
        fed = [n - 1 for n in state.lengths]  # the prompts: the first generated token is fed by the first step
        prompts = [state.row(b)[: fed[b]].tolist() for b in range(state.batch)]
        self.prefix = CachedPrefix(state.batch, state.capacity)
        self.prefix.holds(state.tokens, fed)
        if self.sparse is None:
            self.cache = self.runner.new_cache(state.batch, state.capacity)
            self.runner.prefill(self.cache, prompts)
        else:
            full = self._prompt_cache(state, prompts)
            self.cache = compress(self.runner, full, fed, state.tokens, self.sparse, self.gamma)
            if full is not state.target_cache:
                self.runner.release(full)

    def unseen(self, state) -> int:
        """The most committed tokens a row's next proposal must feed before drafting."""
        self.prefix.agree(state.tokens, state.lengths)
        return max(n - f for n, f in zip(state.lengths, self.prefix.fed))

    def _prompt_cache(self, state, prompts):
        """A dense cache holding the prompts, to be compressed into the sparse draft cache."""
        cache = self.runner.new_cache(state.batch, max(len(p) for p in prompts) + 1)
        self.runner.prefill(cache, prompts)
        return cache

    def params(self) -> dict:
        if self.sparse is None:
            return {"gamma": self.gamma}
        sp = self.sparse
        return {"gamma": self.gamma, "draft_kv": sp.selector, "budget": sp.budget,
                **({"sink": sp.sink} if sp.selector == "streamingllm" else {"window": sp.window})}

    def notes(self, context_tokens: int) -> list[str]:
        sp = self.sparse
        if sp is None or sp.budget < context_tokens:
            return []
        return [f"{self.name}: --set budget={sp.budget} is at least the longest context ({context_tokens} tokens), so "
                f"the sparse draft cache keeps every token: {self.full_budget}"]

    def propose(self, state, gamma: int | None = None) -> Proposal:
        """gamma: tokens to draft this step; None = the configured lookahead (adaptive callers vary it); never
        more than a row can still commit."""
        gamma = state.lookahead(self.gamma if gamma is None else gamma)
        tokens, probs = draft_tokens(self.runner, self.cache, self.prefix, state.tokens, state.lengths, gamma,
                                     state.sampling, state.generator)
        return Proposal(tokens, torch.full((state.batch,), gamma, dtype=torch.long), probs)

    def end(self) -> None:
        if getattr(self, "cache", None) is not None:
            self.runner.release(self.cache)
            self.cache = None

    @classmethod
    def check(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        if cls.name == "draft" and drafts:
            _model_draft(drafts[0] if drafts[0] == DRAFT_NAME else None)
        cls(None, gamma, **options)  # the constructor checks every setting and touches no model

    @classmethod
    def build(cls, ctx: BuildContext) -> Proposer:
        if not ctx.drafts:
            raise SdbenchError("strategy 'draft' needs a draft model: pass --draft MODEL (the target itself works)")
        _model_draft(ctx.drafts[0] if isinstance(ctx.drafts[0], str) else None)
        return cls(ctx.drafts[0], ctx.gamma, **ctx.options)


def _model_draft(model_free: str | None) -> None:
    """Refuse a model-free draft name (such as 'ngram') where strategy 'draft' needs a model."""
    if model_free is not None:
        raise SdbenchError(f"strategy 'draft' needs a draft model, and --draft {model_free} is not one: "
                           f"use --strategy {model_free}, or adaptive to mix it with a model")
