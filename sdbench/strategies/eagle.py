"""EAGLE (1 and 3): a trained head drafts gamma tokens per round (or a token tree gamma levels deep) from the
target's hidden states (--head). `HeadStrategy` is what every trained-head strategy declares alike (medusa.py is
the other)."""

from __future__ import annotations


from sdbench.drafting.dynamic import DynamicTree
from sdbench.engine.tree import Tree
from sdbench.errors import SdbenchError
from sdbench.strategies.base import TrainedHead
from sdbench.strategies.spec import BuildContext, Option, SearchContext, Strategy, need_gamma, register
from sdbench.strategies.trees import TREE_OPTIONS, tree_params, tree_setting, widest

MAX_TUNED_GAMMA = 8


class HeadStrategy(Strategy):
    """A strategy drafting with a trained head of one of `head_kinds` (models/heads/load.py), read from --head."""

    options = (Option("head", "", "the trained head: a folder or a hub id (also --head)", str), *TREE_OPTIONS)

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        from sdbench.models.heads.load import check_folder  # light: no weights read

        need_gamma(cls.name, gamma)
        cls.tree(gamma, options)
        head = options.get("head")
        if not head:
            raise SdbenchError(f"strategy '{cls.name}' needs --head PATH|HUB_ID (a trained head for the target; "
                               f"beside another --strategy: --set {cls.name}.head=PATH)")
        check_folder(head)  # a typo, or a folder that holds no head, fails before the target loads

    @classmethod
    def tree(cls, gamma: int, options: dict) -> Tree | DynamicTree | None:
        """The token tree the head grows each round (None: a chain); raises on impossible settings."""
        return tree_setting(cls.name, gamma, options.get("tree_topk", 0), options.get("tree_nodes", 0),
                            options.get("tree_shape", ""), options.get("tree_dynamic", False))

    @classmethod
    def drafter(cls, head, target, gamma: int, tree: Tree | DynamicTree | None = None, options: dict | None = None):
        """The drafter over a loaded head, drafting a chain or `tree` with the strategy's settings `options`
        (raises SdbenchError on settings the head cannot honour)."""
        raise NotImplementedError

    @classmethod
    def max_gamma(cls, heads: tuple[str, ...]) -> int:
        """The largest lookahead `tune` tries with these head candidates."""
        return MAX_TUNED_GAMMA

    @classmethod
    def search_space(cls, trial, space: SearchContext) -> tuple:
        """gamma, the head (one of the candidates: --head, or the target's heads train-head recorded) and, with
        `tune --trees`, the chain or a top-k tree."""
        head = cls.chosen_head(trial, space)
        gamma = trial.suggest_int("gamma", 1, cls.max_gamma(space.heads))
        return gamma, {"head": head, **space.topk_tree(trial, gamma)}

    @classmethod
    def chosen_head(cls, trial, space: SearchContext) -> str:
        """A trial's head: the one candidate, or one drawn from several (one line without any)."""
        if not space.heads:
            raise SdbenchError(f"strategy '{cls.name}' needs a trained head to tune with: give --head PATH|HUB_ID")
        return space.heads[0] if len(space.heads) == 1 else trial.suggest_categorical("head", list(space.heads))

    @classmethod
    def proposer_for(cls, head, target, gamma: int, options: dict | None = None) -> TrainedHead:
        """The proposer drafting with a loaded head (options: the tree settings, if any)."""
        options = options or {}
        return TrainedHead(cls.drafter(head, target, gamma, cls.tree(gamma, options), options), gamma, head.name,
                           tree_params(options))

    @classmethod
    def build(cls, ctx: BuildContext) -> TrainedHead:
        from sdbench.models.heads.load import load_head  # reads weights: only a run that drafts with it

        return cls.proposer_for(load_head(ctx.options["head"], ctx.target, cls.head_kinds, cls.name), ctx.target,
                                ctx.gamma, ctx.options)


@register
class EagleStrategy(HeadStrategy):
    name = "eagle"
    help = ("EAGLE-1/EAGLE-3 trained head (--head) drafting from the target's hidden states, fixed gamma; "
            "tree_topk=K or tree_shape=... grows a token tree, tree_dynamic=true a shape per row and round (EAGLE-2)")
    head_kinds = ("eagle3", "eagle1")

    @classmethod
    def drafter(cls, head, target, gamma: int, tree: Tree | DynamicTree | None = None, options: dict | None = None):
        from sdbench.drafting.heads import EagleDrafter

        forward = eagle_head(head, target)
        check_width(head.name, tree, forward.vocab_size)
        return EagleDrafter(forward, head.name, head.layers, tree)


def eagle_head(head, target, forward_type=None):
    """EAGLE's forward (or `forward_type`, one like it) over a loaded head (one line where the library refuses its
    layer's config)."""
    from sdbench.models.heads.eagle import EagleHead

    try:
        return (forward_type or EagleHead)(head, target)
    except (ValueError, KeyError, TypeError) as err:
        line = (str(err).strip() or type(err).__name__).splitlines()[0]
        raise SdbenchError(f"--head {head.name}: its layer's config is not one sdbench reads ({line})") from None


def check_width(head: str, tree: Tree | DynamicTree | None, vocab: int) -> None:
    """Refuse a tree with a node of more children than the head has tokens to rank."""
    if tree is not None and widest(tree) > vocab:
        raise SdbenchError(f"--head {head}: a tree node has {widest(tree)} children, more than the {vocab} tokens "
                           "the head drafts")
