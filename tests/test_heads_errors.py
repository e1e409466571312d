"""Bad heads and bad head options: one line each (SdbenchError -> exit 2), before any decoding."""

from __future__ import annotations

import json

import pytest

from sdbench.models.heads.load import load_head
from sdbench.errors import SdbenchError
from sdbench.models.forward.runner import ModelRunner
from tests.conftest import run_cli, tiny_model
from tests.heads import eagle1_dir, eagle3_dir, medusa_dir, small_vocab_target
from tests.references import tiny_cli_files


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(small_vocab_target("llama"))


def _refused(folder, runner, *words):
    with pytest.raises(SdbenchError) as err:
        load_head(str(folder), runner)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_heads_made_for_another_target(tmp_path, runner):
    wider = tiny_model(0, layers=4)  # hidden size 64 and 96 tokens: the target has 32 and 8
    _refused(eagle3_dir(tmp_path / "hidden", wider, draft_vocab=6), runner, "width 192", "hidden size 32")
    _refused(eagle3_dir(tmp_path / "vocab", small_vocab_target("llama", vocab=12)), runner, "12 tokens", "has 8")
    _refused(eagle3_dir(tmp_path / "layers", runner.model, layer_ids=(1, 2, 9)), runner, "layer 9", "4 layers")
    _refused(medusa_dir(tmp_path / "medusa", wider), runner, "hidden size 32 and 8 tokens")


def test_heads_missing_their_parts(tmp_path, runner):
    _refused(eagle3_dir(tmp_path / "d2t", runner.model, draft_vocab=6, drop=("d2t",)), runner, "no d2t")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    _refused(empty, runner, "no weights")
    _refused(tmp_path / "absent", runner, "no such folder")


def test_head_options_on_the_command_line(tmp_path, monkeypatch, capsys):
    args = [*tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3"]), "--max-new-tokens", "4", "--out", str(tmp_path)]
    eagle3_dir(tmp_path / "head", tiny_model(0, layers=4), draft_vocab=6)
    capsys.readouterr()  # the tiny model's saving
    for extra, words in ((["--strategy", "draft", "--head", "x"], "--head needs --strategy eagle, peagle, medusa"),
                         (["--strategy", "eagle"], "needs --head"),
                         (["--compare", "dflash"], "beside another --strategy: --set dflash.head=PATH"),
                         (["--strategy", "medusa", "--head", str(tmp_path / "head")], "use --strategy eagle")):
        code, _, err = run_cli(capsys, "run", *args, *extra)
        assert code == 2 and err.startswith("error:") and err.count("\n") == 1 and words in err, err


def _rewrite(folder, change):
    """The head's config.json with `change` applied to it (the layer's config: the speculators format's own)."""
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg.get("transformer_layer_config", cfg))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_heads_whose_parts_do_not_fit_their_config(tmp_path, runner):
    import torch
    from safetensors.torch import save_file

    target = runner.model
    _refused(eagle3_dir(tmp_path / "no-q", target, drop=("layers.0.self_attn.q_proj.weight",)), runner,
             "no self_attn.q_proj.weight in its weights")
    _refused(_rewrite(eagle3_dir(tmp_path / "hidden", target), lambda c: c.update(hidden_size=16)), runner,
             "hidden size 16", "target's is 32")
    _refused(_rewrite(eagle3_dir(tmp_path / "heads", target), lambda c: c.update(num_attention_heads=4)), runner,
             "self_attn.q_proj.weight has shape (32, 64)", "need (64, 64)")  # 4 heads of 16
    _refused(_rewrite(eagle3_dir(tmp_path / "count", target), lambda c: c.update(num_key_value_heads="one")), runner,
             "num_key_value_heads in its config.json is 'one'")
    folder = eagle1_dir(tmp_path / "bias", target)
    w = torch.load(folder / "pytorch_model.bin", weights_only=True)
    w["fc.bias"] = w["fc.bias"][:10]
    torch.save(w, folder / "pytorch_model.bin")
    _refused(folder, runner, "fc.bias has shape (10,)", "need (32,)")
    folder = medusa_dir(tmp_path / "block", target)
    w = _load(folder / "medusa_lm_head.safetensors")
    w["1.0.linear.weight"] = w["1.0.linear.weight"][:, :16].contiguous()
    save_file(w, str(folder / "medusa_lm_head.safetensors"))
    _refused(folder, runner, "1.0.linear.weight has shape (32, 16)", "need (32, 32)")
    _refused(_rewrite(medusa_dir(tmp_path / "n", target), lambda c: c.update(medusa_num_heads="x")), runner,
             "medusa_num_heads in its config.json is 'x'")


def _load(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_unreadable_head_folders(tmp_path, runner):
    folder = eagle3_dir(tmp_path / "corrupt", runner.model)
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    _refused(folder, runner, f"{folder / 'model.safetensors'} is not a readable weights file")
    folder = eagle1_dir(tmp_path / "pickle", runner.model)
    (folder / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    _refused(folder, runner, "pytorch_model.bin is not a readable weights file")
    (tmp_path / "file").write_text("x")
    _refused(tmp_path / "file", runner, "not a folder (a head is a folder")
    _refused(tmp_path / "missing", runner, "no such folder")
    _refused("./missing", runner, "no such folder")  # a relative path is not taken for a hub id
    folder = eagle3_dir(tmp_path / "ids", runner.model)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "eagle_aux_hidden_state_layer_ids": 3}))
    _refused(folder, runner, "eagle_aux_hidden_state_layer_ids in its config.json is 3, not a list")


