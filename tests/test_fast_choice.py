"""Choices made by measuring, made deterministic here: the CPU fast path per shape (packed or plain products) and
transformers generate's fastest configuration for `bench`; and `bench` at a real model's shape, @random."""

from __future__ import annotations

import re

import pytest
import torch

from sdbench.forward_step import Step
from sdbench.analysis.bandwidth import Bandwidth
from sdbench.commands import hf_generate
from sdbench.errors import SdbenchError
from sdbench.models.forward import cpuchoice, cpufast, cpuhead, cpukernel, cpumeasure, cpupacked
from sdbench.models.forward.runner import ModelRunner
from tests.conftest import run_cli, skip_unless_ci, tiny_model
from tests.test_random_weights import small  # noqa: F401 (fixture)


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """The measured choice, made where sdbench's products do not build (where they do, the fast path takes them
    without measuring: `test_sdbenchs_products_are_taken_unmeasured_where_they_build`), with no choice remembered
    from earlier tests (in this process or kept on disk)."""
    monkeypatch.setenv(cpumeasure.FAST_ENV, "measure")
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpufast, "_chosen", {})
    monkeypatch.setattr(cpukernel, "available", lambda: False)


def test_sdbenchs_products_are_taken_unmeasured_where_they_build(monkeypatch, tmp_path):
    """The default: a model packed into sdbench's products and its head read by them at every width (their rows are
    width-invariant), nothing measured."""
    if not cpukernel.available():
        skip_unless_ci(f"needs sdbench's CPU products ({cpukernel.why_not()})")
    monkeypatch.setenv(cpumeasure.FAST_ENV, "measure")
    monkeypatch.setattr(cpuchoice, "timed_paths", lambda fast: pytest.fail("measured"))
    monkeypatch.setattr(cpuhead, "_head_ways", {})
    monkeypatch.setattr(cpumeasure, "timed", lambda fn, reps=5: pytest.fail("measured"))
    model = tiny_model(0)
    model.lm_head.weight = model.model.get_input_embeddings().weight
    runner = ModelRunner(model, "tied", fast=True)
    choice = cpufast.choose(model)
    assert choice.how == cpuchoice.INVARIANT and choice.layout == "kernel" and "width-invariant" in choice.describe()
    assert set(runner.path.fast.head.ways.values()) == {"kernel"}


@pytest.mark.parametrize("mode, packed", [("packed", True), ("plain", False)])
def test_the_override_decides_without_measuring(monkeypatch, mode, packed):
    monkeypatch.setenv(cpumeasure.FAST_ENV, mode)
    monkeypatch.setattr(cpuchoice, "timed_paths", lambda fast: pytest.fail("measured despite the override"))
    runner = ModelRunner(tiny_model(0), "tiny", fast=True)
    assert runner.cpu_fast is packed and runner.fast is packed
    assert cpufast.choose(runner.model).how == "override"


def test_a_bad_override_is_one_line(monkeypatch):
    monkeypatch.setenv(cpumeasure.FAST_ENV, "sometimes")
    with pytest.raises(SdbenchError, match="SDBENCH_CPU_FAST=sometimes: use measure, kernel, packed, plain or compiled"):
        cpufast.choose(tiny_model(0))


@pytest.mark.parametrize("plain_s, packed_s, packed", [(2.0, 1.0, True), (1.0, 1.15, False)])
def test_the_measured_choice_follows_the_times_once_per_shape(measuring, monkeypatch, plain_s, packed_s, packed):
    calls = []
    monkeypatch.setattr(cpuchoice, "timed_paths", lambda fast: calls.append(fast) or (plain_s, packed_s))
    model = tiny_model(0)
    assert ModelRunner(model, "a", fast=True).cpu_fast is packed
    assert ModelRunner(tiny_model(1), "b", fast=True).cpu_fast is packed  # same shape: remembered, not measured
    assert len(calls) == 1
    choice = cpufast.choose(model)
    assert choice.how == "measured" and choice.ratio == pytest.approx(plain_s / packed_s)
    assert ("packed (oneDNN)" if packed else "plain forward") in choice.describe()
    ModelRunner(tiny_model(0, hidden=32, heads=2, kv=1), "c", fast=True)  # another shape: measured again
    assert len(calls) == 2


