"""The CPU fast path's compiled steps (models/forward/cpucompile.py): the same tokens as transformers' generate, taken only
where asked for, a failed compilation falling back to the eager step."""

from __future__ import annotations

import pytest
import torch

from sdbench.forward_step import Step
from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate
from sdbench.models.forward import cpuchoice, cpufast, cpumeasure, forward_paths
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.strategies.draft import DraftModel
from tests.conftest import tiny_model
from tests.references import hf_generate, perturbed


@pytest.fixture
def compiled_env(monkeypatch):
    monkeypatch.setenv(cpumeasure.FAST_ENV, "compiled")


def test_compiled_steps_give_generates_tokens_and_a_verification_the_eager_logits(compiled_env, prompts):
    """Decoding and a draft model's verifications (widths 1, 2 and 4) through compiled steps: token for token what
    transformers' generate gives, and the logits of a 4-token forward within float32 rounding of the eager
    packed step's (a different summation order in a fused norm is all that may differ)."""
    model = perturbed(tiny_model(0))
    runner = ModelRunner(model, "tiny", fast=True)
    assert runner.path.kind == forward_paths.CPU_COMPILED and runner.static
    reference = [hf_generate(model, p, 10) for p in prompts[:1]]
    ours = generate(runner, Autoregressive(), prompts[:1], max_new_tokens=10, sampling=SamplingConfig())
    assert ours.output_ids == reference
    draft = ModelRunner(tiny_model(1, layers=1, hidden=32, heads=2, kv=1), "draft", fast=True)  # compiled too
    spec = generate(runner, DraftModel(draft, 3), prompts[:1], max_new_tokens=10, sampling=SamplingConfig())
    assert spec.output_ids == reference
    assert runner._compiled is not None and draft._compiled is not None  # the steps did run compiled

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpumeasure.FAST_ENV, "packed")
        eager = ModelRunner(model, "eager", fast=True)
    assert eager.path.kind == forward_paths.CPU_PACKED and not eager.static
    tokens = torch.tensor([[3, 1, 4, 1]])
    out = []
    for r in (runner, eager):
        cache = r.new_cache(1, 32)
        r.prefill(cache, [prompts[0]])
        out.append(r.run(cache, Step(tokens, [len(prompts[0])])))
    torch.testing.assert_close(out[0], out[1], atol=1e-4, rtol=1e-4)


def test_only_the_override_compiles(monkeypatch, tmp_path):
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))  # no packing choice kept from elsewhere
    for mode, kind in (("packed", forward_paths.CPU_PACKED), ("measure", forward_paths.CPU_PACKED),
                       ("compiled", forward_paths.CPU_COMPILED)):
        monkeypatch.setenv(cpumeasure.FAST_ENV, mode)
        monkeypatch.setattr(cpuchoice, "timed_paths", lambda fast: (2.0, 1.0))  # packing pays
        monkeypatch.setattr(cpufast, "_chosen", {})
        runner = ModelRunner(tiny_model(0), "a", fast=True)
        assert runner.path.kind == kind and runner.static is (mode == "compiled") and runner.cpu_fast
        assert ModelRunner(tiny_model(0), "b", fast=True, static=False).path.kind == forward_paths.CPU_PACKED
    monkeypatch.setenv(cpumeasure.FAST_ENV, "plain")
    assert ModelRunner(tiny_model(0), "c", fast=True).path.kind == forward_paths.EAGER


def test_a_step_that_fails_to_compile_falls_back_to_the_eager_step(compiled_env, monkeypatch, prompts):
    model = tiny_model(0)
    reference = [hf_generate(model, prompts[0], 6)]
    runner = ModelRunner(model, "tiny", fast=True)
    layout = runner.path.fast.layout

    def broken(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no compiler here\nsecond line")
        return call
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(RuntimeWarning, match=r"compiling a step failed \(no compiler here\); using the eager packed"):
        ours = generate(runner, Autoregressive(), prompts[:1], max_new_tokens=6, sampling=SamplingConfig())
    assert runner.path.kind == forward_paths.CPU_PACKED
    assert runner.path.fast.layout == layout  # the eager step keeps the layout the model was packed in
    assert ours.output_ids == reference
