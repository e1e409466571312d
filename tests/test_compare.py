"""sdbench compare: exit 0 on equal results, 1 on a planted regression or lossy output, 2 on bad input."""

from __future__ import annotations

import pytest

from sdbench.cli import main
from sdbench.reporting.compare import compare_frames
from sdbench.reporting.results import read_results
from sdbench.reporting.writer import RunWriter
from tests.conftest import run_cli

PROMPTS = ("mt-bench/81", "mt-bench/82", "mt-bench/83")


def rows(base_tps=(100.0, 100.0, 100.0), strat_tps=(150.0, 150.0, 150.0), lossless=True, prompts=PROMPTS):
    """Baseline and draft rows for each prompt; one repeat per value given."""
    out = []
    for p in prompts:
        for repeat, (b, s) in enumerate(zip(base_tps, strat_tps)):
            common = {"target": "smollm2-135m", "dataset": "mt-bench", "prompt_id": p, "batch_size": 1,
                      "repeat": repeat, "new_tokens": 32, "hardware": "cuda:H100"}
            out.append({**common, "role": "baseline", "strategy": "autoregressive", "params": "{}", "draft": "",
                        "tokens_per_s": b, "speedup": 1.0, "lossless": True})
            out.append({**common, "role": "strategy", "strategy": "draft", "params": '{"gamma": 4}',
                        "draft": "smollm2-135m", "tokens_per_s": s, "speedup": s / b, "lossless": lossless})
    return out


def write(folder, run_id, data) -> str:
    writer = RunWriter(folder, run_id)
    writer.append(data)
    return str(writer.finalize())


def test_equal_results_pass(tmp_path, capsys):
    base = write(tmp_path, "base", rows())
    code, out, err = run_cli(capsys, "compare", base, base)
    assert code == 0, err
    assert "no regression beyond 5% on 9 matched comparisons" in out


def test_planted_regression_fails(tmp_path, capsys):
    base = write(tmp_path, "base", rows())
    slow = write(tmp_path / "cur", "cur", rows(strat_tps=(120.0, 120.0, 120.0)))  # -20 % tokens/s
    code, out, err = run_cli(capsys, "compare", base, slow)
    assert code == 1
    assert err.startswith("error: tokens_per_s -20.0% on mt-bench/81 (draft gamma=4 · smollm2-135m)")
    assert "and 5 more" in err  # tokens/s and speedup, three prompts each
    # a generous gate lets the same drop through
    code, _, _ = run_cli(capsys, "compare", base, slow, "--max-regression", "25")
    assert code == 0


def test_planted_lossless_failure_fails(tmp_path, capsys):
    base = write(tmp_path, "base", rows())
    lossy = write(tmp_path / "cur", "cur", rows(lossless=False))
    code, _, err = run_cli(capsys, "compare", base, lossy)
    assert code == 1 and err.startswith("error: lossless broke on 9 row(s), e.g. mt-bench/81")


def test_a_drop_within_the_repeats_noise_passes():
    baseline = read_like(rows(strat_tps=(100.0, 110.0, 90.0)))  # median 100, MAD 10
    current = read_like(rows(strat_tps=(92.0, 102.0, 82.0)))  # median 92: -8 %, but noise 20 %
    result = compare_frames(baseline, current, 0.05)
    tps = result.deltas[(result.deltas["metric"] == "tokens_per_s") & (result.deltas["strategy"] == "draft")]
    assert list(tps["change"].round(6)) == [-0.08] * 3 and list(tps["noise"].round(6)) == [0.2] * 3
    assert not result.failed
    # the same drop with tight repeats is a regression
    tight = compare_frames(read_like(rows()), read_like(rows(strat_tps=(138.0,) * 3)), 0.05)
    assert tight.failed and set(tight.regressions["prompt_id"]) == set(PROMPTS)


def read_like(data):
    import pandas as pd

    return pd.DataFrame(data)


