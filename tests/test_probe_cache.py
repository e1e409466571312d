"""The fidelity probe's verdict, kept per weights, dtype, device, forward path and code, and reused by a later
run within the context it probed: a second run does not probe again, and says so in its output and rows; a
longer context, other weights, `--probe always` and `sdbench check` probe again."""

from __future__ import annotations

import pytest
import torch

from sdbench.models.probing import probe as probe_module
from sdbench.models.probing.probe_cache import ProbeCache, runner_key, weights_fingerprint
from sdbench.models.forward.runner import ModelRunner
from sdbench.reporting.results import read_results
from tests.conftest import run_cli
from tests.test_probe import RUN, tiny_llama_folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture
def counted(monkeypatch):
    """How many probes measured (the real probe, counted)."""
    calls = []
    real = probe_module.probe

    def probe(runner, length, vocab=None):
        calls.append(length)
        return real(runner, length, vocab)

    monkeypatch.setattr(probe_module, "probe", probe)
    return calls


def _run(capsys, llama, out, *extra):
    code, stdout, err = run_cli(capsys, "run", "--target", llama, "--strategy", "ngram", *RUN, "--out", str(out),
                                *extra)
    assert code == 0, err
    return stdout, read_results([out])


def test_a_second_run_reuses_the_verdict_and_says_so(llama, tmp_path, capsys, counted):
    _, first = _run(capsys, llama, tmp_path / "a")
    assert len(counted) == 1 and set(first["probe_reused"]) == {False}
    out, second = _run(capsys, llama, tmp_path / "b")
    assert len(counted) == 1, "the second run probed again"
    assert "verdict of" in out and "is reused" in out and "--probe always" in out
    assert set(second["probe_reused"]) == {True} and set(second["probe"]) == {"passed"}
    assert second["probe_gap"].iloc[0] == first["probe_gap"].iloc[0] > 0  # the gap it measured, kept


def test_probe_always_a_longer_context_and_never(llama, tmp_path, capsys, counted):
    _run(capsys, llama, tmp_path / "a")
    _, again = _run(capsys, llama, tmp_path / "b", "--probe", "always")
    assert len(counted) == 2 and set(again["probe_reused"]) == {False}
    _run(capsys, llama, tmp_path / "c", "--max-new-tokens", "60")  # past the positions probed so far
    assert len(counted) == 3 and counted[-1] > counted[0]
    _, shorter = _run(capsys, llama, tmp_path / "d")  # within the longer verdict: reused
    assert len(counted) == 3 and set(shorter["probe_reused"]) == {True}
    _, skipped = _run(capsys, llama, tmp_path / "e", "--probe", "never")
    assert len(counted) == 3 and set(skipped["probe"]) == {"skipped"} and skipped["probe_reused"].isna().all()


def test_a_bad_probe_mode_is_one_line(llama, tmp_path, capsys):
    code, _, err = run_cli(capsys, "run", "--target", llama, *RUN, "--probe", "sometimes", "--out", str(tmp_path))
    assert code != 0 and err.strip().count("\n") == 0 and "--probe sometimes" in err


def test_check_probes_again_and_keeps_its_verdict_for_runs(llama, tmp_path, capsys, counted):
    _run(capsys, llama, tmp_path / "a")
    for context in ("64", "200"):  # a shorter context first: it does not replace the run's longer verdict
        code, _, err = run_cli(capsys, "check", llama, "--device", "cpu", "--context", context, "--tokens", "4")
        assert code == 0, err
        _, rows = _run(capsys, llama, tmp_path / context)
        assert set(rows["probe_reused"]) == {True}
    assert len(counted) == 3 and counted[1:] == [64, 200]  # check never reuses; the runs after it did


def test_the_fingerprint_follows_the_weight_files(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tiny_llama_folder(tmp_path / "x")
    a, b = AutoModelForCausalLM.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    before = weights_fingerprint(a)
    assert before.startswith("files:") and before == weights_fingerprint(b)
    other = AutoModelForCausalLM.from_pretrained(tiny_llama_folder(tmp_path / "y"))  # the same values elsewhere
    assert weights_fingerprint(other) != before
    with torch.no_grad():  # the folder's weights rewritten with one value one float32 step away
        w = b.model.layers[1].mlp.down_proj.weight
        w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(float("inf")))
    b.save_pretrained(folder)
    assert weights_fingerprint(AutoModelForCausalLM.from_pretrained(folder)) != before


def test_a_model_built_in_memory_is_fingerprinted_by_its_values():
    from sdbench.models.probing.probe_cache import values_fingerprint
    from tests.conftest import tiny_model

    a, b = tiny_model(0), tiny_model(0)
    assert weights_fingerprint(a) == weights_fingerprint(b) == "values:" + values_fingerprint(a)
    with torch.no_grad():
        w = b.model.layers[1].mlp.down_proj.weight
        w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(float("inf")))
    assert weights_fingerprint(a) != weights_fingerprint(b)
    assert weights_fingerprint(tiny_model(1)) != weights_fingerprint(a)


def test_a_random_model_is_fingerprinted_by_its_name_and_config():
    from tests.conftest import tiny_model

    a = tiny_model(0)
    assert weights_fingerprint(a, "x@random") == weights_fingerprint(tiny_model(1), "x@random")  # same shape
    assert weights_fingerprint(a, "x@random") != weights_fingerprint(tiny_model(0, layers=1), "x@random")
    assert weights_fingerprint(a, "x@random").startswith("random:")


def test_the_key_names_dtype_path_and_runner(tmp_path):
    from transformers import AutoModelForCausalLM

    from sdbench.models.forward.generic import GenericRunner

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_folder(tmp_path / "x"))
    plain, fast, generic = ModelRunner(model), ModelRunner(model, fast=True), GenericRunner(model)
    keys = [runner_key(r, "w") for r in (plain, fast, generic)]
    assert keys[0]["dtype"] == "float32" and keys[0]["runner"] == "native" and keys[2]["runner"] == "generic"
    assert len({str(sorted(k.items())) for k in keys}) == (3 if fast.fast else 2)
    half = runner_key(ModelRunner(AutoModelForCausalLM.from_pretrained(tmp_path / "x").to(torch.bfloat16)), "w")
    assert half["dtype"] == "bfloat16" and half != keys[0]


def test_a_verdict_that_could_not_run_is_not_kept(tmp_path):
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_folder(tmp_path / "x"))
    runner = ModelRunner(model)
    cache = ProbeCache("auto", tmp_path / "verdicts")
    cache.put(runner, SimpleNamespace(error="RuntimeError: out of memory", skipped="", length=64))
    assert cache.get(runner, 32) is None and not list((tmp_path / "verdicts").glob("*"))
