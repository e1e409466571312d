"""What the adaptive strategies learn while decoding: costs, acceptance, and which lookahead pays.

Everything here is plain Python floats (and one 4x4 NumPy solve per prompt), updated once per verification
round, so the bookkeeping stays far below one forward pass:

- `LinearCost`: seconds as a + b * width, by exponentially forgetting least squares (verification as a
  function of the tokens verified; drafting as a function of gamma, one per drafter).
- `Window`: accepted tokens and rejections of the last h rounds of one drafter on the current prompt(s);
  the acceptance rate alpha is their maximum-likelihood fit (accepted lengths are truncated geometric),
  shrunk toward a per-prompt prior (`engine.iid_model.shrunk_alpha`).
- `AlphaPrior`: the per-prompt prior, an online ridge regression from cheap prompt features to the alpha a
  drafter reached on the run's earlier prompts.
- `GammaPolicy`: each round, the (drafter, gamma) with the most predicted tokens per second, gamma = 0
  (plain decoding) included, with periodic probes so that drafting can resume; or, for a drafter fixed per
  prompt, that drafter's gamma.
- `select_drafters`: the per-prompt choice, once before decoding, of the drafter with the most predicted
  tokens per second for each prompt of a batch.
- `StepSchedule`: the state-machine alternative (grow after a fully accepted round, shrink after a rejection).
"""

from __future__ import annotations

import math
import zlib
from collections import deque

import numpy as np

from sdbench.engine.iid_model import shrunk_alpha, tokens_per_second

PRIOR_ALPHA = 0.5  # what a drafter is expected to reach before the run has seen any of its rounds
PRIOR_TRIALS = 4.0  # weight of the per-prompt prior, in drafted-token trials
N_FEATURES = 4


class LinearCost:
    """Seconds as a + b * width, from the rounds seen so far, the recent ones weighing most.

    Weighted least squares with forgetting factor `decay`; the slope is pulled toward 0 by `ridge` (in units
    of width^2) so that it stays sane while every round had the same width, and it is never negative.
    """

    def __init__(self, decay: float = 0.97, ridge: float = 1.0):
        self.decay, self.ridge = decay, ridge
        self.n = self.sx = self.sxx = self.sy = self.sxy = 0.0

    @property
    def known(self) -> bool:
        return self.n > 0

    def add(self, width: float, seconds: float) -> None:
        d = self.decay
        self.n = self.n * d + 1.0
        self.sx = self.sx * d + width
        self.sxx = self.sxx * d + width * width
        self.sy = self.sy * d + seconds
        self.sxy = self.sxy * d + width * seconds

    def coefficients(self) -> tuple[float, float]:
        """(a, b); (0, 0) before any round."""
        if not self.n:
            return 0.0, 0.0
        mx, my = self.sx / self.n, self.sy / self.n
        var, cov = self.sxx - self.n * mx * mx, self.sxy - self.n * mx * my
        slope = max(0.0, cov / (var + self.ridge))
        return max(0.0, my - slope * mx), slope

    def __call__(self, width: float) -> float:
        a, b = self.coefficients()
        return a + b * width


class Window:
    """One drafter's last h rounds on the current generation: sums kept as rounds enter and leave."""

    def __init__(self, history: int):
        self.rounds: deque = deque()
        self.history = history
        self.accepted = self.rejections = self.rows = self.hits = 0

    def add(self, accepted: int, rejections: int, rows: int, hits: int) -> None:
        """One round: tokens accepted and rejections over its active rows; rows that had a draft (hits)."""
        self.rounds.append((accepted, rejections, rows, hits))
        self._shift(1, accepted, rejections, rows, hits)
        if len(self.rounds) > self.history:
            self._shift(-1, *self.rounds.popleft())

    def _shift(self, sign: int, accepted: int, rejections: int, rows: int, hits: int) -> None:
        self.accepted += sign * accepted
        self.rejections += sign * rejections
        self.rows += sign * rows
        self.hits += sign * hits

    def alpha(self, prior: float, weight: float = PRIOR_TRIALS) -> float:
        return shrunk_alpha(self.accepted, self.rejections, prior, weight)

    def hit_rate(self) -> float:
        """Share of rounds (per row) in which the drafter found something to propose; 1.0 before any."""
        return self.hits / self.rows if self.rows else 1.0


