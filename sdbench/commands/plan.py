"""A run's plan: every setting of `sdbench run` settled and checked once, before anything heavy loads, and carried
frozen to where it is used — the strategy's checked settings (presets and a schedule's entry applied, defaults
filled) and those of each strategy `--compare` measures beside it, the lookaheads each runs at, and which
models the run needs on the native runner.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sdbench.commands.load import check_load
from sdbench.commands.run_engine import check_engine_run
from sdbench.config import DEFAULT_GAMMA, RunConfig
from sdbench.data.tasks import check_dataset
from sdbench.errors import SdbenchError
from sdbench.models.loading.pair import at_weights
from sdbench.strategies import StrategyChoice, resolve_strategy, strategy
from sdbench.strategies.spec import refuse_head


@dataclass(frozen=True)
class Planned:
    """One strategy of a run: resolved (a preset's settings, a schedule's entry for the run's batch), the
    lookaheads it runs at, its options as given (the preset's, then --set) and as checked (`settings`)."""

    choice: StrategyChoice
    gammas: tuple[int, ...]
    options: dict
    settings: dict

    @property
    def declared(self):
        """The registered strategy class (strategies/spec.py)."""
        return strategy(self.choice.base)


@dataclass(frozen=True)
class RunPlan:
    """A run's configuration as settled (`cfg`: lookaheads capped, drafts and options with the preset's), its
    strategy and the strategies `--compare` brings, each checked."""

    cfg: RunConfig
    strategy: Planned
    compared: tuple[Planned, ...]
    asked: tuple[int, ...]  # the lookaheads asked for, before the cap

    @property
    def choice(self) -> StrategyChoice:
        return self.strategy.choice

    def native(self) -> dict[str, str]:
        """Model name -> what of the run needs that model on the native runner (`load_pair` refuses a model the
        generic runner serves before loading it)."""
        needed: dict[str, str] = {}
        for planned in (self.strategy, *self.compared):
            for model, why in planned.declared.needs_native(self.cfg.target, self.cfg.drafts,
                                                            planned.settings).items():
                needed.setdefault(model, why)
        return needed

    def gamma_note(self) -> str | None:
        """The one line that says the lookahead was capped, or None when it was not."""
        if self.asked == self.cfg.gammas:
            return None
        most = max(1, self.cfg.max_new_tokens - 1)
        return (f"note: --gamma {','.join(map(str, self.asked))} capped to {','.join(map(str, self.cfg.gammas))}: "
                f"a step can commit at most {most} token(s) with --max-new-tokens {self.cfg.max_new_tokens}")


def plan(cfg: RunConfig) -> RunPlan:
    """Settle the strategy (presets included) and every --compare one, and check all the settings."""
    choice = resolve_strategy(cfg.strategy).at(max(cfg.concurrencies or (cfg.batch_size,)), cfg.prompt_len)
    asked = tuple(cfg.gammas or (choice.gamma or DEFAULT_GAMMA,))
    cfg = at_weights(replace(cfg, gammas=asked, drafts=tuple(cfg.drafts or choice.drafts),
                             options={**choice.options, **cfg.options}))
    _check_numbers(cfg)
    check_engine_run(cfg, choice.base)  # what the engine cannot run, before the strategy's own checks
    cfg = replace(cfg, gammas=capped_gammas(cfg.gammas, cfg.max_new_tokens))
    own = _settled(cfg, choice, cfg.gammas, cfg.options, cfg.strategy)
    compared = tuple(_compared(cfg, name, options, choice) for name, options in cfg.compare.items())
    check_dataset(cfg.dataset, cfg.fields, cfg.depths, cfg.prompt_len)  # an unknown data set or a bad file fails before models load
    return RunPlan(cfg, own, compared, asked)


def capped_gammas(gammas: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    """Each lookahead capped to the most tokens a step can still commit (every token after the prefill's first),
    so that what a row records is the lookahead actually used; duplicates the cap makes are dropped."""
    cap = max(1, max_new_tokens - 1)
    return tuple(dict.fromkeys(min(g, cap) for g in gammas))


def _check_numbers(cfg: RunConfig) -> None:
    for name, value, low in (("--limit", cfg.limit, 1), ("--max-new-tokens", cfg.max_new_tokens, 1),
                             ("--batch-size", cfg.batch_size, 1), ("--repeats", cfg.repeats, 1), ("--turns", cfg.turns, 1),
                             ("--gamma", min(cfg.gammas), 0)):
        if value is not None and value < low:
            raise SdbenchError(f"{name} must be at least {low} (got {value})")
    if cfg.sampling.temperature < 0 or not 0 < cfg.sampling.top_p <= 1:
        raise SdbenchError("--temperature must be >= 0 and --top-p in (0, 1]")
    if cfg.prompt_len is not None and cfg.prompt_len < 1:
        raise SdbenchError(f"--prompt-len must be at least 1 (got {cfg.prompt_len})")


def _settled(cfg: RunConfig, choice: StrategyChoice, gammas: tuple[int, ...], options: dict, label: str) -> Planned:
    """One strategy's settings parsed and checked at every lookahead it runs at (label: its name on the command
    line, for the refusal of a head it cannot take); under load, the load's own checks too."""
    declared = strategy(choice.base)
    if "head" in options:
        refuse_head(declared, label)
    settings = declared.settings(options)
    if cfg.under_load or cfg.slo:
        check_load(cfg, choice.base, settings)
    for gamma in gammas:
        declared.check(gamma, settings, cfg.drafts, cfg.sampling)
    return Planned(choice, gammas, options, settings)


def _compared(cfg: RunConfig, name: str, own: dict, run_choice: StrategyChoice) -> Planned:
    """A --compare strategy: at its preset's lookahead, else the run's first --gamma, drafting with the run's
    --draft models (cfg as `plan` settled it)."""
    if name == run_choice.name:
        raise SdbenchError(f"--compare {name}: it is the run's --strategy already")
    c = resolve_strategy(name).at(max(cfg.concurrencies or (cfg.batch_size,)), cfg.prompt_len)
    if c.drafts and tuple(c.drafts) != tuple(cfg.drafts):
        raise SdbenchError(f"--compare {name}: it drafts with {', '.join(c.drafts)}, and this run loads "
                           f"{', '.join(cfg.drafts) or 'no draft model'}: give --draft {' --draft '.join(c.drafts)}")
    gamma = capped_gammas((c.gamma or cfg.gammas[0],), cfg.max_new_tokens)
    return _settled(cfg, c, gamma, {**c.options, **own}, name)
