"""Counting a tree's verification (engine/metrics.py): acceptance by depth and sibling rank, tree size and the
verification width, on hand-built rounds whose tries are listed by hand; and those counters reach a results file
and come back from it."""

from __future__ import annotations

from sdbench.engine.counters import RowStats, chain_tries, tries
from sdbench.engine.tree import Tree

# root children (0,) (1,) (2,); below (0,): (0, 0) (0, 1); below (1,): (1, 0)
TREE = Tree.from_vllm("[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]")  # nodes 0..5 in that order


def test_the_tree_is_numbered_as_written():
    assert TREE.parents == (-1, -1, -1, 0, 0, 1) and TREE.rank == (0, 1, 2, 0, 1, 0)


def test_tries_walk_the_accepted_path_trying_children_in_rank_order():
    # nothing accepted: the root's three children tried, all rejected
    assert tries(TREE, []) == [(0, 0, False), (0, 1, False), (0, 2, False)]
    # (1,) accepted after (0,) was rejected; then its one child (1, 0) tried and rejected
    assert tries(TREE, [1]) == [(0, 0, False), (0, 1, True), (1, 0, False)]
    # (0,) then (0, 1) after (0, 0): node 4 is a leaf, so nothing below it is tried
    assert tries(TREE, [0, 4]) == [(0, 0, True), (1, 0, False), (1, 1, True)]
    assert tries(TREE, [1, 5]) == [(0, 0, False), (0, 1, True), (1, 0, True)]
    # a chain as a tree, and the chain's own count, agree
    for drafted in range(4):
        for accepted in range(drafted + 1):
            assert tries(Tree.chain(drafted), list(range(accepted))) == chain_tries(drafted, accepted)
    assert chain_tries(3, 1) == [(0, 0, True), (1, 0, False)] and chain_tries(0, 0) == []


def test_a_rows_tables_sum_the_tries_of_its_rounds():
    row = RowStats()
    for path in ([], [1], [0, 4], [1, 5]):
        row.add_step(6, len(path), 0.0, 0.0, tree=TREE, path=path, width=8)
    # by hand from the four lists above: depth 0 tried ranks 0/1/2 in 4/3/1 rounds, accepted in 1/2/0
    assert row.tried_per_depth_rank == [[4, 3, 1], [3, 1]]
    assert row.accepted_per_depth_rank == [[1, 2, 0], [1, 1]]
    assert (row.tree_steps, row.tree_nodes, row.sibling_accepts) == (4, 24, 3)  # (1,) twice and (0, 1) once
    assert row.verified_width == 32 and row.rejections == 2  # rounds 1 and 2 end at a node with children
    assert row.drafted_per_position == [4, 4] and row.accepted_per_position == [3, 2]


def test_a_cut_path_counts_the_verifiers_verdict_but_commits_only_its_kept_nodes():
    row = RowStats()
    row.add_step(6, 1, 0.0, 0.0, tree=TREE, path=[0, 4])  # an EOS at (0,): (0, 1) accepted but not committed
    assert row.accepted_per_depth_rank == [[1], [0, 1]] and row.sibling_accepts == 0
    assert row.accepted_per_position == [1] and row.verified_width == 7  # default width: the nodes and the root


def test_chains_and_plain_steps_count_rank_zero_only():
    row = RowStats()
    row.add_step(4, 2, 0.0, 0.0)  # rejected at the third draft
    row.add_step(4, 2, 0.0, 0.0, rejected=False, verified=4)  # all 4 accepted, an EOS cut after the second
    row.add_step(0, 0, 0.0, 0.0)  # plain step: nothing tried, one token wide
    assert row.tried_per_depth_rank == [[2], [2], [2], [1]]
    assert row.accepted_per_depth_rank == [[2], [2], [1], [1]]
    assert row.verified_width == 5 + 5 + 1 and row.tree_steps == 0


def test_the_counters_reach_the_results_file_and_come_back(tmp_path):
    """Through the one row builder (`result_row`) into Parquet, and read back as `predict tree` reads them."""
    from sdbench.analysis.tree_acceptance import summed_tables
    from sdbench.engine.counters import BatchResult
    from sdbench.engine.metrics import row_metrics
    from sdbench.reporting.results import read_results
    from sdbench.reporting.rows import Judged, Place, RunFields, result_row
    from sdbench.reporting.writer import RunWriter

    row = RowStats()
    for path in ([], [1], [0, 4], [1, 5]):
        row.add_step(6, len(path), 0.01, 0.02, tree=TREE, path=path, width=8)
    m = row_metrics(BatchResult([[1, 2, 3, 4, 5, 6]], [3], [row], 1.0, 0.1), 0)

    class Role:
        name, strategy, drafts = "strategy", "ngram", ()

        def params(self):
            return {"gamma": 2, "tree": 3}

    run = RunFields("t", "d", 1, 0.0, 1.0, 0, True, 6, None, None, "native", None, None)
    writer = RunWriter(tmp_path, "r")
    writer.append([result_row(run, Role(), Place("c", "p0", 0, 0), m, Judged(None, True), (None, "none"), "real")])
    df = read_results(writer.finalize())
    got = df.iloc[0]
    assert (got["tree_steps"], got["tree_nodes"], got["sibling_accepts"], got["verified_width"]) == (4, 24, 3, 32)
    assert summed_tables(df["tried_per_depth_rank"]) == [[4, 3, 1], [3, 1]]
    assert summed_tables(df["accepted_per_depth_rank"]) == [[1, 2, 0], [1, 1]]