def prompt_features(tokens: np.ndarray) -> np.ndarray:
    """[4] float: bias, repetition (share of bigrams seen earlier in the prompt), compressibility (zlib ratio
    of the token ids, a perplexity-like signal that needs no model) and log length. tokens: [L] int."""
    L = len(tokens)
    if L < 2:
        return np.array([1.0, 0.0, 1.0, 0.0])
    t = tokens.astype(np.int64)
    bigrams = t[:-1] * (int(t.max()) + 1) + t[1:]
    repeated = 1.0 - len(np.unique(bigrams)) / len(bigrams)
    raw = t.astype(np.int32).tobytes()
    compressed = len(zlib.compress(raw, 1)) / len(raw)
    return np.array([1.0, repeated, compressed, math.log(L) / math.log(4096)])


class AlphaPrior:
    """Predicts the alpha a drafter will reach on a prompt from `prompt_features`, learnt online.

    Ridge regression of (alpha - PRIOR_ALPHA) on the features, updated after every prompt with weight
    trials / (trials + 32) (a long generation counts more, but not without bound). Before any update the
    prediction is PRIOR_ALPHA. The task is not a feature: one run decodes one data set, and the model lives
    for one run.
    """

    def __init__(self, ridge: float = 1.0):
        self.A = np.eye(N_FEATURES) * ridge
        self.b = np.zeros(N_FEATURES)

    def predict(self, x: np.ndarray) -> float:
        return float(np.clip(PRIOR_ALPHA + x @ np.linalg.solve(self.A, self.b), 0.02, 0.98))

    def add(self, x: np.ndarray, alpha: float, trials: float) -> None:
        if trials <= 0 or math.isnan(alpha):
            return
        w = trials / (trials + 32.0)
        self.A += w * np.outer(x, x)
        self.b += w * x * (alpha - PRIOR_ALPHA)


