"""The check's tree step at LLAMA_8B's shape: what `predict tree` answers on this machine for every shipped
acceptance table (sdbench/data/tree_acceptance.json, measured on a CPU with small models). The target's
verification of 1 to max budget + 1 tokens is profiled through the graphs at the sizes' batches and context
(`predict_tree.profiled_widths`, `analysis/costs.profile`), with a draft model's cost c there (one LLAMA_1B step
over one LLAMA_8B step, same batch and context); then per table, batch and node budget the tree
`analysis/trees.hardware_trees` chooses, beside the best chain."""

from __future__ import annotations

import pandas as pd

from sdbench.analysis.costs import memory_plan, profile
from sdbench.analysis.tree_acceptance import shipped_tables
from sdbench.analysis.trees import hardware_trees
from sdbench.commands.gpucheck.costs import _fallback_claim, on_graphs
from sdbench.commands.gpucheck.plan import LLAMA_1B, LLAMA_8B, Ctx, Section, free
from sdbench.commands.predict import NATIVE_NEEDED
from sdbench.commands.predict_tree import profiled_widths, relative_verify
from sdbench.models.loading import pair as pair_module


def tree_costs(ctx: Ctx) -> list[Section]:
    """Two sections: `tree-costs` (per batch: the target step, each verification width and its v = T(N)/T(1),
    the draft step and its c; each recording whether it fell back from the graphs) and `trees` (one row per
    table x batch x budget: the chosen tree, its expected accepted length, v, predicted speedup, the best chain's
    and the ratio)."""
    s, dev, dt = ctx.sizes, ctx.torch_device, ctx.torch_dtype
    tables = shipped_tables()
    widths = profiled_widths(max(t.acceptance().depth for t in tables), s.tree_budgets)  # drafted tokens
    found = memory_plan(LLAMA_8B, dt, dev, s.tree_batches, (s.tree_context,), max(widths))
    batches = sorted(b for b, _ in found.fits)
    if not batches:
        return [Section("tree-costs", pd.DataFrame([{"kind": "not measured", "why": found.line()}]),
                        notes=[f"tree costs not measured: {found.line()}"])]
    models = pair_module.load_models([LLAMA_8B, LLAMA_1B], dev, dt, ctx.console, static=True, fit=False,
                                     native=dict.fromkeys((LLAMA_8B, LLAMA_1B), NATIVE_NEEDED))  # as the step costs run
    runners = {name: got.runner for name, got in models.items()}
    asked = {name: bool(r.graphs) for name, r in runners.items()}
    rows, v, c = [], {}, {}
    target, draft = runners[LLAMA_8B], runners[LLAMA_1B]
    for b in batches:
        p, graphs = on_graphs(target, asked[LLAMA_8B],
                              lambda: profile(target, b, s.tree_context, widths, (), reps=s.reps))
        d, draft_graphs = on_graphs(draft, asked[LLAMA_1B],
                                    lambda: profile(draft, b, s.tree_context, (), (), reps=s.reps))
        v[b], c[b] = relative_verify(p), d.target_s / p.target_s
        common = {"batch": b, "context": s.tree_context}
        rows.append(dict(common, **graphs, model=LLAMA_8B, kind="target", tokens=1, ms=p.target_s * 1e3, v=1.0))
        rows += [dict(common, **graphs, model=LLAMA_8B, kind="verify", tokens=g + 1, ms=t * 1e3, v=t / p.target_s)
                 for g, t in sorted(p.verify_s.items())]
        rows.append(dict(common, **draft_graphs, model=LLAMA_1B, kind="draft", tokens=1, ms=d.target_s * 1e3, c=c[b]))
        ctx.console.print(f"  tree costs: batch {b}, context {s.tree_context}: v({max(widths) + 1}) = "
                          f"{v[b](max(widths) + 1):.2f}, "
                          f"c = {c[b]:.3f} ({graphs['path']})", highlight=False)
    del runners, target, draft, models
    free(dev)
    rows += [{"batch": b, "context": n, "kind": "not measured", "fallback": "",
              "why": "does not fit beside the weights"} for (b, n) in sorted(found.too_big)]
    frame = pd.DataFrame(rows)
    costs = Section("tree-costs", frame, [_fallback_claim(frame, asked[LLAMA_8B], "tree-cost")])
    if frame.get("fell_back", pd.Series(dtype=bool)).fillna(False).astype(bool).any():
        first = frame[frame["fell_back"].fillna(False).astype(bool)].iloc[0]
        costs.failures.append(f"tree costs: CUDA graphs fell back to the eager forward for {first['model']} at batch "
                              f"{first['batch']} ({first['fallback'] or 'graphs off'})")
    choices, notes = _picked_trees(tables, batches, v, c, s)
    return [costs, Section("trees", pd.DataFrame(choices), notes=notes)]


def _picked_trees(tables, batches: list[int], v: dict, c: dict, s) -> tuple[list[dict], list[str]]:
    """The `trees` section's rows (every budget's tree per acceptance table and batch, from the measured v and c)
    and one note per table and batch on the best of them against the best chain."""
    choices, notes = [], []
    for table in tables:
        acc = table.acceptance()
        for b in batches:
            found_trees = hardware_trees(acc, lambda _, w, b=b: v[b](w), c[b], [b], s.tree_budgets)
            top = max(found_trees, key=lambda ch: ch.speedup)
            choices += [{"table": table.name, "batch": b, "context": s.tree_context, "budget": ch.budget,
                         "nodes": len(ch.tree), "depth": ch.tree.max_depth, "acc_len": ch.accepted_len,
                         "v": ch.verify_cost, "c": c[b], "predicted_speedup": ch.speedup, "chain_gamma": ch.chain_gamma,
                         "chain_speedup": ch.chain_speedup, "vs_chain": ch.vs_chain, "best": ch is top,
                         "tree_shape": ch.tree.to_vllm()} for ch in found_trees]
            notes.append(f"trees for {table.name} at {LLAMA_8B}, batch {b}: best budget {top.budget} ({len(top.tree)} "
                         f"nodes, depth {top.tree.max_depth}) {top.speedup:.2f}x predicted, best chain (gamma "
                         f"{top.chain_gamma}) {top.chain_speedup:.2f}x")
    return choices, notes
