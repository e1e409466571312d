"""`predict magicdec` at a real model's shape: MODEL@random (shrunk here), with alpha given or fitted to real
runs, over the (batch, context) points that fit beside the weights, estimated before anything is allocated."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from sdbench.analysis.costs import alphas_from_results
from sdbench.errors import SdbenchError
from sdbench.models.loading import memory
from sdbench.models.loading.loader import load_config
from sdbench.models.loading.shapes import parameter_count, shrink
from sdbench.reporting.writer import RunWriter
from tests.conftest import run_cli
from tests.test_random_weights import SMALL_VOCAB, small  # noqa: F401 (fixture)

ARGS = ["predict", "magicdec", "--target", "llama-1b@random", "--batch", "1,2", "--context", "64,128",
        "--budget", "16,32", "--gamma", "1,2", "--alpha", "0.7", "--device", "cpu"]


def test_kv_bytes_by_hand():
    config = load_config("llama-8b")  # 32 layers, 8 key/value heads of 128
    assert memory.kv_bytes(config, batch=2, capacity=1000, dtype=torch.bfloat16) == 2 * 32 * 2 * 8 * 128 * 1000 * 2
    assert memory.working_bytes(config, 1, 1000, 5) == 4 * 5 * (128256 + 32 * 1000)


def omega(alpha: float, gamma: int) -> float:
    """Expected tokens per step under i.i.d. acceptance, summed by hand: 1 + alpha + ... + alpha^gamma."""
    return sum(alpha**i for i in range(gamma + 1))


def table_rows(out: str, cells: int) -> list[list[str]]:
    """The body rows of the printed tables that have `cells` cells, as stripped strings."""
    rows = [[c.strip() for c in line.strip().strip("│").split("│")] for line in out.splitlines()
            if line.lstrip().startswith("│")]
    return [r for r in rows if len(r) == cells]


def assert_predict_magicdec_output(out: str, df) -> None:
    """`predict magicdec`'s printed figures recomputed from its Parquet profile: each row's predicted speedup
    Omega(gamma, alpha) / (gamma T_D / T_T + T_V / T_T), the best setting printed per (batch, context), and the
    first context per batch whose best exceeds 1."""
    for r in df.itertuples():
        by_hand = omega(r.alpha, r.gamma) / (r.gamma * r.draft_ms / r.target_ms + r.verify_ms / r.target_ms)
        assert r.predicted_speedup == pytest.approx(by_hand)
    best = df.loc[df.groupby(["batch", "context"])["predicted_speedup"].idxmax()]
    printed = {(int(r[0]), int(r[1])): r for r in table_rows(out, 10) if r[0].isdigit()}
    assert set(printed) == set(zip(best["batch"], best["context"]))
    for r in best.itertuples():
        row = printed[(r.batch, r.context)]
        assert row[5:8] == [str(r.gamma), str(r.budget), r.selector] and row[9] == f"{r.predicted_speedup:.2f}x"
        assert row[2:5] == [f"{r.target_ms:.1f}", f"{r.draft_ms:.1f}", f"{r.verify_ms:.1f}"]
    critical = {int(r[0]): r[1] for r in table_rows(out, 3) if r[0].isdigit()}
    for batch, group in best.groupby("batch"):
        winning = group.loc[group["predicted_speedup"] > 1.0, "context"]
        assert critical[batch] == (str(winning.min()) if len(winning) else f"> {df['context'].max()}")


def _needs(capacity) -> tuple[int, dict]:
    config = shrink(load_config("llama-1b"), vocab=SMALL_VOCAB)
    weights = parameter_count(config) * 4
    needs = {(b, s): memory.kv_bytes(config, b, capacity(s), torch.float32) + memory.working_bytes(config, b, s, 3)
             for b in (1, 2) for s in (64, 128)}
    return weights, needs


def test_predict_at_random_profiles_what_fits_and_says_what_does_not(small, capsys, tmp_path, monkeypatch):  # noqa: F811
    from sdbench.engine.state import needed_capacity

    weights, needs = _needs(lambda s: needed_capacity(s, 0, 2))
    assert max(needs, key=needs.get) == (2, 128)
    room = weights + max(v for k, v in needs.items() if k != (2, 128))
    monkeypatch.setattr(memory, "free_bytes", lambda device: int(room / memory.HEADROOM) + 1)
    code, out, err = run_cli(capsys, *ARGS, "--out", str(tmp_path))
    assert code == 0, err
    assert "note: not profiled, as they do not fit" in out and "batch 2 from context 128" in out
    assert "critical sequence length" in out
    df = pd.read_parquet(next(tmp_path.glob("predict-magicdec-*.parquet")))
    assert set(zip(df["batch"], df["context"])) == {(1, 64), (1, 128), (2, 64)}
    assert set(df["weights"]) == {"random"} and (df["alpha"] == 0.7).all()
    assert set(df["gamma"]) == {1, 2} and set(df["budget"]) == {16, 32}
    assert_predict_magicdec_output(out, df)


def test_weights_that_do_not_fit_are_refused_before_loading(small, capsys, monkeypatch):  # noqa: F811
    import sdbench.models.loading.loader as loader

    monkeypatch.setattr(memory, "free_bytes", lambda device: 1000)
    monkeypatch.setattr(loader, "load_model", lambda *a: pytest.fail("loaded a model that cannot fit"))
    code, _, err = run_cli(capsys, *ARGS)
    assert code == 2 and err.count("\n") == 1
    assert "llama-1b@random: its weights take" in err and "nothing can be profiled" in err


def _magicdec_rows(weights: str | None) -> list[dict]:
    return [{"role": "strategy", "strategy": "magicdec", "prompt_id": f"p{i}", "repeat": 0, "batch_id": i,
             "params": '{"budget": 64, "gamma": 4, "kv": "streamingllm"}', "steps": 10, "new_tokens": 31,
             "prompt_tokens": 512, "weights": weights} for i in range(2)]


def test_alpha_from_runs_leaves_random_weights_out(tmp_path, capsys):
    from rich.console import Console

    writer = RunWriter(tmp_path, "mixed")
    writer.append(_magicdec_rows("random") + [{**r, "prompt_id": "q" + r["prompt_id"]} for r in _magicdec_rows(None)])
    path = str(writer.finalize())
    measured = alphas_from_results([path], console=Console())
    assert set(measured) == {("streamingllm", 64, 512)}
    assert "2 magicdec row(s) with random weights left out" in capsys.readouterr().out
    writer = RunWriter(tmp_path / "r", "random")
    writer.append(_magicdec_rows("random"))
    with pytest.raises(SdbenchError, match="every magicdec row has random weights"):
        alphas_from_results([str(writer.finalize())])


def test_predict_speedup_takes_its_costs_from_a_model_at_random(small, capsys):  # noqa: F811
    code, out, err = run_cli(capsys, "predict", "speedup", "--alpha", "0.8", "--gamma", "1,3",
                             "--target", "llama-8b@random", "--draft", "llama-1b@random", "--context", "32",
                             "--device", "cpu")
    assert code == 0, err
    import re

    c = float(re.search(r"costs measured at 32 tokens of context: draft cost c = ([\d.]+) ", out).group(1))
    rows = table_rows(out, 5)[-2:]  # gamma, tokens/step, verify cost, overhead, speedup
    assert [r[0].rstrip(" *") for r in rows] == ["1", "3"] and sum(r[0].endswith("*") for r in rows) == 1
    speedups = []
    for r in rows:
        gamma, v, h = int(r[0].rstrip(" *")), float(r[2]), float(r[3])
        assert r[1] == f"{omega(0.8, gamma):.2f}" and h >= 0
        # the speedup from the printed c (3 decimals), v (2) and the overhead h (3): within their rounding
        s = float(r[4].rstrip("x"))
        low = omega(0.8, gamma) / (gamma * (c + 5e-4) + v + 5e-3 + h + 5e-4)
        high = omega(0.8, gamma) / (gamma * max(c - 5e-4, 0) + v - 5e-3 + max(h - 5e-4, 0))
        assert low - 5e-3 <= s <= high + 5e-3, (r, c)
        speedups.append(s)
    assert rows[speedups.index(max(speedups))][0].endswith("*")  # the best gamma is marked


def test_step_costs_are_timed_interleaved_so_a_burst_keeps_their_ratios(monkeypatch):
    """Three calls costing 1, 2 and 5 units on a clock of our own, and a burst of other work that triples whatever
    runs during the second to fourth repetitions: timed one after another, the burst would fall on one call's
    median; interleaved, every median takes it and the ratios stay exact."""
    from sdbench.analysis import costs

    clock = {"t": 0.0, "calls": 0}
    order = []

    def call(key, cost):
        def fn():
            order.append(key)
            clock["calls"] += 1
            rep = (clock["calls"] - 1) // 3 - 2  # two warm-up rounds of the three calls, then the repetitions
            clock["t"] += cost * (3 if 1 <= rep <= 3 else 1)
        return fn

    monkeypatch.setattr(costs, "now", lambda device=None: clock["t"])
    t = costs.median_times({"a": call("a", 1.0), "b": call("b", 2.0), "c": call("c", 5.0)}, "cpu", reps=5, warmup=2)
    assert order == ["a", "b", "c"] * 7
    assert t == {"a": 3.0, "b": 6.0, "c": 15.0} and t["c"] / t["a"] == 5.0
