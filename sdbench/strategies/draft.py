"""Draft-model speculative decoding: a smaller model (or the target itself) drafts gamma tokens per step."""

from __future__ import annotations

from sdbench.drafting.model import ModelDrafter
from sdbench.drafting.ngram import DRAFT_NAME
from sdbench.errors import SdbenchError
from sdbench.kv.sparse import SparseSpec
from sdbench.strategies.base import BuildContext, FixedLookahead, Option, Proposer


class DraftModel(FixedLookahead):
    """A draft model (or the target itself) drafting gamma tokens per round through a `ModelDrafter`, with a
    dense cache or a fixed-budget sparse view of the prompt."""

    name = "draft"
    full_budget = "the draft runs as with a dense cache"  # what a budget covering the whole context amounts to
    self_speculation = False  # MagicDec: the drafter compresses the target's own prefilled cache
    options = (
        Option("draft_kv", "dense", "draft KV cache: dense, or a fixed-size sparse view: streamingllm, snapkv", str),
        Option("budget", 256, "sparse draft cache: tokens attended"),
        Option("sink", 16, "streamingllm: attention-sink tokens kept"),
        Option("window", 32, "snapkv: recent (observation) window"),
    )

    def __init__(self, runner, gamma: int, draft_kv: str = "dense", budget: int = 256, sink: int = 16,
                 window: int = 32):
        sparse = None if draft_kv == "dense" else SparseSpec(draft_kv, budget, sink, window)
        super().__init__(ModelDrafter(runner, sparse, gamma, self_speculation=self.self_speculation), gamma)
        self.runner, self.sparse = runner, sparse
        self.rows_join = sparse is None  # a sparse view is compressed from a whole batch's prompts at once

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

    @classmethod
    def check(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        if cls.name == "draft" and drafts:
            _model_draft(drafts[0] if drafts[0] == DRAFT_NAME else None)
        cls(None, gamma, **options)  # the constructor checks every setting and touches no model

    @classmethod
    def join_refusal(cls, options: dict) -> str | None:
        if options.get("draft_kv", "dense") != "dense":
            return f"its sparse draft cache (--set draft_kv={options['draft_kv']}) is compressed from a whole batch's prompts"
        return super().join_refusal(options)

    @classmethod
    def needs_native(cls, target: str, drafts: tuple[str, ...], options: dict) -> dict[str, str]:
        kv = options.get("draft_kv", "dense")
        if kv == "dense":
            return {}
        return {d: f"the sparse draft cache (--set draft_kv={kv})" for d in drafts[:1] if d != DRAFT_NAME}

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