def test_measuring_times_both_paths_and_leaves_the_weights_as_they_were(measuring):
    model = tiny_model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fast = cpufast.enable(model)  # packed already: measuring unpacks around itself and packs again
    choice = cpufast.choose(model)
    assert choice.how == "measured" and 0 < choice.ratio < float("inf")
    assert fast.packed
    cpufast.disable(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_runner_that_chose_plain_gives_the_plain_runners_logits(monkeypatch):
    model = tiny_model(0)
    monkeypatch.setenv(cpumeasure.FAST_ENV, "plain")
    chose_plain = ModelRunner(model, "x", fast=True)
    plain = ModelRunner(model, "y", fast=False)
    outs = []
    for runner in (chose_plain, plain):
        cache = runner.new_cache(1, 16)
        outs.append(runner.prefill(cache, [[3, 5, 7, 9]]))
    assert torch.equal(outs[0], outs[1]) and not chose_plain.fast


# --- the vocabulary head's product per width -------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_every_head_way_computes_the_librarys_product(bias):
    torch.manual_seed(0)
    w = torch.randn(300, 48)
    b = torch.randn(300) if bias else None
    for rows in (1, 2, 3, 5, 8, 17, 40):
        x = torch.randn(1, rows, 48)
        want = torch.nn.functional.linear(x, w, b)
        for name, way in cpuhead.HEAD_WAYS.items():
            got = way(x, w, b)
            assert got.shape == want.shape, name
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_the_head_reads_by_the_way_measured_fastest_at_the_nearest_width(measuring, monkeypatch):
    # each way's time per measured width; the test's own clock, so the choice is known in advance
    cost = {"library": {1: 1.0, 2: 3.0, 5: 3.0, 8: 9.0}, "onednn": {1: 2.0, 2: 4.0, 5: 1.0, 8: 2.0},
            "transposed": {1: 3.0, 2: 2.0, 5: 2.0, 8: 1.0}}
    ran = []
    fakes = {name: (lambda x, w, b, name=name: ran.append((name, x.shape[1])) or torch.zeros(*x.shape[:-1], w.shape[0]))
             for name in cost}
    monkeypatch.setattr(cpuhead, "HEAD_WAYS", fakes)
    monkeypatch.setattr(cpuhead, "_head_ways", {})
    monkeypatch.setattr(cpumeasure, "timed", lambda fn, reps=5: [fn(), cost[ran[-1][0]][ran[-1][1]]][1])
    head = cpuhead.HeadProduct(torch.nn.Linear(16, 40, bias=False))
    assert head.ways == {1: "library", 2: "transposed", 5: "onednn", 8: "transposed"}
    expect = {1: "library", 2: "transposed", 3: "transposed", 4: "onednn", 6: "onednn", 7: "transposed",
              16: "transposed", 17: "library", 64: "library"}  # past 16 rows (a prefill): the library's
    for rows, way in expect.items():
        ran.clear()
        assert head(torch.zeros(1, rows, 16)).shape == (1, rows, 40)
        assert ran == [(way, rows)], rows
    cpuhead.HeadProduct(torch.nn.Linear(16, 40, bias=False))
    assert len(ran) == 1  # the same shape again: remembered, not measured


def test_a_measured_head_gives_the_librarys_logits_on_a_tied_model(measuring, monkeypatch):
    monkeypatch.setattr(cpuhead, "_head_ways", {})
    model = tiny_model(0)
    model.lm_head.weight = model.model.get_input_embeddings().weight
    runner = ModelRunner(model, "tied", fast=True)
    prompt = [3, 5, 7, 9, 11, 2]
    cache = runner.new_cache(1, 16)
    ours = torch.cat([runner.prefill(cache, [prompt[:3]]).unsqueeze(1),
                      runner.run(cache, Step(torch.tensor([prompt[3:]]), [3]))], dim=1)[0]
    with cpufast.plain(model), torch.inference_mode():
        ref = model(torch.tensor([prompt])).logits[0, 2:]
    torch.testing.assert_close(ours, ref.float(), rtol=1e-4, atol=1e-4)


# --- transformers generate's fastest configuration -------------------------------------------------------------


def test_pick_takes_the_fastest_configuration_that_runs_and_says_why_others_did_not(monkeypatch):
    delay = {"dynamic": 0.03, "static": 0.01}
    clock = [0.0]  # a fake clock each configuration's run advances by its delay: no timing, no flakes

    def generator(model, eos, kwargs):
        name = "compiled" if "compile_config" in kwargs else "static" if kwargs else "dynamic"

        def run(prompt, n):
            if name == "compiled":
                raise RuntimeError("inductor: no C++ compiler\nmore detail")
            clock[0] += delay[name]
            return [1] * n
        return run

    monkeypatch.setattr(hf_generate, "generator", generator)
    monkeypatch.setattr(hf_generate, "now", lambda device: clock[0])
    picked = hf_generate.pick(None, [1, 2], [0], "fastest", torch.device("cpu"))
    assert picked.name == "static" and set(picked.rates) == {"dynamic", "static"}
    line = picked.line()
    assert line.startswith("transformers generate: static cache, the fastest of dynamic cache")
    assert "static cache, torch.compile did not run: RuntimeError: inductor: no C++ compiler" in line
    assert "more detail" not in line
    named = hf_generate.pick(None, [1], [0], "static", torch.device("cpu"))
    assert named.rates == {} and "as --generate asked" in named.line()
    with pytest.raises(SdbenchError, match="--generate fast: use one of fastest, dynamic, static, compiled"):
        hf_generate.pick(None, [1], [0], "fast", torch.device("cpu"))


def test_the_static_cache_configuration_decodes_as_the_default_one():
    model = tiny_model(0)
    prompt = [3, 5, 7, 9, 11]
    outs = [hf_generate.generator(model, [0], hf_generate.kwargs_for(name, torch.device("cpu")))(prompt, 12)
            for name in ("dynamic", "static")]
    assert outs[0] == outs[1] and len(outs[0]) == 12


# --- bench at a real model's shape -----------------------------------------------------------------------------


def test_bench_on_an_alias_at_random_says_what_it_used(small, capsys, tmp_path, monkeypatch):  # noqa: F811
    import pandas as pd

    import sdbench.commands.bench as bench

    fake = Bandwidth(1e9, "fake", {"fake": 1e9})
    monkeypatch.setattr(bench, "memory_bandwidth", lambda device: fake)  # not what this test is about
    code, out, err = run_cli(capsys, "bench", "--target", "llama-1b@random", "--limit", "1", "--max-new-tokens", "6",
                             "--repeats", "1", "--gamma", "2", "--device", "cpu", "--generate", "static",
                             "--out", str(tmp_path))
    assert code == 0, err
    assert "note: llama-1b@random: random weights" in out
    assert "transformers generate: static cache, as --generate asked" in out
    layout = cpufast.choose(ModelRunner(tiny_model(0), "t").model).layout  # the tests' override: kernel or packed
    assert f"CPU fast path: {cpupacked.LAYOUT_NAMES[layout]} forward, set by SDBENCH_CPU_FAST" in out
    assert "verification cost T(3 tokens) / T(1 token), llama-1b@random" in out
    # the roofline's read: the probe's, or a plain decoding's where it read faster than that
    assert re.search(r"memory bandwidth: [\d.]+ GB/s \((fake|sdbench autoregressive.*'s decoding), the best of fake", out)
    df = pd.read_parquet(tmp_path / "bench.parquet")
    assert "transformers generate (static cache)" in set(df["system"]) and df["same_output"].all()


def test_the_measured_choice_is_kept_for_later_runs_on_this_machine(measuring, monkeypatch):
    """A second process (here: the in-process memory emptied) takes the kept choice without measuring, and says
    when it was measured; the opposite of what a new measurement would say proves it was not measured again."""
    model = tiny_model(0)
    monkeypatch.setattr(cpuchoice, "timed_paths", lambda fast: (2.0, 1.0))  # packing measured 2x faster
    first = cpufast.choose(model)
    assert first.packed and first.ratio == 2.0 and not first.measured
    monkeypatch.setattr(cpufast, "_chosen", {})
    monkeypatch.setattr(cpuchoice, "timed_paths", lambda fast: (1.0, 2.0))  # would now choose plain
    again = cpufast.choose(model)
    assert again.packed and again.ratio == 2.0 and again.measured and "kept" in again.describe()
    other = tiny_model(1, layers=1)  # another shape: measured, not taken from the first
    assert not cpufast.choose(other).packed
