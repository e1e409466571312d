"""Adaptive lookahead and draft choice: lossless, the policy on synthetic histories, the state machines' exact
gamma sequences, per-row figures, the comparison variants and the command line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from sdbench.commands.run import RunHarness
from sdbench.config import RunConfig, SamplingConfig
from sdbench.engine.loop import generate
from sdbench.errors import SdbenchError
from sdbench.reporting.results import read_results
from sdbench.strategies import BuildContext, build_proposer, build_configurations, strategy
from sdbench.strategies.adaptive import Adaptive, AdaptiveFSM, parse_compare
from sdbench.strategies.adaptive_online import (AlphaPrior, GammaPolicy, LinearCost, StepSchedule, Window,
                                                prompt_features)
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.engine.state import Proposal
from sdbench.strategies.adaptive import make_drafters
from sdbench.engine.iid_model import shrunk_alpha, tokens_per_second
from tests.conftest import VOCAB

GREEDY = SamplingConfig()
NEW = 24


def reference(target, prompts, eos=()):
    return generate(target, Autoregressive(), prompts, max_new_tokens=NEW, sampling=GREEDY, eos_ids=eos).output_ids


def repetitive(prompts, batch):
    return [(p * 3)[:20] for p in prompts[:batch]]  # something for the n-gram lookup to find


class OracleDrafter:
    """Drafts the reference continuation, shifted by `offset` (0: always right, 1: always wrong)."""

    def __init__(self, reference, offset=0, name="oracle"):
        self.reference, self.offset, self.name = reference, offset, name

    def begin(self, state):
        self.prompt_lengths = list(state.prompt_lengths)

    def catch_up(self, ctx, lengths):
        return 0

    def draft(self, ctx, lengths, limits):
        gamma = max(limits)
        tokens = torch.zeros(len(lengths), gamma, dtype=torch.long)
        for b, n in enumerate(lengths):
            done = n - self.prompt_lengths[b]
            ref = self.reference[b][done: done + gamma]
            tokens[b] = (torch.tensor(ref + [0] * (gamma - len(ref))) + self.offset) % VOCAB
        return Proposal(tokens, torch.tensor(limits))

    def end(self):
        pass


class Scripted(Adaptive):
    """Adaptive with a fixed script of (drafter, gamma): switches, idle drafters, plain rounds and every
    gamma, whatever the timings say."""

    SCRIPT = [(0, 3), (None, 0), (1, 2), (1, 5), (0, 1), (None, 0), (None, 0), (1, 1), (0, 4), (0, 2)]

    def _start(self, state):
        super()._start(state)
        self.turn = 0

    def _choose(self):
        self.turn += 1
        return self.SCRIPT[(self.turn - 1) % len(self.SCRIPT)]


# --- lossless ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("drafts", ["model", "ngram", "model+ngram"])
def test_adaptive_matches_greedy(target, small_draft, prompts, batch, drafts):
    ps = repetitive(prompts, batch)
    ref = reference(target, ps)
    candidates = {"model": [small_draft], "ngram": ["ngram"], "model+ngram": [small_draft, "ngram"]}[drafts]
    proposer = Adaptive(make_drafters(candidates, 3, 1), 4, probe=2)
    for _ in range(2):  # the second generation starts from what the first taught
        out = generate(target, proposer, ps, max_new_tokens=NEW, sampling=GREEDY)
        assert out.output_ids == ref


@pytest.mark.parametrize("batch", [1, 4])
def test_scripted_switching_keeps_every_draft_cache_in_step(target, small_draft, prompts, batch):
    ps = prompts[:batch]
    ref = reference(target, ps)
    for candidates in ([small_draft, target], [target, "ngram"]):
        out = generate(target, Scripted(make_drafters(candidates, 3, 1), 4), ps, max_new_tokens=NEW,
                       sampling=GREEDY)
        assert out.output_ids == ref
        assert out.extras[0]["switches"] >= 3
    # the target drafting for itself is always right, however long it sat idle
    right = generate(target, Scripted(make_drafters([small_draft, target], 3, 1), 4), ps, max_new_tokens=NEW,
                     sampling=GREEDY)
    assert right.extras[0]["alpha"]["tiny-target"] == 1.0


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("schedule, drafts", [("step", "model"), ("heuristic", "ngram"), ("heuristic", "self")])
def test_fsm_matches_greedy(target, small_draft, prompts, batch, schedule, drafts):
    ps = repetitive(prompts, batch)
    ref = reference(target, ps)
    candidates = {"model": [small_draft], "ngram": ["ngram"], "self": [target]}[drafts]
    out = generate(target, AdaptiveFSM(make_drafters(candidates, 3, 1), 2, schedule=schedule), ps,
                   max_new_tokens=NEW, sampling=GREEDY)
    assert out.output_ids == ref


def test_eos_inside_a_draft(target, small_draft, prompts):
    ref = reference(target, prompts)
    eos = ref[0][9]
    stopped = reference(target, prompts, eos=(eos,))
    for proposer in (Adaptive(make_drafters([target, "ngram"], 3, 1), 5),
                     AdaptiveFSM([OracleDrafter(ref)], 6, schedule="heuristic")):
        out = generate(target, proposer, prompts, max_new_tokens=NEW, sampling=GREEDY, eos_ids=(eos,))
        assert out.output_ids == stopped


def test_sampling_follows_target_distribution(target, small_draft, monkeypatch):
    """The first verified token under sampling is distributed as the target's (as for `draft`)."""
    import tests.test_decode as td

    monkeypatch.setattr(td, "DraftModel", lambda runner, gamma: Adaptive(make_drafters([runner], 3, 1), gamma))
    td.test_sampling_loop_follows_target_distribution(target, small_draft)


