import pytest

from sdbench.errors import SdbenchError
from sdbench.strategies import resolve_strategy, strategy


def test_builtin_and_alias():
    assert resolve_strategy("pld").base == "ngram"
    assert resolve_strategy("ar").base == "autoregressive"


def test_presets_resolve_with_their_settings():
    choice = resolve_strategy("ngram-code")
    assert (choice.base, choice.gamma, choice.options) == ("ngram", 6, {"max_ngram": 4, "min_ngram": 2})
    assert strategy(choice.base).settings(choice.options) == {"max_ngram": 4, "min_ngram": 2, "tree": 0}
    assert resolve_strategy("self-draft").drafts == ("smollm2-135m",)


def test_preset_folder_override(tmp_path, monkeypatch):
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "broken.yaml").write_text("name: broken\nstrategy: nothing\n")
    monkeypatch.setenv("SDBENCH_HOME", str(tmp_path))
    with pytest.raises(SdbenchError, match="unknown strategy 'nothing'"):
        resolve_strategy("broken")
    with pytest.raises(SdbenchError, match="unknown strategy 'missing'"):
        resolve_strategy("missing")


def test_user_presets_are_read_beside_the_shipped_ones_and_win_on_a_clash(tmp_path, monkeypatch, capsys):
    from tests.conftest import run_cli

    mine = tmp_path / "strategies"
    mine.mkdir()
    (mine / "mine.yaml").write_text("name: mine\nstrategy: draft\ngamma: 3\n")
    (mine / "ngram-code.yaml").write_text("name: ngram-code\nstrategy: ngram\ngamma: 2\ndescription: my own\n")
    monkeypatch.setenv("SDBENCH_CONFIG", str(tmp_path))
    assert (resolve_strategy("mine").base, resolve_strategy("mine").gamma) == ("draft", 3)
    assert resolve_strategy("ngram-code").gamma == 2  # the user's, not the shipped gamma 6
    assert resolve_strategy("self-draft").drafts == ("smollm2-135m",)  # shipped ones still there
    code, out, _ = run_cli(capsys, "list", "strategies")
    assert code == 0 and "mine" in out and "self-draft" in out and "my own" in out


def test_the_user_folder_follows_sdbench_config_then_xdg(tmp_path, monkeypatch):
    from pathlib import Path

    from sdbench.presets import shipped_dir, user_dir

    monkeypatch.setenv("SDBENCH_CONFIG", str(tmp_path / "c"))
    assert user_dir() == tmp_path / "c" / "strategies"
    monkeypatch.delenv("SDBENCH_CONFIG")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "x"))
    assert user_dir() == tmp_path / "x" / "sdbench" / "strategies"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert user_dir() == Path.home() / ".config" / "sdbench" / "strategies"
    monkeypatch.delenv("SDBENCH_HOME", raising=False)
    assert shipped_dir() == Path(__file__).resolve().parent.parent / "strategies"
