"""The README's `train-head` command on the embedded SmolLM2 itself, shortened: the folder it writes names its
verifier by the hub id engines load it by, holds no path of this machine, and loads in vLLM's `speculators` once
that verifier is there (here: the de-quantised weights sdbench cached, placed in a hub cache as a user who
downloaded the model would have them, with the hub offline); `run --head` decodes with it losslessly."""

from __future__ import annotations

import json
import os
import sys

from tests.conftest import run_cli, skip_unless_ci

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_the_readmes_train_head_writes_a_head_speculators_loads(tmp_path, capsys, monkeypatch):
    try:
        from speculators.models.eagle3 import Eagle3DraftModel
    except ImportError:
        skip_unless_ci("the speculators package is not installed (make setup installs it)")
    import huggingface_hub.constants

    from sdbench.models.loading.loader import load_model

    out = tmp_path / "heads" / "smollm2-eagle3"
    code, text, err = run_cli(capsys, "train-head", "--target", "smollm2-135m", "--kind", "eagle3", "--minutes",
                              "0.05", "--prompts", "4", "--max-new-tokens", "8", "--out", str(out))
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == REPO
    assert ".gguf" not in (out / "config.json").read_text()
    for written in out.glob("*.json"):  # no file of the head names a path of this machine (a cache, the venv)
        assert os.path.expanduser("~") not in written.read_text() and sys.prefix not in written.read_text(), written
    record = json.loads((out / "sdbench_head.json").read_text())
    assert record["target"] == "smollm2-135m" and len(record["target_weights"]["sha256"]) == 64

    # the verifier as a user who downloaded it has it: the model's weights in the hub cache, the hub offline
    target = load_model("smollm2-135m", "cpu", "float32")
    snapshot = tmp_path / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / ("0" * 40)
    target.model.save_pretrained(snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    head = Eagle3DraftModel.from_pretrained(str(out))
    assert sum(p.numel() for p in head.parameters()) > 0

    code, text, err = run_cli(capsys, "run", "--strategy", "eagle", "--head", str(out), "--limit", "1",
                              "--max-new-tokens", "12", "--out", str(tmp_path / "run"))
    assert code == 0, err
    from sdbench.reporting.results import read_results

    rows = read_results([tmp_path / "run"])
    assert rows[rows["role"] == "strategy"]["lossless"].all()
