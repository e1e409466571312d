"""The command line: bad input gets one line and a non-zero exit; runs end to end on the embedded SmolLM2."""

from __future__ import annotations

import json
import re

import pytest
import torch

from sdbench.commands import backends
from sdbench.commands import run as benchmark
from sdbench.cli import main
from sdbench.reporting.results import read_results
from tests.conftest import run_cli

SMALL = ["--limit", "2", "--max-new-tokens", "12"]


def one_line_error(code: int, err: str) -> str:
    assert code != 0
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("argv, expect", [
    (["run", "--strategy", "nope"], "unknown strategy 'nope'"),
    (["run", "--dataset", "nope"], "unknown task 'nope'"),
    (["run", "--strategy", "draft"], "needs --draft"),
    (["run", "--set", "colour=blue"], "has no setting 'colour'"),
    (["run", "--set", "max_ngram=many"], "expected int"),
    (["run", "--set", "oops"], "expected key=value"),
    (["run", "--limit", "0"], "--limit must be at least 1"),
    (["run", "--gamma", "2,x"], "--gamma 2,x"),
    (["run", "--gamma", "-1"], "--gamma must be at least 0"),
    (["run", "--top-p", "0"], "--top-p"),
    (["run", "--dtype", "float64"], "--dtype float64"),
    (["run", "--device", "cuda:7"] if not __import__("torch").cuda.is_available() else ["run", "--device", "tpu"],
     "--device"),
    (["run", "--device", "tpu"], "--device tpu: use cpu, cuda, cuda:N or auto"),
    (["run", "--bogus"], "No such option"),
    (["run", "--resume", "no-such-run"], "no-such-run"),
    (["list", "things"], "cannot list 'things'"),
    (["report", "/nonexistent/results.parquet"], "/nonexistent"),
    (["bench", "--draft", "ngram"], "bench --draft takes a draft model"),
    (["run", "--turns", "0"], "--turns must be at least 1"),
    (["run", "--prompt-field", "q"], "apply to --dataset FILE only"),
    (["run", "--depth", "half"], "--depth half"),
    (["run", "--depth", "0.5"], "--depth applies to retrieval tasks"),
    (["run", "--dataset", "passkey"], "needs --prompt-len"),
    (["run", "--dataset", "/nonexistent/prompts.jsonl"], "/nonexistent/prompts.jsonl: no such prompt file"),
    (["report", "--by", "colour", "/nonexistent/results.parquet"], "/nonexistent"),
    (["predict", "magicdec", "--batch", "0"], "--batch 0: every value must be at least 1"),
    (["predict", "magicdec", "--context", "x"], "--context x: expected a whole number"),
    (["predict", "speedup", "--alpha", "0.5", "--gamma", "0"], "--gamma 0: every value must be at least 1"),
    (["run", "--compare", "nope"], "unknown strategy 'nope'"),
    (["run", "--compare", "ngram"], "--compare ngram: it is the run's --strategy already"),
    (["run", "--compare", "suffix", "--set", "rest.datastore=x"], "'rest' is neither --strategy nor a --compare"),
    (["run", "--compare", "suffix", "--set", "suffix.colour=blue"], "has no setting 'colour'"),
    (["run", "--compare", "draft"], "needs --draft"),
])
def test_bad_input_is_one_line(capsys, tmp_path, argv, expect):
    code, _, err = run_cli(capsys, *argv, *(["--out", str(tmp_path)] if argv[0] == "run" else []))
    assert expect in one_line_error(code, err)


