import math
import random

import pytest

from sdbench.engine.counters import RowStats
from sdbench.engine.iid_model import expected_tokens_per_step, fit_alpha, predicted_speedup as formula
from sdbench.engine.metrics import predicted_batch_speedup, predicted_speedup


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 0) == 1.0
    assert math.isclose(expected_tokens_per_step(0.5, 2), 1 + 0.5 + 0.25)


def test_fit_alpha_recovers_the_acceptance_rate():
    rng = random.Random(0)
    alpha, gamma = 0.7, 5
    accepted = rejections = 0
    for _ in range(20000):
        k = 0
        while k < gamma and rng.random() < alpha:
            k += 1
        accepted += k
        rejections += k < gamma
    assert math.isclose(fit_alpha(accepted, rejections), alpha, abs_tol=0.01)
    assert math.isnan(fit_alpha(0, 0))


def test_predicted_speedup_formula_and_from_measurements():
    # a free draft that is always right at gamma 4 with a verification as cheap as one forward: 5x
    assert formula(1.0, 4, 0.0, 1.0) == 5.0
    assert formula(0.0, 4, 0.25, 1.0) == pytest.approx(0.5)
    base = RowStats()
    for _ in range(10):
        base.add_step(0, 0, 0.0, 0.01)
    strat = RowStats()
    for _ in range(4):  # all 3 drafts accepted; drafting costs 0.002 s per token, verifying 0.015 s
        strat.add_step(3, 3, 0.006, 0.015)
    assert predicted_speedup(strat, base) == pytest.approx(4 / (3 * 0.2 + 1.5))
    assert math.isnan(predicted_speedup(strat, RowStats()))



def test_rounds_drafting_different_numbers_are_predicted_from_their_own_numbers():
    """Prompt lookup: half the rounds find no match (no draft), half draft 4, each draft accepted with
    probability 0.6 given the ones before it (simulated). A round costs one target forward whatever it drafts, so
    the prediction is the tokens per round itself: 1/2 + Omega(4, 0.6)/2 = 1.653 by hand, which the simulated
    rounds commit; Omega at the mean 2 drafts per round, 1.96, would overstate it by 19 %."""
    rng = random.Random(1)
    base, row = RowStats(), RowStats()
    for _ in range(10):
        base.add_step(0, 0, 0.0, 0.01)
    for i in range(20000):
        gamma = 4 * (i % 2)
        k = 0
        while k < gamma and rng.random() < 0.6:
            k += 1
        row.add_step(gamma, k, 0.0, 0.01)
    by_hand = 0.5 + 0.5 * (1 + 0.6 + 0.36 + 0.216 + 0.1296)
    measured = 1 + row.accepted / row.steps
    assert measured == pytest.approx(by_hand, rel=0.01)
    assert predicted_speedup(row, base) == pytest.approx(by_hand, rel=0.01)
    assert expected_tokens_per_step(0.6, row.drafted / row.steps) > 1.15 * by_hand


