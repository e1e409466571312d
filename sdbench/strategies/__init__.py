"""The strategies: each is declared once (strategies/spec.py `Strategy`, registered by `@register` on the
declaration in its own module) and runs as a proposer (strategies/base.py).

Named presets (`sdbench.presets`: the shipped strategies/*.yaml and the user's own) are strategies with saved
settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from sdbench.errors import SdbenchError
from sdbench.presets import read_presets
from sdbench.schedule import Entry, Schedule
from sdbench.strategies.base import Proposal, Proposer
from sdbench.strategies.spec import (BuildContext, Configuration, Strategy, refuse_head, register, strategy,
                                     strategy_registry)

# each module registers its strategy (`@register` on its declaration)
from sdbench.strategies import (adaptive, autoregressive, dflash, draft, dsi, dspark, eagle,  # noqa: E402,F401
                                lookahead, magicdec, medusa, mtp, ngram, pard, peagle, polybasic, rest,
                                suffix)
from sdbench.strategies.mtp import declares_own_module  # noqa: E402


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


def head_candidates(asked: str, target: str, given: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The heads `tune` chooses among for strategy (or preset) `asked`: those given (--head), else a preset's own,
    else the target's heads of a kind the strategy drafts with that train-head recorded; () for a strategy that
    takes no head."""
    choice = resolve_strategy(asked)
    declared = strategy(choice.base)
    given = given or tuple(h for h in (choice.options.get("head"),) if h)
    if given:
        refuse_head(declared, asked)
        return tuple(dict.fromkeys(given))
    if not declared.head_kinds:
        return ()
    from sdbench.models.heads.registry import known_heads  # reads the user's index of heads

    found = tuple(h["path"] for h in known_heads(target) if h.get("kind") in declared.head_kinds)
    if "mtp" in declared.head_kinds and declares_own_module(target):  # the MTP module its checkpoint ships
        found = (target, *found)
    if not found:
        raise SdbenchError(f"strategy '{declared.name}' needs a trained head to tune with: give --head PATH|HUB_ID "
                           f"(repeatable), or train one for {target} with `sdbench train-head`")
    return found


def heads_for(asked: tuple[str, ...], target: str, given: tuple[str, ...] = ()) -> dict[str, tuple[str, ...]]:
    """The head candidates of each strategy (or preset) tuned together, by its name as asked. With one strategy,
    `head_candidates`; with several, each --head goes to the strategy drafting with its kind (a Medusa config to
    medusa, a P-EAGLE, MTP, DFlash or DSpark head to its own, any other head to eagle) and a head strategy given none
    takes the target's recorded heads."""
    if len(asked) == 1:
        return {asked[0]: head_candidates(asked[0], target, given)}
    from sdbench.models.heads.load import config_kind  # reads config.json only

    found, kind = {}, {h: config_kind(h) or "eagle3" for h in given}
    for name in asked:
        kinds = strategy(resolve_strategy(name).base).head_kinds
        mine = tuple(h for h in given if kind[h] in kinds)
        found[name] = head_candidates(name, target, mine) if kinds else ()
    unused = [h for h in given if not any(h in heads for heads in found.values())]
    if unused:
        raise SdbenchError(f"--head {unused[0]}: no --strategy tuned here drafts with it (a head needs eagle, "
                           "medusa, peagle, mtp, dflash or dspark among them)")
    return found


def _checked(base: str, ctx: BuildContext) -> tuple[type[Strategy], BuildContext]:
    """The declaration and the context with its settings checked (defaults filled), as `run` checked them
    before loading (the sampling rules excepted: a build does not know the sampling)."""
    declared = strategy(base)
    ctx = replace(ctx, options=declared.settings(ctx.options))
    declared.check(ctx.gamma, ctx.options, ctx.draft_names())
    return declared, ctx


def build_proposer(base: str, ctx: BuildContext) -> Proposer:
    declared, ctx = _checked(base, ctx)
    return declared.build(ctx)


def build_configurations(base: str, ctx: BuildContext) -> list[Configuration]:
    """The proposer for one setting plus any configurations the strategy runs beside it for comparison."""
    declared, ctx = _checked(base, ctx)
    return declared.configurations(ctx)


__all__ = ["BuildContext", "Proposal", "Proposer", "Strategy", "StrategyChoice", "Configuration", "build_proposer",
           "build_configurations", "head_candidates", "heads_for", "register", "resolve_strategy", "strategy",
           "strategy_registry"]
