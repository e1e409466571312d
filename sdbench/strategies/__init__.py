"""The strategy registry: each strategy is a Proposer class with declared `options` and `build(ctx)`.

Named presets (`sdbench.presets`: the shipped strategies/*.yaml and the user's own) are strategies with saved
settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from sdbench.presets import read_presets
from sdbench.registry import Registry
from sdbench.schedule import Entry, Schedule
from sdbench.strategies.base import BuildContext, Proposal, Proposer, Variant, take_options

strategy_registry: Registry = Registry("strategy")
strategy_registry.add(
    "adaptive", "sdbench.strategies.adaptive:Adaptive",
    "gamma (0 = plain) and draft chosen each round for the most predicted tokens/s; n-gram draft without --draft",
    aliases=("adaptive-gamma",), needs_draft=False,
)
strategy_registry.add(
    "adaptive-fsm", "sdbench.strategies.adaptive:AdaptiveFSM",
    "state-machine gamma: grow after a fully accepted round, shrink after a rejection (schedule=step|heuristic)",
    aliases=("fsm",), needs_draft=False,
)
strategy_registry.add(
    "autoregressive", "sdbench.strategies.autoregressive:Autoregressive",
    "plain decoding, one target forward per token (the baseline)", aliases=("ar", "baseline"), needs_draft=False,
)
strategy_registry.add(
    "draft", "sdbench.strategies.draft:DraftModel",
    "draft-model speculative decoding, fixed gamma (any same-tokenizer draft, the target itself included)",
    aliases=("sd", "speculative"), needs_draft=True,
)
strategy_registry.add(
    "dsi", "sdbench.strategies.dsi:DSI",
    "distributed speculative inference: drafting never waits, windows verified on a pool of target workers "
    "(--set workers=N backend=process|ray), greedy only",
    aliases=("distributed",), needs_draft=True,
)
strategy_registry.add(
    "magicdec", "sdbench.strategies.magicdec:MagicDec",
    "self-speculation: the target drafts through a fixed-budget sparse KV cache (StreamingLLM or SnapKV)",
    aliases=("self-spec", "sparse-kv"), needs_draft=False,
)
strategy_registry.add(
    "ngram", "sdbench.strategies.ngram:NGram",
    "prompt lookup: draft from the latest earlier match of the context's suffix (no model)",
    aliases=("prompt-lookup", "pld"), needs_draft=False,
)
strategy_registry.add(
    "polybasic", "sdbench.strategies.polybasic:Polybasic",
    "a chain of drafters (--draft from the top down, ngram allowed at the bottom), each verifying the one below",
    aliases=("chain",), needs_draft=True,
)


@dataclass(frozen=True)
class StrategyChoice:
    """A strategy name resolved through presets: the base strategy plus preset settings."""

    name: str  # what the user asked for (strategy or preset name)
    base: str  # registered strategy
    gamma: int | None = None
    options: dict = field(default_factory=dict)
    drafts: tuple[str, ...] = ()
    schedule: Schedule | None = None  # a tuned schedule: settings per batch size (and context), looked up by `run`
    entry: Entry | None = None  # the schedule's entry a run applies (`at`)

    def at(self, batch: int, prompt_len: int | None) -> "StrategyChoice":
        """The choice with the schedule's entry for this batch size and prompt length applied (itself when it
        has no schedule)."""
        if self.schedule is None:
            return self
        e = self.schedule.lookup(batch, prompt_len)
        return replace(self, gamma=e.gamma, options=dict(e.options), drafts=e.drafts or self.drafts, entry=e)


def resolve_strategy(name: str) -> StrategyChoice:
    if name in strategy_registry:
        return StrategyChoice(name, strategy_registry.entry(name).name)
    preset = read_presets().get(name.lower())
    if preset is None:
        strategy_registry.entry(name)  # raises the one-line unknown-strategy error
    base = strategy_registry.entry(str(preset.get("strategy", ""))).name
    schedule = (Schedule.from_spec(preset["schedule"], f"preset '{name}'") if preset.get("schedule") is not None
                else None)
    return StrategyChoice(name, base, preset.get("gamma"), dict(preset.get("options") or {}),
                          tuple(preset.get("drafts") or ()), schedule)


def check_options(base: str, given: dict) -> dict:
    """The strategy's settings with --set values applied; unknown keys or bad values raise."""
    return take_options(strategy_registry.get(base).options, given, strategy_registry.entry(base).name)


def native_needed(cfg) -> dict[str, str]:
    """For a RunConfig: model name -> what of its strategy needs that model on the native runner."""
    choice = resolve_strategy(cfg.strategy)
    options = check_options(choice.base, {**choice.options, **cfg.options})
    drafts = tuple(cfg.drafts or choice.drafts)
    return strategy_registry.get(choice.base).needs_native(cfg.target, drafts, options)


def build_proposer(base: str, ctx: BuildContext) -> Proposer:
    cls = strategy_registry.get(base)
    return cls.build(replace(ctx, options=check_options(base, ctx.options)))


def build_variants(base: str, ctx: BuildContext) -> list[Variant]:
    """The proposer for one setting plus any configurations the strategy runs beside it for comparison."""
    cls = strategy_registry.get(base)
    return cls.variants(replace(ctx, options=check_options(base, ctx.options)))


def needs_draft(base: str) -> bool:
    return bool(strategy_registry.entry(base).meta.get("needs_draft"))


__all__ = ["BuildContext", "Proposal", "Proposer", "StrategyChoice", "Variant", "build_proposer", "build_variants",
           "needs_draft", "check_options", "resolve_strategy", "strategy_registry"]