def _no_weights(folder, target):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    return folder


def _corrupt(folder, target):
    eagle3_dir(folder, target, layer_ids=(0, 1, 1))
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    return folder


BAD_HEADS = {  # name: (strategy and options, how the head is made for the CLI's 2-layer target, the error)
    "absent": (["--strategy", "eagle"], lambda f, t: f, "no such folder, nor a hub id"),
    "another target": (["--strategy", "eagle"],
                       lambda f, t: eagle3_dir(f, small_vocab_target("llama"), layer_ids=(0, 1, 1)),
                       "reads hidden states of width 96, but the target's layers (0, 1, 1) give 192"),
    "layer ids": (["--strategy", "eagle"], lambda f, t: eagle3_dir(f, t, layer_ids=(0, 1, 5)),
                  "reads target layer 5, but the target has 2 layers"),
    "no d2t": (["--strategy", "eagle"],
               lambda f, t: eagle3_dir(f, t, layer_ids=(0, 1, 1), draft_vocab=48, drop=("d2t",)),
               "drafts over 48 tokens and has no d2t"),
    "no weights": (["--strategy", "eagle"], _no_weights, "no weights in"),
    "corrupt weights": (["--strategy", "eagle"], _corrupt, "model.safetensors is not a readable weights file"),
    "medusa gamma": (["--strategy", "medusa", "--gamma", "4"], lambda f, t: medusa_dir(f, t, heads=3),
                     "--gamma 4: --head"),
    "ngram": (["--strategy", "ngram"], lambda f, t: medusa_dir(f, t), "--head needs --strategy eagle, peagle, medusa"),
}


@pytest.mark.parametrize("case", list(BAD_HEADS))
def test_bad_heads_through_the_cli_are_one_line(tmp_path, monkeypatch, capsys, case):
    from tests.test_cli import one_line_error

    strategy, make, words = BAD_HEADS[case]
    args = [*tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3"]), "--max-new-tokens", "8", "--out", str(tmp_path)]
    head = make(tmp_path / "head", tiny_model(0))
    capsys.readouterr()
    code, _, err = run_cli(capsys, "run", *args, *strategy, "--head", str(head), "--device", "cpu")
    assert code == 2 and words in one_line_error(code, err), err


def test_head_options_of_tune_and_check_are_one_line(tmp_path, monkeypatch, capsys):
    from tests.test_cli import one_line_error

    args = [*tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3"]), "--out", str(tmp_path), "--device", "cpu"]
    capsys.readouterr()
    for extra, words in ((["--strategy", "ngram", "--head", "x"], "--head needs --strategy eagle, peagle, medusa"),
                         (["--strategy", "eagle"], "'eagle' needs a trained head to tune with: give --head"),
                         (["--strategy", "medusa", "--head", "./nowhere"], "--head ./nowhere: no such folder")):
        code, _, err = run_cli(capsys, "tune", *args, *extra)
        assert words in one_line_error(code, err), err
    code, out, err = run_cli(capsys, "check", args[1], "--device", "cpu", "--context", "16", "--tokens", "4",
                             "--head", str(tmp_path / "nowhere"))
    assert code == 1 and "no such folder" in one_line_error(code, err) and "sdbench check" in out


def _no_config(folder, target):
    eagle3_dir(folder, target, layer_ids=(0, 1, 1))
    (folder / "config.json").unlink()
    return folder


def _bad_json(folder, target):
    eagle3_dir(folder, target, layer_ids=(0, 1, 1))
    (folder / "config.json").write_text("{not json")
    return folder


@pytest.mark.parametrize("make, words", [(_no_config, "no config.json in"), (_bad_json, "config.json is not JSON"),
                                         (_no_weights, "no weights in")])
@pytest.mark.parametrize("command", ["run", "bench"])
def test_a_folder_that_holds_no_head_is_refused_before_the_target_loads(tmp_path, monkeypatch, capsys, make, words,
                                                                         command):
    """A head folder is checked before any model loads: the target's load (seconds to a minute on a real model)
    must not happen first."""
    from sdbench.models.loading import loader
    from tests.test_cli import one_line_error

    args = [*tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3"]), "--max-new-tokens", "8"]
    head = make(tmp_path / "head", tiny_model(0))
    capsys.readouterr()

    def load_model(*a, **k):
        raise AssertionError("the target loaded before the head folder was checked")

    monkeypatch.setattr(loader, "load_model", load_model)
    strategy = ["--strategy", "eagle", "--out", str(tmp_path)] if command == "run" else []
    code, _, err = run_cli(capsys, command, *args, *strategy, "--head", str(head), "--device", "cpu")
    assert code == 2 and words in one_line_error(code, err), err
