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
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from sdbench.engine.formulas import mean_accepted_length
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


# ---- what a run measured ------------------------------------------------------------------------------------


def summed_tables(tables) -> list[list[int]]:
    """[d][r] tables (a results column: lists of lists, or nulls) summed element-wise."""
    total: list[list[int]] = []
    for table in tables:
        if table is None or (not hasattr(table, "__len__")):
            continue
        for d, row in enumerate(table):
            total.extend([] for _ in range(d + 1 - len(total)))
            total[d].extend([0] * (len(row) - len(total[d])))
            for r, x in enumerate(row):
                total[d][r] += int(x)
    return total


@dataclass(frozen=True)
class ShippedTable:
    """An acceptance table measured by a run and shipped with sdbench (sdbench/data/tree_acceptance.json):
    tried and accepted drafted nodes per depth and sibling rank, as `summed_tables` gives them from its rows."""

    name: str
    source: str  # what was measured: models, data set, prompts, tokens, date, machine
    tried: list[list[int]]  # [d][r]
    accepted: list[list[int]]  # [d][r]

    def acceptance(self, by_depth: bool = False) -> Acceptance:
        return Acceptance.from_counts(self.tried, self.accepted, by_depth)


def _counts(name: str, key: str, table) -> list[list[int]]:
    if not isinstance(table, list) or not all(isinstance(row, list) and all(isinstance(x, int) and x >= 0
                                                                          for x in row) for row in table):
        raise SdbenchError(f"acceptance table {name}: {key} must be a list of lists of counts (got {table!r})")
    return table


def shipped_tables(path=None) -> list[ShippedTable]:
    """Every table of the shipped file (or `path`), checked: counts per depth and rank, never more accepted than
    tried, and at least one drafted node tried."""
    if path is None:
        from importlib.resources import files

        path = files("sdbench.data") / "tree_acceptance.json"
    out = []
    for entry in json.loads(path.read_text(encoding="utf-8")):
        name = str(entry.get("name") or "")
        tried, accepted = _counts(name, "tried", entry.get("tried")), _counts(name, "accepted", entry.get("accepted"))
        if not name or not entry.get("source"):
            raise SdbenchError(f"acceptance table {name or '(no name)'}: needs a name and a source")
        if ([len(r) for r in tried] != [len(r) for r in accepted]
                or any(a > t for ts, acc in zip(tried, accepted) for t, a in zip(ts, acc)) or not summed_tables([tried])
                or not any(any(row) for row in tried)):
            raise SdbenchError(f"acceptance table {name}: tried and accepted must have the same shape, some node "
                               "tried, and never more accepted than tried")
        out.append(ShippedTable(name, str(entry["source"]), tried, accepted))
    return out


def shipped_table(name: str) -> ShippedTable:
    """The shipped table of that name; refused in one line naming the known ones."""
    tables = shipped_tables()
    for table in tables:
        if table.name == name:
            return table
    raise SdbenchError(f"--acceptance {name}: no such shipped acceptance table (known: "
                       f"{', '.join(t.name for t in tables) or 'none'})")


@dataclass(frozen=True)
class MeasuredTrees:
    """What `predict tree` reads from a run: its acceptance counts by depth and rank, pooled over its rows, and
    what it needs to profile the costs like the run."""

    strategy: str
    target: str
    tried: list[list[int]]
    accepted: list[list[int]]
    rounds: int  # steps that tried a draft
    draft_cost: float | None  # c: drafting time per level over the baseline's time per target step; None: no baseline
    batches: tuple[int, ...]
    context: int  # mean prompt tokens plus half the mean new tokens: where a round's verification sits on average
    dtype: str | None
    side: int = 0  # nodes each verifying forward also fed beside the tree (lookahead's window), mean over steps


def side_nodes(strategy: str, params) -> int:
    """Nodes a run's verifying forwards fed beside its drafted tree, from the strategy's declaration and the
    settings a row recorded (JSON); 0 for a strategy that feeds none."""
    from sdbench.strategies import strategy_registry

    if strategy not in strategy_registry:
        return 0
    settings = json.loads(params) if isinstance(params, str) and params else {}  # a row without: null or NaN
    return strategy_registry.get(strategy).side_nodes(settings)