class GammaPolicy:
    """Chooses each round's drafter and gamma to maximise predicted tokens per second.

    For drafter d and lookahead g: alpha_d from the window (shrunk toward the prompt's prior), hit rate
    h_d from the window, then iid_model.tokens_per_second(alpha_d, g, draft_d(g), verify(h_d * g), h_d), where
    draft_d and verify are the online linear costs. g = 0 (a plain step, 1 token per verify(0)) wins when no
    drafter beats it. Rules around that:
      - a drafter never used in this run is tried first, at the initial gamma;
      - after `probe` consecutive plain rounds, one round drafts a single token with the best drafter, so
        that the acceptance estimate keeps following the text and drafting resumes once it pays again.
    """

    def __init__(self, n_drafters: int, gamma0: int, gamma_max: int, history: int, probe: int,
                 prior_trials: float = PRIOR_TRIALS):
        self.gamma0, self.gamma_max, self.probe = gamma0, gamma_max, probe
        self.prior_trials = prior_trials  # 0: the plain maximum-likelihood alpha once a round was seen
        self.verify = LinearCost()
        self.draft = [LinearCost() for _ in range(n_drafters)]
        self.tried = [False] * n_drafters
        self.found = [[0, 0] for _ in range(n_drafters)]  # over the whole run: [rows with a draft, rows asked]
        self.history = history
        self.start([PRIOR_ALPHA] * n_drafters)

    def start(self, priors: list[float]) -> None:
        """A new generation: fresh windows, the prompt's prior alpha per drafter."""
        self.priors = list(priors)
        self.windows = [Window(self.history) for _ in priors]
        self.plain_run: dict = {}  # plain rounds in a row, per drafter set choose() was asked about

    def _top(self, d: int, alpha: float, hit: float, top: tuple) -> tuple[float, int, int]:
        va, vb = self.verify.coefficients()  # each fit solved once per call, not once per gamma
        da, db = self.draft[d].coefficients()
        for g in range(1, self.gamma_max + 1):
            r = tokens_per_second(alpha, g, da + db * g, va + vb * hit * g, hit)
            if r > top[0]:
                top = (r, d, g)
        return top

    def best(self, only: int | None = None) -> tuple[float, int, int]:
        """(rate, drafter, gamma) of the best drafting choice (among all drafters, or drafter `only`); ties go
        to the smaller gamma."""
        top = (-math.inf, 0 if only is None else only, 1)
        for d, window in enumerate(self.windows):
            if only is None or d == only:
                top = self._top(d, window.alpha(self.priors[d], self.prior_trials), window.hit_rate(), top)
        return top

    def prompt_rate(self, d: int, alpha: float) -> float:
        """Predicted tokens per second of drafter d over a whole prompt whose acceptance is `alpha`: its best
        gamma, with its hit rate over the run so far and the costs measured so far."""
        hits, asked = self.found[d]
        return self._top(d, alpha, hits / asked if asked else 1.0, (-math.inf, d, 1))[0]

    def choose(self, only: int | None = None) -> tuple[int | None, int]:
        """(drafter index, gamma) for the next round, among all drafters or drafter `only`; (None, 0) = a
        plain step."""
        untried = [d for d, t in enumerate(self.tried) if not t and (only is None or d == only)]
        if untried and self.gamma0 > 0:
            return untried[0], self.gamma0
        if not self.verify.known:
            return (only or 0, self.gamma0) if self.gamma0 else (None, 0)
        rate, d, g = self.best(only)
        if rate > 1.0 / max(self.verify(0), 1e-12):
            self.plain_run[only] = 0
            return d, g
        self.plain_run[only] = self.plain_run.get(only, 0) + 1
        if self.plain_run[only] % self.probe == 0:
            return d, 1
        return None, 0

    def record(self, d: int | None, gamma: int, width: int, drafted: list[int], accepted: list[int],
               verify_s: float | None, draft_s: float | None) -> None:
        """One round over its active rows: drafted/accepted per row; width = tokens verified after the last
        committed one; verify_s = the verification's seconds (None: already recorded for this round, when
        several drafters shared it); draft_s = drafting seconds when they measure a steady round (None
        otherwise)."""
        if verify_s is not None:
            self.verify.add(width, verify_s)
        if d is None or gamma == 0:
            return
        self.tried[d] = True
        if draft_s is not None:
            self.draft[d].add(gamma, draft_s)
        rejections = sum(a < n for a, n in zip(accepted, drafted) if n > 0)
        hits = sum(n > 0 for n in drafted)
        self.windows[d].add(sum(accepted), rejections, len(drafted), hits)
        self.found[d][0] += hits
        self.found[d][1] += len(drafted)


def select_drafters(policy: GammaPolicy, priors: list[AlphaPrior], features: list[np.ndarray]) -> list[int]:
    """Per prompt (features [4] each), the drafter it decodes with: a drafter whose cost the run has not
    measured yet first (spread over the batch's rows, so that every candidate is tried), else the one with the
    most predicted tokens per second at the alpha its prior predicts for that prompt."""
    n = len(priors)
    untried = [d for d in range(n) if not policy.draft[d].known]
    if untried:
        return [untried[b % len(untried)] for b in range(len(features))]
    return [max(range(n), key=lambda d: policy.prompt_rate(d, priors[d].predict(x))) for x in features]


class StepSchedule:
    """The state-machine lookahead: up by `up` after a round whose drafts were all accepted, down by one
    after a rejection, within [1, gamma_max]; a round that drafted nothing leaves gamma as it was.

    up = 1 is the plain step machine; up = 2 is the schedule of transformers' "heuristic" assistant.
    """

    UPS = {"step": 1, "heuristic": 2}

    def __init__(self, gamma0: int, gamma_max: int, up: int):
        self.gamma0, self.gamma_max, self.up = gamma0, gamma_max, up
        self.gamma = gamma0

    def start(self) -> None:
        self.gamma = self.gamma0

    def update(self, drafted: list[int], accepted: list[int]) -> int:
        pairs = [(a, n) for a, n in zip(accepted, drafted) if n > 0]
        if pairs:
            full = all(a == n for a, n in pairs)
            self.gamma = min(self.gamma_max, self.gamma + self.up) if full else max(1, self.gamma - 1)
        return self.gamma
