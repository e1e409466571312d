"""On-the-fly adaptive speculative decoding: the lookahead gamma, and the draft, chosen while decoding.

No training and no offline tuning: both strategies only propose (the decode loop verifies, as for every
strategy) and learn from what each round cost and how much of it was accepted.

- `adaptive` picks the draft candidate and gamma (0 = a plain step) with the most predicted tokens per
  second (`adaptive_online.GammaPolicy`): acceptance alpha by maximum likelihood over the last `history` rounds,
  shrunk toward a per-prompt prior worth `prior_trials` drafted tokens (0: the paper's plain estimate), and the
  draft and verification times the decode loop measured. `select=round` (default) chooses the candidate every
  round for the whole batch; `select=prompt` is the paper's draft selection, once per prompt before its first
  round, from the alpha predicted from prompt features (`adaptive_online.select_drafters`, `AlphaPrior`,
  `prompt_features`); rows of a batch may then draft with different candidates, verified together.
- `adaptive-fsm` is the state machine: gamma grows after a fully accepted round and shrinks after a
  rejection (`schedule=step`: +1/-1; `schedule=heuristic`: +2/-1, transformers' schedule).

A round whose drafting also paid for a drafter's prefill or a long catch-up (more than STEADY_CATCH_UP unseen
tokens) does not teach the draft-cost model. `--set compare=1,2,4` also runs fixed-gamma speculative decoding
with every draft candidate at those gammas and at --gamma, in the same run on the same prompts.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import torch
import torch.nn.functional as F

from sdbench.drafting.model import ModelDrafter
from sdbench.drafting.ngram import DRAFT_NAME, NGramDrafter, check_ngram
from sdbench.engine.clock import Spans
from sdbench.engine.counters import AdaptiveRowStats
from sdbench.engine.iid_model import fit_alpha
from sdbench.engine.state import DecodeState, Proposal
from sdbench.engine.step import Round
from sdbench.errors import SdbenchError
from sdbench.options import split_list
from sdbench.strategies.adaptive_online import (PRIOR_TRIALS, AlphaPrior, GammaPolicy, StepSchedule,
                                                prompt_features, select_drafters)
from sdbench.strategies.base import Proposer
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.ngram import NGram
from sdbench.strategies.spec import BuildContext, Option, Strategy, Configuration, need_gamma, register

COMMON = (
    Option("gamma_max", 8, "largest lookahead the adaptation may choose"),
    Option("compare", "", "also run fixed-gamma SD at these gammas (and --gamma), e.g. 1,2,4,6,8", str),
    Option("max_ngram", 3, "n-gram draft: longest suffix (tokens) to match"),
    Option("min_ngram", 1, "n-gram draft: shortest suffix (tokens) to match"),
)


STEADY_CATCH_UP = 2  # a round feeding more unseen tokens than this is not a typical drafting cost


def make_drafters(drafts: list, max_ngram: int, min_ngram: int) -> list:
    """One drafter per --draft entry (a runner, or the name 'ngram'); prompt lookup when there are none."""
    return [NGramDrafter(max_ngram, min_ngram) if isinstance(d, str) else ModelDrafter(d)
            for d in drafts or [DRAFT_NAME]]


def parse_compare(text: str, strategy: str = "adaptive") -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(x) for x in split_list(str(text), "--set compare")}))
    except ValueError:
        raise SdbenchError(f"--set compare={text}: expected gammas like 1,2,4,6,8") from None
    for v in values:
        need_gamma(strategy, v, f"--set compare={text}: every gamma")
    return values


def merge_proposals(parts: list[Proposal]) -> Proposal:
    """One proposal from several drafters' proposals over disjoint rows (a row has drafts in one part at
    most). Under sampling a deterministic part's rows get the one-hot draft distribution, which is what the
    acceptance rule assumes for a proposal without probs, so each row is verified as its own drafter's."""
    width = max(p.tokens.shape[1] for p in parts)
    lengths = sum(p.lengths.cpu() for p in parts)
    with_probs = [p.probs for p in parts if p.probs is not None]
    device = with_probs[0].device if with_probs else parts[0].tokens.device
    batch = len(lengths)
    tokens = torch.zeros(batch, width, dtype=torch.long, device=device)
    probs = with_probs[0].new_zeros(batch, width, with_probs[0].shape[-1]) if with_probs else None
    for p in parts:
        rows = torch.nonzero(p.lengths.cpu() > 0).flatten().to(device)
        g = p.tokens.shape[1]
        part = p.tokens.to(device)[rows]
        tokens[rows, :g] = part
        if probs is not None:
            probs[rows, :g] = (p.probs.to(device)[rows] if p.probs is not None
                               else F.one_hot(part, probs.shape[-1]).to(probs.dtype))
    return Proposal(tokens, lengths, probs)


