"""The fidelity probe: passes on tiny random models, refuses a runner broken on purpose in one line, falls back
to the generic runner where it can, and is wired into `run` (rows, --no-probe, refusals before loading)."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import sdbench.models.forward.runner as native_module
from sdbench.errors import SdbenchError
from sdbench.models.forward import cpufast
from sdbench.models.probing import probe as probe_module
from sdbench.models.forward.generic import GenericRunner
from sdbench.models.loading.pair import Pair
from sdbench.models.probing.probe import PHASES, probe, probe_pair, reference
from sdbench.models.forward.runner import ModelRunner
from sdbench.reporting.results import read_results
from tests.conftest import run_cli, skip_unless_ci, tiny_model
from tests.test_cli import one_line_error
from tests.test_generic import perturbed
from tests.test_models_loading import tiny_tokenizer

QUIET = Console(quiet=True)


def broken_rotary(monkeypatch):
    """The native runner's rotary embedding 0.1% off: one op changed."""
    real = native_module.rope
    monkeypatch.setattr(native_module, "rope", lambda x, cos, sin: real(x, cos, sin) * 1.001)


@pytest.fixture(scope="module")
def llama():
    return perturbed(tiny_model(0), 0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("kind", ["plain", "fast", "static"])
def test_the_probe_passes_on_tiny_native_models(arch, kind):
    """300 positions: past the rotary table's first size (256), so the table has grown during the probe."""
    model = perturbed(tiny_model(0, arch), 0)
    runner = ModelRunner(model, arch, fast=kind == "fast", static=kind == "static" or None)
    result = probe(runner, 300)
    assert result.passed, result.line()
    assert set(result.gaps) == set(PHASES) and result.length == 300 and result.gap < 1e-5


def test_a_broken_rotary_is_refused_in_one_line(llama, monkeypatch):
    broken_rotary(monkeypatch)
    result = probe(ModelRunner(llama, "tiny-llama"), 100)
    assert not result.passed and result.gap > result.tolerance == 1e-4
    line = result.line()
    assert "\n" not in line and "'tiny-llama'" in line and "native runner" in line
    phase, position = result.worst[:2]
    assert phase in PHASES and f"at {phase} position {position}" in line and 92 <= position < 100


def test_a_broken_norm_on_the_fast_path_is_caught_by_the_fast_probe(llama, monkeypatch):
    """The probe runs the path the run uses: a fast-path op broken fails the fast runner only."""
    real = cpufast.rms_norm
    monkeypatch.setattr(cpufast, "rms_norm", lambda module, x: real(module, x) * 1.001)
    fast = ModelRunner(llama, "fast", fast=True)
    if not fast.cpu_fast:
        skip_unless_ci("no packed GEMM on this CPU build")
    assert not probe(fast, 64).passed
    assert probe(ModelRunner(llama, "plain"), 64).passed


def test_the_reference_in_chunks_is_the_one_forward(llama, monkeypatch):
    """The reference's calls (a prefix, single steps, a verification; the prefix in chunks when long) give the
    library's uncached forward of the whole sequence, for a rope whose scaling does not depend on the call."""
    ids = torch.randint(0, 96, (200,), generator=torch.Generator().manual_seed(0))
    whole = reference(llama, ids, 193, "cpu")  # positions 192..199
    monkeypatch.setattr(probe_module, "REFERENCE_CHUNK", 64)
    torch.testing.assert_close(reference(llama, ids, 193, "cpu"), whole, atol=1e-4, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(whole, llama(ids[None]).logits[0, -8:], atol=1e-4, rtol=0)


def test_a_failing_native_runner_falls_back_to_the_generic_one(llama, monkeypatch, capsys):
    broken_rotary(monkeypatch)
    runner = ModelRunner(llama, "tiny-llama")
    pair = Pair(runner, None, [runner, "ngram"], [], 1024)  # the target drafting for itself, and prompt lookup
    probe_pair(pair, 64, {}, Console(file=None, force_terminal=False))
    assert isinstance(pair.target, GenericRunner) and pair.drafts[0] is pair.target and pair.drafts[1] == "ngram"
    assert pair.fidelity()["runner"] == "generic" and pair.fidelity()["probe"] == "fallback"
    assert 0 <= pair.fidelity()["probe_gap"] < 1e-5
    out = capsys.readouterr().out
    assert "note: model 'tiny-llama' on the native runner does not compute" in out and "generic runner" in out


def test_no_fallback_where_the_run_needs_the_native_runner(llama, monkeypatch):
    broken_rotary(monkeypatch)
    pair = Pair(ModelRunner(llama, "tiny-llama"), None, [], [], 1024)
    with pytest.raises(SdbenchError, match="'tiny-llama'.*MagicDec's sparse draft cache needs the native runner"):
        probe_pair(pair, 64, {"tiny-llama": "MagicDec's sparse draft cache"}, QUIET)


def test_refused_when_the_generic_runner_fails_too(llama, monkeypatch):
    broken_rotary(monkeypatch)
    real = GenericRunner.run
    monkeypatch.setattr(GenericRunner, "run", lambda self, *a, **k: real(self, *a, **k) + 0.01)
    pair = Pair(ModelRunner(llama, "tiny-llama"), None, [], [], 1024)
    with pytest.raises(SdbenchError, match="^model 'tiny-llama' on the native runner does not compute"):
        probe_pair(pair, 64, {}, QUIET)


def test_a_runner_that_crashes_is_one_line(llama, monkeypatch):
    def crash(*args, **kwargs):
        raise IndexError("index 7 is out of bounds\nsecond line")

    monkeypatch.setattr(GenericRunner, "prefill", crash)
    result = probe(GenericRunner(llama, "tiny"), 64)
    assert not result.passed and result.line().endswith("failed the fidelity probe: IndexError: index 7 is out "
                                                         "of bounds")


def test_a_quantised_copy_is_not_probed_and_says_so(llama, capsys):
    from sdbench.models.loading.variants import quantise_int8

    target = ModelRunner(llama, "tiny")
    pair = Pair(target, None, [ModelRunner(quantise_int8(llama), "tiny@int8")], [], 1024)
    probe_pair(pair, 64, {}, Console())
    assert [p.skipped != "" for p in pair.probes] == [False, True]
    assert pair.fidelity()["probe_gap"] == pair.probes[0].gap
    assert "note: tiny@int8 is not probed: a quantised copy" in capsys.readouterr().out


def test_bfloat16_passes_within_its_stated_tolerance(llama):
    import copy

    model = copy.deepcopy(llama).to(torch.bfloat16)
    result = probe(ModelRunner(model, "bf16"), 100)
    assert result.passed and result.tolerance == 1e-1


# ---- through the command line ------------------------------------------------------------------------------


def save(folder, model):
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def tiny_llama_folder(folder, seed: int = 0, **extra):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                      eos_token_id=2, initializer_range=0.3, **extra)
    return save(folder, perturbed(LlamaForCausalLM(cfg), seed))


def tiny_gpt2_folder(folder, seed: int = 0):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=200, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=1,
                     eos_token_id=2, initializer_range=0.3)
    return save(folder, perturbed(GPT2LMHeadModel(cfg), seed))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {"llama": tiny_llama_folder(root / "llama"), "gpt2": tiny_gpt2_folder(root / "gpt2")}


