"""Trained heads in the commands around a run: `check --head` (the hidden states a head reads, through the runner,
against the library's `output_hidden_states`; decoding with it against plain greedy decoding) and `list models`
(the heads train-head recorded, under their target)."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from tests.conftest import run_cli
from tests.heads import dflash_dir, eagle1_dir, eagle3_dir, medusa_dir, mtp_dir, small_vocab_target
from tests.references import tiny_model_dir

CHECK = ["--device", "cpu", "--context", "32", "--tokens", "12"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A target folder with a 12-token vocabulary and a head of each kind for it, plus one made for a target with
    another vocabulary."""
    root = tmp_path_factory.mktemp("heads")
    model = small_vocab_target("llama", vocab=12)
    tiny_model_dir(root / "target", model=model)
    return {"target": str(root / "target"),
            "eagle3": str(eagle3_dir(root / "eagle3", model, draft_vocab=6, seed=1)),
            "eagle1": str(eagle1_dir(root / "eagle1", model)),
            "medusa": str(medusa_dir(root / "medusa", model, heads=3)),
            "dflash": str(dflash_dir(root / "dflash", model, block=4, layer_ids=(1, 3))),
            "dspark": str(dflash_dir(root / "dspark", model, block=4, layer_ids=(1, 3), dspark={"type": "gated"})),
            "peagle": str(eagle3_dir(root / "peagle", model, fmt="peagle", seed=2)),
            "mtp": str(mtp_dir(root / "mtp", model, seed=1)),
            "other": str(medusa_dir(root / "other", small_vocab_target("llama", vocab=8)))}


def _row(out: str, name: str) -> str:
    (line,) = [line for line in out.splitlines() if f" {name} " in line]
    return line


def _spied(monkeypatch) -> list:
    """(proposer class name, output ids, drafted tokens) of every decode `check` runs."""
    import sdbench.commands.check as check

    seen, real = [], check.generate

    def generate(target, proposer, prompts, **kw):
        out = real(target, proposer, prompts, **kw)
        seen.append((type(proposer).__name__, out.output_ids[0], sum(r.drafted for r in out.rows)))
        return out
    monkeypatch.setattr(check, "generate", generate)
    return seen


def test_check_reports_each_head(folders, capsys, monkeypatch):
    seen = _spied(monkeypatch)
    kinds = ("eagle3", "eagle1", "medusa", "dflash", "dspark", "peagle", "mtp")
    heads = [folders[k] for k in kinds]
    code, out, err = run_cli(capsys, "check", folders["target"], *[a for h in heads for a in ("--head", h)], *CHECK)
    assert code == 0, err + out
    for kind in kinds:
        row = _row(out, folders[kind])
        assert f"{kind} head" in row and "✓" in row and "ok" in row
        gaps = [float(g) for g in re.findall(r"\d\.\de[+-]\d\d", row)]
        assert len(gaps) == 3 and max(gaps) < 1e-4  # the three phases' hidden-state gaps, within the tolerance
    (plain, *spec) = seen
    assert plain[0] == "Autoregressive" and [s[0] for s in spec] == ["TrainedHead"] * 7
    assert all(s[1] == plain[1] for s in spec)  # each head's decoding gave the plain tokens
    assert len(plain[1]) == 12 and all(s[2] > 0 for s in spec)  # over 12 tokens, each head drafting


def test_check_fails_when_the_runner_hands_a_head_other_states(folders, capsys, monkeypatch):
    from sdbench.engine.hidden import Taps

    real = Taps.put
    monkeypatch.setattr(Taps, "put", lambda self, layer, h: real(self, layer, h * 1.01))
    code, out, _ = run_cli(capsys, "check", folders["target"], "--head", folders["medusa"], *CHECK)
    assert code == 1
    assert "failed" in _row(out, folders["medusa"]) and "ok" in _row(out, folders["target"])
    assert f"--head {folders['medusa']}: the target's hidden states at layers (-1,) differ from the library's " \
           "output_hidden_states" in out


def test_check_fails_when_decoding_with_a_head_changes_the_output(folders, capsys, monkeypatch):
    """A verifier that always accepts the first drafted token: the head's decoding differs from plain decoding."""
    from sdbench.engine import sampling

    real = sampling.verify_greedy

    def verify_greedy(draft, n_draft, target_logits):
        verdict = real(draft, n_draft, target_logits)
        verdict.accepted[(verdict.accepted == 0) & (n_draft > 0)] = 1
        return verdict
    monkeypatch.setattr(sampling, "verify_greedy", verify_greedy)
    code, out, _ = run_cli(capsys, "check", folders["target"], "--head", folders["eagle3"], *CHECK)
    assert code == 1
    row = _row(out, folders["eagle3"])
    assert "✗" in row and "failed" in row
    assert f"--head {folders['eagle3']}: speculative decoding with it changed the target's greedy output" in out


def test_check_refuses_a_head_made_for_another_target(folders, capsys):
    code, out, err = run_cli(capsys, "check", folders["target"], "--head", folders["other"], *CHECK)
    assert code == 1 and "failed" in _row(out, folders["other"]) and "ok" in _row(out, folders["target"])
    assert err.count("\n") == 1 and "hidden size 32 and 12 tokens" in err


def test_list_models_shows_the_heads_train_head_recorded(folders, tmp_path, monkeypatch):
    from sdbench.commands.listing import show
    from sdbench.models.heads.registry import HeadRecord, write_record

    monkeypatch.setenv("SDBENCH_CONFIG", str(tmp_path))
    write_record(folders["eagle3"], HeadRecord(target="smollm2", kind="eagle3"))  # an alias's second name
    write_record(folders["medusa"], HeadRecord(target=folders["target"], kind="medusa"))
    console = Console(width=500, file=io.StringIO())
    show("models", console)
    out = console.file.getvalue()
    assert f"eagle3 {folders['eagle3']}" in _row(out, "smollm2-135m,")  # under the alias it was made for
    assert f"medusa {folders['medusa']}" in _row(out, folders["target"])  # a folder target: a row of its own
    assert out.count(folders["eagle3"]) == 1 and out.count(folders["medusa"]) == 1
