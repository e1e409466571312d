"""Trained heads under sampling: every output position of the first verification follows the target's exact
distribution (the chi-square check of tests/test_sampling_reference.py, which is shown there to fail on wrong
samplers), with each head's draft distribution over the target's vocabulary (EAGLE-3's mapped through d2t)."""

from __future__ import annotations

import pytest

from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies import BuildContext, build_proposer
from tests.heads import eagle1_dir, eagle3_dir, medusa_dir, one_thread  # noqa: F401
from tests.test_sampling_reference import GAMMA, _model, position_checks

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return _model(0, 4)


@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "medusa"])
def test_heads_sample_the_target_distribution(tmp_path, target, kind):
    make = {"eagle3": lambda f: eagle3_dir(f, target, draft_vocab=6), "eagle1": lambda f: eagle1_dir(f, target),
            "medusa": lambda f: medusa_dir(f, target, heads=GAMMA)}[kind]
    folder = make(tmp_path / kind)
    proposer = build_proposer("medusa" if kind == "medusa" else "eagle",
                              BuildContext(ModelRunner(target), [], GAMMA, {"head": str(folder)}))
    checks, out = position_checks(target, proposer)
    assert all(stat < bound for _, stat, bound in checks), checks
    accepted, drafted = sum(r.accepted for r in out.rows), sum(r.drafted for r in out.rows)
    assert min(accepted, drafted - accepted) > 300  # both acceptance and rejection (the residual) exercised
