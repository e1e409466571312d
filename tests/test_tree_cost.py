"""The tree cost model (analysis/trees.py) against hand computations, brute force and the verifier itself.

A tree's expected accepted length is checked by hand on a small tree, and against a Monte Carlo run of the
engine's own lossless tree verification (`verify_tree_sampling`) with targets whose distributions give known
acceptance by depth and rank; the rows' counters (engine/metrics.py) give those probabilities back. Sequoia's
dynamic programme must find the optimum of an enumeration of every tree of small budgets, and the hardware
choice the best predicted speedup over them; a one-branch tree's prediction is the chain's cost model exactly.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from sdbench.analysis.trees import (Acceptance, best_trees, expected_accepted, hardware_trees, interpolated,
                                    predicted_speedup, reach)
from sdbench.engine import iid_model
from sdbench.engine.counters import RowStats
from sdbench.engine.sampling import verify_tree_sampling
from sdbench.engine.tree import Tree, TreeBatch
from sdbench.errors import SdbenchError


def test_expected_accepted_length_by_hand():
    tree = Tree.from_vllm("[(0,), (1,), (0, 0)]")
    acc = Acceptance(((0.6, 0.5), (0.7, 0.3)))
    # (0,): 0.6; (1,): tried when (0,) fails, 0.4 * 0.5 = 0.2; (0, 0): 0.6 * 0.7
    assert reach(tree, acc) == pytest.approx([0.6, 0.2, 0.42])
    assert expected_accepted(tree, acc) == pytest.approx(1.22)
    # a rank or depth not given is never accepted
    assert expected_accepted(Tree.from_vllm("[(0,), (1,), (2,), (0, 0), (0, 0, 0)]"), acc) == pytest.approx(1.22)
    assert predicted_speedup(tree, acc, 0.1, 1.25) == pytest.approx(2.22 / (2 * 0.1 + 1.25))


def test_a_one_branch_tree_is_the_chains_cost_model():
    for alpha, gamma, c, v in ((0.7, 4, 0.05, 1.1), (0.3, 1, 0.2, 1.0), (0.9, 7, 0.0, 1.6)):
        acc = Acceptance(((alpha,),) * gamma)
        assert predicted_speedup(Tree.chain(gamma), acc, c, v) == pytest.approx(
            iid_model.predicted_speedup(alpha, gamma, c, v), rel=1e-12)


def test_counts_become_acceptance_by_depth_or_pooled_by_rank():
    tried, accepted = [[10, 6, 2], [4, 1]], [[4, 3, 0], [2, 0]]
    assert Acceptance.from_counts(tried, accepted, by_depth=True).p == ((0.4, 0.5, 0.0), (0.5, 0.0, 0.0))
    assert Acceptance.from_counts(tried, accepted).p == ((6 / 14, 3 / 7, 0.0),) * 2
    with pytest.raises(SdbenchError, match=r"\[0, 1\]"):
        Acceptance(((1.5,),))


# ---- every tree of a small budget -------------------------------------------------------------------------------

def forests(n: int, levels: int):
    """Every ordered forest of exactly n nodes at most `levels` deep, as nested tuples of children."""
    if n == 0:
        yield ()
        return
    if levels == 0:
        return
    for t in range(1, n + 1):
        for first in forests(t - 1, levels - 1):
            for rest in forests(n - t, levels):
                yield (first,) + rest


def as_tree(forest) -> Tree:
    paths = []

    def walk(children, prefix):
        for r, sub in enumerate(children):
            paths.append(prefix + (r,))
            walk(sub, prefix + (r,))

    walk(forest, ())
    return Tree.from_paths(paths)


def all_trees(budget: int, levels: int) -> list[Tree]:
    return [as_tree(f) for n in range(1, budget + 1) for f in forests(n, levels)]


def test_the_enumeration_counts_the_catalan_numbers():
    assert [sum(1 for _ in forests(n, n)) for n in range(1, 8)] == [1, 2, 5, 14, 42, 132, 429]


ACCEPTANCES = {
    "pooled": Acceptance(((0.6, 0.3, 0.2),) * 4),
    "by depth": Acceptance(((0.8, 0.5, 0.4), (0.5, 0.45, 0.1), (0.3, 0.6), (0.9,))),
    "a zero rank": Acceptance(((0.5, 0.0, 0.9), (0.2, 0.0, 0.8), (0.7, 0.1, 0.6))),  # rank 1 only makes room
    "random": Acceptance(tuple(tuple(torch.rand(3, generator=torch.Generator().manual_seed(d)).tolist())
                               for d in range(3))),
}


@pytest.mark.parametrize("name", list(ACCEPTANCES))
def test_the_dynamic_programme_finds_the_best_tree_of_every_small_budget(name):
    acc = ACCEPTANCES[name]
    budget = 7
    trees = all_trees(budget, acc.depth)
    for levels in range(1, acc.depth + 1):
        found = best_trees(acc, budget, levels)
        assert found[0] == (0.0, None)
        for n in range(1, budget + 1):
            value, tree = found[n]
            brute = max(expected_accepted(t, acc) for t in trees if len(t) <= n and t.max_depth <= levels)
            assert value == pytest.approx(brute, abs=1e-12)
            assert len(tree) <= n and tree.max_depth <= levels
            assert expected_accepted(tree, acc) == pytest.approx(value, abs=1e-12)
            assert Tree.from_vllm(tree.to_vllm()) == tree


def test_the_best_tree_of_a_budget_is_a_known_shape():
    """Rank 0 accepted half the time, rank 1 a third of the rest: with 3 nodes, the root's two children and the
    first one's child (0.5 + 0.5/3 + 0.25) beat the chain of 3 (0.5 + 0.25 + 0.125) and three siblings."""
    acc = Acceptance(((0.5, 1 / 3, 0.0),) * 3)
    value, tree = best_trees(acc, 3)[3]
    assert tree.to_vllm() == "[(0,), (1,), (0, 0)]" and value == pytest.approx(0.5 + 0.5 / 3 + 0.25)