# --- the state machines -----------------------------------------------------------------------------------

def test_step_schedules_exact():
    step = StepSchedule(2, 5, StepSchedule.UPS["step"])
    full, miss, nothing = ([3], [3]), ([3], [1]), ([0], [0])
    seq = [step.update(*r) for r in (full, full, full, full, miss, nothing, miss, miss, miss, miss, full)]
    assert seq == [3, 4, 5, 5, 4, 4, 3, 2, 1, 1, 2]
    heuristic = StepSchedule(4, 8, StepSchedule.UPS["heuristic"])
    seq = [heuristic.update(*r) for r in (full, full, full, miss, miss, full)]
    assert seq == [6, 8, 8, 7, 6, 8]
    # a batch round is full only when every row that drafted accepted all of it
    assert StepSchedule(3, 8, 1).update([2, 2, 0], [2, 1, 0]) == 2
    assert StepSchedule(3, 8, 1).update([2, 2, 0], [2, 2, 0]) == 4


@pytest.mark.parametrize("schedule, offset, hist", [
    # commits 5, 6, 7, then the budget's last 5: the round that would draft 7 drafts only those 5
    ("step", 0, {"4": 1, "5": 2, "6": 1}),
    ("heuristic", 0, {"4": 1, "6": 1, "8": 1, "2": 1}),  # 5, 7, 9, then the last 2
    ("step", 1, {"4": 1, "3": 1, "2": 1, "1": NEW - 4}),  # every draft wrong: one token per round
    ("heuristic", 1, {"4": 1, "3": 1, "2": 1, "1": NEW - 4}),
])
def test_fsm_gamma_sequence_and_row_stats(target, prompts, schedule, offset, hist):
    ref = reference(target, prompts[:1])
    out = generate(target, AdaptiveFSM([OracleDrafter(ref, offset)], 4, schedule=schedule), prompts[:1],
                   max_new_tokens=NEW, sampling=GREEDY)
    assert out.output_ids == ref
    stats = out.extras[0]
    assert stats["gamma_hist"] == dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
    rounds = sum(hist.values())
    assert stats["drafts"] == {"oracle": rounds} and stats["switches"] == 0
    assert stats["gamma_mean"] == round(sum(int(g) * n for g, n in hist.items()) / rounds, 4)
    # right: every draft accepted, the last round's too (capped to the budget, it never runs past the reference)
    assert stats["alpha"] == {"oracle": 0.0 if offset else 1.0}
    assert out.rows[0].steps == rounds


# --- the online pieces -------------------------------------------------------------------------------------

def test_linear_cost_fits_a_line():
    exact = LinearCost(decay=1.0, ridge=0.0)
    for w, t in ((0, 1.0), (2, 2.0), (4, 3.0)):
        exact.add(w, t)
    assert exact.coefficients() == pytest.approx((1.0, 0.5))
    flat = LinearCost(decay=1.0)
    flat.add(3, 0.2)
    flat.add(3, 0.4)
    assert flat.coefficients() == pytest.approx((0.3, 0.0))  # one width seen: no slope to speak of
    forgetting = LinearCost(decay=0.5)
    forgetting.add(3, 1.0)
    forgetting.add(3, 0.0)
    assert forgetting(3) == pytest.approx(1 / 3)  # the older round weighs half
    assert not LinearCost().known and LinearCost()(5) == 0.0


