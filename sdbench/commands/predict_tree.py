"""`sdbench predict tree RESULTS`: the token tree sized for this hardware, per batch size and node budget.

The model is analysis/trees.py: the run's acceptance by depth and sibling rank (`measured_trees`), the draft's
cost per level measured by the run, and here the target's verification of 1 to budget + 1 tokens profiled on
this machine at each batch size (analysis/costs.py `profile`: a cache of random values at the run's context);
this module loads the target, profiles, and prints the choices with the `--set` that runs each.
"""

from __future__ import annotations

from rich.table import Table

from sdbench.analysis.costs import profile
from sdbench.analysis.trees import Acceptance, TreeChoice, hardware_trees, interpolated, measured_trees
from sdbench.commands.predict import fitting_points
from sdbench.config import PredictTreeConfig
from sdbench.errors import SdbenchError
from sdbench.models import loader  # the module: tests replace loader.load_model
from sdbench.models.pair import resolve_device, resolve_dtype, say_note
from sdbench.reporting import results  # the module: tests replace results.read_results


def profiled_widths(depth: int, budgets, side: int = 0) -> list[int]:
    """The drafted-token counts whose verification is timed: every chain up to the measured depth, each budget,
    and the powers of two between (costs in between are interpolated), each with the `side` nodes every
    verification also feeds (lookahead's window)."""
    top = max(budgets)
    powers = [2**k for k in range(top.bit_length() + 1) if 2**k <= top]
    return sorted({w + side for w in {*range(1, depth + 1), *budgets, *powers}})


def _percent(row) -> str:
    return " / ".join(f"{x:.0%}" for x in row)


def describe(measured, acc: Acceptance, by_depth: bool) -> str:
    ranks = acc.ranks - 1
    if by_depth:
        shown = "; ".join(f"depth {d + 1}: {_percent(row)}" for d, row in enumerate(acc.p))
        how = "per depth and rank"
    else:
        shown = _percent(acc.p[0])
        how = f"per rank, pooled over depths 1..{acc.depth}"
    return (f"acceptance of {measured.strategy} on {measured.target} over {measured.rounds} rounds, {how} (given "
            f"its elder siblings were rejected): {shown}; ranks 0..{ranks} and depths 1..{acc.depth} measured, "
            "nodes beyond them count as never accepted")


def run_predict_tree(cfg: PredictTreeConfig, console) -> list[TreeChoice]:
    from sdbench.models.runner import ModelRunner  # loads transformers (slow): only profiling needs it

    measured = measured_trees(results.read_results(list(cfg.results)), cfg.strategy)
    acc = Acceptance.from_counts(measured.tried, measured.accepted, cfg.by_depth)
    c = cfg.draft_cost if cfg.draft_cost is not None else measured.draft_cost
    if c is None:
        raise SdbenchError("these results have no baseline to measure the draft's cost against: give --draft-cost "
                           "(one draft level over one target step)")
    target = cfg.target or measured.target
    batches = cfg.batches or measured.batches
    context = cfg.context or measured.context
    if context < 1:
        raise SdbenchError(f"--context {context}: must be at least 1")
    dev = resolve_device(cfg.device)
    dt = resolve_dtype(cfg.dtype or measured.dtype or "float32", dev)
    side = measured.side
    widths = profiled_widths(acc.depth, cfg.budgets, side)
    fits = fitting_points(target, dt, dev, batches, (context,), max(widths), console)
    console.print(describe(measured, acc, cfg.by_depth), highlight=False, soft_wrap=True)
    source = "--draft-cost" if cfg.draft_cost is not None else "the run's drafting time per level over its baseline's step"
    console.print(f"draft cost c = {c:.3f} of a target step per level ({source})", highlight=False)
    with console.status(f"loading {target}"):
        loaded = loader.load_model(target, dev, dt)
        runner = ModelRunner(loaded.model, target, fast=cfg.fast)
    say_note(loaded, console)
    costs = {}
    with console.status("profiling verification"):
        for b, s in fits:
            p = profile(runner, b, s, widths, ())
            costs[b] = interpolated({1: 1.0, **{g + 1: t / p.target_s for g, t in p.verify_s.items()}})
    if side:
        console.print(f"each verification of {measured.strategy} also feeds {side} side nodes (its window): a tree "
                      f"of n nodes is verified at n + {side + 1} tokens", highlight=False)
    choices = hardware_trees(acc, lambda b, w: costs[b](w + side), c, sorted(costs), cfg.budgets)
    console.print(choice_table(choices, target, dev, context))
    print_settings(choices, measured.strategy, console)
    return choices


def choice_table(choices: list[TreeChoice], target: str, device, context: int) -> Table:
    table = Table(title=f"{target} on {device}, context {context}: the tree with the most predicted tokens/s per "
                        "batch size and node budget",
                  caption="acc.len: expected tokens per round, bonus included; v = T(nodes + 1) / T(1) profiled "
                          "here; chain: the best chain for the same acceptance and costs")
    for col in ("batch", "budget", "nodes", "depth", "acc.len", "v", "predicted", "chain", "vs chain"):
        table.add_column(col, justify="right")
    best = {}
    for ch in choices:
        if ch.batch not in best or ch.speedup > best[ch.batch].speedup:
            best[ch.batch] = ch
    for ch in choices:
        mark = " *" if best[ch.batch] is ch else ""
        table.add_row(str(ch.batch), str(ch.budget), str(len(ch.tree)), str(ch.tree.max_depth),
                      f"{ch.accepted_len:.2f}", f"{ch.verify_cost:.2f}", f"{ch.speedup:.2f}x{mark}",
                      f"γ={ch.chain_gamma} {ch.chain_speedup:.2f}x", f"{ch.vs_chain:.2f}x")
    return table


def print_settings(choices: list[TreeChoice], strategy: str, console) -> None:
    """The settings that run each chosen tree (a static tree: `--gamma D --set tree_shape=...`)."""
    from sdbench.strategies.spec import tree_growers

    shaped = sorted(n for n, settings in tree_growers().items() if "tree_shape" in settings)
    if strategy not in shaped:
        console.print(f"note: the shapes are run by a strategy that takes a static tree ({', '.join(shaped)}); "
                      f"{strategy} grows its trees from what it finds", highlight=False)
    for ch in choices:
        console.print(f"batch {ch.batch}, budget {ch.budget}: --gamma {ch.tree.max_depth} --set "
                      f"tree_shape=\"{ch.tree.to_vllm()}\"", highlight=False, soft_wrap=True)
