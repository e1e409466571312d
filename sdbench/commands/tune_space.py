"""A `tune` trial's settings, drawn from the search spaces of the strategies tuned (`commands/tune.py`).

With one strategy, its own `search_space` draws gamma, options and drafts under the names it gives them. With
several, the trial draws a strategy first (a categorical), then that strategy's settings, named `STRATEGY.NAME` so
that two strategies' `gamma` stay two parameters (`Within`). What a space draws is checked against the candidates
the command was given (`--draft`, `--head`) and the strategy's own settings.
"""

from __future__ import annotations

from sdbench.errors import SdbenchError
from sdbench.strategies import strategy
from sdbench.strategies.spec import SearchContext


def draw(base: str, trial, space: SearchContext) -> dict:
    """One trial's settings from the strategy's search space: gamma, checked options, drafts."""
    declared = strategy(base)
    drawn = declared.search_space(trial, space)
    if not isinstance(drawn, tuple) or len(drawn) not in (2, 3):
        raise SdbenchError(f"strategy '{base}': search_space must return (gamma, options[, drafts])")
    gamma, options, drafts = (*drawn, None)[:3]
    if drafts is None:  # one candidate per trial for a draft-model strategy; none for the others
        drafts = space.drafts if declared.needs_draft else ()
        if len(drafts) > 1:
            drafts = (trial.suggest_categorical("draft", list(drafts)),)
    unknown = sorted(set(drafts) - set(space.drafts))
    if unknown:
        raise SdbenchError(f"strategy '{base}' chose draft '{unknown[0]}', which is not a --draft candidate")
    if options.get("head") and options["head"] not in space.heads:
        raise SdbenchError(f"strategy '{base}' chose head '{options['head']}', which is not a --head candidate")
    declared.settings(dict(options))
    return {"gamma": int(gamma), "options": dict(options), "drafts": list(drafts)}


class Within:
    """A trial as one of several strategies tuned together sees it: the parameters it suggests are named
    STRATEGY.NAME, so that each strategy's search space is its own (TPE models each apart)."""

    def __init__(self, trial, strategy: str):
        self.trial, self.prefix = trial, f"{strategy}."

    def suggest_int(self, name: str, *args, **kwargs):
        return self.trial.suggest_int(self.prefix + name, *args, **kwargs)

    def suggest_float(self, name: str, *args, **kwargs):
        return self.trial.suggest_float(self.prefix + name, *args, **kwargs)

    def suggest_categorical(self, name: str, *args, **kwargs):
        return self.trial.suggest_categorical(self.prefix + name, *args, **kwargs)


def draw_among(bases: tuple[str, ...], trial, spaces: dict[str, SearchContext]) -> dict:
    """One trial's settings: with one strategy, its own draw (parameters as the strategy names them); with
    several, the strategy first (a categorical), then its settings, and the settings record which it is."""
    if len(bases) == 1:
        return draw(bases[0], trial, spaces[bases[0]])
    base = trial.suggest_categorical("strategy", list(bases))
    return {"strategy": base, **draw(base, Within(trial, base), spaces[base])}
