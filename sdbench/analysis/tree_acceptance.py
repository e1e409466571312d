"""Token trees' acceptance as runs measured it: the tried and accepted drafted nodes per depth and sibling rank
of a results file, summed over its rows (`measured_trees`, with what `predict tree` needs to profile the costs
like the run), and the tables of them shipped with sdbench (sdbench/data/tree_acceptance.json). Each gives the
cost model's `Acceptance` (analysis/trees.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from sdbench.analysis.trees import Acceptance
from sdbench.errors import SdbenchError


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
