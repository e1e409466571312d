"""`sdbench bench`'s measuring loop, cost ratios and Parquet output, on fake systems and tiny models."""

import pandas as pd
import pytest

from sdbench.models.runner import ModelRunner
from sdbench.commands.bench import Measured, _measure, _table, cost_ratios, write_bench
from tests.conftest import run_cli, tiny_model


class _Status:
    def update(self, text: str) -> None:
        pass


def test_measure_readies_weights_before_each_clock_and_keeps_repeats():
    calls = []

    def system(name):
        def fn(prompt, budget):
            calls.append(name)
            return prompt[: budget or 3]
        return fn

    weights = []
    systems = [("transformers a", system("a"), False), ("sdbench b", system("b"), True),
               ("transformers c", system("c"), False)]
    results = _measure(systems, [[1, 2, 3, 4], [5, 6, 7]], 2, "cpu", _Status(), weights.append)
    assert [len(m.tokens) for m in results] == [2, 2, 2] and results[1].tokens == [6, 6]
    # per prompt the plain-weight systems run first: the weights change twice a prompt, not per system
    assert calls[3:6] == ["a", "c", "b"] and weights[3:6] == [False, False, True]
    assert all(m.outputs == [[1, 2, 3], [5, 6, 7]] for m in results)
    table = _table(results, 10.0, "t")
    assert table.row_count == 3


def test_write_bench_has_one_row_per_system_and_repeat(tmp_path):
    results = [Measured("transformers generate", False, [10, 12], [1.0, 2.0], [[1]]),
               Measured("sdbench autoregressive (fast)", True, [10, 12], [0.5, 1.0], [[2]])]
    path = write_bench(results, str(tmp_path), {"model": "m", "draft": "d", "dataset": "x", "device": "cpu",
                                                "dtype": "float32", "verify_cost": 1.2, "draft_cost": 0.3})
    df = pd.read_parquet(path)
    assert len(df) == 4
    for col in ("system", "model", "draft", "dataset", "tokens", "seconds", "tokens_per_s", "same_output",
                "torch_version", "hardware", "repeat"):
        assert col in df.columns
    assert list(df.tokens_per_s) == [10.0, 6.0, 20.0, 12.0]
    assert list(df.same_output) == [True, True, False, False]
    assert results[1].tokens_per_s == 16.0  # the median over repeats


def test_cost_ratios_on_a_tiny_pair():
    target = ModelRunner(tiny_model(0), fast=True)
    draft = ModelRunner(tiny_model(1, layers=1), fast=True)
    verify, c = cost_ratios(target, draft, [[1, 2, 3, 4, 5], [6, 7, 8]], 4)
    assert verify > 0 and c > 0


@pytest.mark.parametrize("args", [["--repeats", "0"], ["--limit", "0"], ["--gamma", "0"]])
def test_bench_rejects_impossible_settings(capsys, args):
    code, _, err = run_cli(capsys, "bench", *args)
    assert code != 0 and "at least 1" in err and "Traceback" not in err


