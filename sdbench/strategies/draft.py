"""Draft-model speculative decoding: a smaller model (or the target itself) drafts gamma tokens per step."""

from __future__ import annotations

import torch

from sdbench.errors import SdbenchError
from sdbench.sampling import choose
from sdbench.kv.sparse import SparseSpec, compress
from sdbench.strategies.base import BuildContext, Option, Proposal, Proposer


class DraftModel(Proposer):
    """Drafts autoregressively with its own KV cache, kept in step with the committed sequence.

    The draft cache holds keys for the first `fed[b]` tokens of row b. After a verification only the
    accepted prefix stays valid, so `observe` shortens `fed`; the next proposal first feeds the committed
    tokens the draft has not seen (one, or two when every draft was accepted).
    """

    name = "draft"
    options = (
        Option("draft_kv", "dense", "draft KV cache: dense, or a fixed-size sparse view: streamingllm, snapkv", str),
        Option("budget", 256, "sparse draft cache: tokens attended"),
        Option("sink", 16, "streamingllm: attention-sink tokens kept"),
        Option("window", 32, "snapkv: recent (observation) window"),
    )

    def __init__(self, runner, gamma: int, draft_kv: str = "dense", budget: int = 256, sink: int = 16,
                 window: int = 32):
        if gamma < 1:
            raise SdbenchError(f"--gamma must be at least 1 for strategy '{self.name}' (got {gamma})")
        super().__init__(gamma)
        self.runner = runner
        self.sparse = None if draft_kv == "dense" else SparseSpec(draft_kv, budget, sink, window)

    def begin(self, state) -> None:
        self.fed = [n - 1 for n in state.lengths]
        prompts = [state.row(b)[: self.fed[b]].tolist() for b in range(state.batch)]
        if self.sparse is None:
            self.cache = self.runner.new_cache(state.batch, state.capacity)
            self.runner.prefill(self.cache, prompts)
        else:
            full = self._prompt_cache(state, prompts)
            self.cache = compress(self.runner, full, self.fed, state.tokens, self.sparse, self.gamma)
            if full is not state.target_cache:
                self.runner.release(full)

    def _prompt_cache(self, state, prompts):
        """A dense cache holding the prompts, to be compressed into the sparse draft cache."""
        cache = self.runner.new_cache(state.batch, max(self.fed) + 1)
        self.runner.prefill(cache, prompts)
        return cache

    def params(self) -> dict:
        if self.sparse is None:
            return {"gamma": self.gamma}
        sp = self.sparse
        return {"gamma": self.gamma, "draft_kv": sp.selector, "budget": sp.budget,
                **({"sink": sp.sink} if sp.selector == "streamingllm" else {"window": sp.window})}

    def _catch_up(self, state) -> torch.Tensor:
        """Feed each row's unseen committed tokens; logits [B, V] after its last committed token."""
        todo = [n - f for n, f in zip(state.lengths, self.fed)]
        tokens = torch.zeros(state.batch, max(todo), dtype=torch.long)
        for b, (f, n) in enumerate(zip(self.fed, state.lengths)):
            tokens[b, : n - f] = state.tokens[b, f:n]
        return self.runner.forward(self.cache, tokens, self.fed, at=torch.tensor(todo) - 1)

    def propose(self, state, gamma: int | None = None) -> Proposal:
        """gamma: tokens to draft this step; None = the configured lookahead (adaptive callers vary it)."""
        gamma = self.gamma if gamma is None else gamma
        logits = self._catch_up(state)
        drafted, probs = [], []
        for i in range(gamma):
            x, p = choose(logits, state.sampling, state.generator)
            drafted.append(x)
            probs.append(p)
            if i + 1 < gamma:
                logits = self.runner.forward(self.cache, x[:, None], [n + i for n in state.lengths])[:, 0]
        self.fed = [n + gamma - 1 for n in state.lengths]
        tokens = torch.stack(drafted, 1).cpu()
        lengths = torch.full((state.batch,), gamma, dtype=torch.long)
        return Proposal(tokens, lengths, None if state.sampling.greedy else torch.stack(probs, 1))

    def observe(self, state, accepted, proposal) -> None:
        # the sequence now agrees with what the draft saw up to the last accepted token
        self.fed = [min(f, n - 1) for f, n in zip(self.fed, state.lengths)]

    def end(self) -> None:
        if getattr(self, "cache", None) is not None:
            self.runner.release(self.cache)
            self.cache = None

    @classmethod
    def build(cls, ctx: BuildContext) -> Proposer:
        if not ctx.drafts:
            raise SdbenchError("strategy 'draft' needs a draft model: pass --draft MODEL (the target itself works)")
        if isinstance(ctx.drafts[0], str):  # a model-free draft name such as 'ngram'
            raise SdbenchError(f"strategy 'draft' needs a draft model, and --draft {ctx.drafts[0]} is not one: "
                               f"use --strategy {ctx.drafts[0]}, or adaptive to mix it with a model")
        return cls(ctx.drafts[0], ctx.gamma, **ctx.options)
