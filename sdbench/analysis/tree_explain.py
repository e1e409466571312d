"""What `report --explain` says of token trees: per configuration that verified them, the measured acceptance by
depth and rank and accepted length, beside what the cost model (analysis/trees.py) predicts for the run's own
tree and for the best tree of its size.
"""

from __future__ import annotations

import json
import math

import numpy as np

from sdbench.analysis.tree_acceptance import summed_tables
from sdbench.analysis.trees import Acceptance, best_trees, expected_accepted, predicted_speedup
from sdbench.engine.formulas import mean_accepted_length
from sdbench.engine.tree import Tree


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
    from sdbench.reporting.labels import labelled

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