class RowTrace:
    """One row's rounds: gamma asked for, the drafter used, and that drafter's acceptance counts."""

    def __init__(self):
        self.gammas: Counter = Counter()
        self.drafts: Counter = Counter()
        self.counts: dict[int, list[int]] = {}  # drafter index -> [accepted, rejections]
        self.switches = 0
        self.last: int | None = None

    def add(self, d: int | None, gamma: int, drafted: int, accepted: int) -> None:
        self.gammas[gamma] += 1
        if d is None or gamma == 0:
            return
        self.drafts[d] += 1
        self.switches += self.last is not None and d != self.last
        self.last = d
        if drafted:
            counts = self.counts.setdefault(d, [0, 0])
            counts[0] += accepted
            counts[1] += accepted < drafted


class _Adaptive(Proposer):
    """What both adaptive strategies share: draft candidates, timing, per-row traces, comparisons."""

    def __init__(self, drafters: list, gamma: int, gamma_max: int = 8, compare: str = "", max_ngram: int = 3,
                 min_ngram: int = 1):
        super().__init__(gamma)
        self.drafters, self.gamma_max = drafters, gamma_max
        self.compare = parse_compare(compare, self.name)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._rows: list[RowTrace] = []
        self._started: list[bool] = []

    @property
    def max_lookahead(self) -> int:
        return self.gamma_max

    def begin(self, state: DecodeState) -> None:
        # a drafter starts (prefills) on the first round it is chosen: a candidate never chosen costs nothing;
        # one left idle for some rounds feeds the committed tokens it has not seen on its next use
        self._started = [False] * len(self.drafters)
        self._start(state)
        self._rows = [RowTrace() for _ in range(state.batch)]
        self._spans = [Spans(state.device) for _ in self.drafters]
        self._steady = [False] * len(self.drafters)

    def propose(self, state: DecodeState) -> Proposal | None:
        self._round, parts = [], []
        for d, gamma, rows in self._groups(state):
            limits = [n if b in rows else 0 for b, n in enumerate(state.lookahead(gamma))]
            gamma = max(limits, default=0)  # the lookahead used (and recorded): never past what a row can commit
            self._round.append((d, gamma, rows))
            if gamma:
                parts.append(self._draft(d, state, limits))
        proposals = [p for p in parts if p.tokens.shape[1]]  # a lookup that found nothing: a plain step
        if len(proposals) <= 1:
            return proposals[0] if proposals else None
        return merge_proposals(proposals)

    def _draft(self, d: int, state: DecodeState, limits: list[int]) -> Proposal:
        drafter = self.drafters[d]
        if not self._started[d]:
            drafter.begin(state)
            self._started[d], steady = True, False
        else:
            steady = drafter.catch_up(state.tokens, state.lengths) <= STEADY_CATCH_UP
        t0 = self._spans[d].start()
        proposal = drafter.draft(state.tokens, state.lengths, limits)
        self._spans[d].stop(t0)
        self._steady[d] = steady
        return proposal

    def observe(self, state: DecodeState, proposal: Proposal | None, rnd: Round) -> None:
        width = 0 if proposal is None else proposal.tokens.shape[1]
        drafting = [g for g in self._round if g[1]]
        verify_s = rnd.verify_s + rnd.accept_s  # one verification and its verdict, whatever drafted: recorded once
        for d, gamma, rows in self._round:
            active = [b for b in rows if rnd.active[b]]
            for b in active:
                self._rows[b].add(d, gamma, rnd.drafted[b], rnd.committed[b])
            draft_s = None
            if gamma:
                # a lookup that missed still cost its time; with several drafters, each timed its own call
                spent = self._spans[d].settle()
                draft_s = (rnd.draft_s if len(drafting) == 1 else spent) if self._steady[d] else None
            if active or verify_s is not None:
                self._learn(d, gamma, width, [rnd.drafted[b] for b in active], [rnd.committed[b] for b in active],
                            verify_s, draft_s)
                verify_s = None

    def end(self) -> None:
        for drafter, started in zip(self.drafters, self._started):
            if started:
                drafter.end()

    def row_stats(self, b: int) -> dict:
        """AdaptiveRowStats over the row's rounds: gamma asked of the drafter, rounds per candidate, switches
        between candidates, and each candidate's fitted alpha."""
        return self._row_stats(b).to_dict()

    def _row_stats(self, b: int) -> AdaptiveRowStats:
        row = self._rows[b]
        rounds = sum(row.gammas.values())
        names = [d.name for d in self.drafters]
        return AdaptiveRowStats(
            gamma_mean=round(sum(g * n for g, n in row.gammas.items()) / rounds, 4) if rounds else None,
            gamma_hist=dict(sorted(row.gammas.items())),
            drafts={names[d]: n for d, n in sorted(row.drafts.items())},
            switches=row.switches,
            alpha={names[d]: round(fit_alpha(a, r), 4) for d, (a, r) in sorted(row.counts.items()) if a + r},
        )

    def params(self) -> dict:
        return {"gamma": self.gamma, "gamma_max": self.gamma_max,
                **({"max_ngram": self.max_ngram, "min_ngram": self.min_ngram}
                   if any(d.name == DRAFT_NAME for d in self.drafters) else {})}

    # what each strategy decides
    def _groups(self, state: DecodeState) -> list[tuple[int | None, int, set[int]]]:
        """This round's (drafter, gamma, rows) groups: by default one drafter (or none) for the whole batch."""
        d, gamma = self._choose()
        return [(d, gamma, set(range(state.batch)))]

    def _start(self, state: DecodeState) -> None:
        raise NotImplementedError

    def _choose(self) -> tuple[int | None, int]:
        raise NotImplementedError

    def _learn(self, d, gamma, width, drafted, accepted, verify_s, draft_s) -> None:
        raise NotImplementedError


