"""What a strategy is: a proposer. The decode loop asks it for draft tokens and tells it what was committed.

A class here does three jobs, grouped below: running (begin / propose / observe / end, called by the one loop),
reporting (params, notes, row_stats: what results record) and construction (options, check, build, variants,
search_space: what the CLI and the tuner ask before and while making one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sdbench.engine.state import DecodeState, Proposal
from sdbench.engine.step import Round
from sdbench.errors import SdbenchError


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


class Proposer:
    """Base proposer: proposes nothing, so the loop decodes one target token per step."""

    name = "autoregressive"
    options: tuple[Option, ...] = ()
    decoder = "sequential"  # the decoder the command runs it with (sdbench/decoders.py): the one loop, or "dsi"
    rows_join = False  # True: requests may join a running batch (serving under load): `begin_rows` is implemented

    def __init__(self, gamma: int = 0):
        self.gamma = gamma

    # ---- running -------------------------------------------------------------------------------------------
    @property
    def max_lookahead(self) -> int:
        """Most tokens ever proposed in one step (sizes the KV caches)."""
        return self.gamma

    def begin(self, state: DecodeState) -> None:
        """Called once after the target's prefill and first token."""

    def begin_rows(self, state: DecodeState, rows: list[int]) -> None:
        """Serving under load: rows `rows` now hold a new request (its prompt and first token) in the middle of a
        generation; forget whatever was kept for the requests they held before (a draft model prefills its own
        cache row). Only called where `rows_join` is set."""
        if not self.rows_join:
            raise NotImplementedError(f"strategy '{self.name}' cannot take rows joining mid-generation")

    def propose(self, state: DecodeState) -> Proposal | None:
        return None

    def observe(self, state: DecodeState, proposal: Proposal | None, rnd: Round) -> None:
        """Called after each verification: the proposal as verified (cut to what each row could commit) and
        the round: per row drafted, accepted and committed drafts, and the round's measured draft and verify
        seconds."""

    def end(self) -> None:
        """Called once the generation is over (also after an error): give back caches for reuse."""

    # ---- reporting -----------------------------------------------------------------------------------------
    def params(self) -> dict:
        """The settings recorded with every result row."""
        return {"gamma": self.gamma}

    def notes(self, context_tokens: int) -> list[str]:
        """What the user should be told before a run whose contexts reach `context_tokens` (prompt plus new
        tokens): settings that are accepted but do something other than their name suggests."""
        return []

    def row_stats(self, b: int) -> dict:
        """Strategy-specific figures for row b of the generation that just ended (JSON-able), recorded in
        the `strategy_stats` column: e.g. a gamma trajectory, per-level counts, worker busy fractions."""
        return {}

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def check(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        """Raise on settings this strategy refuses, before any model loads: options as validated by
        take_options (defaults filled), drafts the --draft names, sampling the SamplingConfig. `build` (with
        the models) refuses the same; a strategy whose constructor checks its settings and touches no model
        builds itself with placeholders here."""

    @classmethod
    def join_refusal(cls, options: dict) -> str | None:
        """Why this strategy with these options (validated, defaults filled) cannot serve requests that join a
        running batch (`run --request-rate/--concurrency`), in a few words; None when it can."""
        if cls.decoder != "sequential":
            return "it runs its own decode loop, one batch from start to end"
        if not cls.rows_join:
            return "its proposer keeps state for a whole batch from the start of a generation"
        return None

    @classmethod
    def needs_native(cls, target: str, drafts: tuple[str, ...], options: dict) -> dict[str, str]:
        """Model name -> what of this strategy needs that model on the native runner (sdbench's own attention,
        where the sparse KV caches live), so that a model the generic runner serves is refused before its
        weights load. options: validated, defaults filled."""
        return {}

    @classmethod
    def build(cls, ctx: "BuildContext") -> "Proposer":
        """Make the proposer from loaded models and settings (ctx.options already validated)."""
        return cls(ctx.gamma, **ctx.options)

    @classmethod
    def variants(cls, ctx: "BuildContext") -> list["Variant"]:
        """The configurations one setting of this strategy runs: itself, plus any it brings along to be
        compared with in the same run (adaptive strategies add fixed-gamma ones)."""
        return [Variant(cls.build(ctx))]

    @classmethod
    def search_space(cls, trial, space: "SearchContext") -> tuple:
        """What `sdbench tune` may try: draw settings from an Optuna `trial` and return (gamma, options) or
        (gamma, options, drafts).

        Use trial.suggest_int / suggest_categorical / suggest_float with parameter names that stay the same
        across trials; options must be declared `options` (checked like --set values), and those left out
        keep their defaults. Return drafts only to pick or order the --draft candidates yourself
        (space.drafts); with two elements the tuner picks one candidate per trial (parameter "draft") when
        there are several. Raise SdbenchError when there is nothing to tune. The default tunes gamma alone.
        """
        return trial.suggest_int("gamma", 1, 8), {}


@dataclass(frozen=True)
class SearchContext:
    """What a search space may depend on when tuning."""

    drafts: tuple[str, ...] = ()  # the --draft candidates
    prompt_tokens: int = 0  # longest prompt of the tuning subset
    max_new_tokens: int = 0

    @property
    def context_tokens(self) -> int:
        """Longest context a generation reaches (e.g. the ceiling for a KV budget)."""
        return self.prompt_tokens + self.max_new_tokens


@dataclass
class BuildContext:
    """What a strategy factory gets: loaded runners and the user's settings."""

    target: Any  # ModelRunner
    drafts: list = field(default_factory=list)  # [ModelRunner, or a model-free draft name such as "ngram"]
    gamma: int = 4
    options: dict = field(default_factory=dict)


@dataclass
class Variant:
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


def take_options(declared: tuple[Option, ...], given: dict, strategy: str) -> dict:
    """Declared defaults overridden by --set values; unknown keys are an error."""
    known = {o.name: o for o in declared}
    unknown = sorted(set(given) - set(known))
    if unknown:
        names = ", ".join(sorted(known)) or "none"
        raise SdbenchError(f"strategy '{strategy}' has no setting '{unknown[0]}' (settings: {names})")
    return {k: (o.parse(given[k]) if k in given else o.default) for k, o in known.items()}


class FixedLookahead(Proposer):
    """A fixed-k use of one drafter: every round asks it for `gamma` tokens per row (never more than a row can
    still commit). Draft-model SD, prompt lookup and MagicDec are this with their own drafter."""

    def __init__(self, drafter, gamma: int):
        need_gamma(self.name, gamma)
        super().__init__(gamma)
        self.drafter = drafter

    rows_join = True

    def begin(self, state: DecodeState) -> None:
        self.drafter.begin(state)

    def begin_rows(self, state: DecodeState, rows: list[int]) -> None:
        self.drafter.begin_rows(state, rows)

    def propose(self, state: DecodeState) -> Proposal:
        return self.drafter.draft(state.tokens, state.lengths, state.lookahead(self.gamma))

    def end(self) -> None:
        self.drafter.end()
