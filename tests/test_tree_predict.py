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
from sdbench.reporting.writer import RunWriter
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
    from sdbench.analysis.tree_acceptance import measured_trees
    from sdbench.reporting.results import read_results

    other = _rows(tried=([[3, 1]], [[2]]), accepted=([[1, 0]], [[1]]), baseline=False, strategy="ngram")
    mixed = read_results([_results(tmp_path, _rows() + [{**r, "prompt_id": "n" + r["prompt_id"]} for r in other])])
    alone = read_results([_results(tmp_path, _rows(), name="alone")])
    picked, single = measured_trees(mixed, "draft"), measured_trees(alone)
    assert (picked.tried, picked.accepted) == (single.tried, single.accepted) == ([[20, 11, 3], [11, 3]],
                                                                                  [[9, 5, 1], [6, 1]])
    assert picked.draft_cost == pytest.approx(single.draft_cost) and picked.strategy == "draft"
    assert measured_trees(mixed, "ngram").tried == [[5, 1]]  # its two rows, one depth each


def test_the_shipped_tables_parse_and_each_gives_an_acceptance():
    from sdbench.analysis.tree_acceptance import shipped_table, shipped_tables

    tables = shipped_tables()
    assert tables and len({t.name for t in tables}) == len(tables)
    for t in tables:
        assert t.source and [len(r) for r in t.tried] == [len(r) for r in t.accepted]
        acc = t.acceptance()
        assert acc.depth == len(t.tried) and acc.ranks >= 2  # siblings measured: a tree can be chosen
        assert all(0 <= x <= 1 for row in t.acceptance(by_depth=True).p for x in row)
    eagle = shipped_table("smollm2-eagle3-mtbench")
    # pooled per rank, by hand: rank 0 accepted 103 of 473 tries over the six depths, rank 1 52 of 319
    assert eagle.acceptance().p[0] == pytest.approx((103 / 473, 52 / 319))
    assert eagle.acceptance(by_depth=True).p[1] == pytest.approx((23 / 114, 7 / 57))


@pytest.mark.parametrize("entry, says", [
    ({"name": "x", "source": "s", "tried": [[1, 2]], "accepted": [[2, 0]]}, "never more accepted than tried"),
    ({"name": "x", "source": "s", "tried": [[1, 2]], "accepted": [[1]]}, "the same shape"),
    ({"name": "x", "source": "s", "tried": [[1, -2]], "accepted": [[1, 0]]}, "lists of counts"),
    ({"name": "x", "tried": [[1]], "accepted": [[1]]}, "needs a name and a source"),
])
def test_a_bad_table_is_refused_in_one_line(tmp_path, entry, says):
    import json

    from sdbench.analysis.tree_acceptance import shipped_tables
    from sdbench.errors import SdbenchError

    path = tmp_path / "tables.json"
    path.write_text(json.dumps([entry]))
    with pytest.raises(SdbenchError, match=says):
        shipped_tables(path)


def test_a_shipped_table_predicts_at_any_target_with_the_given_draft_cost(small, capsys, monkeypatch):  # noqa: F811
    from sdbench.analysis.tree_acceptance import shipped_table

    asked = []

    def spy(runner, batch, context, gammas, budgets, *args):
        asked.append((batch, context, tuple(gammas), tuple(budgets)))
        timed = costs.profile(runner, batch, context, gammas, budgets, reps=1, warmup=1)
        assert set(timed.verify_s) == set(gammas) and timed.target_s > 0
        return costs.Profile(batch, context, 0.01, {g: 0.01 * (1 + g / 20) for g in gammas}, {})

    monkeypatch.setattr(predict_tree, "profile", spy)
    code, out, err = run_cli(capsys, "predict", "tree", "--acceptance", "smollm2-eagle3-mtbench", "--target", TARGET,
                             "--draft-cost", "0.2", "--budget", "4,8", "--batch", "1,2", "--device", "cpu")
    assert code == 0, err
    # batch 1 and 2 at the default context 1024; the table's six depths, each budget, the powers of two
    assert asked == [(b, 1024, (1, 2, 3, 4, 5, 6, 8), ()) for b in (1, 2)]
    assert "the shipped table smollm2-eagle3-mtbench (measured 2026-11-26" in out
    assert "draft cost c = 0.200 of a target step per level (--draft-cost)" in out
    assert "note: the shapes are run by" not in out  # a table names no strategy that grows its own trees
    acc = shipped_table("smollm2-eagle3-mtbench").acceptance()
    shapes = re.findall(r"batch (\d), budget (\d+): --gamma \d+ --set tree_shape=\"(.+)\"", out)
    rows = table_rows(out, 9)
    assert len(rows) == len(shapes) == 4
    for r, (b, n, shape) in zip(rows, shapes):
        tree = Tree.from_vllm(shape)
        assert (r[0], r[1]) == (b, n) and (r[2], r[3]) == (str(len(tree)), str(tree.max_depth))
        accepted_len = expected_accepted(tree, acc) + 1
        v = 1 + len(tree) / 20
        assert float(r[4]) == pytest.approx(accepted_len, abs=0.006)
        assert float(r[6].rstrip(" *x")) == pytest.approx(accepted_len / (tree.max_depth * 0.2 + v), abs=0.006)


@pytest.mark.parametrize("args, says", [
    (("RESULTS", "--acceptance", "smollm2-eagle3-mtbench", "-t", TARGET, "--draft-cost", "0.2"),
     "give a run's results or --acceptance NAME, not both"),
    ((), "give a run's results (RESULTS) or --acceptance NAME"),
    (("--acceptance", "list"), "--acceptance list: no such shipped acceptance table (known: smollm2-eagle3-mtbench"),
    (("--acceptance", "smollm2-eagle3-mtbench", "--draft-cost", "0.2"), "give --target MODEL (a shipped table"),
    (("--acceptance", "smollm2-eagle3-mtbench", "-t", TARGET), "give --draft-cost C (a shipped table"),
    (("--acceptance", "smollm2-eagle3-mtbench"), "give --target MODEL and --draft-cost C"),
    (("--acceptance", "smollm2-eagle3-mtbench", "-t", TARGET, "--draft-cost", "0.2", "--strategy", "draft"),
     "--strategy picks the rows of a run's results"),
])
def test_acceptance_asked_wrongly_is_refused_in_one_line(tmp_path, capsys, args, says):
    args = tuple(_results(tmp_path, _rows()) if a == "RESULTS" else a for a in args)
    code, _, err = run_cli(capsys, "predict", "tree", *args, "--device", "cpu")
    assert code == 2 and err.count("\n") == 1 and says in err


def test_a_profile_where_a_wider_verification_ran_faster_than_one_token_is_told():
    """No forward over 5 tokens takes 40 % of a forward over one: a profile saying so was disturbed, and is told
    in one line naming the point; a plausible profile says nothing."""
    from sdbench.commands.predict_tree import disturbed_note

    fine = costs.Profile(1, 64, 0.01, {1: 0.011, 4: 0.013}, {})
    assert disturbed_note({1: fine}) is None
    bad = costs.Profile(4, 64, 0.01, {1: 0.0095, 4: 0.004}, {})
    note = disturbed_note({1: fine, 4: bad})
    assert note.startswith("note: at batch 4 verifying 5 tokens timed 0.40 of a one-token step") and "\n" not in note