def test_window_forgets_old_rounds_and_shrinks_toward_the_prior():
    w = Window(history=2)
    for accepted, rejections, rows, hits in ((0, 1, 1, 1), (3, 0, 1, 1), (2, 1, 2, 1)):
        w.add(accepted, rejections, rows, hits)
    assert (w.accepted, w.rejections, w.rows, w.hits) == (5, 1, 3, 2)
    assert w.alpha(prior=0.5, weight=4.0) == pytest.approx((5 + 2) / (5 + 1 + 4))
    assert w.hit_rate() == pytest.approx(2 / 3)
    assert shrunk_alpha(0, 0, 0.3, 4.0) == 0.3 and shrunk_alpha(9, 1, 0.5, 0.0) == 0.9


def test_tokens_per_second_formula():
    # alpha 0.5, gamma 2: Omega = 1.75; found half the time: 1 + 0.5 * 0.75 tokens in 0.1 + 0.4 s
    assert tokens_per_second(0.5, 2, 0.1, 0.4, hit=0.5) == pytest.approx(1.375 / 0.5)
    assert tokens_per_second(0.5, 0, 0.0, 0.25) == pytest.approx(4.0)
    assert math.isnan(tokens_per_second(0.5, 2, 0.0, 0.0))


def feed(policy: GammaPolicy, choice, accept_all: bool, verify=(0.010, 0.001), draft=0.002):
    """One synthetic round: verification costs verify[0] + verify[1] * width, drafting `draft` per token."""
    d, g = choice
    accepted = [g if accept_all else 0]
    policy.record(d, g, g, [g], accepted, verify[0] + verify[1] * g, draft * g if g else None)


def simulate(policy: GammaPolicy, rounds: int, accept_all: bool, seq=None) -> list:
    """The policy's choices over synthetic rounds that accept all or nothing of what it drafts."""
    seq = seq or [policy.choose()]
    for _ in range(rounds):
        feed(policy, seq[-1], accept_all)
        seq.append(policy.choose())
    return seq


def test_policy_high_acceptance_goes_long_and_zero_acceptance_goes_plain():
    policy = GammaPolicy(1, gamma0=4, gamma_max=8, history=16, probe=4)
    seq = simulate(policy, 12, accept_all=True)
    # untried: the user's gamma first; then, as alpha climbs from its prior toward 1 and the verification
    # slope becomes known, the longest lookahead (drafting is cheap here)
    assert seq == [(0, 4), (0, 8), (0, 5), (0, 6), (0, 7)] + [(0, 8)] * 8
    # nothing accepted any more: gamma falls as the window forgets, then plain steps with a probe every 4th
    seq = simulate(policy, 24, accept_all=False, seq=seq[-1:])
    shrinking = [(0, 7), (0, 6), (0, 5), (0, 4), (0, 4), (0, 3), (0, 3), (0, 2), (0, 2), (0, 1), (0, 1)]
    plain = [(None, 0)] * 3 + [(0, 1)]
    assert seq == [(0, 8)] * 5 + shrinking + plain * 2 + [(None, 0)]


def test_policy_probes_and_returns_to_drafting():
    policy = GammaPolicy(1, gamma0=4, gamma_max=8, history=16, probe=4)
    seq = simulate(policy, 24, accept_all=False)
    first = seq.index((None, 0))
    assert seq[first: first + 8] == [(None, 0)] * 3 + [(0, 1)] + [(None, 0)] * 3 + [(0, 1)]
    # the text turns predictable: accepted probes raise alpha until drafting pays again, then gamma climbs
    seq = simulate(policy, 60, accept_all=True, seq=seq[-1:])
    assert seq[:5] == [(None, 0), (0, 1)] + [(None, 0)] * 3
    gammas = [g for _, g in seq[5:]]  # from the second accepted probe on: drafting, gamma only growing
    assert min(gammas) == 1 and gammas == sorted(gammas) and gammas[-30:] == [8] * 30


