"""MagicDec: self-speculation through a sparse KV cache.

The target drafts for itself while attending to a fixed budget of keys (StreamingLLM sinks + recent
window, or SnapKV's selected prefix + window), then verifies with its full cache. At long context and
large batch, decoding is bound by reading the KV cache, so a draft whose cache stays small keeps its cost
flat as the context grows, while its acceptance stays high because it is the target itself.

With `--set tree_topk=K [tree_nodes=N]` or `tree_shape=...` the sparse-cache draft grows a token tree, as a draft
model does (drafting/model.py `draft_tree`), which the target verifies over its full cache.
"""

from __future__ import annotations

from sdbench.kv.sparse import SparseSpec
from sdbench.strategies.draft import GROWTH_OPTIONS, SPARSE_OPTIONS, DraftModel, check_growth
from sdbench.strategies.spec import BuildContext, Option, Strategy, need_gamma, register
from sdbench.strategies.trees import TREE_OPTIONS


class MagicDec(DraftModel):
    name = "magicdec"
    full_budget = "this runs as plain self-speculation with a full cache"
    self_speculation = True  # the target's own prefill already holds the prompt: compress it, no second prefill
    rows_join = False

    def __init__(self, runner, gamma: int, kv: str = "streamingllm", budget: int = 256, sink: int = 16,
                 window: int = 32, **tree):
        super().__init__(runner, gamma, kv, budget, sink, window, **tree)
        self.rows_join = False

    def params(self) -> dict:
        params = super().params()
        params["kv"] = params.pop("draft_kv")
        return params


@register
class MagicDecStrategy(Strategy):
    name = "magicdec"
    help = "self-speculation: the target drafts through a fixed-budget sparse KV cache (StreamingLLM or SnapKV)"
    aliases = ("self-spec", "sparse-kv")
    # the draft strategy's sparse-cache settings, with the selector named `kv` and never dense
    options = (Option("kv", "streamingllm", "draft cache selector: streamingllm or snapkv", str), *SPARSE_OPTIONS,
               *TREE_OPTIONS, *GROWTH_OPTIONS)
    proposer = MagicDec

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        need_gamma(cls.name, gamma)
        SparseSpec(options["kv"], options["budget"], options["sink"], options["window"])  # never dense
        check_growth(cls.name, gamma, options["kv"], options, sampling)

    @classmethod
    def join_refusal(cls, options: dict) -> str | None:
        return "its draft cache is compressed from the target's prefill of a whole batch"

    @classmethod
    def search_space(cls, trial, space) -> tuple:
        """gamma, the selector, and a budget from a grid of powers of two that never exceeds the context
        (a budget as long as the context is the full cache: nothing left to save)."""
        grid = [b for b in (32, 64, 128, 256, 512, 1024, 2048) if b < max(space.context_tokens, 33)] or [32]
        options = {"kv": trial.suggest_categorical("kv", ["streamingllm", "snapkv"]),
                   "budget": trial.suggest_categorical("budget", grid)}
        options["window"] = min(32, options["budget"])
        gamma = trial.suggest_int("gamma", 1, 6)
        return gamma, {**options, **space.topk_tree(trial, gamma)}

    @classmethod
    def needs_native(cls, target: str, drafts: tuple[str, ...], options: dict) -> dict[str, str]:
        return {target: "MagicDec's sparse draft cache"}

    @classmethod
    def build(cls, ctx: BuildContext) -> MagicDec:
        return MagicDec(ctx.target, ctx.gamma, **ctx.options)