class Adaptive(_Adaptive):
    """Online window-size optimisation with draft choice; see `adaptive_online.GammaPolicy`."""

    name = "adaptive"

    def __init__(self, drafters: list, gamma: int, history: int = 16, probe: int = 8,
                 prior_trials: float = PRIOR_TRIALS, select: str = "round", **common):
        super().__init__(drafters, gamma, **common)
        self.history, self.probe, self.prior_trials, self.select = history, probe, prior_trials, select
        self.policy = GammaPolicy(len(drafters), gamma, self.gamma_max, history, probe, prior_trials)
        self.priors = [AlphaPrior() for _ in drafters]
        self._features: list = []
        self._chosen: list[int] = []
        self._exploring = False

    def _start(self, state: DecodeState) -> None:
        # the generation that just ended teaches the per-prompt prior before this one is predicted
        for x, row in zip(self._features, self._rows):
            for d, (a, r) in row.counts.items():
                self.priors[d].add(x, fit_alpha(a, r), a + r)
        self._features = [prompt_features(state.tokens[b, : state.prompt_lengths[b]].numpy())
                          for b in range(state.batch)]
        rows = [list(range(state.batch))] * len(self.drafters)
        if self.select == "prompt":  # each drafter's window starts from the prior of the prompts it drafts for
            self._exploring = not all(cost.known for cost in self.policy.draft)  # select_drafters' first rule
            self._chosen = select_drafters(self.policy, self.priors, self._features)
            rows = [[b for b, c in enumerate(self._chosen) if c == d] or rows[d] for d in range(len(self.drafters))]
        self.policy.start([sum(p.predict(self._features[b]) for b in r) / len(r) for p, r in zip(self.priors, rows)])

    def _groups(self, state: DecodeState) -> list[tuple[int | None, int, set[int]]]:
        if self.select == "round":
            return super()._groups(state)
        groups = []
        for d in sorted({self._chosen[b] for b in range(state.batch) if not state.done[b]}):
            rows = {b for b in range(state.batch) if self._chosen[b] == d}
            chosen, gamma = self.policy.choose(only=d)
            groups.append((chosen, gamma, rows))
        return groups

    def _choose(self) -> tuple[int | None, int]:
        return self.policy.choose()

    def _learn(self, d, gamma, width, drafted, accepted, verify_s, draft_s) -> None:
        self.policy.record(d, gamma, width, drafted, accepted, verify_s, draft_s)

    def _row_stats(self, b: int) -> AdaptiveRowStats:
        """As for every adaptive strategy; with select=prompt also `selected` and `exploring`."""
        stats = super()._row_stats(b)
        if self.select == "prompt":
            stats = replace(stats, selected=self.drafters[self._chosen[b]].name, exploring=self._exploring)
        return stats

    def params(self) -> dict:
        return {**super().params(), "history": self.history, "probe": self.probe,
                **({"prior_trials": self.prior_trials} if self.prior_trials != PRIOR_TRIALS else {}),
                **({"select": self.select} if self.select != "round" else {})}


