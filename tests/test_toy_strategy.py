"""A strategy added in one file plus its registration is lossless through the one loop, and runs end to end."""

from __future__ import annotations

import pytest

from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate
from sdbench.strategies import BuildContext, build_proposer, register, resolve_strategy, strategy_registry
from sdbench.strategies.autoregressive import Autoregressive
from tests.toy_strategy import RepeatStrategy

GREEDY = SamplingConfig()
NEW = 24


@pytest.fixture
def registered():
    register(RepeatStrategy)
    yield
    strategy_registry.remove("repeat")


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("gamma", [1, 3])
def test_toy_strategy_is_lossless_through_the_one_loop(registered, target, prompts, batch, gamma):
    ps = [p + p[-1:] * 4 for p in prompts[:batch]]  # a repeated token at the end, so some drafts are accepted
    ref = generate(target, Autoregressive(), ps, max_new_tokens=NEW, sampling=GREEDY)
    proposer = build_proposer(resolve_strategy("repeat").base, BuildContext(target, [], gamma))
    out = generate(target, proposer, ps, max_new_tokens=NEW, sampling=GREEDY)
    assert out.output_ids == ref.output_ids
    assert all(r.drafted > 0 for r in out.rows)  # it really drafted, through the loop's records
    assert sum(r.steps for r in out.rows) <= sum(r.steps for r in ref.rows)