def measured_trees(df, strategy: str | None = None) -> MeasuredTrees:
    """The acceptance by depth and rank of the results' one configuration (strategy, draft, target), pooled over
    its rows and parameters; refused in one line when no row counted it, when several configurations are mixed,
    or when only chains were drafted (a sibling's acceptance is then unmeasured). strategy: only the rows of this
    strategy or preset (a run with --compare holds several)."""
    if strategy is not None:
        held = sorted(set(df.loc[df["role"] != "baseline", "strategy"]))
        if strategy not in held:
            raise SdbenchError(f"--strategy {strategy}: these results hold no rows of it (they hold "
                               f"{', '.join(held) or 'plain decoding only'})")
        df = df[(df["role"] == "baseline") | (df["strategy"] == strategy)]
    rows = df[(df["role"] != "baseline") & df["tried_per_depth_rank"].notna()]
    rows = rows.loc[np.array([bool(summed_tables([t])) for t in rows["tried_per_depth_rank"]], dtype=bool)]
    if rows.empty:
        raise SdbenchError("no row of these results counted acceptance by depth and rank (results written before "
                           "these counters, or plain decoding only): run the strategy again")
    configs = sorted({f"{s} ({d or 'no draft'}) on {t}" for s, d, t in
                      zip(rows["strategy"], rows["draft"].fillna(""), rows["target"])})
    if len(configs) > 1:
        raise SdbenchError(f"these results hold several configurations ({'; '.join(configs)}): give the results "
                           "of one, or --strategy NAME")
    tried, accepted = summed_tables(rows["tried_per_depth_rank"]), summed_tables(rows["accepted_per_depth_rank"])
    if max(len(r) for r in tried) < 2:
        if "tree_steps" in rows and float(rows["tree_steps"].fillna(0).sum()) > 0:
            raise SdbenchError(f"{configs[0]} drafted trees, but no sibling past the first was ever tried (each "
                               "first child was accepted, or its parent was not), so a sibling's acceptance (rank "
                               "> 0) is unmeasured: measure a tree with a drafter the target disagrees with")
        raise SdbenchError(f"{configs[0]} drafted chains only, so a sibling's acceptance (rank > 0) is unmeasured: "
                           "measure a tree first (ngram --set tree=K, or draft --set tree_topk=K tree_nodes=N)")
    base = df[(df["role"] == "baseline") & df["run_id"].isin(set(rows["run_id"]))]
    levels = sum(sum(int(x) for x in p) for p in rows["drafted_per_position"] if p is not None)
    base_steps, base_s = float(base["steps"].sum()), float(base["verify_s"].sum())
    cost = None
    if levels and base_steps and base_s > 0:
        cost = float(rows["draft_s"].sum()) / levels / (base_s / base_steps)
    dtypes = set(rows["dtype"].dropna()) if "dtype" in rows else set()
    name = str(rows["strategy"].iloc[0])
    params = rows["params"] if "params" in rows else [None] * len(rows)
    side = [side_nodes(name, p) for p in params]
    steps = [float(x) for x in rows["steps"]]
    return MeasuredTrees(name, str(rows["target"].iloc[0]), tried, accepted,
                         tried[0][0],
                         cost, tuple(sorted({int(b) for b in rows["batch_size"].dropna()})) or (1,),
                         max(1, round(float(rows["prompt_tokens"].mean()) + float(rows["new_tokens"].mean()) / 2)),
                         dtypes.pop() if len(dtypes) == 1 else None,
                         int(round(float(np.average(side, weights=steps)))) if sum(steps) else max(side, default=0))


# ---- `report --explain` ----------------------------------------------------------------------------------------


def run_tree(params: dict) -> Tree | None:
    """The static tree a run verified every round (its tree_shape, or tree_topk's shape with tree_nodes, by the
    strategies' own rule); None for trees found or grown per round (ngram, tree_dynamic) or a chain."""
    from sdbench.strategies.trees import tree_setting

    if params.get("tree_dynamic") or not (params.get("tree_shape") or params.get("tree_topk")):
        return None
    return tree_setting("run", int(params.get("gamma") or 0), int(params.get("tree_topk") or 0),
                        int(params.get("tree_nodes") or 0), str(params.get("tree_shape") or ""))


def acceptance_text(tried, accepted) -> str:
    """'d1 40/50 · d2 50 %': per depth, each rank's accepted share of its tries ('–' where never tried)."""
    return " · ".join(f"d{d + 1} " + "/".join(f"{a / t:.0%}".rstrip("%") if t else "–" for t, a in zip(ts, accepted[d]))
                      for d, ts in enumerate(tried)) + " %"


def explain_trees(df) -> list[dict]:
    """Per configuration that verified token trees (its rows' `tree_steps`): the mean tree size and verification
    width, acceptance by depth and rank, the measured mean accepted length; what the cost model predicts from
    that acceptance (per depth and rank) for the run's own tree when it is static, and for the DP's best tree of
    the run's mean size; each speedup at the run's measured costs (c: drafting per level, v: a verification over
    the baseline's step)."""
    from sdbench.reporting.cells import ratio  # pandas: only a report needs these
    from sdbench.reporting.report import labelled

    data = labelled(df)
    if "tree_steps" not in data:
        return []
    out = []
    for (run_id, strategy, params), group in data[data["role"] != "baseline"].groupby(
            ["run_id", "strategy", "params"], sort=False):
        tree_steps = float(np.nansum(group["tree_steps"].astype(float)))
        if not tree_steps:
            continue
        base = data[(data["role"] == "baseline") & (data["run_id"] == run_id)]
        step = ratio(float(base["verify_s"].sum()), float(base["steps"].sum()))
        steps = float(group["steps"].sum())
        levels = sum(sum(int(x) for x in p) for p in group["drafted_per_position"] if p is not None)
        c = ratio(ratio(float(group["draft_s"].sum()), levels), step)
        v = ratio(ratio(float(group["verify_s"].sum()), steps), step)
        tried, accepted = summed_tables(group["tried_per_depth_rank"]), summed_tables(group["accepted_per_depth_rank"])
        acc = Acceptance.from_counts(tried, accepted, by_depth=True)
        size = float(group["tree_nodes"].sum()) / tree_steps
        own = run_tree(json.loads(params or "{}"))
        found = best_trees(acc, max(1, round(size)))[-1][1] if acc.depth else None
        row = {"run_id": run_id, "strategy": strategy, "tree_size": size,
               "width": ratio(float(group["verified_width"].sum()), steps),
               "acceptance": acceptance_text(tried, accepted),
               "acc_len": mean_accepted_length(float(group["new_tokens"].sum()), steps, len(group))}
        for key, tree in (("model", own), ("best", found)):
            row[f"{key}_nodes"] = len(tree) if tree is not None else math.nan
            row[f"{key}_acc_len"] = expected_accepted(tree, acc) + 1.0 if tree is not None else math.nan
            row[f"{key}_speedup"] = predicted_speedup(tree, acc, c, v) if tree is not None else math.nan
        out.append(row)
    return out
