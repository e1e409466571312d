"""`sdbench check` through the command line on tiny model folders: one table, exit 0 when everything passes,
exit 1 on any failure (a runner that fails the probe, a draft with another tokenizer)."""

from __future__ import annotations

import re

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from sdbench.models.forward.generic import GenericRunner
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


def _mib(folder: str) -> str:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    return f"{sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20:,.1f} MiB"


def test_check_passes_with_one_table(folders, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM

    from tests.references import hf_generate

    seen = _recorded(monkeypatch)
    code, out, err = run_cli(capsys, "check", folders["llama"], "--draft", folders["gpt2"], "--draft", "ngram",
                             *CHECK)
    assert code == 0, err + out
    assert "sdbench check" in out and out.count("┏") == 1  # one table
    (target,) = rows(out, folders["llama"])
    assert "target" in target and "native" in target and "✓" in target and "ok" in target
    (draft,) = rows(out, folders["gpt2"])
    assert "generic" in draft and "same" in draft and "✓" in draft and "ok" in draft
    # the weights: the parameters' bytes, counted here from the library's own model
    assert _mib(folders["llama"]) in target and _mib(folders["gpt2"]) in draft
    # the probe's gaps: the native runner's within the tolerance; the generic one's exactly 0 at the prefill
    # and the steps (it is the library's cached forward, called the same way), and at rounding level for its
    # one-call verification against the reference's one token per call
    assert all(float(g) < 1e-4 for g in re.findall(r"\d\.\de[+-]\d\d", target)) and "tolerance 0.0001" in out
    gaps = re.findall(r"\d\.\de[+-]\d\d", draft)
    assert gaps[:2] == ["0.0e+00"] * 2 and float(gaps[2]) < 1e-5
    # what the greedy columns compared: sdbench's plain tokens (the library's generate on the same prompt), and
    # each draft's speculative decoding (the same tokens)
    (_, (prompt,), new, (plain,)), *spec = seen
    assert new == 8 and plain == hf_generate(AutoModelForCausalLM.from_pretrained(folders["llama"]), prompt, 8)
    assert [(s[0], s[1], s[3]) for s in spec] == [("DraftModel", [prompt], [plain]), ("NGram", [prompt], [plain])]


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
    real = GenericRunner.run
    monkeypatch.setattr(GenericRunner, "run", lambda self, *a, **k: real(self, *a, **k) + 0.01)
    code, out, _ = run_cli(capsys, "check", folders["llama"], *CHECK)
    assert code == 1 and "failed" in out
    assert f"model '{folders['llama']}' on the native runner does not compute the library's model" in out


def test_check_bad_settings_are_one_line(capsys):
    code, _, err = run_cli(capsys, "check", "smollm2-135m", "--context", "0")
    assert code == 2 and "--context and --tokens must be at least 1" in err and "Traceback" not in err


def _recorded(monkeypatch):
    """Every decode `check` runs, recorded: (proposer class name, prompts, max_new_tokens, output ids)."""
    import sdbench.commands.check as check

    seen, real = [], check.generate

    def generate(target, proposer, prompts, **kw):
        out = real(target, proposer, prompts, **kw)
        seen.append((type(proposer).__name__, prompts, kw["max_new_tokens"], out.output_ids))
        return out
    monkeypatch.setattr(check, "generate", generate)
    return seen


def test_check_fails_when_greedy_tokens_differ_from_the_librarys_generate(folders, capsys, monkeypatch):
    """The library's generate answering with its fourth token changed (the probe still passes): exit 1, the
    target's greedy column ✗, and the error line names token 3, on the prompt sdbench decoded."""
    seen, asked = _recorded(monkeypatch), []
    real = LlamaForCausalLM.generate

    def generate(self, ids, **kw):
        out = real(self, ids, **kw)
        asked.append((ids[0].tolist(), kw, out[0, ids.shape[1]:].tolist()))
        out = out.clone()
        out[0, ids.shape[1] + 3] = (out[0, ids.shape[1] + 3] + 1) % self.config.vocab_size
        return out
    monkeypatch.setattr(LlamaForCausalLM, "generate", generate)
    code, out, _ = run_cli(capsys, "check", folders["llama"], *CHECK)
    assert code == 1
    (target,) = rows(out, folders["llama"])
    assert "✗" in target and "failed" in target and "native" in target
    assert f"✗ model '{folders['llama']}': sdbench's greedy tokens differ from the library's generate from token 3 on" \
        in out
    (ours,) = seen
    (prompt, kw, theirs), = asked
    assert ours[0] == "Autoregressive" and ours[1] == [prompt] and ours[2] == kw["max_new_tokens"] == 8
    assert len(prompt) == 24 and kw["do_sample"] is False
    assert ours[3] == [theirs]  # unbroken, the two agreed: only the change at token 3 failed the check


def test_check_fails_when_speculative_decoding_changes_the_output(folders, capsys, monkeypatch):
    """A verifier that always accepts the first drafted token (the draft's probe passes, the target's too): the
    draft's speculative decoding differs from the target's plain decoding, which still equals the library's."""
    from sdbench.engine import sampling

    seen = _recorded(monkeypatch)
    real = sampling.verify_greedy

    def verify_greedy(draft, n_draft, target_logits):
        verdict = real(draft, n_draft, target_logits)
        first = (verdict.accepted == 0) & (n_draft > 0)
        verdict.accepted[first] = 1
        return verdict
    monkeypatch.setattr(sampling, "verify_greedy", verify_greedy)
    code, out, _ = run_cli(capsys, "check", folders["llama"], "--draft", folders["gpt2"], *CHECK)
    assert code == 1
    (target,) = rows(out, folders["llama"])
    (draft,) = rows(out, folders["gpt2"])
    assert "✓" in target and "ok" in target
    assert "✗" in draft and "failed" in draft and "same" in draft
    assert f"✗ model '{folders['gpt2']}': speculative decoding with it as the draft changed the target's greedy " \
        "output" in out
    plain, spec = seen
    assert (plain[0], spec[0]) == ("Autoregressive", "DraftModel") and plain[1:3] == spec[1:3]
    assert spec[3] != plain[3]
    from transformers import AutoModelForCausalLM

    from tests.references import hf_generate

    library = hf_generate(AutoModelForCausalLM.from_pretrained(folders["llama"]), plain[1][0], 8)
    assert plain[3] == [library]  # what the draft's run was compared with is the library's greedy output


def test_check_makes_an_int8_draft_of_the_loaded_target(folders, capsys, monkeypatch):
    """MODEL@int8 as a draft of MODEL: made of the target's loaded weights (no second load from the folder), not
    probed (no one forward is its reference), decoding losslessly; the weights column counts the int8 copy."""
    import sdbench.models.loading.loader as loader

    seen, loads, real = _recorded(monkeypatch), [], loader.load_model
    monkeypatch.setattr(loader, "load_model", lambda name, *a, **k: loads.append(name) or real(name, *a, **k))
    name = f"{folders['llama']}@int8"
    code, out, err = run_cli(capsys, "check", folders["llama"], "--draft", name, *CHECK)
    assert code == 0, err + out
    assert loads == [folders["llama"]]
    (draft,) = [line for line in rows(out, name) if "│" in line]
    assert f"{name} is not probed" in out and "native" in draft and "same" in draft and "✓" in draft and "ok" in draft
    assert _mib(folders["llama"]) not in draft  # int8 weights: fewer bytes than the float copy
    (_, _, _, (plain,)), (kind, _, _, (spec,)) = seen
    assert kind == "DraftModel" and spec == plain