def test_policy_picks_the_better_drafter_and_switches_when_it_fails():
    policy = GammaPolicy(2, gamma0=2, gamma_max=6, history=8, probe=4)
    assert policy.choose() == (0, 2)  # untried candidates first, in order
    feed(policy, (0, 2), False)
    assert policy.choose() == (1, 2)
    feed(policy, (1, 2), True)
    for _ in range(6):
        choice = policy.choose()
        assert choice[0] == 1
        feed(policy, choice, True)
    for _ in range(12):  # drafter 1 stops agreeing; drafter 0's single bad round is older news
        choice = policy.choose()
        feed(policy, choice, choice[0] == 0)
    assert policy.choose()[0] == 0


def test_alpha_prior_learns_from_prompt_features():
    prior = AlphaPrior()
    rng = np.random.default_rng(0)
    loop = np.array([5, 6, 7, 8] * 30)
    noise = rng.integers(0, 50_000, size=120)
    assert prior.predict(prompt_features(loop)) == 0.5
    for _ in range(5):
        prior.add(prompt_features(loop), 0.9, 200)
        prior.add(prompt_features(noise), 0.1, 200)
    assert prior.predict(prompt_features(loop)) > 0.75 > 0.25 > prior.predict(prompt_features(noise))
    x = prompt_features(np.array([1, 2, 1, 2, 1, 2]))
    assert x[0] == 1.0 and x[1] == pytest.approx(0.6) and x[3] == pytest.approx(math.log(6) / math.log(4096))


# --- settings, variants, row figures ------------------------------------------------------------------------

def test_settings_are_checked(small_draft):
    with pytest.raises(SdbenchError, match="gamma_max"):
        build_proposer("adaptive", BuildContext(None, [], 9))
    with pytest.raises(SdbenchError, match="schedule=fast"):
        build_proposer("adaptive-fsm", BuildContext(None, [], 4, {"schedule": "fast"}))
    with pytest.raises(SdbenchError, match="one --draft"):
        build_proposer("adaptive-fsm", BuildContext(None, [small_draft, "ngram"], 4))
    with pytest.raises(SdbenchError, match="compare=2,x"):
        parse_compare("2,x")
    with pytest.raises(SdbenchError, match="compare=0,2: every gamma must be at least 1"):
        parse_compare("0,2")
    assert parse_compare("4, 1,2,4") == (1, 2, 4) and parse_compare("") == ()
    with pytest.raises(SdbenchError, match="--draft ngram is not one"):
        build_configurations("draft", BuildContext(None, ["ngram"], 4, {}))


def test_compare_variants(target, small_draft):
    made = build_configurations("adaptive", BuildContext(target, [small_draft, "ngram"], 3, {"compare": "1,4"}))
    assert [(v.label, v.strategy, v.drafts) for v in made] == [
        ("", "", ""),
        ("draft-tiny-draft-g1", "draft", "tiny-draft"), ("draft-tiny-draft-g3", "draft", "tiny-draft"),
        ("draft-tiny-draft-g4", "draft", "tiny-draft"),
        ("ngram-g1", "ngram", "ngram"), ("ngram-g3", "ngram", "ngram"), ("ngram-g4", "ngram", "ngram")]
    assert [v.proposer.gamma for v in made] == [3, 1, 3, 4, 1, 3, 4]
    assert len(build_configurations("adaptive-fsm", BuildContext(target, [], 2, {}))) == 1  # no compare: itself only


def test_adaptive_row_stats_add_up(target, small_draft, prompts):
    ps = repetitive(prompts, 4)
    proposer = Adaptive(make_drafters([small_draft, "ngram"], 3, 1), 2, probe=3)
    out = generate(target, proposer, ps, max_new_tokens=NEW, sampling=GREEDY)
    for stats, row in zip(out.extras, out.rows):
        assert set(stats) == {"gamma_mean", "gamma_hist", "drafts", "switches", "alpha"}
        assert sum(stats["gamma_hist"].values()) == row.steps
        drafting = sum(n for g, n in stats["gamma_hist"].items() if g != "0")
        assert sum(stats["drafts"].values()) == drafting and set(stats["drafts"]) <= {"tiny-draft", "ngram"}
        assert 0 <= stats["gamma_mean"] <= 8
    json.dumps(out.extras)


# --- the command line on the embedded model ---------------------------------------------------------------