def test_a_malformed_prompt_file_is_one_line_before_any_model_loads(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(backends, "load_pair", lambda *a: pytest.fail("loaded models for a bad file"))
    path = tmp_path / "mine.csv"
    path.write_text("prompt,category\nhello,chat\nbye,chat,extra\n")
    code, _, err = run_cli(capsys, "run", "--dataset", str(path), "--out", str(tmp_path))
    assert f"{path}:3: 1 more value(s)" in one_line_error(code, err)


def test_unusable_out_folder_is_one_line(capsys, tmp_path):
    a_file = tmp_path / "results"
    a_file.write_text("")
    for out, expect in ((a_file, "a file of that name exists"), ("/proc/sdbench/results", "cannot create the folder")):
        code, _, err = run_cli(capsys, "run", "--out", str(out))
        assert f"--out {out}: {expect}" in one_line_error(code, err)
        code, _, err = run_cli(capsys, "simulate", "dsi", "--grid", "2", "--repeats", "1", "--out", str(out))
        assert expect in one_line_error(code, err)


def test_report_refuses_a_foreign_parquet(capsys, tmp_path):
    import pandas as pd

    foreign = tmp_path / "other.parquet"
    pd.DataFrame({"city": ["Oslo"], "population": [709_000]}).to_parquet(foreign)
    code, _, err = run_cli(capsys, "report", str(foreign))
    assert "is not an sdbench results file" in one_line_error(code, err)


def test_predict_speedup_at_full_acceptance(capsys):
    code, out, _ = run_cli(capsys, "predict", "speedup", "--alpha", "1", "--gamma", "4", "--draft-cost", "0")
    assert code == 0
    assert "5.00" in out and "5.00x" in out  # every draft accepted: Omega = gamma + 1, at no drafting cost


def test_unknown_model_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli(capsys, "run", "--target", "no-org/no-such-model", "--out", str(tmp_path))
    assert "no-org/no-such-model" in one_line_error(code, err)


def test_run_passes_settings_to_the_engine(capsys, monkeypatch):
    seen = {}

    class FakeHarness:
        def __init__(self, cfg, console):
            seen["cfg"] = cfg

        def run(self):
            raise SystemExit(0)

    monkeypatch.setattr(benchmark, "RunHarness", FakeHarness)
    run_cli(capsys, "run", "--target", "m", "--draft", "d1", "--draft", "d2", "--strategy", "ngram", "--gamma", "3",
            "--set", "max_ngram=2", "--temperature", "0.5", "--top-p", "0.9", "--seed", "4", "--batch-size", "2",
            "--prompt-len", "100", "--dataset", "kjv", "--no-baseline", "--repeats", "3", "--dtype", "bfloat16",
            "--turns", "1", "--prompt-field", "ask", "--id-field", "key", "--depth", "0,0.5")
    cfg = seen["cfg"]
    assert (cfg.target, cfg.drafts, cfg.strategy, cfg.gammas) == ("m", ("d1", "d2"), "ngram", (3,))
    assert cfg.options == {"max_ngram": "2"}
    assert (cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.seed) == (0.5, 0.9, 4)
    assert (cfg.batch_size, cfg.prompt_len, cfg.dataset, cfg.baseline, cfg.repeats, cfg.dtype) == (
        2, 100, "kjv", False, 3, "bfloat16")
    assert (cfg.turns, cfg.fields, cfg.depths) == (1, {"prompt": "ask", "id": "key"}, (0.0, 0.5))
    assert cfg.compare == {}
    run_cli(capsys, "run", "--strategy", "ngram", "--compare", "suffix,rest", "--compare", "draft", "--set",
            "max_ngram=2", "--set", "ngram.min_ngram=1", "--set", "rest.datastore=books", "--set", "suffix.tree=1")
    cfg = seen["cfg"]
    assert cfg.options == {"max_ngram": "2", "min_ngram": "1"}
    assert list(cfg.compare.items()) == [("suffix", {"tree": "1"}), ("rest", {"datastore": "books"}), ("draft", {})]


def test_list_commands(capsys):
    for what, expect in (("strategies", "ngram"), ("datasets", "mt-bench"), ("models", "smollm2-135m")):
        code, out, _ = run_cli(capsys, "list", what)
        assert code == 0 and expect in out


@pytest.mark.slow
def test_run_end_to_end_self_draft_both_turns(capsys, tmp_path):
    code, out, err = run_cli(capsys, "run", "--strategy", "draft", "--draft", "smollm2-135m", "--gamma", "3",
                             *SMALL, "--out", str(tmp_path))
    assert code == 0, err
    df = read_results([tmp_path])
    assert len(df) == 8 and set(df["role"]) == {"baseline", "strategy"} and sorted(set(df["turn"])) == [1, 2]
    assert df["lossless"].dropna().all() and df["lossless"].notna().sum() == 8
    strat = df[df["role"] == "strategy"]
    # the target drafting for itself is always right
    assert (strat["accepted"] == strat["drafted"]).all() and (strat["mean_accepted_len"] > 3.0).all()
    base = df[df["role"] == "baseline"].set_index(["prompt_id", "turn"])
    for _, row in strat.iterrows():
        assert list(row["output_ids"]) == list(base.loc[(row["prompt_id"], row["turn"]), "output_ids"])
        assert row["new_tokens"] == len(row["output_ids"])
        assert row["prompt_tokens"] == base.loc[(row["prompt_id"], row["turn"]), "prompt_tokens"]
    # the second turn's prompt holds the first turn and its answer
    first, second = (base.xs(t, level="turn")["prompt_tokens"] for t in (1, 2))
    assert (second > first + 12).all() and df.groupby(["turn", "role"])["batch_id"].nunique().eq(2).all()
    assert "by turn" in out
    assert df["dataset"].iloc[0] == "mt-bench" and df["device"].iloc[0] == ("cuda" if torch.cuda.is_available() else "cpu")  # --device auto
    assert "ALL" in out and "lossless" in out
    code, out, _ = run_cli(capsys, "report", str(tmp_path))
    assert code == 0 and "draft" in out


@pytest.mark.slow
def test_run_compares_strategies_in_one_interleaved_run(capsys, tmp_path):
    """--compare: every strategy decodes the same batches beside the baseline, each row naming its own strategy and
    settings; all of them lossless against the baseline."""
    code, out, err = run_cli(capsys, "run", "--strategy", "ngram", "--compare", "suffix", "--compare", "draft",
                             "--draft", "smollm2-135m", "--set", "suffix.tree=1", "--gamma", "3", *SMALL, "--turns",
                             "1", "--out", str(tmp_path))
    assert code == 0, err
    df = read_results([tmp_path])
    assert set(df["role"]) == {"baseline", "strategy", "compare-suffix", "compare-draft"} and len(df) == 8
    assert dict(zip(df["role"], df["strategy"])) == {"baseline": "autoregressive", "strategy": "ngram",
                                                     "compare-suffix": "suffix", "compare-draft": "draft"}
    assert df["lossless"].all() and (df.groupby("role")["prompt_id"].nunique() == 2).all()
    suffix = df[df["role"] == "compare-suffix"]
    assert (suffix["gamma"] == 3).all() and all(json.loads(p)["tree"] is True for p in suffix["params"])
    draft = df[df["role"] == "compare-draft"]
    assert (draft["accepted"] == draft["drafted"]).all()  # the target drafting for itself
    for name in ("ngram", "suffix", "draft"):
        assert re.search(rf"\b{name}\b", out)


@pytest.mark.slow
def test_run_batched_ngram_and_long_context(capsys, tmp_path):
    code, _, err = run_cli(capsys, "run", "--strategy", "ngram", "--batch-size", "2", "--dataset", "pg19",
                           "--prompt-len", "200", *SMALL, "--out", str(tmp_path))
    assert code == 0, err
    df = read_results([tmp_path])
    assert (df["prompt_tokens"] == 200).all() and (df["batch_size"] == 2).all()
    assert df["batch_id"].nunique() == 1 and df["lossless"].all()
    assert df["dataset"].iloc[0] == "kjv-bible (PG-19 stand-in)"


@pytest.mark.slow
def test_interrupted_run_keeps_finished_batches_and_resumes(capsys, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = benchmark.decode

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:  # warm-up (2 calls) and the first batch (2) finish; the second batch is cut
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(benchmark, "decode", flaky)
    code, _, err = run_cli(capsys, "run", *SMALL, "--turns", "1", "--out", str(tmp_path))
    line = one_line_error(code, err)
    assert "interrupted" in line and "--resume" in line
    run_id = line.split("--resume ")[1].split()[0]
    assert len(read_results([tmp_path])) == 2  # baseline and strategy rows of the finished batch
    code, _, err = run_cli(capsys, "run", "--resume", run_id, "--out", str(tmp_path))
    assert code == 0, err
    df = read_results([tmp_path])
    assert len(df) == 4 and df["prompt_id"].nunique() == 2 and (df["run_id"] == run_id).all()


@pytest.mark.slow
def test_run_a_spec_bench_format_file_batched_both_turns(capsys, tmp_path):
    import json

    records = [{"question_id": 1, "category": "writing", "turns": ["Write one line about rain.", "Now about snow."]},
               {"question_id": 2, "category": "translation", "turns": ["Translate 'good morning' into French."]},
               {"question_id": 3, "category": "qa", "turns": ["What is the capital of Italy?"]}]
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out, err = run_cli(capsys, "run", "--dataset", str(path), "--strategy", "ngram", "--limit", "3",
                             "--batch-size", "2", "--max-new-tokens", "8", "--out", str(tmp_path / "out"))
    assert code == 0, err
    df = read_results([tmp_path / "out"])
    assert set(df["category"]) == {"writing", "translation", "qa"} and set(df["dataset"]) == {"question.jsonl"}
    assert sorted(df.loc[df["turn"] == 2, "prompt_id"].unique()) == ["question/1"] and df["lossless"].all()
    assert "by turn" in out and "translation" in out


@pytest.mark.slow
def test_run_passkey_with_magicdec(capsys, tmp_path):
    code, out, err = run_cli(capsys, "run", "--dataset", "passkey", "--prompt-len", "512", "--strategy", "magicdec",
                             "--set", "budget=128", "--limit", "1", "--max-new-tokens", "8", "--out", str(tmp_path))
    assert code == 0, err
    df = read_results([tmp_path])
    assert (df["prompt_tokens"] == 512).all() and (df["depth"] == 0.5).all() and df["lossless"].all()
    assert df["found"].notna().all() and df["found"].nunique() == 1  # the same output on both sides
    assert df["dataset"].iloc[0] == "passkey in kjv-bible (PG-19 stand-in)" and "Answer found" in out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["process", "ray"])
def test_dsi_with_the_fast_path_end_to_end(capsys, tmp_path, request, backend):
    """DSI with the defaults (fast path on), in worker processes and on Ray's local cluster: the workers build
    their own fast path from the plain weights they receive."""
    import json

    from sdbench.dsi.pools import shutdown_pools

    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    try:
        code, _, err = run_cli(capsys, "run", "--target", "smollm2-135m", "--draft", "smollm2-135m", "--strategy",
                               "dsi", "--set", "workers=2", "--set", f"backend={backend}", "--limit", "1",
                               "--max-new-tokens", "16", "--turns", "1", "--out", str(tmp_path))
    finally:
        shutdown_pools()
    assert code == 0, err
    df = read_results([tmp_path])
    assert df["fast"].all() and df["lossless"].notna().all() and df["lossless"].all() and len(df) == 2
    stats = json.loads(df[df["role"] == "strategy"]["strategy_stats"].iloc[0])
    assert stats["workers"] == 2 and stats["backend"] == backend
    assert len(stats["busy"]) == 2 and all(0.0 <= b <= 1.0 for b in stats["busy"]) and sum(stats["busy"]) > 0


@pytest.mark.slow
def test_magicdec_budget_over_the_context_is_told(capsys, tmp_path):
    code, out, err = run_cli(capsys, "run", "--strategy", "magicdec", "--set", "budget=4096", "--limit", "1",
                             "--max-new-tokens", "4", "--no-baseline", "--turns", "1", "--out", str(tmp_path))
    assert code == 0, err
    assert "note: magicdec: --set budget=4096 is at least the longest context" in out
    assert "plain self-speculation with a full cache" in out


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_run_stopped_by_a_signal_resumes_to_every_prompt_once(tmp_path, sig):
    """A real signal after the first batch is written: SIGINT (and SIGTERM, taken as it) finalizes what finished,
    SIGKILL gets no chance to clean up; either way --resume completes the run with every prompt exactly once per
    role and repeat."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo)}
    run = ["run", "--limit", "3", "--max-new-tokens", "16", "--repeats", "2", "--turns", "1", "--out", str(tmp_path)]
    ready = tmp_path.parent / f"{tmp_path.name}.second-batch"
    # the run as the user starts it, except that once its first part is on disk, its next generation says so in
    # a file and waits there for the signal: the signal lands mid-batch by an event, not by a race against a sleep
    # SIGINT as Ctrl-C delivers it to a run in a terminal: a shell starts background jobs (CI's among them) with
    # SIGINT ignored, and a child keeps that, so the run puts Python's own handler back first
    hold = (f"import pathlib, signal, time; import sdbench.commands.run as r; real = r.decode\n"
            f"signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            f"def held(*a, **k):\n"
            f"    if list(pathlib.Path({str(tmp_path)!r}).glob('*.parts/part-*.parquet')):\n"
            f"        pathlib.Path({str(ready)!r}).touch()\n"
            f"        time.sleep(600)\n"
            f"    return real(*a, **k)\n"
            f"r.decode = held\n"
            f"from sdbench.cli import main; main({run!r})\n")
    proc = subprocess.Popen([sys.executable, "-c", hold], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900  # a hang guard only
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run never reached its second batch: {proc.communicate()[1][-2000:]}")
        time.sleep(0.1)
    proc.send_signal(getattr(signal, sig))
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode != 0, err
    if sig != "SIGKILL":
        assert "interrupted" in err and "--resume" in err
    argv = [sys.executable, "-m", "sdbench"]
    run_id = next(tmp_path.glob("*.config.json")).name[: -len(".config.json")]
    done = read_results([tmp_path])
    assert 0 < len(done) < 12
    code = subprocess.run([*argv[:3], "run", "--resume", run_id, "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True)
    assert code.returncode == 0, code.stderr
    df = read_results([tmp_path / f"{run_id}.parquet"])
    assert len(df) == 12 and not df.duplicated(["role", "prompt_id", "repeat"]).any()
    assert set(df["role"]) == {"baseline", "strategy"} and df["prompt_id"].nunique() == 3
    assert df["lossless"].all() and not (tmp_path / f"{run_id}.parts").exists()


@pytest.fixture
def narrow_target(tmp_path, monkeypatch):
    """A target that knows 64 of its tokenizer's 96 tokens, a draft that knows them all, and a prompt with a token
    only the draft knows: the DSI workers' forwards fail, the drafter's do not."""
    from transformers import AutoModelForCausalLM

    from tests.references import tiny_model_dir

    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    tiny_model_dir(tmp_path / "draft", seed=1)
    tiny_model_dir(tmp_path / "target")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    model.resize_token_embeddings(64)
    model.save_pretrained(tmp_path / "target")
    (tmp_path / "p.csv").write_text('prompt\n"w1 w2 w80 w3"\n')
    return ["run", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--strategy", "dsi",
            "--set", "workers=2", "--dataset", str(tmp_path / "p.csv"), "--limit", "1", "--max-new-tokens", "4",
            "--no-baseline", "--out", str(tmp_path / "out")]


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_failed_dsi_worker_is_one_line_naming_it(capsys, narrow_target):
    from sdbench.dsi.pools import shutdown_pools

    capsys.readouterr()
    try:
        code, _, err = run_cli(capsys, *narrow_target)
    finally:
        shutdown_pools()
    assert code == 2
    assert re.fullmatch(r"error: DSI worker [01] failed: IndexError: index out of range in self", _one_line(err))


def test_a_missing_package_is_one_line_with_its_install_command(capsys, narrow_target, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    capsys.readouterr()
    code, _, err = run_cli(capsys, *narrow_target, "--set", "backend=ray")
    assert code == 2
    line = _one_line(err)
    assert "the DSI Ray backend needs the package 'ray'" in line and "pip install 'sdbench[ray]'" in line, line
