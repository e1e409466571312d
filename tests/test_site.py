"""`sdbench site`: the leaderboard's figures against the rows computed by hand, the command that reruns a run
through the real command line, every kind of results file on its page, and bad input as one line."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pandas as pd
import pytest

from sdbench import config as C
from sdbench.reporting.site.assets import as_plain_script
from sdbench.reporting.site.command import run_arguments
from sdbench.reporting.results import read_results
from tests.conftest import run_cli
from tests.references import tiny_model_dir
from tests.site_data import expected, other_kinds, run_rows, table_rows, write_run


def test_leaderboard_figures_are_the_rows_own(tmp_path, capsys):
    rows_a = run_rows("ngram", "cpu:machine-a", 1.5)
    rows_b = [{**r, "params": '{"kv": "snapkv", "gamma": 4, "budget": 64}'} if r["role"] == "strategy" else r
              for r in run_rows("magicdec", "cuda:machine-b", 2.0)]
    write_run(tmp_path / "results", "run-a", rows_a)
    write_run(tmp_path / "results", "run-b", rows_b)
    code, out, err = run_cli(capsys, "site", str(tmp_path / "results"), "--out", str(tmp_path / "site"))
    assert code == 0, err
    assert "site: 2 runs" in out
    board = pd.read_csv(tmp_path / "site" / "data" / "leaderboard.csv")
    overall = board[(board["category"] == "ALL") & (board["turn"] == "ALL")].set_index("run_id")
    assert set(overall["hardware"]) == {"cpu:machine-a", "cuda:machine-b"}  # one row per machine: never pooled
    for run_id, rows in (("run-a", rows_a), ("run-b", rows_b)):
        want = expected(rows)
        got = overall.loc[run_id]
        for name in ("speedup", "mean_accepted_len", "acceptance_rate", "tokens_per_s"):
            assert got[name] == pytest.approx(want[name], rel=1e-9), name
        assert [float(x) for x in got["acceptance_by_position"].split()] == pytest.approx(want["by_position"],
                                                                                        abs=5e-4)
        assert got["speedup_low"] < got["speedup"] < got["speedup_high"]
        assert got["gamma"] == 4 and got["dataset"] == "mt-bench" and got["n_prompts"] == 3
    assert overall.loc["run-b", "settings"] == "budget=64 kv=snapkv" and pd.isna(overall.loc["run-a", "settings"])
    math_rows = [r for r in rows_a if r["category"] == "math"]
    math_row = board[(board["run_id"] == "run-a") & (board["category"] == "math")].iloc[0]
    assert math_row["speedup"] == pytest.approx(expected(math_rows)["speedup"], rel=1e-9)


def test_run_page_names_the_command_that_reruns_it(tmp_path, capsys, monkeypatch):
    """The command shown on a run's page, parsed by the real `sdbench run`, gives back the saved configuration."""
    cfg = C.RunConfig(target="qwen2.5-coder-1.5b", drafts=("qwen2.5-coder-0.5b",), strategy="draft", dataset="gsm8k",
                      limit=7, max_new_tokens=33, batch_size=2, sampling=C.SamplingConfig(0.7, 0.9, 5),
                      gammas=(2, 4), device="cpu", dtype="bfloat16", repeats=3, options={"draft_kv": "snapkv"},
                      out=str(tmp_path / "o"), baseline=False, fast=False, turns=1, probe="never",
                      request_rates=(2.0, math.inf), concurrencies=(4,), slo={"ttft": 500.0},
                      compare={"ngram": {"max_ngram": "4"}}, fields={"prompt": "q"}, depths=(0.25,))
    captured = {}

    class Harness:
        def __init__(self, given, console):
            captured["cfg"] = given
            raise SystemExit(0)

    monkeypatch.setattr("sdbench.commands.run.RunHarness", Harness)
    code, _, err = run_cli(capsys, "run", *run_arguments(asdict(cfg)))
    assert code == 0, err
    assert asdict(captured["cfg"]) == asdict(cfg)
    write_run(tmp_path / "r", "run-c", run_rows("draft", "cpu:m", 1.3), config=asdict(cfg))
    assert run_cli(capsys, "site", str(tmp_path / "r"), "--out", str(tmp_path / "s"))[0] == 0
    page = (tmp_path / "s" / "runs" / "run-c.html").read_text()
    assert "sdbench run --target qwen2.5-coder-1.5b --strategy draft --dataset gsm8k" in page
    assert (tmp_path / "s" / "data" / "runs" / "run-c.parquet").is_file()
    assert pd.read_parquet(tmp_path / "s" / "data" / "runs" / "run-c.parquet")["prompt_id"].nunique() == 3


