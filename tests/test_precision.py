"""What a precision costs in acceptance: the table over rows of two dtypes against sums worked out by hand, and
`run --dtype A,B` through the CLI (every dtype checked before anything loads, one run file per dtype)."""

from __future__ import annotations

import pandas as pd
from rich.console import Console

from sdbench.reporting.precision import precision_table


def _rows() -> pd.DataFrame:
    """Two runs, float32 then q4_0, two prompts each; the draft strategy's acceptance by position set by hand."""
    rows = []
    for run, dtype, accepted in (("r1", "float32", ([4, 3], [2, 1])), ("r2", "q4_0", ([3, 1], [1, 0]))):
        for p in range(2):
            common = dict(run_id=run, dtype=dtype, prompt_id=f"p{p}", category="c", repeat=0)
            rows.append(dict(common, role="baseline", strategy="autoregressive", new_tokens=9, steps=8,
                             accepted_per_position=[], drafted_per_position=[]))
            steps = 4  # 4 rounds of 2 drafts each
            rows.append(dict(common, role="strategy", strategy="draft", steps=steps,
                             new_tokens=1 + steps + sum(accepted[p]), accepted_per_position=accepted[p],
                             drafted_per_position=[steps, steps]))
    return pd.DataFrame(rows)


def _text(table) -> str:
    console = Console(record=True, width=200)
    console.print(table)
    return console.export_text()


def test_rates_lengths_and_change_by_hand():
    # float32: accepted 6 and 4 of 8 drafted at positions 1 and 2; 8 steps commit 8 + 10 tokens: 18 / 8 = 2.25
    # q4_0: accepted 4 and 1 of 8; 8 + 5 = 13 tokens over 8 steps: 1.625, a change of 1.625 / 2.25 - 1 = -27.8 %
    text = _text(precision_table(_rows()))
    f32 = next(line for line in text.splitlines() if "float32" in line)
    q4 = next(line for line in text.splitlines() if "q4_0" in line)
    assert "2.25" in f32 and "75.0%" in f32 and "50.0%" in f32
    assert "1.62" in q4 and "-27.8%" in q4 and "50.0%" in q4 and "12.5%" in q4


def test_one_dtype_has_no_table():
    rows = _rows()
    assert precision_table(rows[rows.dtype == "q4_0"]) is None


def test_run_at_two_dtypes(tmp_path, monkeypatch, capsys):
    from tests.conftest import run_cli
    from tests.references import tiny_cli_files

    files = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w1 w2", "w4 w4 w5"])
    args = ["run", *files, "--strategy", "ngram", "--max-new-tokens", "8", "--device", "cpu"]
    code, out, err = run_cli(capsys, *args, "--dtype", "float32,bfloat16", "--out", str(tmp_path / "o"))
    assert code == 0, err
    runs = pd.concat(pd.read_parquet(p) for p in (tmp_path / "o").glob("*.parquet"))
    assert sorted(runs.dtype.unique()) == ["bfloat16", "float32"] and runs.run_id.nunique() == 2
    assert "Acceptance by precision" in out
    code, _, err = run_cli(capsys, *args, "--dtype", "float32,float8", "--out", str(tmp_path / "bad"))
    assert code != 0 and "float8" in err and "Traceback" not in err
    assert not list((tmp_path / "bad").glob("*.parquet"))  # refused before the first dtype ran
    code, _, err = run_cli(capsys, *args, "--dtype", "float32,q4_0", "--resume", "x", "--out", str(tmp_path / "o"))
    assert code != 0 and "--resume continues one run" in err