class AdaptiveFSM(_Adaptive):
    """The state-machine lookahead; see `adaptive_online.StepSchedule`. One draft candidate."""

    name = "adaptive-fsm"

    def __init__(self, drafters: list, gamma: int, schedule: str = "step", **common):
        super().__init__(drafters, gamma, **common)
        self.schedule = schedule
        self.fsm = StepSchedule(gamma, self.gamma_max, StepSchedule.UPS[schedule])

    def _start(self, state: DecodeState) -> None:
        self.fsm.start()

    def _choose(self) -> tuple[int | None, int]:
        return 0, self.fsm.gamma

    def _learn(self, d, gamma, width, drafted, accepted, verify_s, draft_s) -> None:
        self.fsm.update(drafted, accepted)

    def params(self) -> dict:
        return {**super().params(), "schedule": self.schedule}


class _AdaptiveStrategy(Strategy):
    """What both adaptive declarations share: the common settings' rules, building, the comparisons."""

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        gamma_max = options["gamma_max"]
        if gamma_max < 1 or not 0 <= gamma <= gamma_max:
            raise SdbenchError(f"strategy '{cls.name}' needs 0 <= --gamma <= gamma_max and gamma_max >= 1 "
                               f"(got --gamma {gamma}, gamma_max {gamma_max}; raise it with --set gamma_max=N)")
        check_ngram(cls.name, options["max_ngram"], options["min_ngram"])
        parse_compare(options["compare"], cls.name)

    @classmethod
    def build(cls, ctx: BuildContext) -> _Adaptive:
        drafters = make_drafters(ctx.drafts, ctx.options["max_ngram"], ctx.options["min_ngram"])
        return cls.proposer(drafters, ctx.gamma, **ctx.options)

    @classmethod
    def configurations(cls, ctx: BuildContext) -> list[Configuration]:
        """Itself, then with `compare` set: fixed-gamma SD per draft candidate at those gammas and --gamma."""
        me = cls.build(ctx)
        made = [Configuration(me)]
        gammas = sorted(set(me.compare) | ({ctx.gamma} if ctx.gamma else set())) if me.compare else []
        for spec in ctx.drafts or [DRAFT_NAME]:
            for g in gammas:
                if isinstance(spec, str):
                    made.append(Configuration(NGram(g, me.max_ngram, me.min_ngram), f"ngram-g{g}", "ngram", DRAFT_NAME))
                else:
                    made.append(Configuration(DraftModel(spec, g), f"draft-{spec.name}-g{g}", "draft", spec.name))
        return made


@register
class AdaptiveStrategy(_AdaptiveStrategy):
    name = "adaptive"
    help = ("gamma (0 = plain) and draft chosen each round for the most predicted tokens/s; n-gram draft "
            "without --draft")
    aliases = ("adaptive-gamma",)
    SELECT = ("round", "prompt")
    options = (
        Option("history", 16, "verification rounds the acceptance estimate looks back on"),
        Option("probe", 8, "after this many plain rounds, draft one token to re-check acceptance"),
        Option("prior_trials", PRIOR_TRIALS, "weight of the per-prompt prior alpha, in drafted-token trials "
               "(0: the plain maximum-likelihood alpha)", float),
        Option("select", "round", "round: the draft candidate chosen every round; prompt: chosen once per "
               "prompt, before decoding, from a model over prompt features", str),
        *COMMON,
    )
    proposer = Adaptive

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        super().validate(gamma, options, drafts, sampling)
        history, probe, prior_trials = options["history"], options["probe"], options["prior_trials"]
        if history < 1 or probe < 1:
            raise SdbenchError(f"strategy 'adaptive' needs history >= 1 and probe >= 1 (got {history}, {probe})")
        if not 0 <= prior_trials < math.inf:
            raise SdbenchError(f"--set prior_trials={prior_trials}: expected a number of trials >= 0 "
                               "(0 = the plain maximum-likelihood alpha)")
        if options["select"] not in cls.SELECT:
            raise SdbenchError(f"--set select={options['select']}: use round (the draft chosen every round) or "
                               "prompt (chosen once per prompt)")


@register
class AdaptiveFSMStrategy(_AdaptiveStrategy):
    name = "adaptive-fsm"
    help = ("state-machine gamma: grow after a fully accepted round, shrink after a rejection "
            "(schedule=step|heuristic)")
    aliases = ("fsm",)
    options = (
        Option("schedule", "step", "step: +1 after a fully accepted round, -1 after a rejection; "
               "heuristic: +2 / -1 (transformers' schedule)", str),
        *COMMON,
    )
    proposer = AdaptiveFSM

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        super().validate(gamma, options, drafts, sampling)
        if options["schedule"] not in StepSchedule.UPS:
            raise SdbenchError(f"--set schedule={options['schedule']}: use one of {', '.join(StepSchedule.UPS)}")
        if len(drafts) > 1:
            raise SdbenchError("strategy 'adaptive-fsm' drafts with one --draft; use 'adaptive' to choose "
                               "among several")
        need_gamma(cls.name, gamma)
