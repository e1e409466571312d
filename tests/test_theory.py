import math
import random

import pytest

from sdbench.engine.metrics import RowStats, predicted_speedup
from sdbench.theory import expected_tokens_per_step, fit_alpha, predicted_speedup as formula


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


def test_predict_speedup_command(capsys):
    from sdbench.cli import main

    main(["predict", "speedup", "--alpha", "0.8", "--gamma", "2,4", "--draft-cost", "0.0", "--verify-cost", "1.0"])
    out = capsys.readouterr().out
    assert "2.44" in out and "3.36x" in out and "4 *" in out  # Omega(2, .8) = 2.44; Omega(4, .8) = 3.36, best
