"""Warm-up prompts: short on CPU; on a GPU the longest batch in full, so no first-prefill cost is measured."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console

from sdbench.commands.roles import Role, baseline_role
from sdbench.commands.run import WARMUP_PROMPT_TOKENS, RunHarness
from sdbench.config import RunConfig
from sdbench.strategies.autoregressive import Autoregressive


@pytest.mark.parametrize("device, expected", [
    ("cpu", [[WARMUP_PROMPT_TOKENS, 10]] * 2),  # the first batch, cut short; baseline and strategy alike
    ("cuda", [[20, 900]] * 2),  # the batch holding the longest prompt, whole
])
def test_warm_up_prompts(device, expected):
    bench = object.__new__(RunHarness)  # only what _warm_up reads: no models, no device
    bench.cfg, bench.console, bench.device = RunConfig(max_new_tokens=8), Console(quiet=True), torch.device(device)
    seen = []
    bench._generate = lambda pair, prop, batch, *args, **kwargs: seen.append([len(p) for p in batch])
    encoded = [[1] * n for n in (300, 10, 20, 900, 40)]
    roles = [baseline_role(), Role("strategy", Autoregressive(), "autoregressive")]
    bench._warm_up(None, roles, encoded, [[0, 1], [2, 3], [4]])
    assert seen == expected