def test_unmatched_and_bad_input(tmp_path, capsys):
    base = write(tmp_path, "base", rows())
    other = write(tmp_path / "cur", "cur", rows(prompts=("gsm8k/1",)))
    code, _, err = run_cli(capsys, "compare", base, other)
    assert code == 2 and "nothing to compare: no rows match" in err
    code, _, err = run_cli(capsys, "compare", base, str(tmp_path / "missing.parquet"))
    assert code == 2 and "results path not found" in err
    code, _, err = run_cli(capsys, "compare", base, base, "--max-regression", "-1")
    assert code == 2 and "--max-regression -1" in err


def test_partial_overlap_is_noted(tmp_path, capsys):
    base = write(tmp_path, "base", rows())
    fewer = write(tmp_path / "cur", "cur", rows(prompts=PROMPTS[:2]))
    code, out, _ = run_cli(capsys, "compare", base, fewer)
    assert code == 0 and "unmatched keys: 2 only in the baseline" in out


@pytest.mark.parametrize("column, value", [("hardware", "cpu:laptop")])
def test_different_hardware_is_noted(tmp_path, capsys, column, value):
    base = write(tmp_path, "base", rows())
    moved = write(tmp_path / "cur", "cur", [{**r, column: value} for r in rows()])
    code, out, _ = run_cli(capsys, "compare", base, moved)
    assert code == 0 and "hardware differs: baseline cuda:H100 vs current cpu:laptop" in out


def test_different_settings_are_refused_unless_asked(tmp_path, capsys):
    same = {"max_new_tokens": 48, "dtype": "float32", "temperature": 0.0, "top_p": 1.0, "seed": 0, "fast": True}
    base = write(tmp_path, "base", [{**r, **same} for r in rows()])
    short = write(tmp_path / "cur", "cur", [{**r, **same, "max_new_tokens": 8, "dtype": "bfloat16"} for r in rows()])
    for a, b in ((base, short), (short, base)):  # refused both ways round, before any table
        code, out, err = run_cli(capsys, "compare", a, b)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
        assert "--max-new-tokens" in err and "--dtype" in err and "--across max-new-tokens,dtype" in err
    code, _, err = run_cli(capsys, "compare", base, short, "--across", "max-new-tokens")
    assert code == 2 and "--dtype float32 vs bfloat16" in err and "--max-new-tokens" not in err
    code, out, err = run_cli(capsys, "compare", base, short, "--across", "max-new-tokens,dtype")
    assert code == 0, err
    assert "compared across --max-new-tokens: baseline 48 vs current 8" in out
    code, _, err = run_cli(capsys, "compare", base, short, "--across", "colour")
    assert code == 2 and "unknown setting 'colour'" in err
    for column, value in (("temperature", 0.5), ("top_p", 0.9), ("seed", 3), ("fast", False)):
        moved = write(tmp_path / column, "cur", [{**r, **same, column: value} for r in rows()])
        code, _, err = run_cli(capsys, "compare", base, moved)
        assert code == 2 and f"--{column.replace('_', '-')}" in err


def test_a_low_precision_tie_passes_the_lossless_gate(tmp_path, capsys):
    base = write(tmp_path, "base", rows())
    tied = write(tmp_path / "tie", "cur", [{**r, "divergence": "tie", "divergence_gap": 0.125} if
                                           r["role"] == "strategy" else r for r in rows(lossless=False)])
    code, _, err = run_cli(capsys, "compare", base, tied)
    assert code == 0, err
    real = write(tmp_path / "real", "cur", [{**r, "divergence": "real", "divergence_gap": 4.0} if
                                            r["role"] == "strategy" else r for r in rows(lossless=False)])
    code, _, err = run_cli(capsys, "compare", base, real)
    assert code == 1 and "lossless broke on 9 row(s)" in err


