import pytest

from sdbench.errors import SdbenchError
from sdbench.strategies import check_options, resolve_strategy


def test_builtin_and_alias():
    assert resolve_strategy("pld").base == "ngram"
    assert resolve_strategy("ar").base == "autoregressive"


def test_presets_resolve_with_their_settings():
    choice = resolve_strategy("ngram-code")
    assert (choice.base, choice.gamma, choice.options) == ("ngram", 6, {"max_ngram": 4, "min_ngram": 2})
    assert check_options(choice.base, choice.options) == {"max_ngram": 4, "min_ngram": 2}
    assert resolve_strategy("self-draft").drafts == ("smollm2-135m",)


def test_preset_folder_override(tmp_path, monkeypatch):
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "broken.yaml").write_text("name: broken\nstrategy: nothing\n")
    monkeypatch.setenv("SDBENCH_HOME", str(tmp_path))
    with pytest.raises(SdbenchError, match="unknown strategy 'nothing'"):
        resolve_strategy("broken")
    with pytest.raises(SdbenchError, match="unknown strategy 'missing'"):
        resolve_strategy("missing")
