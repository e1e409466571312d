"""`sdbench sweep`: a grid of `run`s on a tiny model folder through the CLI, resumed after an interrupt; the
frontier recomputed by hand from synthetic result rows; bad input as one line.

References: the speedups recomputed by hand from the rows' token counts and wall times (what `run`'s table
defines), and frontiers worked out by hand for grids that pay, never pay, always pay and pay again.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from sdbench.reporting.results import read_results
from sdbench.reporting.sweep import best_points, frontier, frontier_line
from sdbench.reporting.writer import RunWriter
from tests.conftest import run_cli
from tests.references import tiny_model_dir
from tests.test_cli import one_line_error

GRID = ["--batch", "1,2", "--prompt-len", "24,40"]
POINTS = ["b1-L24", "b2-L24", "b1-L40", "b2-L40"]  # prompt length by prompt length


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("sweep") / "tiny")


def _sweep(capsys, tiny, out, *extra):
    return run_cli(capsys, "sweep", "--target", str(tiny), "--limit", "2", "--max-new-tokens", "6", "--gamma", "3",
                   "--device", "cpu", "--no-probe", "--out", str(out), *extra)


def _by_hand(rows: pd.DataFrame) -> float:
    """tokens/s over the baseline's: new tokens over the summed wall time of each batch (counted once)."""
    def rate(side):
        return side["new_tokens"].sum() / side.groupby(["batch_id", "repeat"])["wall_s"].first().sum()

    return rate(rows[rows["role"] != "baseline"]) / rate(rows[rows["role"] == "baseline"])


def test_a_2x2_sweep_writes_a_file_per_point_with_one_baseline_and_each_strategy(capsys, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    code, out, err = _sweep(capsys, tiny, tmp_path, *GRID, "-s", "ngram", "-s", "draft", "--draft", str(tiny))
    assert code == 0, err
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir() and p.name != "cache"]
    assert sorted(p.name for p in folder.glob("*.parquet")) == sorted(f"{folder.name}-{p}.parquet" for p in POINTS)
    assert json.loads((folder / "done.json").read_text()) == POINTS
    points = pd.read_csv(folder / "points.csv")
    for name in POINTS:
        rows = read_results([folder / f"{folder.name}-{name}.parquet"])
        size, length = int(name[1]), int(name.split("L")[1])
        assert sorted(rows["role"].value_counts().items()) == [("baseline", 2), ("strategy:draft", 2),
                                                               ("strategy:ngram", 2)]  # one baseline for both
        assert (rows["batch_size"] == size).all() and (rows["prompt_len"] == length).all()
        assert (rows["prompt_tokens"] == length).all() and (rows["sweep"] == folder.name).all()
        assert rows["lossless"].dropna().all() and rows["lossless"].notna().sum() == 6
        base = rows[rows["role"] == "baseline"]
        for family in ("ngram", "draft"):
            mine = rows[rows["role"] == f"strategy:{family}"]
            assert set(mine["strategy"]) == {family}
            measured = points[(points["family"] == family) & (points["size"] == size) & (points["prompt_len"] == length)]
            assert measured["speedup"].item() == pytest.approx(_by_hand(pd.concat([base, mine])))
            n, p = mine["new_tokens"] - 1, mine["predicted_speedup"]  # rows' predictions by their decode tokens
            assert measured["predicted"].item() == pytest.approx(n.sum() / (n / p).sum())
    assert set(points["family"]) == {"ngram", "draft", "any"}
    front = pd.read_csv(folder / "frontier.csv")
    assert len(front) == 6 and (folder / "frontier.png").stat().st_size > 0
    assert "frontier (ngram): SD loses at batch" in out and "frontier (draft)" in out and "lossless: 16/16" in out
    code, report, _ = run_cli(capsys, "report", str(folder))
    assert code == 0 and "where speculative decoding stops paying" in report