def test_every_kind_of_results_file_has_its_page(tmp_path, capsys):
    other_kinds(tmp_path / "results")
    code, out, err = run_cli(capsys, "site", str(tmp_path / "results"), "--out", str(tmp_path / "site"))
    assert code == 0, err
    site = tmp_path / "site"
    sweeps = (site / "sweeps.html").read_text()
    assert "Where speculative decoding stops paying" in sweeps and "heatmap" in sweeps
    studies = (site / "studies.html").read_text()
    assert "Study s1" in studies and "3 trials, 2 complete" in studies
    best = table_rows(studies, "best-per-batch")
    assert [(r["batch_size"], r["trial"], r["value"], r["gamma"]) for r in best] == [("2", "1", "1.5", "4")]
    engines = (site / "engines.html").read_text()
    assert "llama.cpp ngram" in engines and (site / "data" / "engines" / "0-bench.parquet").is_file()
    repro = (site / "reproductions.html").read_text()
    assert "speedup grows with batch" in repro
    assert (site / "reproductions" / "0-repro-magicdec" / "report.html").is_file()
    compared = (site / "comparisons.html").read_text()
    assert "6 of 9 matched comparisons regressed" in compared and "gate-current.parquet" in compared


def test_compare_out_keeps_a_failing_gates_record(tmp_path, capsys):
    base = write_run(tmp_path, "base", run_rows("ngram", "cpu:m", 1.5))
    current = write_run(tmp_path, "current", run_rows("ngram", "cpu:m", 1.0))
    code, out, err = run_cli(capsys, "compare", str(base), str(current), "--out", str(tmp_path / "cmp"))
    assert code == 1 and "-33.3% on p1" in err and "and 5 more" in err
    deltas = pd.read_parquet(tmp_path / "cmp" / "compare.parquet")
    speed = deltas[deltas["metric"] == "speedup"]
    assert len(speed) == 3 and speed["regressed"].all()
    assert speed["change"].to_numpy() == pytest.approx(1.0 / 1.5 - 1, rel=1e-9)  # the strategy's wall times x 1.5
    configs = pd.read_parquet(tmp_path / "cmp" / "compare-configurations.parquet")
    assert set(configs.loc[configs["metric"] == "speedup", "verdict"]) == {"too few prompts"}  # 3 prompts


