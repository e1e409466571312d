"""How a strategy is declared: one `Strategy` class per strategy, registered by the `@register` decorator on it.

The declaration is what the CLI and the tuner know before any model loads: the name and aliases, the settings
`--set` may change (`options`), whether it needs `--draft` (and whether that draft must be a model), a pure
`validate` of the settings, and what `sdbench tune` may try (`search_space`). `build` makes the proposer (the
part that runs in the decode loop, strategies/base.py) from loaded models. The decorator is the one source of a
registered strategy: its name, aliases, help and settings are read from the class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from sdbench.drafting.ngram import DRAFT_NAME
from sdbench.engine.runner import Runner
from sdbench.engine.tree import is_tree_setting
from sdbench.errors import SdbenchError
from sdbench.registry import Registry
from sdbench.strategies.base import Proposer


@dataclass(frozen=True)
class Option:
    """A strategy setting that `--set key=value` may change."""

    name: str
    default: Any
    help: str
    kind: type = int

    def parse(self, raw: Any) -> Any:
        if isinstance(raw, self.kind):
            return raw
        try:
            if self.kind is bool:
                if str(raw).lower() in ("1", "true", "yes", "on"):
                    return True
                if str(raw).lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(raw)
            return self.kind(raw)
        except (TypeError, ValueError):
            raise SdbenchError(f"--set {self.name}={raw}: expected {self.kind.__name__}") from None


TREE_TOPKS = (2, 3, 4)  # `tune --trees`: the top-k widths (ngram: branches) tried beside the chain
TREE_NODE_BUDGETS = (4, 8, 16, 32)  # a top-k tree's node budgets, each capped at the full tree's size


@dataclass(frozen=True)
class SearchContext:
    """What a search space may depend on when tuning."""

    drafts: tuple[str, ...] = ()  # the --draft candidates
    prompt_tokens: int = 0  # longest prompt of the tuning subset
    max_new_tokens: int = 0
    heads: tuple[str, ...] = ()  # the trained-head candidates (--head, or the target's recorded heads)
    trees: bool = False  # `tune --trees`: a strategy that grows token trees draws their shape too (the chain
    # stays a choice); off, its search space is the chain's, parameter for parameter

    @property
    def context_tokens(self) -> int:
        """Longest context a generation reaches (e.g. the ceiling for a KV budget)."""
        return self.prompt_tokens + self.max_new_tokens

    def topk_tree(self, trial, gamma: int) -> dict:
        """The tree settings of a strategy whose drafter ranks its candidates (tree_topk, tree_nodes): none
        without `tune --trees` (no parameter drawn); with it, the chain (tree_topk 0: no settings) or a top-k
        tree gamma levels deep with a node budget, capped at the k + k^2 + ... + k^gamma nodes of the full
        tree (a larger budget would give the same tree)."""
        if not self.trees:
            return {}
        topk = trial.suggest_categorical("tree_topk", [0, *TREE_TOPKS])
        if not topk:
            return {}
        full = sum(topk**d for d in range(1, gamma + 1))
        budget = trial.suggest_categorical("tree_nodes", list(TREE_NODE_BUDGETS))
        return {"tree_topk": topk, "tree_nodes": min(budget, full)}


@dataclass
class BuildContext:
    """What a strategy's `build` gets: loaded runners and the user's settings."""

    target: Runner
    drafts: list[Runner | str] = field(default_factory=list)  # a model-free draft by its name (ngram)
    gamma: int = 4
    options: dict = field(default_factory=dict)
    tokenizer: Any = None  # the target's tokenizer, where the strategy's data must match it (a REST datastore)

    def draft_names(self) -> tuple[str, ...]:
        """The drafts as the user named them: a runner's model name, or the model-free draft's name."""
        return tuple(d if isinstance(d, str) else d.name for d in self.drafts)


@dataclass
class Configuration:
    """One configuration to run. label '' is the strategy as asked for; an extra configuration has a label
    naming it (unique within the run) and the strategy name and draft column its rows record."""

    proposer: Proposer
    label: str = ""
    strategy: str = ""
    drafts: str = ""


def need_gamma(strategy: str, gamma: int, option: str = "--gamma") -> None:
    """A strategy that always drafts needs a lookahead of at least one token: the one check of that rule.
    option: how the user gave the value, for the error."""
    if gamma < 1:
        raise SdbenchError(f"{option} must be at least 1 for strategy '{strategy}' (got {gamma})")


def refuse_head(declared: type["Strategy"], asked: str) -> None:
    """--head given to a strategy that drafts with no trained head: one line. asked: the strategy as named."""
    if not declared.head_kinds:
        raise SdbenchError(f"--head needs --strategy eagle, peagle, medusa, mtp, dflash or dspark (a trained head "
                           f"drafts for them), not '{asked}'")


def tree_settings(declared: type["Strategy"]) -> tuple[str, ...]:
    """The tree settings a strategy declares (`tree`, `tree_*`, and its `tree_options`); () for one that drafts
    only chains."""
    return tuple(o.name for o in declared.options if is_tree_setting(o.name) or o.name in declared.tree_options)


def tree_growers() -> dict[str, tuple[str, ...]]:
    """Registered strategy -> its tree settings, for those that grow token trees."""
    return {name: found for name in strategy_registry.names() if (found := tree_settings(strategy(name)))}


def _tree_refusal(strategy_name: str, setting: str) -> str:
    """Why --set SETTING (a tree setting) does not apply to this strategy, naming the strategies that grow trees."""
    growers = tree_growers()
    listed = ", ".join(f"{name} ({', '.join(found)})" for name, found in growers.items())
    if strategy_name in growers:
        return f"strategy '{strategy_name}' has no setting '{setting}': its token tree is set by " \
               f"{', '.join(growers[strategy_name])} (tree settings by strategy: {listed})"
    return f"strategy '{strategy_name}' grows no token tree (--set {setting}): the strategies that do are {listed}"


def take_options(declared: tuple[Option, ...], given: dict, strategy: str) -> dict:
    """Declared defaults overridden by --set values; unknown keys are an error (a tree setting's names the
    strategies that grow trees)."""
    known = {o.name: o for o in declared}
    unknown = sorted(set(given) - set(known))
    if unknown:
        trees = [k for k in unknown if is_tree_setting(k)]
        if trees:
            raise SdbenchError(_tree_refusal(strategy, trees[0]))
        names = ", ".join(sorted(known)) or "none"
        raise SdbenchError(f"strategy '{strategy}' has no setting '{unknown[0]}' (settings: {names})")
    return {k: (o.parse(given[k]) if k in given else o.default) for k, o in known.items()}


class Strategy:
    """A strategy's declaration: everything about it but running. Subclass, set the class attributes, override
    what differs, and put `@register` on the class."""

    name: ClassVar[str]
    help: ClassVar[str] = ""  # one line for `sdbench list strategies`
    aliases: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[tuple[Option, ...]] = ()
    needs_draft: ClassVar[bool] = False  # refused without --draft
    model_draft: ClassVar[bool] = False  # the first --draft must be a model (not a model-free draft such as ngram)
    head_kinds: ClassVar[tuple[str, ...]] = ()  # the trained heads it drafts with (--head); () : it takes none
    tree_options: ClassVar[tuple[str, ...]] = ()  # options not named tree* that shape the token tree it always
    # grows (lookahead's window, ngram, pool): with the tree* ones, its tree settings (`tree_settings`)
    proposer: ClassVar[type[Proposer]] = Proposer  # what `build` makes (its decoder and rows_join say how it runs)

    @classmethod
    def settings(cls, given: dict) -> dict:
        """The declared options with --set values (or a preset's) applied; unknown keys or bad values raise."""
        return take_options(cls.options, given, cls.name)

    @classmethod
    def check(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling=None) -> None:
        """Raise on settings this strategy refuses, before any model loads: the draft rules, then `validate`.
        options: as `settings` returns them; drafts: the --draft names; sampling: the SamplingConfig (None when
        not known yet)."""
        if cls.needs_draft and not drafts:
            raise SdbenchError(f"strategy '{cls.name}' needs --draft MODEL (the target itself works: --draft "
                               "TARGET lets it draft for itself)")
        if cls.model_draft and drafts and drafts[0] == DRAFT_NAME:
            raise SdbenchError(f"strategy '{cls.name}' needs a draft model, and --draft {DRAFT_NAME} is not one: "
                               f"use --strategy {DRAFT_NAME}, or adaptive to mix it with a model")
        cls.validate(gamma, options, drafts, sampling)

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        """The strategy's own rules on its settings; pure (no model, no proposer made)."""

    @classmethod
    def build(cls, ctx: BuildContext) -> Proposer:
        """Make the proposer from loaded models and checked settings."""
        return cls.proposer(ctx.gamma, **ctx.options)

    @classmethod
    def configurations(cls, ctx: BuildContext) -> list[Configuration]:
        """The configurations one setting of this strategy runs: itself, plus any it brings along to be
        compared with in the same run (adaptive strategies add fixed-gamma ones)."""
        return [Configuration(cls.build(ctx))]

    @classmethod
    def side_nodes(cls, params: dict) -> int:
        """Nodes each verifying forward feeds beside the drafted tree (engine/state.py `Side`), from the settings a
        run recorded (its proposer's `params`): what the tree cost model adds to a tree's width."""
        return 0

    @classmethod
    def join_refusal(cls, options: dict) -> str | None:
        """Why this strategy with these options (checked, defaults filled) cannot serve requests that join a
        running batch (`run --request-rate/--concurrency`), in a few words; None when it can."""
        if cls.proposer.decoder != "sequential":
            return "it runs its own decode loop, one batch from start to end"
        if not cls.proposer.rows_join:
            return "its proposer keeps state for a whole batch from the start of a generation"
        return None

    @classmethod
    def needs_native(cls, target: str, drafts: tuple[str, ...], options: dict) -> dict[str, str]:
        """Model name -> what of this strategy needs that model on the native runner (sdbench's own attention,
        where the sparse KV caches live), so that a model the generic runner serves is refused before its
        weights load. options: checked, defaults filled."""
        return {}

    @classmethod
    def search_space(cls, trial, space: SearchContext) -> tuple:
        """What `sdbench tune` may try: draw settings from an Optuna `trial` and return (gamma, options) or
        (gamma, options, drafts).

        Use trial.suggest_int / suggest_categorical / suggest_float with parameter names that stay the same
        across trials; options must be declared `options` (checked like --set values), and those left out
        keep their defaults. Return drafts only to pick or order the --draft candidates yourself
        (space.drafts); with two elements the tuner picks one candidate per trial (parameter "draft") when
        there are several. Raise SdbenchError when there is nothing to tune. The default tunes gamma alone.
        """
        return trial.suggest_int("gamma", 1, 8), {}


strategy_registry: Registry[type[Strategy]] = Registry("strategy")


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: add a strategy declaration to the registry under its name and aliases."""
    strategy_registry.add(cls.name, cls, cls.help, cls.aliases)
    return cls


def strategy(name: str) -> type[Strategy]:
    """The declaration registered under a name or alias (a one-line error with a suggestion otherwise)."""
    return strategy_registry.get(name)


def head_strategy(kind: str) -> type[Strategy]:
    """The strategy that drafts with a trained head of this kind (models/heads/load.py: eagle3, medusa, ...)."""
    return next(strategy(n) for n in strategy_registry.names() if kind in strategy(n).head_kinds)
