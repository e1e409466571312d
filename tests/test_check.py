"""`sdbench check` through the command line on tiny model folders: one table, exit 0 when everything passes,
exit 1 on any failure (a runner that fails the probe, a draft with another tokenizer)."""

from __future__ import annotations

import re

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from sdbench.models.generic import GenericRunner
from tests.conftest import run_cli
from tests.test_generic import perturbed
from tests.test_models_loading import tiny_tokenizer
from tests.test_probe import broken_rotary, tiny_gpt2_folder, tiny_llama_folder

CHECK = ["--device", "cpu", "--context", "64", "--tokens", "8"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("check-models")
    other = root / "other-tokenizer"
    LlamaForCausalLM(LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(other)
    tiny_tokenizer([f"v{i}" for i in range(197)]).save_pretrained(other)
    return {"llama": tiny_llama_folder(root / "llama"), "gpt2": tiny_gpt2_folder(root / "gpt2", seed=1),
            "other": str(other)}


def rows(out: str, name: str) -> list[str]:
    return [line for line in out.splitlines() if f" {name} " in line]


def test_check_passes_with_one_table(folders, capsys):
    code, out, err = run_cli(capsys, "check", folders["llama"], "--draft", folders["gpt2"], "--draft", "ngram",
                             *CHECK)
    assert code == 0, err + out
    assert "sdbench check" in out and out.count("┏") == 1  # one table
    (target,) = rows(out, folders["llama"])
    assert "target" in target and "native" in target and "✓" in target and "ok" in target and "MiB" in target
    (draft,) = rows(out, folders["gpt2"])
    assert "generic" in draft and "same" in draft and "✓" in draft and "ok" in draft
    # its probe's gaps are shown (the generic runner is the library's cached forward: exactly the reference)
    assert len(re.findall(r"\d\.\de[+-]\d\d", draft)) == 3


def test_check_fails_on_a_draft_with_another_tokenizer(folders, capsys):
    code, out, _ = run_cli(capsys, "check", folders["llama"], "--draft", folders["other"], *CHECK)
    assert code == 1
    (draft,) = rows(out, folders["other"])
    assert "differs" in draft and "failed" in draft
    assert "do not share a tokenizer" in out


def test_check_fails_on_a_runner_that_fails_the_probe(folders, capsys, monkeypatch):
    broken_rotary(monkeypatch)
    code, out, _ = run_cli(capsys, "check", folders["llama"], *CHECK)
    assert code == 0 and "generic (fallback)" in out and "running it on the generic runner" in out
    real = GenericRunner.forward
    monkeypatch.setattr(GenericRunner, "forward", lambda self, *a, **k: real(self, *a, **k) + 0.01)
    code, out, _ = run_cli(capsys, "check", folders["llama"], *CHECK)
    assert code == 1 and "failed" in out
    assert f"model '{folders['llama']}' on the native runner does not compute the library's model" in out


def test_check_bad_settings_are_one_line(capsys):
    code, _, err = run_cli(capsys, "check", "smollm2-135m", "--context", "0")
    assert code == 2 and "--context and --tokens must be at least 1" in err and "Traceback" not in err