def test_an_interrupted_sweep_resumes_without_touching_finished_points(capsys, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    appended = []
    real_append = RunWriter.append

    def append(self, rows):
        path = real_append(self, rows)
        appended.append(self.run_id)
        if self.run_id.endswith("-b1-L40") and interrupt:  # the third point's first batch is saved, then Ctrl-C
            raise KeyboardInterrupt
        return path

    interrupt = True
    monkeypatch.setattr(RunWriter, "append", append)
    code, _, err = _sweep(capsys, tiny, out, *GRID)
    assert code == 130 and "2/4 points are done" in err and "sdbench sweep --resume" in err
    (folder,) = out.iterdir()
    files = {p: (folder / f"{folder.name}-{p}.parquet") for p in POINTS}
    kept = {p: (files[p].read_bytes(), files[p].stat().st_mtime_ns) for p in POINTS[:2]}
    partial = read_results([files["b1-L40"]])
    assert len(partial) == 2 and not files["b2-L40"].exists()

    interrupt, appended[:] = False, []
    code, stdout, err = run_cli(capsys, "sweep", "--resume", folder.name, "--out", str(out))
    assert code == 0, err
    assert "point 1/4: batch 1, 24-token prompts: done earlier, kept" in stdout
    assert "point 2/4: batch 2, 24-token prompts: done earlier, kept" in stdout
    assert {r[len(folder.name) + 1:] for r in appended} == {"b1-L40", "b2-L40"}
    assert appended.count(f"{folder.name}-b1-L40") == 1  # only its second batch was decoded
    for p in POINTS[:2]:
        assert (files[p].read_bytes(), files[p].stat().st_mtime_ns) == kept[p]
    resumed = read_results([files["b1-L40"]])
    assert len(resumed) == 4 and resumed["prompt_id"].nunique() == 2
    first = resumed[resumed["prompt_id"].isin(partial["prompt_id"])].sort_values("role")
    assert first["wall_s"].tolist() == partial.sort_values("role")["wall_s"].tolist()
    assert json.loads((folder / "done.json").read_text()) == POINTS
    assert len(pd.read_csv(folder / "points.csv")) == 4


def _rows(table: dict[int, dict[int, list[tuple[float, float]]]]) -> pd.DataFrame:
    """Result rows of a sweep: table[prompt_len][size] = [(speedup, predicted) per gamma]; one batch of `size`
    prompts per point, the baseline's batch 1 s, each configuration's 1/speedup s, 10 tokens per prompt."""
    rows = []
    for length, by_size in table.items():
        for size, configs in by_size.items():
            run = f"S-b{size}-L{length}"
            sides = [("baseline", "autoregressive", 0, 1.0, np.nan)]
            sides += [(f"strategy-{i + 1}", "ngram", 2 * (i + 1), 1 / s, p) for i, (s, p) in enumerate(configs)]
            for role, name, gamma, wall, predicted in sides:
                for k in range(size):
                    rows.append({"run_id": run, "sweep": "S", "role": role, "strategy": name, "params": json.dumps(
                        {"gamma": gamma}), "draft": "", "prompt_id": f"p{k}", "repeat": 0, "turn": 1, "batch_id": 0,
                        "batch_size": size, "prompt_len": length, "new_tokens": 10, "steps": 10, "wall_s": wall,
                        "ttft_s": 0.0, "predicted_speedup": predicted, "category": "c", "lossless": True})
    return pd.DataFrame(rows)


def test_the_frontier_from_result_rows_by_hand():
    df = _rows({
        256: {1: [(1.5, 1.4)], 2: [(1.1, 0.95)], 4: [(0.9, 0.8)]},  # pays to 2; predicted: to 1, a step apart
        1024: {1: [(1.3, 1.2), (1.6, 1.1)], 2: [(1.2, 1.5)], 4: [(1.05, 1.1)]},  # always pays; the best of 2 gammas
        2048: {1: [(0.9, 0.95)], 2: [(0.8, 0.9)], 4: [(0.7, 0.9)]},  # never pays
        4096: {1: [(0.9, 1.2)], 2: [(1.2, 1.1)], 4: [(0.8, 1.3)]},  # loses at 1, pays again at 2; predicted always
    })
    points = best_points(df)
    at = points.set_index(["prompt_len", "size"])
    assert at.loc[(1024, 1), "speedup"] == pytest.approx(1.6) and at.loc[(1024, 1), "setting"] == "gamma=4"
    assert at.loc[(1024, 1), "predicted"] == pytest.approx(1.1) and at.loc[(1024, 1), "predicted_best"] == pytest.approx(1.2)
    assert at.loc[(256, 4), "speedup"] == pytest.approx(0.9) and at.loc[(256, 4), "setting"] == "gamma=2"
    front = frontier(points).set_index("prompt_len")
    by_hand = {  # pays_up_to, loses_from, predicted_pays_up_to, predicted_loses_from, steps apart, pays again
        256: (2, 4, 1, 2, 1, ""), 1024: (4, None, 4, None, 0, ""), 2048: (None, 1, None, 1, 0, ""),
        4096: (None, 1, 4, None, 3, "2")}
    columns = ["pays_up_to", "loses_from", "predicted_pays_up_to", "predicted_loses_from", "steps_apart", "pays_again"]
    for length, expect in by_hand.items():
        got = tuple(None if pd.isna(v) else v for v in front.loc[length, columns])
        assert got == expect, length
    line = frontier_line(frontier(points))
    assert line == ("frontier (ngram): SD loses at batch ≥ 4 at 256, none at 1024, ≥ 1 at 2048, ≥ 1 at 4096 tokens "
                    "of context, measured; predicted ≥ 2 at 256, none at 1024, ≥ 1 at 2048, none at 4096")


@pytest.mark.parametrize("speedups, expect", [
    ([1.2, 1.1, 1.01], (8, None, "")),  # SD always pays
    ([0.99, 0.5, 0.2], (None, 2, "")),  # SD never pays
    ([1.0, 1.2, 1.3], (None, 2, "4,8")),  # exactly 1 does not pay
    ([1.4, 0.9, 1.1], (2, 4, "8")),  # pays again past the frontier
    ([np.nan, np.nan, np.nan], (None, None, "")),  # no prediction: nothing known
])
def test_frontier_edges(speedups, expect):
    points = pd.DataFrame({"sweep": "S", "axis": "batch", "family": "ngram", "prompt_len": 512, "size": [8, 2, 4],
                           "speedup": [speedups[2], speedups[0], speedups[1]], "predicted_best": np.nan})
    row = frontier(points).iloc[0]
    got = tuple(None if pd.isna(v) else v for v in row[["pays_up_to", "loses_from"]]) + (row["pays_again"],)
    if expect == (None, None, ""):
        assert got == expect
        return
    assert got == expect and pd.isna(row["predicted_loses_from"]) and pd.isna(row["steps_apart"])


def test_the_cli_asks_for_the_quick_grid_and_scoped_settings(capsys, monkeypatch):
    from sdbench.commands import sweep

    seen = {}
    monkeypatch.setattr(sweep, "run_sweep", lambda cfg, console, remote: seen.setdefault("cfg", cfg))
    code, _, err = run_cli(capsys, "sweep", "--quick", "-s", "ngram", "-s", "draft", "--draft", "d", "--set",
                           "ngram.max_ngram=2", "--set", "gamma_max=3", "--concurrency", "1,3")
    cfg = seen["cfg"]
    assert code == 0, err
    assert (cfg.axis, cfg.sizes, cfg.prompt_lens, cfg.strategies) == ("concurrency", (1, 3), (256, 1024), ("ngram", "draft"))
    assert cfg.run.max_new_tokens == 32 and cfg.run.dataset == "pg19" and cfg.run.drafts == ("d",)
    assert cfg.scoped == {"ngram": {"max_ngram": "2"}} and cfg.run.options == {"gamma_max": "3"}


@pytest.mark.parametrize("extra, expect", [
    (["--prompt-len", ","], "--prompt-len ,: an empty item in the list"),
    (["--batch", ""], "--batch : expected distinct whole numbers"),
    (["--batch", "0,2"], "--batch 0,2: every value must be at least 1"),
    (["-s", "nosuch"], "nosuch"),
    (["--batch", "1", "--concurrency", "2"], "two axes"),
    (["--set", "draft.budget=4"], "no --strategy draft in this sweep"),
    (["--draft", "x"], "none of the strategies drafts with a model"),
    (["--resume", "nope"], "--resume nope: no sweep of that id"),
    (["--concurrency", "2", "-s", "magicdec"], "strategy 'magicdec' cannot serve requests joining"),
])
def test_bad_sweep_input_is_one_line(capsys, tmp_path, extra, expect):
    code, _, err = run_cli(capsys, "sweep", "--out", str(tmp_path), *extra)
    assert expect in one_line_error(code, err)
    assert not any(tmp_path.iterdir())  # nothing is left behind