def test_predicted_batch_speedup_waits_for_the_slowest_row():
    base = [RowStats(), RowStats()]
    for stats in base:  # plain decoding of 9 tokens after the first: 9 forwards of 0.01 s
        for _ in range(9):
            stats.add_step(0, 0, 0.0, 0.01)
    lucky, unlucky = RowStats(), RowStats()
    for _ in range(3):  # every 2-token draft accepted: 3 rounds commit 9 tokens; rounds of 0.004 + 0.012 s
        lucky.add_step(2, 2, 0.004, 0.012)
    for _ in range(9):  # every draft rejected: 9 rounds, one token each
        unlucky.add_step(2, 0, 0.004, 0.012)
    # on its own the lucky row would run 3x faster over rounds of 1.6 forwards: 3 / 1.6
    assert predicted_speedup(lucky, base[0]) == pytest.approx(3 / 1.6)
    assert predicted_batch_speedup([lucky], base[:1], [10]) == pytest.approx(3 / 1.6)
    # together the batch runs until the unlucky row is done: 9 rounds of 1.6 forwards against 9 forwards
    assert predicted_batch_speedup([lucky, unlucky], base, [10, 10]) == pytest.approx(9 / (9 * 1.6))
    # a row that drafted nothing (prompt lookup found no match) takes one round per token
    nothing = RowStats()
    for _ in range(9):
        nothing.add_step(0, 0, 0.004, 0.012)  # the batch drafted for the other row meanwhile
    assert predicted_batch_speedup([lucky, nothing], base, [10, 10]) == pytest.approx(9 / (9 * 1.6))
    # a row whose budget ended after its first token adds no rounds; shapes that disagree give no figure
    assert predicted_batch_speedup([lucky, RowStats()], base, [10, 1]) == pytest.approx(3 / 1.6)
    assert math.isnan(predicted_batch_speedup([lucky], base, [10]))

def test_a_tree_row_is_predicted_from_its_tokens_per_round_not_as_a_chain_of_its_nodes():
    """A round verifying a 15-node tree that commits 3 drafts: the chain model with gamma = 15 and alpha fitted to
    3-of-15 accepted lengths would count every node as a chain position; the prediction is the row's 4 tokens per
    round over its round cost instead, by hand."""
    from sdbench.engine.tree import Tree

    base = RowStats()
    for _ in range(8):
        base.add_step(0, 0, 0.0, 0.01)
    tree = Tree.from_vllm(str([(0,)] + [(0,) * d for d in range(2, 6)] + [(r,) for r in range(1, 11)]))
    row, chain = RowStats(), RowStats()
    for _ in range(2):  # each round: the first three nodes of the trunk accepted, then a rejection
        row.add_step(15, 3, 0.01, 0.02, tree=tree, path=[0, 11, 12])
        chain.add_step(15, 3, 0.01, 0.02)
    assert row.tree_steps == 2
    assert predicted_speedup(row, base) == pytest.approx(4 / 3)  # 4 tokens per round of 0.03 s = 3 target steps
    assert predicted_batch_speedup([row], [base], [9]) == pytest.approx(8 / (2 * 3))
    assert predicted_speedup(chain, base) != pytest.approx(predicted_speedup(row, base))  # the chain model differs


def test_predict_speedup_command(capsys):
    from sdbench.cli import main

    main(["predict", "speedup", "--alpha", "0.8", "--gamma", "2,4", "--draft-cost", "0.0", "--verify-cost", "1.0"])
    out = capsys.readouterr().out
    assert "2.44" in out and "3.36x" in out and "4 *" in out  # Omega(2, .8) = 2.44; Omega(4, .8) = 3.36, best


def test_predict_speedup_of_a_block_drafter(capsys):
    """A block drafter pays its draft forward once per round: at alpha 0.8, c = 0.3, v = 1, Omega(8) = 4.33 over
    1.3 forwards is 3.33x and gamma 8 is best, where a drafter of one token per forward gets 4.33 / 3.4 = 1.27x
    there and does best at gamma 3 (2.95 / 1.9 = 1.55x)."""
    from sdbench.cli import main

    args = ["predict", "speedup", "--alpha", "0.8", "--gamma", "3,8", "--draft-cost", "0.3", "--verify-cost", "1.0"]
    main([*args, "--block"])
    out = capsys.readouterr().out
    assert "3.33x" in out and "8 *" in out and "a block drafter" in out
    main(args)
    out = capsys.readouterr().out
    assert "1.27x" in out and "1.55x" in out and "3 *" in out


def test_block_with_a_measured_target_is_one_line(capsys):
    from tests.conftest import run_cli

    code, _, err = run_cli(capsys, "predict", "speedup", "--alpha", "0.8", "--block", "--target", "smollm2-135m")
    assert code == 2 and "--block with --target" in err and "Traceback" not in err
