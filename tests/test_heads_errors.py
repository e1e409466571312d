"""Bad heads and bad head options: one line each (SdbenchError -> exit 2), before any decoding."""

from __future__ import annotations

import json

import pytest

from sdbench.models.heads.load import load_head
from sdbench.errors import SdbenchError
from sdbench.models.runner import ModelRunner
from tests.conftest import run_cli, tiny_model
from tests.heads import eagle3_dir, medusa_dir, small_vocab_target
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
    _refused(tmp_path / "absent", runner, "not a folder")


def test_head_options_on_the_command_line(tmp_path, monkeypatch, capsys):
    args = [*tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3"]), "--max-new-tokens", "4", "--out", str(tmp_path)]
    eagle3_dir(tmp_path / "head", tiny_model(0, layers=4), draft_vocab=6)
    capsys.readouterr()  # the tiny model's saving
    for extra, words in ((["--strategy", "draft", "--head", "x"], "--head needs --strategy eagle or medusa"),
                         (["--strategy", "eagle"], "needs --head"),
                         (["--strategy", "medusa", "--head", str(tmp_path / "head")], "use --strategy eagle")):
        code, _, err = run_cli(capsys, "run", *args, *extra)
        assert code == 2 and err.startswith("error:") and err.count("\n") == 1 and words in err, err