@pytest.mark.slow
def test_cli_adaptive_with_ngram_draft_and_comparison(tmp_path):
    from sdbench.reporting.tables import adaptive_table

    cfg = RunConfig(drafts=("ngram",), strategy="adaptive", dataset="humaneval", limit=1, max_new_tokens=12,
                    options={"compare": "2"}, out=str(tmp_path))
    df = read_results([RunHarness(cfg).run()])
    assert set(df["role"]) == {"baseline", "strategy", "compare-ngram-g2", "compare-ngram-g4"}
    assert dict(zip(df["role"], df["strategy"]))["compare-ngram-g2"] == "ngram"
    assert df["lossless"].all()
    stats = json.loads(df.loc[df["role"] == "strategy", "strategy_stats"].iloc[0])
    assert sum(stats["gamma_hist"].values()) == df.loc[df["role"] == "strategy", "steps"].iloc[0]
    assert adaptive_table(df) is not None


@pytest.mark.slow
def test_cli_draft_strategy_refuses_ngram(capsys, tmp_path):
    from tests.test_cli import one_line_error, run_cli

    code, _, err = run_cli(capsys, "run", "--strategy", "draft", "--draft", "ngram", "--limit", "1",
                           "--out", str(tmp_path))
    assert "--draft ngram is not one" in one_line_error(code, err)


# --- the prior's weight and the per-prompt draft selection --------------------------------------------------

def test_prior_trials_zero_is_the_plain_maximum_likelihood_alpha():
    plain = GammaPolicy(1, gamma0=2, gamma_max=4, history=8, probe=4, prior_trials=0.0)
    shrunk = GammaPolicy(1, gamma0=2, gamma_max=4, history=8, probe=4)
    for policy in (plain, shrunk):
        policy.start([0.5])
        assert policy.windows[0].alpha(0.5, policy.prior_trials) == 0.5  # nothing seen: the prior either way
        policy.record(0, 4, 4, [4, 4], [4, 1], 0.01, 0.004)  # 5 accepted, 1 rejection
    assert plain.windows[0].alpha(0.5, plain.prior_trials) == pytest.approx(5 / 6)
    assert shrunk.windows[0].alpha(0.5, shrunk.prior_trials) == pytest.approx((5 + 2) / (6 + 4))
    # the rate the policy ranks gammas by uses that alpha
    rate, d, g = plain.best()
    hit = plain.windows[0].hit_rate()
    assert rate == pytest.approx(tokens_per_second(5 / 6, g, plain.draft[0](g), plain.verify(hit * g), hit))


def test_prompt_selection_settings_are_checked(small_draft):
    for options, message in (({"prior_trials": -1.0}, "prior_trials=-1.0"), ({"prior_trials": math.inf}, "inf"),
                             ({"select": "token"}, "select=token")):
        with pytest.raises(SdbenchError, match=message):
            build_proposer("adaptive", BuildContext(None, [small_draft], 3, options))
    with pytest.raises(SdbenchError, match="prior_trials=lots: expected float"):
        strategy("adaptive").settings({"prior_trials": "lots"})
    assert strategy("adaptive").settings({"prior_trials": "0", "select": "prompt"})["prior_trials"] == 0.0
    made = Adaptive(make_drafters([small_draft], 3, 1), 3, prior_trials=0.0, select="prompt")
    assert made.params()["prior_trials"] == 0.0 and made.params()["select"] == "prompt"
    assert "select" not in Adaptive(make_drafters([small_draft], 3, 1), 3).params()


def test_merge_proposals_keeps_each_row_from_its_drafter():
    from sdbench.strategies.adaptive import merge_proposals

    model = Proposal(torch.tensor([[1, 2, 3], [9, 9, 9], [4, 5, 6]]), torch.tensor([3, 0, 2]),
                     torch.full((3, 3, VOCAB), 1.0 / VOCAB))
    lookup = Proposal(torch.tensor([[0, 0], [7, 8], [0, 0]]), torch.tensor([0, 2, 0]))
    merged = merge_proposals([model, lookup])
    assert merged.tokens.tolist() == [[1, 2, 3], [7, 8, 0], [4, 5, 6]]
    assert merged.lengths.tolist() == [3, 2, 2]
    assert torch.equal(merged.probs[0], model.probs[0]) and torch.equal(merged.probs[2], model.probs[2])
    assert merged.probs[1, 0, 7] == 1.0 and merged.probs[1, 1, 8] == 1.0 and merged.probs[1, :2].sum() == 2.0
    assert merge_proposals([Proposal(lookup.tokens, lookup.lengths), Proposal(lookup.tokens, torch.tensor(
        [1, 0, 0]))]).probs is None  # deterministic drafts only: still no distributions


