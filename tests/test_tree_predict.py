"""`sdbench predict tree RESULTS`: a run's acceptance by depth and rank read back from its results file, the
verification costs profiled on this machine (a shrunk MODEL@random), and the printed trees checked against the
cost model worked out by hand from the rows written; runs it cannot read are refused in one line."""

from __future__ import annotations

import re

import pytest

from sdbench.analysis import costs
from sdbench.analysis.trees import Acceptance, expected_accepted
from sdbench.commands import predict_tree
from sdbench.engine.tree import Tree
from sdbench.reporting.results import RunWriter
from tests.conftest import run_cli
from tests.test_predict_scale import table_rows
from tests.test_random_weights import small  # noqa: F401 (fixture)

TARGET = "llama-1b@random"


def _rows(tried=([[10, 6, 3], [5, 2]], [[10, 5], [6, 1]]), accepted=([[4, 3, 1], [3, 1]], [[5, 2], [3, 0]]),
          baseline: bool = True, strategy: str = "draft") -> list[dict]:
    common = {"target": TARGET, "batch_size": 1, "repeat": 0, "prompt_tokens": 24, "new_tokens": 16,
              "dtype": "float32", "turn": 1}
    rows = [{**common, "role": "strategy", "strategy": strategy, "draft": "tiny", "prompt_id": f"p{i}",
             "batch_id": i, "steps": 10, "draft_s": 0.02, "verify_s": 0.15, "drafted_per_position": [10, 6 + i],
             "tried_per_depth_rank": t, "accepted_per_depth_rank": a} for i, (t, a) in enumerate(zip(tried, accepted))]
    if baseline:
        rows += [{**common, "role": "baseline", "strategy": "autoregressive", "draft": "", "prompt_id": f"p{i}",
                  "batch_id": i, "steps": 20, "draft_s": 0.0, "verify_s": 0.2} for i in range(2)]
    return rows


def _results(tmp_path, rows, name: str = "run") -> str:
    writer = RunWriter(tmp_path / name, name)
    writer.append(rows)
    return str(writer.finalize())


def test_the_printed_trees_follow_the_runs_acceptance_and_the_profiled_costs(small, tmp_path, capsys,  # noqa: F811
                                                                             monkeypatch):
    asked = []

    def spy(runner, batch, context, gammas, budgets, *args):
        """The real profile runs (each width timed), then costs that checks can recompute: T(g + 1)/T(1) = 1 + g/10."""
        asked.append((batch, context, tuple(gammas), tuple(budgets)))
        timed = costs.profile(runner, batch, context, gammas, budgets, reps=1, warmup=1)
        assert set(timed.verify_s) == set(gammas) and timed.target_s > 0
        return costs.Profile(batch, context, 0.01, {g: 0.01 * (1 + g / 10) for g in gammas}, {})

    monkeypatch.setattr(predict_tree, "profile", spy)
    path = _results(tmp_path, _rows())
    code, out, err = run_cli(capsys, "predict", "tree", path, "--budget", "4,8", "--device", "cpu")
    assert code == 0, err
    # the run's batch size, at its mean prompt plus half its new tokens; every chain up to depth 2 and each budget
    assert asked == [(1, 24 + 8, (1, 2, 4, 8), ())]
    # pooled by rank over both depths, by hand: rank 0 accepted 15 of 31 tries, rank 1 6 of 14, rank 2 1 of 3
    acc = Acceptance(((15 / 31, 6 / 14, 1 / 3),) * 2)
    assert "48% / 43% / 33%" in out
    c = 0.04 / (16 + 17) / (0.4 / 40)  # drafting per level over the baseline's step
    assert f"draft cost c = {c:.3f}" in out
    shapes = dict(re.findall(r"batch 1, budget (\d+): --gamma \d+ --set tree_shape=\"(.+)\"", out))
    rows = [r for r in table_rows(out, 9) if r[0] == "1"]
    assert [r[1] for r in rows] == ["4", "8"] and set(shapes) == {"4", "8"}
    for r in rows:
        tree = Tree.from_vllm(shapes[r[1]])
        assert (r[2], r[3]) == (str(len(tree)), str(tree.max_depth)) and len(tree) <= int(r[1])
        accepted_len = expected_accepted(tree, acc) + 1
        assert float(r[4]) == pytest.approx(accepted_len, abs=0.006)
        v = 1 + len(tree) / 10  # interpolated between profiled widths: the same line
        assert float(r[5]) == pytest.approx(v, abs=0.006)
        assert float(r[6].rstrip(" *x")) == pytest.approx(accepted_len / (tree.max_depth * c + v), abs=0.006)
    assert sum(r[6].endswith("*") for r in rows) == 1


@pytest.mark.parametrize("rows, args, says", [
    (_rows(tried=([[10], [5]], [[8], [2]]), accepted=([[4], [3]], [[5], [1]])), (), "drafted chains only"),
    (_rows(baseline=False), (), "give --draft-cost"),
    (_rows(tried=(None, None), accepted=(None, None)), (), "no row of these results counted"),
    (_rows() + [{**r, "strategy": "ngram", "prompt_id": "n" + r["prompt_id"]} for r in _rows(baseline=False)], (),
     "several configurations"),
    (_rows() + [{**r, "strategy": "ngram", "prompt_id": "n" + r["prompt_id"]} for r in _rows(baseline=False)],
     ("--strategy", "suffix"), "--strategy suffix: these results hold no rows of it (they hold draft, ngram)"),
])
def test_results_it_cannot_use_are_refused_in_one_line(tmp_path, capsys, rows, args, says):
    code, _, err = run_cli(capsys, "predict", "tree", _results(tmp_path, rows), *args, "--device", "cpu")
    assert code == 2 and err.count("\n") == 1 and says in err


def test_strategy_picks_one_configuration_of_a_compared_run(tmp_path):
    """A run with --compare holds several configurations: --strategy NAME reads that one's counts and its drafting
    cost against the run's baseline, as if it had run alone."""
    from sdbench.analysis.trees import measured_trees
    from sdbench.reporting.results import read_results

    other = _rows(tried=([[3, 1]], [[2]]), accepted=([[1, 0]], [[1]]), baseline=False, strategy="ngram")
    mixed = read_results([_results(tmp_path, _rows() + [{**r, "prompt_id": "n" + r["prompt_id"]} for r in other])])
    alone = read_results([_results(tmp_path, _rows(), name="alone")])
    picked, single = measured_trees(mixed, "draft"), measured_trees(alone)
    assert (picked.tried, picked.accepted) == (single.tried, single.accepted) == ([[20, 11, 3], [11, 3]],
                                                                                  [[9, 5, 1], [6, 1]])
    assert picked.draft_cost == pytest.approx(single.draft_cost) and picked.strategy == "draft"
    assert measured_trees(mixed, "ngram").tried == [[5, 1]]  # its two rows, one depth each
