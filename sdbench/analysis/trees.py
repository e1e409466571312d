"""Token trees' cost model: a tree's expected accepted length, the best tree for a node budget (Sequoia's dynamic
programme) and its predicted speedup on this hardware.

Acceptance. p[d][r] is the probability that the rank-r child of an accepted node at depth d (0: the root, the
last committed token) is accepted when it is tried, i.e. when its elder siblings were all rejected: what a run
counts as accepted_per_depth_rank / tried_per_depth_rank (engine/metrics.py). The child is then the accepted one
with the marginal probability m[d][r] = p[d][r] * prod_{r' < r} (1 - p[d][r']). A node v is reached iff every
node on its path is its parent's accepted child, so under the positional model (acceptance depends only on the
depth and the sibling rank, Sequoia's positional acceptance assumption, here optionally per depth)

    P(v) = prod_{u on the path to v} m[depth(u) - 1][rank(u)],     E(tree) = sum_v P(v)

is the expected number of accepted drafts per round, and E + 1 the expected tokens per round (the bonus
included). A chain of γ with p = α at every depth gives E + 1 = 1 + α + ... + α^γ = Ω(γ, α).

Speedup. A round drafts the tree level by level (one draft forward per level, each costing c target steps
whatever its width: `draft_cost`) and verifies its N nodes and the root in one forward costing
v(N + 1) = T(N + 1) / T(1) target steps, so

    speedup = (E + 1) / (depth * c + v(N + 1)),

which for a one-branch tree is the chain's Ω(γ, α) / (γ c + v) (engine/iid_model.predicted_speedup) exactly.

The best tree. For a node budget, `best_trees` finds the tree maximising E (Sequoia, Chen et al., arXiv
2402.12374, its dynamic programme, with acceptance per depth): F(d, n), the most expected accepted nodes below an
accepted node at depth d with at most n nodes, is 0 at the deepest allowed level and otherwise the best over
k children of ranks 0..k-1 with subtree sizes n_0 + ... + n_{k-1} <= n of sum_r m[d][r] (1 + F(d + 1, n_r - 1)),
found by a knapsack over the ranks. `hardware_trees` then, per batch size and budget, picks over the depth limit
the tree with the most predicted tokens per second, beside the best chain.

The acceptance a run measured and the tables shipped with sdbench are read in analysis/tree_acceptance.py;
what `report --explain` says of trees is analysis/tree_explain.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from sdbench.engine.tree import Tree
from sdbench.errors import SdbenchError

_TIE = 1e-12  # a larger tree must do better than this to be kept over a smaller one


@dataclass(frozen=True)
class Acceptance:
    """Conditional acceptance p[d][r] (module docstring); ranks and depths beyond those given count as never
    accepted, and no tree grows deeper than `depth`."""

    p: tuple[tuple[float, ...], ...]  # [d][r]: rank-r child of an accepted node at depth d, given it is tried

    def __post_init__(self):
        p = tuple(tuple(float(x) for x in row) for row in self.p)
        if any(not 0.0 <= x <= 1.0 for row in p for x in row):
            raise SdbenchError(f"acceptance probabilities must lie in [0, 1] (got {p})")
        object.__setattr__(self, "p", p)

    @classmethod
    def from_counts(cls, tried: Sequence[Sequence[int]], accepted: Sequence[Sequence[int]],
                    by_depth: bool = False) -> "Acceptance":
        """From a run's [d][r] counts: per depth (a (d, r) never tried counts as never accepted) or, by default,
        per rank pooled over the depths (Sequoia's positional assumption) at every depth that was tried."""
        depth = max((d + 1 for d, row in enumerate(tried) if any(row)), default=0)
        ranks = max((len(row) for row in tried), default=0)

        def get(table, d, r) -> int:
            return table[d][r] if d < len(table) and r < len(table[d]) else 0

        if by_depth:
            return cls(tuple(tuple(get(accepted, d, r) / get(tried, d, r) if get(tried, d, r) else 0.0
                                   for r in range(ranks)) for d in range(depth)))
        pooled = []
        for r in range(ranks):
            t = sum(get(tried, d, r) for d in range(depth))
            pooled.append(sum(get(accepted, d, r) for d in range(depth)) / t if t else 0.0)
        return cls(tuple(tuple(pooled) for _ in range(depth)))

    @property
    def depth(self) -> int:
        return len(self.p)

    @property
    def ranks(self) -> int:
        return max((len(row) for row in self.p), default=0)

    def marginal(self, d: int, r: int) -> float:
        """m[d][r]: the chance that the rank-r child of an accepted node at depth d is the accepted one."""
        if d >= len(self.p) or r >= len(self.p[d]):
            return 0.0
        row = self.p[d]
        return row[r] * math.prod(1.0 - x for x in row[:r])


def reach(tree: Tree, acc: Acceptance) -> list[float]:
    """[N] P(v): the chance that node v is accepted (module docstring)."""
    out: list[float] = []
    for i, a in enumerate(tree.parents):
        above = 1.0 if a < 0 else out[a]
        out.append(above * acc.marginal(tree.depth[i] - 1, tree.rank[i]))
    return out


def expected_accepted(tree: Tree, acc: Acceptance) -> float:
    """E: the expected accepted drafts of one round verifying `tree` (tokens per round: E + 1)."""
    return sum(reach(tree, acc))


def predicted_speedup(tree: Tree, acc: Acceptance, draft_cost: float, verify_cost: float) -> float:
    """(E + 1) / (depth * c + v): c one draft forward (a level) and v the verification of the tree's nodes and
    its root, both over one plain target step."""
    denominator = tree.max_depth * draft_cost + verify_cost
    return (expected_accepted(tree, acc) + 1.0) / denominator if denominator > 0 else math.nan


def best_trees(acc: Acceptance, budget: int, max_depth: int | None = None) -> list[tuple[float, Tree | None]]:
    """[n] for n = 0..budget: (E, tree) of the tree of at most n nodes and `max_depth` levels (default: the
    acceptance's depth) with the most expected accepted drafts; the smallest such tree; None for E = 0."""
    D = acc.depth if max_depth is None else min(max_depth, acc.depth)
    R = acc.ranks
    F = [[0.0] * (budget + 1) for _ in range(D + 1)]  # F[d][n], module docstring; F[D] = 0
    plans: list[list[tuple[int, list]]] = [[(0, [])] * (budget + 1) for _ in range(D + 1)]
    for d in range(D - 1, -1, -1):
        m = [acc.marginal(d, r) for r in range(R)]
        # H[r][s]: children of ranks 0..r-1 in at most s nodes; pick[r][s]: the rank r-1 child's subtree size
        H = [[0.0] * (budget + 1)] + [[-math.inf] * (budget + 1) for _ in range(R)]
        pick = [[0] * (budget + 1) for _ in range(R + 1)]
        for r in range(1, R + 1):
            for s in range(r, budget + 1):
                for t in range(1, s - r + 2):
                    value = H[r - 1][s - t] + m[r - 1] * (1.0 + F[d + 1][t - 1])
                    if value > H[r][s] + _TIE:
                        H[r][s], pick[r][s] = value, t
        for n in range(budget + 1):
            best_r = 0  # the fewest children on a tie
            for r in range(1, R + 1):
                if H[r][n] > H[best_r][n] + _TIE:
                    best_r = r
            F[d][n] = max(H[best_r][n], 0.0)
            sizes, s = [], n
            for r in range(best_r, 0, -1):
                sizes.append(pick[r][s])
                s -= pick[r][s]
            plans[d][n] = (best_r, sizes[::-1])
    out = []
    for n in range(budget + 1):
        paths = _paths(F, plans, 0, _smallest(F, 0, n), ())
        out.append((F[0][n] if D else 0.0, Tree.from_paths(paths) if paths else None))
    return out


def _smallest(F, d: int, n: int) -> int:
    """The fewest nodes (at most n) below depth d that reach F[d][n]."""
    return next(k for k in range(n + 1) if F[d][k] >= F[d][n] - _TIE)


def _paths(F, plans, d: int, n: int, prefix: tuple) -> list[tuple[int, ...]]:
    if d >= len(F) - 1 or n == 0 or F[d][n] <= 0:
        return []
    _, sizes = plans[d][n]
    out = []
    for r, t in enumerate(sizes):
        here = prefix + (r,)
        out.append(here)
        out += _paths(F, plans, d + 1, _smallest(F, d + 1, t - 1), here)
    return out


@dataclass(frozen=True)
class TreeChoice:
    """The tree `hardware_trees` chose for one budget at one batch size, beside the best chain there."""

    batch: int
    budget: int
    tree: Tree
    accepted_len: float  # E + 1: tokens per round, bonus included
    verify_cost: float  # v(N + 1) of this tree
    speedup: float  # predicted
    chain_gamma: int  # the best chain at this batch size (the same acceptance at rank 0, the same costs)
    chain_speedup: float

    @property
    def vs_chain(self) -> float:
        return self.speedup / self.chain_speedup if self.chain_speedup > 0 else math.nan


def hardware_trees(acc: Acceptance, verify_cost: Callable[[int, int], float], draft_cost: float,
                   batches: Sequence[int], budgets: Sequence[int]) -> list[TreeChoice]:
    """Per batch size and node budget, the tree with the most predicted tokens per second: among the DP's best
    trees of at most n nodes and D levels, for every n up to the budget and D up to the acceptance's depth. Where
    verify_cost never falls as the width grows, no tree of at most `budget` nodes is predicted faster (any tree
    has at most the expected accepted length of the DP's tree of its size and depth, and at least its costs).
    verify_cost(batch, width): T(width) / T(1) at that batch size."""
    if acc.depth < 1:
        raise SdbenchError("no acceptance measured: the run tried no drafted token")
    top = max(budgets)
    by_depth = {D: best_trees(acc, top, D) for D in range(1, acc.depth + 1)}
    out = []
    for b in batches:
        chains = [(predicted_speedup(Tree.chain(g), acc, draft_cost, verify_cost(b, g + 1)), g)
                  for g in range(1, acc.depth + 1)]
        chain_speedup, gamma = max(chains)
        for n in budgets:
            best = None
            for found in by_depth.values():
                for _, tree in found[1: n + 1]:
                    if tree is None:
                        continue
                    s = predicted_speedup(tree, acc, draft_cost, verify_cost(b, len(tree) + 1))
                    if best is None or s > best[0] + _TIE:
                        best = (s, tree)
            if best is None:
                continue
            s, tree = best
            out.append(TreeChoice(b, n, tree, expected_accepted(tree, acc) + 1.0, verify_cost(b, len(tree) + 1), s,
                                  gamma, chain_speedup))
    return out


def interpolated(points: dict[int, float]) -> Callable[[int], float]:
    """v(width) from the widths profiled: exact at them, linear between them; refused outside them."""
    xs = sorted(points)

    def v(width: int) -> float:
        if width in points:
            return points[width]
        if not xs or not xs[0] <= width <= xs[-1]:
            raise SdbenchError(f"no verification cost profiled around {width} tokens (profiled: {xs})")
        hi = next(x for x in xs if x > width)
        lo = max(x for x in xs if x < width)
        return points[lo] + (points[hi] - points[lo]) * (width - lo) / (hi - lo)

    return v