def test_problems_are_said_on_the_terminal_and_the_page(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, out, err = run_cli(capsys, "site", str(tmp_path / "empty"), "--out", str(tmp_path / "s0"))
    assert code == 0, err
    assert "site: no runs found under" in out
    assert "no runs found under" in (tmp_path / "s0" / "index.html").read_text()
    results = tmp_path / "results"
    write_run(results, "run-ok", run_rows("ngram", "cpu:m", 1.4))
    write_run(results, "run-cut", run_rows("suffix", "cpu:m", 1.2), finish=False)
    (results / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    code, out, err = run_cli(capsys, "site", str(results), "--out", str(tmp_path / "s1"))
    assert code == 0, err
    lines = [line for line in out.splitlines() if "broken.parquet" in line]
    assert len(lines) == 1 and "cannot be read as Parquet" in lines[0]
    index = (tmp_path / "s1" / "index.html").read_text()
    assert "broken.parquet" in index and "run run-cut stopped before its end: RuntimeError: out of memory" in index
    assert "partial run" in index
    assert "this run stopped before its end" in (tmp_path / "s1" / "runs" / "run-cut.html").read_text()


def test_bad_input_is_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(capsys, "site", str(tmp_path / "nowhere"), "--out", str(tmp_path / "s"))
    assert code != 0 and "results path not found" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()
    (tmp_path / "r").mkdir()
    (tmp_path / "file").write_text("x")
    code, out, err = run_cli(capsys, "site", str(tmp_path / "r"), "--out", str(tmp_path / "file"))
    assert code != 0 and "a file of that name exists" in err and "Traceback" not in err
    real = __import__("importlib").util.find_spec
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "plotly" else real(name, *a))
    code, out, err = run_cli(capsys, "site", str(tmp_path / "r"), "--out", str(tmp_path / "s2"))
    assert code != 0 and "pip install 'sdbench[site]'" in err and not (tmp_path / "s2").exists()


def test_the_tables_bundle_loads_as_a_plain_script():
    module = "var a=1;function b(){return 'export{x}'}export{a as DataTable,b as default};\n/*! licence */\n"
    script = as_plain_script(module)
    assert script.startswith("var a=1;function b(){return 'export{x}'}")
    assert "window.sdbenchTables = {DataTable: a, default: b};" in script and script.endswith("/*! licence */\n")


def test_report_of_several_machines_names_each_rows_hardware(tmp_path, capsys):
    """Folders of two machines read together: every summary row says which machine it ran on."""
    write_run(tmp_path / "cpu", "run-cpu", run_rows("ngram", "cpu:machine-a", 1.5))
    write_run(tmp_path / "gpu", "run-gpu", run_rows("ngram", "cuda:machine-b", 2.0))
    code, out, err = run_cli(capsys, "report", str(tmp_path / "cpu"), str(tmp_path / "gpu"))
    assert code == 0, err
    header = next(line for line in out.splitlines() if "hardware" in line and "strategy" in line)
    assert header.index("run") < header.index("hardware") < header.index("strategy")
    for run_id, machine in (("run-cpu", "cpu:machine-a"), ("run-gpu", "cuda:machine-b")):
        rows = [line for line in out.splitlines() if run_id in line and "x ±" in line]  # the summary's rows
        assert rows and all(machine in line for line in rows), out
    code, out, err = run_cli(capsys, "report", str(tmp_path / "cpu"))
    assert code == 0 and not any("hardware" in line and "strategy" in line for line in out.splitlines())


def test_a_run_served_under_load_has_its_serving_table(tmp_path, capsys, monkeypatch):
    """A real `run --concurrency` on a tiny model: its page shows output tokens/s over the baseline's on the same
    arrivals, which is the rows' new tokens over each role's serving time, by hand; the leaderboard leaves it out."""
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [f"w{i} w3 w{i} w3 w{i} w3"]})
                            + "\n" for i in range(4)))
    code, _, err = run_cli(capsys, "run", "--target", str(tiny_model_dir(tmp_path / "tiny")), "--strategy", "ngram",
                           "--dataset", str(data), "--limit", "4", "--max-new-tokens", "8", "--device", "cpu",
                           "--no-probe", "--concurrency", "2", "--out", str(tmp_path / "r"))
    assert code == 0, err
    code, _, err = run_cli(capsys, "site", str(tmp_path / "r"), "--out", str(tmp_path / "s"))
    assert code == 0, err
    (page,) = (tmp_path / "s" / "runs").glob("*.html")
    served = table_rows(page.read_text(), "served")
    rows = read_results([tmp_path / "r"])
    rate = {role: g["new_tokens"].sum() / g["duration_s"].iloc[0] for role, g in rows.groupby("role")}
    (strategy,) = [r for r in served if r["strategy"] != "baseline"]
    want = rate["strategy"] / rate["baseline"]
    assert float(strategy["vs_baseline"]) == pytest.approx(want, rel=5e-3)  # shown to 3 digits
    assert strategy["concurrency"] == "2" and strategy["completed"] == "4"
    assert not table_rows((tmp_path / "s" / "index.html").read_text(), "leaderboard")
