"""A tune trial runs, records and hands a preset the lookahead as the run caps it (a step commits at most
--max-new-tokens - 1 tokens), not the larger one its search space drew."""

from __future__ import annotations

import json

import pandas as pd
import yaml

from tests.conftest import run_cli
from tests.test_schedule import ran, tiny  # noqa: F401 (fixture)


def test_a_drawn_lookahead_past_what_a_step_commits_is_recorded_as_run(capsys, tmp_path, tiny):  # noqa: F811
    tiny = [a if a != "6" else "3" for a in tiny]  # --max-new-tokens 3: a step commits at most 2 tokens
    code, out, err = run_cli(capsys, "tune", *tiny, "--strategy", "ngram", "--limit", "2", "--trials", "4",
                             "--study", "s", "--preset", "capped", "--out", str(tmp_path / "tune"))
    assert code == 0, err
    trials = pd.read_parquet(next((tmp_path / "tune").rglob("trials.parquet")))
    drawn = [json.loads(p)["gamma"] if isinstance(p, str) else p["gamma"] for p in trials["params"]]
    assert max(drawn) > 2  # the draws reach past the cap, so the cap matters here
    assert set(trials["gamma"]) <= {1, 2}
    preset = yaml.safe_load((tmp_path / "home" / "strategies" / "capped.yaml").read_text())
    assert preset["gamma"] <= 2
    code, _, err = run_cli(capsys, "run", *tiny, "--strategy", "capped", "--limit", "2", "--out", str(tmp_path / "r"))
    assert code == 0 and "capped to" not in err, err
    assert set(ran(tmp_path / "r")["gamma"]) == {preset["gamma"]}