def test_intervals_tell_noise_from_a_regression_across_prompts():
    import numpy as np

    prompts = tuple(f"mt-bench/{i}" for i in range(12))
    level = np.linspace(100.0, 200.0, len(prompts))
    noisy = [(0.75 * v, v, 1.25 * v) for v in level]  # each prompt's repeats spread ±25 %
    base = read_like([r for p, v in zip(prompts, noisy) for r in rows(strat_tps=v, prompts=(p,))])
    slower = read_like([r for p, v in zip(prompts, noisy) for r in rows(strat_tps=tuple(0.85 * x for x in v),
                                                                        prompts=(p,))])
    result = compare_frames(base, slower, 0.05)
    assert result.regressions.empty  # no prompt's drop beats its repeats' noise ...
    configs = result.configurations[result.configurations["strategy"] == "draft"].set_index("metric")
    assert configs.loc["tokens_per_s", "verdict"] == "regression"  # ... but 12 prompts all 15 % slower do
    assert configs.loc["tokens_per_s", "high"] < -0.05 and result.failed
    same = compare_frames(base, base, 0.05)
    assert not same.failed and set(same.configurations["verdict"]) == {"noise"}


def test_a_regression_found_by_the_interval_fails_the_cli(tmp_path, capsys):
    prompts = tuple(f"mt-bench/{i}" for i in range(8))
    base = write(tmp_path, "base", rows(strat_tps=(120.0, 150.0, 180.0), prompts=prompts))
    cur = write(tmp_path / "cur", "cur", rows(strat_tps=(102.0, 127.5, 153.0), prompts=prompts))  # -15 % each
    code, out, err = run_cli(capsys, "compare", base, cur)
    assert code == 1 and "95 % interval" in err and "lies below -5%" in err
    assert "regression" in out


def machine(hardware: str, scale: float, prompts=PROMPTS):
    """rows() on one hardware class, every tokens/s times `scale` (speedup unchanged)."""
    return [{**r, "hardware": hardware, "tokens_per_s": r["tokens_per_s"] * scale} for r in rows(prompts=prompts)]


def test_a_fleet_is_compared_per_hardware_class(tmp_path, capsys):
    """Pooled, an L4 20 % slower and an H100 20 % faster would pass (the medians over both machines move +10 %);
    matched per class, the L4 fails on its own, named, and a class without a baseline is said, not compared."""
    write(tmp_path / "fleet/h100/baseline", "b", machine("cuda:H100", 3.0))
    write(tmp_path / "fleet/l4/baseline", "b", machine("cuda:L4", 1.0))
    write(tmp_path / "fleet/h100/current", "c", machine("cuda:H100", 3.6))
    write(tmp_path / "fleet/l4/current", "c", machine("cuda:L4", 0.8))
    write(tmp_path / "fleet/a100/current", "c", machine("cuda:A100", 2.0))
    base, cur = str(tmp_path / "fleet/*/baseline"), str(tmp_path / "fleet/*/current")
    code, out, err = run_cli(capsys, "compare", base, cur, "--out", str(tmp_path / "compared"))
    assert code == 1
    assert err.startswith("error: tokens_per_s -20.0% on mt-bench/81 (autoregressive on cuda:L4)")
    assert "and 5 more" in err  # the L4's three prompts, both decodings; its speedup held, the H100 got faster
    assert "hardware cuda:A100: no baseline rows, not compared" in out
    assert "cuda:H100" in out and "cuda:L4" in out  # the table's hardware column
    import pandas as pd

    deltas = pd.read_parquet(tmp_path / "compared/compare.parquet")
    tps = deltas[deltas["metric"].eq("tokens_per_s")].set_index(["hardware", "strategy", "prompt_id"])["change"]
    assert tps.loc[("cuda:L4", "draft", "mt-bench/82")] == pytest.approx(120 / 150 - 1)
    assert tps.loc[("cuda:H100", "autoregressive", "mt-bench/83")] == pytest.approx(360 / 300 - 1)
    assert set(deltas["hardware"]) == {"cuda:H100", "cuda:L4"}
    pooled = compare_frames(read_results([tmp_path / "fleet/h100/baseline", tmp_path / "fleet/l4/baseline"])
                            .assign(hardware="one"), read_results(cur).assign(hardware="one"))
    assert not pooled.failed  # what matching across machines would have said


def test_a_pattern_that_matches_nothing_is_one_line(tmp_path, capsys):
    code, _, err = run_cli(capsys, "compare", str(tmp_path / "none/*/baseline"), str(tmp_path))
    assert code == 2 and err.strip() == f"error: no results path matches {tmp_path}/none/*/baseline"
