"""The target's hidden states through the runner, against transformers' own `output_hidden_states` (index i < L:
the input of layer i; index L: the final-norm output), on every forward path: eager, CPU-packed, static shapes
(the CUDA-graph path's maths, on CPU) and the generic runner; and nothing kept when no proposer asks."""

from __future__ import annotations

import pytest
import torch

from sdbench.forward_step import Step
from sdbench.config import SamplingConfig
from sdbench.engine.hidden import FINAL, Taps
from sdbench.engine.loop import generate
from sdbench.models.forward.generic import GenericRunner
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies.ngram import NGram
from tests.conftest import tiny_model
from tests.references import perturbed

LAYERS = (0, 2, 3, FINAL)
PROMPTS = [[5, 17, 42, 8, 9, 11, 3], [7, 1, 30, 2]]


@pytest.fixture(scope="module")
def target():
    return perturbed(tiny_model(0, layers=4), 100)


def _library(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[-1 if i == FINAL else i][0] for i in LAYERS], -1)  # [T, k*H]


def _runner(model, path: str):
    if path == "generic":
        return GenericRunner(model)
    return ModelRunner(model, fast=path == "packed", static=path == "static")


@pytest.mark.parametrize("path", ["eager", "packed", "static", "generic"])
def test_prefill_and_forward_keep_the_library_states(target, path):
    runner = _runner(target, path)
    cache = runner.new_cache(2, 64)
    taps = Taps(LAYERS)
    runner.prefill(cache, PROMPTS, taps=taps)
    kept = taps.states()  # [B, longest, k*H], right-padded
    with runner.library_forward():
        for b, p in enumerate(PROMPTS):
            torch.testing.assert_close(kept[b, : len(p)], _library(target, p), atol=1e-4, rtol=1e-4)
    more = torch.tensor([[60, 61, 62], [70, 71, 72]])  # rows at different positions, as a verification is
    taps = Taps(LAYERS)
    logits = runner.run(cache, Step(more, [len(p) for p in PROMPTS], taps=taps))
    with runner.library_forward(), torch.no_grad():
        for b, p in enumerate(PROMPTS):
            ids = p + more[b].tolist()
            torch.testing.assert_close(taps.states()[b], _library(target, ids)[len(p):], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(logits[b], target(torch.tensor([ids])).logits[0, len(p):], atol=1e-4, rtol=1e-4)
    runner.release(cache)


def test_the_state_before_the_final_norm(target):
    runner = ModelRunner(target)
    cache = runner.new_cache(1, 32)
    taps = Taps((4, FINAL))
    runner.prefill(cache, PROMPTS[:1], taps=taps)
    pre, post = taps.states().split(64, -1)
    with torch.no_grad():
        torch.testing.assert_close(target.model.norm(pre), post)
        assert not torch.allclose(pre, post, atol=1e-2)


def test_nothing_is_asked_for_when_the_proposer_reads_no_states(target):
    class Watched(ModelRunner):
        calls: list = []

        def run(self, cache, step):
            self.calls.append({k: v for k, v in (("taps", step.taps), ("tree", step.tree)) if v is not None})
            return super().run(cache, step)

        def prefill(self, cache, prompts, chunk=None, **kw):
            self.calls.append({k: v for k, v in kw.items() if v is not None})
            return super().prefill(cache, prompts, chunk, **kw)

    runner = Watched(target)
    generate(runner, NGram(3), PROMPTS, max_new_tokens=6, sampling=SamplingConfig())
    assert len(runner.calls) > 2 and all(kw == {} for kw in runner.calls)