def test_select_drafters_tries_each_candidate_then_follows_the_prompt_model():
    from sdbench.strategies.adaptive_online import select_drafters

    policy = GammaPolicy(2, gamma0=2, gamma_max=4, history=8, probe=4)
    priors = [AlphaPrior(), AlphaPrior()]
    loop, noise = np.array([5, 6, 7, 8] * 30), np.random.default_rng(0).integers(0, 50_000, size=120)
    xs = [prompt_features(loop), prompt_features(noise)]
    assert select_drafters(policy, priors, xs + xs) == [0, 1, 0, 1]  # no costs measured yet: spread
    for d in (0, 1):  # equal costs, so the predicted alpha alone decides
        policy.record(d, 2, 2, [2], [1], 0.010, 0.002)
    for _ in range(5):  # drafter 0 does well on repetitive prompts only, drafter 1 on the others
        priors[0].add(xs[0], 0.9, 200)
        priors[0].add(xs[1], 0.1, 200)
        priors[1].add(xs[0], 0.3, 200)
        priors[1].add(xs[1], 0.6, 200)
    assert select_drafters(policy, priors, xs) == [0, 1]
    policy.draft[0].add(2, 1.0)  # drafter 0 turns very slow: it no longer pays even where it agrees
    assert select_drafters(policy, priors, xs) == [1, 1]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("drafts", ["model+ngram", "model+self"])
def test_prompt_selection_matches_greedy(target, small_draft, prompts, batch, drafts):
    ps = repetitive(prompts, batch)
    ref = reference(target, ps)
    candidates = {"model+ngram": [small_draft, "ngram"], "model+self": [small_draft, target]}[drafts]
    proposer = Adaptive(make_drafters(candidates, 3, 1), 3, probe=2, select="prompt")
    names = [d.name for d in proposer.drafters]
    used = set()
    for _ in range(3):  # later generations select from what the earlier ones taught
        out = generate(target, proposer, ps, max_new_tokens=NEW, sampling=GREEDY)
        assert out.output_ids == ref
        for stats in out.extras:
            assert stats["selected"] in names and stats["switches"] == 0
            assert set(stats["drafts"]) <= {stats["selected"]}  # a prompt drafts with its drafter only
            used.add(stats["selected"])
    assert used == set(names)  # every candidate was tried



def test_prompt_selection_says_which_choices_explored(target, small_draft, prompts):
    """A prompt given a candidate whose cost was not measured yet is marked exploring; once every candidate has
    drafted, the prompt model chooses and the mark is off."""
    ps = repetitive(prompts, 2)
    proposer = Adaptive(make_drafters([small_draft, "ngram"], 3, 1), 3, probe=2, select="prompt")
    marks = []
    for _ in range(3):
        out = generate(target, proposer, ps, max_new_tokens=NEW, sampling=GREEDY)
        marks.append({s["exploring"] for s in out.extras})
        assert all(c.known for c in proposer.policy.draft) or marks[-1] == {True}
    assert marks[0] == {True} and marks[-1] == {False}

def test_prompt_selection_with_mixed_rows_follows_target_distribution(target, small_draft):
    """Rows drafted by a model (with distributions) and by prompt lookup (one-hot) verified in one round."""
    from tests.conftest import second_token_chi_square

    proposer = Adaptive(make_drafters([small_draft, "ngram"], 3, 1), 3, select="prompt")
    stat, dof, out = second_token_chi_square(target, proposer, SamplingConfig(1.0, 0.95), prompt=(5, 17, 42, 5, 17))
    assert {s["selected"] for s in out.extras} == {"tiny-draft", "ngram"}
    from scipy.stats import chi2

    bound = chi2.ppf(1 - 1e-3, dof)  # a correct sampler fails this one time in a thousand
    assert stat < bound, f"chi-square {stat:.1f} with {dof} dof, bound {bound:.1f}"
    lookup_rows = [r for r, s in zip(out.rows, out.extras) if s["selected"] == "ngram"]
    assert sum(r.drafted for r in lookup_rows) > 0  # the lookup did draft in those rows