def test_the_hardware_choice_is_the_best_predicted_speedup_over_every_tree():
    acc = ACCEPTANCES["by depth"]
    budgets = (3, 6)
    trees = all_trees(max(budgets), acc.depth)
    costs = {1: lambda w: 1.0, 4: lambda w: 1.0 + 0.15 * (w - 1) ** 1.5}  # batch 4: verification grows with width
    choices = hardware_trees(acc, lambda b, w: costs[b](w), 0.05, batches=(1, 4), budgets=budgets)
    assert [(c.batch, c.budget) for c in choices] == [(1, 3), (1, 6), (4, 3), (4, 6)]
    for c in choices:
        v = costs[c.batch]
        brute = max(predicted_speedup(t, acc, 0.05, v(len(t) + 1)) for t in trees if len(t) <= c.budget)
        assert c.speedup == pytest.approx(brute, abs=1e-12)
        assert c.accepted_len == pytest.approx(expected_accepted(c.tree, acc) + 1)
        chains = [predicted_speedup(Tree.chain(g), acc, 0.05, v(g + 1)) for g in range(1, acc.depth + 1)]
        assert c.chain_speedup == pytest.approx(max(chains)) and c.chain_gamma == 1 + chains.index(max(chains))
    free, costly = choices[1], choices[3]
    assert len(free.tree) > len(costly.tree)  # a costlier wide verification asks for a smaller tree


def test_verification_costs_are_interpolated_between_profiled_widths_only():
    v = interpolated({1: 1.0, 5: 1.4, 9: 2.2})
    assert (v(1), v(3), v(5), v(7)) == (1.0, pytest.approx(1.2), 1.4, pytest.approx(1.8))
    with pytest.raises(SdbenchError, match="around 10 tokens"):
        v(10)


# ---- the formula against the verifier ------------------------------------------------------------------------

def test_the_formula_is_what_lossless_tree_verification_gives():
    """Children drafted as tokens 0, 1, 2 (by rank) and a target whose distribution after a node at depth d is
    q_d: verification accepts the rank-r child with probability q_d(r) over what its elder siblings left, so
    p[d][r] = q_d(r) / (1 - q_d(0) - ... - q_d(r - 1)) and the marginal m[d][r] = q_d(r)."""
    V, B = 5, 40000
    q = torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.1], [0.3, 0.3, 0.1, 0.2, 0.1], [0.6, 0.1, 0.1, 0.1, 0.1],
                      [0.2, 0.2, 0.2, 0.2, 0.2]], dtype=torch.float64)
    p = tuple(tuple(float(q[d, r] / (1 - q[d, :r].sum())) for r in range(3)) for d in range(3))
    acc = Acceptance(p)
    tree = Tree.from_vllm("[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 0, 1)]")
    tokens = torch.tensor(tree.rank)[None].expand(B, -1)
    depths = torch.tensor((0,) + tree.depth)  # row 0: the root
    probs = q[depths].float()[None].expand(B, -1, -1)
    verdict = verify_tree_sampling(TreeBatch.of([tree] * B), tokens, None, probs, torch.Generator().manual_seed(0))
    lengths = verdict.accepted.double()
    se = lengths.std().item() / math.sqrt(B)
    assert abs(lengths.mean().item() - expected_accepted(tree, acc)) < 4 * se
    # the rows' counters give p back
    row = RowStats()
    for path, n in zip(verdict.path.tolist(), verdict.accepted.tolist()):
        row.add_step(len(tree), n, 0.0, 0.0, tree=tree, path=path[:n])
    tried, accepted = row.tried_per_depth_rank, row.accepted_per_depth_rank
    assert tried[0][0] == B  # every round tries the root's first child
    for d, r in ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1)):  # the (depth, rank) this tree has
        t = tried[d][r]
        assert abs(accepted[d][r] / t - p[d][r]) < 4 * math.sqrt(p[d][r] * (1 - p[d][r]) / t)