RUN = ["--limit", "1", "--max-new-tokens", "6", "--device", "cpu"]


def test_run_refuses_a_broken_runner_in_one_line(folders, tmp_path, monkeypatch, capsys):
    """MagicDec needs the native runner, so a native runner that fails the probe is refused, naming the model
    and the phase."""
    broken_rotary(monkeypatch)
    code, _, err = run_cli(capsys, "run", "--target", folders["llama"], "--strategy", "magicdec", *RUN,
                           "--out", str(tmp_path))
    line = one_line_error(code, err)
    assert f"model '{folders['llama']}' on the native runner does not compute" in line
    assert any(f"at {phase} position" in line for phase in PHASES) and "needs the native runner" in line
    assert not list(tmp_path.glob("*.parquet"))


def test_run_falls_back_and_rows_record_it(folders, tmp_path, monkeypatch, capsys):
    broken_rotary(monkeypatch)
    code, out, err = run_cli(capsys, "run", "--target", folders["llama"], "--draft", folders["gpt2"],
                             "--strategy", "draft", *RUN, "--out", str(tmp_path))
    assert code == 0, err
    assert "running it on the generic runner" in out
    df = read_results([tmp_path])
    assert set(df["runner"]) == {"generic"} and set(df["probe"]) == {"fallback"}
    assert (df["probe_gap"] < 1e-4).all() and df["lossless"].dropna().all()


def test_run_records_the_native_runner_and_its_gap(folders, tmp_path, capsys):
    code, _, err = run_cli(capsys, "run", "--target", folders["llama"], "--draft", folders["gpt2"],
                           "--strategy", "draft", *RUN, "--out", str(tmp_path))
    assert code == 0, err
    df = read_results([tmp_path])
    assert set(df["runner"]) == {"native"} and set(df["probe"]) == {"passed"}
    assert ((df["probe_gap"] > 0) & (df["probe_gap"] < 1e-4)).all() and df["lossless"].dropna().all()


def test_no_probe_is_said_on_every_row(folders, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(probe_module, "probe", lambda *a: pytest.fail("probed with --no-probe"))
    code, out, err = run_cli(capsys, "run", "--target", folders["llama"], "--no-probe", *RUN, "--out",
                             str(tmp_path))
    assert code == 0, err
    assert "--probe never" in out
    df = read_results([tmp_path])
    assert set(df["probe"]) == {"skipped"} and df["probe_gap"].isna().all() and set(df["runner"]) == {"native"}


@pytest.mark.parametrize("argv", [["--strategy", "magicdec", "--target", "GPT2"],
                                  ["--strategy", "draft", "--draft", "GPT2", "--set", "draft_kv=snapkv"]])
def test_sparse_caches_on_a_generic_model_are_refused_before_loading(folders, tmp_path, monkeypatch, capsys, argv):
    from sdbench.models.loading import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded weights"))
    argv = [folders["gpt2"] if a == "GPT2" else a for a in argv]
    if "--target" not in argv:
        argv += ["--target", folders["llama"]]
    code, _, err = run_cli(capsys, "run", *argv, *RUN, "--out", str(tmp_path))
    line = one_line_error(code, err)
    assert f"model '{folders['gpt2']}' runs on the generic runner" in line and "needs the native runner" in line


def test_an_int8_copy_of_a_generic_model_is_one_line(folders, tmp_path, capsys):
    code, _, err = run_cli(capsys, "run", "--target", folders["gpt2"], "--draft", folders["gpt2"] + "@int8",
                           "--strategy", "draft", *RUN, "--out", str(tmp_path))
    assert "runs on the generic runner" in one_line_error(code, err)
