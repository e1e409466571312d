"""Draft-model speculative decoding: a smaller model (or the target itself) drafts gamma tokens per step."""

from __future__ import annotations

from sdbench.drafting.dynamic import DynamicTree
from sdbench.drafting.model import ModelDrafter
from sdbench.drafting.ngram import DRAFT_NAME
from sdbench.engine.tree import Tree
from sdbench.errors import SdbenchError
from sdbench.kv.sparse import SparseSpec
from sdbench.strategies.base import FixedLookahead
from sdbench.strategies.spec import BuildContext, Option, Strategy, need_gamma, register
from sdbench.strategies.trees import TREE_OPTIONS, tree_setting


class DraftModel(FixedLookahead):
    """A draft model (or the target itself) drafting gamma tokens per round through a `ModelDrafter`, with a
    dense cache or a fixed-budget sparse view of the prompt."""

    name = "draft"
    full_budget = "the draft runs as with a dense cache"  # what a budget covering the whole context amounts to
    self_speculation = False  # MagicDec: the drafter compresses the target's own prefilled cache

    def __init__(self, runner, gamma: int, draft_kv: str = "dense", budget: int = 256, sink: int = 16,
                 window: int = 32, tree_topk: int = 0, tree_nodes: int = 0, tree_shape: str = "",
                 tree_dynamic: bool = False, tree_sample: bool = False):
        sparse = sparse_spec(draft_kv, {"budget": budget, "sink": sink, "window": window})
        tree = {"tree_topk": tree_topk, "tree_nodes": tree_nodes, "tree_shape": tree_shape,
                "tree_dynamic": tree_dynamic, "tree_sample": tree_sample}
        self.tree = grown_tree(gamma, draft_kv, tree)
        self.tree_settings = {k: v for k, v in tree.items() if v}
        drafter = ModelDrafter(runner, sparse, _lookahead(gamma, self.tree), self_speculation=self.self_speculation,
                               tree=self.tree, sample_children=tree_sample)
        super().__init__(drafter, gamma)
        self.runner, self.sparse = runner, sparse
        self.rows_join = sparse is None  # a sparse view is compressed from a whole batch's prompts at once

    @property
    def proposes_trees(self) -> bool:
        return self.tree is not None

    @property
    def max_lookahead(self) -> int:
        return _lookahead(self.gamma, self.tree)

    def observe(self, state, proposal, rnd) -> None:
        self.drafter.keep_paths(proposal, rnd)

    def params(self) -> dict:
        if self.sparse is None:
            return {"gamma": self.gamma, **self.tree_settings}
        sp = self.sparse
        return {"gamma": self.gamma, "draft_kv": sp.selector, "budget": sp.budget,
                **({"sink": sp.sink} if sp.selector == "streamingllm" else {"window": sp.window}),
                **self.tree_settings}

    def notes(self, context_tokens: int) -> list[str]:
        sp = self.sparse
        if sp is None or sp.budget < context_tokens:
            return []
        return [f"{self.name}: --set budget={sp.budget} is at least the longest context ({context_tokens} tokens), so "
                f"the sparse draft cache keeps every token: {self.full_budget}"]


def _lookahead(gamma: int, tree: Tree | DynamicTree | None) -> int:
    """Tokens one round may write past the context: the chain's gamma, a tree's nodes, or a dynamic tree's
    slots (its last forward may feed more expanded nodes than it keeps)."""
    if isinstance(tree, DynamicTree):
        return tree.slots
    return gamma if tree is None else len(tree)


SPARSE_OPTIONS = (
    Option("budget", 256, "sparse draft cache: tokens attended"),
    Option("sink", 16, "streamingllm: attention-sink tokens kept"),
    Option("window", 32, "snapkv: recent (observation) window"),
)


def tree_spec(gamma: int, draft_kv: str, tree_topk: int, tree_nodes: int, tree_shape: str,
              tree_dynamic: bool = False) -> Tree | DynamicTree | None:
    """The token tree these settings ask the draft model to grow each round (None: the chain), over its dense
    or sparse cache alike; raises on impossible ones (strategies/trees.py)."""
    return tree_setting("draft", gamma, tree_topk, tree_nodes, tree_shape, tree_dynamic)


GROWTH_OPTIONS = (
    Option("tree_sample", False, "SpecInfer's sampled children (under sampling): each node's children in the "
                                 "tree_topk or tree_shape tree drawn from the draft's distribution, with "
                                 "replacement", bool),
)


def grown_tree(gamma: int, draft_kv: str, options: dict) -> Tree | DynamicTree | None:
    """The tree the draft model grows each round: `tree_spec`'s (a DynamicTree with tree_dynamic: a shape chosen
    per row and round); tree_sample changes how its children are drawn, not its shape. Raises on impossible
    settings."""
    dynamic, sample = options.get("tree_dynamic", False), options.get("tree_sample", False)
    tree = tree_spec(gamma, draft_kv, options["tree_topk"], options["tree_nodes"], options["tree_shape"], dynamic)
    if sample and dynamic:
        raise SdbenchError("draft: --set tree_sample's children would be kept or dropped by their probability in "
                           "a tree_dynamic tree, which no longer draws them from the draft: set one")
    if sample and tree is None:
        raise SdbenchError("draft: --set tree_sample draws a tree's children: set tree_topk or tree_shape too")
    return tree


def check_growth(name: str, gamma: int, draft_kv: str, options: dict, sampling) -> None:
    """Strategy `name`'s tree settings (`grown_tree`), and sampled children refused under greedy decoding."""
    grown_tree(gamma, draft_kv, options)
    if options["tree_sample"] and sampling is not None and sampling.greedy:
        raise SdbenchError(f"{name}: --set tree_sample draws children from the draft's distribution, which needs "
                           "sampling: use --temperature above 0")


def sparse_spec(selector: str, options: dict) -> SparseSpec | None:
    """The sparse draft cache these settings ask for (None: dense); raises on impossible ones."""
    if selector == "dense":
        return None
    return SparseSpec(selector, options["budget"], options["sink"], options["window"])


@register
class DraftStrategy(Strategy):
    name = "draft"
    help = "draft-model speculative decoding, fixed gamma (any same-tokenizer draft, the target itself included)"
    aliases = ("sd", "speculative")
    options = (
        Option("draft_kv", "dense", "draft KV cache: dense, or a fixed-size sparse view: streamingllm, snapkv", str),
        *SPARSE_OPTIONS,
        *TREE_OPTIONS,
        *GROWTH_OPTIONS,
    )
    needs_draft = model_draft = True
    proposer = DraftModel

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        need_gamma(cls.name, gamma)
        sparse_spec(options["draft_kv"], options)
        check_growth(cls.name, gamma, options["draft_kv"], options, sampling)

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
    def build(cls, ctx: BuildContext) -> DraftModel:
        return DraftModel(ctx.drafts[0], ctx.gamma, **ctx.options)

    @classmethod
    def search_space(cls, trial, space) -> tuple:
        """gamma; with `tune --trees`, the chain or a top-k tree gamma levels deep (SearchContext.topk_tree)."""
        gamma = trial.suggest_int("gamma", 1, 8)
        return gamma, space.topk_tree(trial, gamma)
