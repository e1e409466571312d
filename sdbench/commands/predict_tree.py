"""`sdbench predict tree RESULTS` (or `--acceptance NAME`): the token tree sized for this hardware, per batch size
and node budget.

The model is analysis/trees.py: the run's acceptance by depth and sibling rank (`measured_trees`; or a shipped
table's, `shipped_tables`), the draft's cost per level measured by the run (or given), and here the target's
verification of 1 to budget + 1 tokens profiled on this machine at each batch size (analysis/costs.py `profile`:
a cache of random values at the run's context); this module loads the target, profiles, and prints the choices
with the `--set` that runs each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from rich.table import Table

from sdbench.analysis.costs import profile
from sdbench.analysis.tree_acceptance import measured_trees, shipped_table
from sdbench.analysis.trees import Acceptance, TreeChoice, hardware_trees, interpolated
from sdbench.commands.predict import NATIVE_NEEDED, fitting_points
from sdbench.config import PredictTreeConfig
from sdbench.errors import SdbenchError
from sdbench.models.loading.names import with_weights
from sdbench.models.loading.pair import device_and_dtype, load_models
from sdbench.reporting import results  # the module: tests replace results.read_results


def profiled_widths(depth: int, budgets, side: int = 0) -> list[int]:
    """The drafted-token counts whose verification is timed: every chain up to the measured depth, each budget,
    and the powers of two between (costs in between are interpolated), each with the `side` nodes every
    verification also feeds (lookahead's window)."""
    top = max(budgets)
    powers = [2**k for k in range(top.bit_length() + 1) if 2**k <= top]
    return sorted({w + side for w in {*range(1, depth + 1), *budgets, *powers}})


def relative_verify(p) -> Callable[[int], float]:
    """v(N) = T(N) / T(1) from a profile of verifications (`costs.Profile`: gamma -> the time of gamma + 1
    tokens), interpolated between the widths profiled (`trees.interpolated`)."""
    return interpolated({1: 1.0, **{g + 1: t / p.target_s for g, t in p.verify_s.items()}})


FASTER_THAN_ONE = 0.9  # a wider verification timed below this share of a one-token step: the timing was disturbed


def disturbed_note(profiles: dict) -> str | None:
    """The one line saying that a wider verification was timed faster than a one-token step (batch -> Profile),
    which no forward is: something else ran on the machine while it was profiled; None when none was."""
    low = [(b, g + 1, t / p.target_s) for b, p in profiles.items() for g, t in p.verify_s.items()
           if t / p.target_s < FASTER_THAN_ONE]
    if not low:
        return None
    b, width, v = min(low, key=lambda x: x[2])
    return (f"note: at batch {b} verifying {width} tokens timed {v:.2f} of a one-token step, faster than one token "
            "can be: other work disturbed the profile, and the trees below rest on it; profile again on a quiet "
            "machine")


def _percent(row) -> str:
    return " / ".join(f"{x:.0%}" for x in row)


def describe(what: str, acc: Acceptance, by_depth: bool) -> str:
    ranks = acc.ranks - 1
    if by_depth:
        shown = "; ".join(f"depth {d + 1}: {_percent(row)}" for d, row in enumerate(acc.p))
        how = "per depth and rank"
    else:
        shown = _percent(acc.p[0])
        how = f"per rank, pooled over depths 1..{acc.depth}"
    return (f"acceptance of {what}, {how} (given its elder siblings were rejected): {shown}; ranks 0..{ranks} and "
            f"depths 1..{acc.depth} measured, nodes beyond them count as never accepted")


@dataclass(frozen=True)
class Asked:
    """What the prediction starts from: a run's results or a shipped table, with the run's defaults or ours."""

    acc: Acceptance
    said: str  # what was measured, for the printed line
    c: float
    c_source: str
    target: str
    batches: tuple[int, ...]
    context: int
    dtype: str
    strategy: str | None  # the run's strategy (None: a shipped table)
    side: int = 0  # side nodes every verification of the run also feeds (lookahead's window)


TABLE_BATCHES, TABLE_CONTEXT = (1,), 1024  # --acceptance's defaults: a shipped table holds no run's


def asked(cfg: PredictTreeConfig) -> Asked:
    """The acceptance, draft cost and profiling point from the run's results, or from the shipped table
    --acceptance names (which needs --target and --draft-cost: a table has no run's models or costs)."""
    if cfg.acceptance is not None:
        if cfg.results:
            raise SdbenchError("give a run's results or --acceptance NAME, not both")
        if cfg.strategy is not None:
            raise SdbenchError("--strategy picks the rows of a run's results: a shipped table (--acceptance) has none")
        table = shipped_table(cfg.acceptance)
        missing = [o for o, v in (("--target MODEL", cfg.target), ("--draft-cost C", cfg.draft_cost)) if v is None]
        if missing:
            raise SdbenchError(f"--acceptance {table.name}: give {' and '.join(missing)} (a shipped table holds a "
                               "run's acceptance, not its models or costs)")
        acc = table.acceptance(cfg.by_depth)
        return Asked(acc, f"the shipped table {table.name} ({table.source})", cfg.draft_cost, "--draft-cost",
                     cfg.target, cfg.batches or TABLE_BATCHES, cfg.context or TABLE_CONTEXT, cfg.dtype or "float32",
                     None)
    if not cfg.results:
        raise SdbenchError("give a run's results (RESULTS) or --acceptance NAME (a shipped acceptance table)")
    measured = measured_trees(results.read_results(list(cfg.results)), cfg.strategy)
    acc = Acceptance.from_counts(measured.tried, measured.accepted, cfg.by_depth)
    c = cfg.draft_cost if cfg.draft_cost is not None else measured.draft_cost
    if c is None:
        raise SdbenchError("these results have no baseline to measure the draft's cost against: give --draft-cost "
                           "(one draft level over one target step)")
    source = ("--draft-cost" if cfg.draft_cost is not None
              else "the run's drafting time per level over its baseline's step")
    return Asked(acc, f"{measured.strategy} on {measured.target} over {measured.rounds} rounds", c, source,
                 cfg.target or measured.target, cfg.batches or measured.batches, cfg.context or measured.context,
                 cfg.dtype or measured.dtype or "float32", measured.strategy, measured.side)


def run_predict_tree(cfg: PredictTreeConfig, console) -> list[TreeChoice]:
    a = asked(cfg)
    if a.context < 1:
        raise SdbenchError(f"--context {a.context}: must be at least 1")
    dev, dt = device_and_dtype(cfg.device, a.dtype)
    a = replace(a, target=with_weights(a.target, a.dtype, dev.type == "cpu"))
    widths = profiled_widths(a.acc.depth, cfg.budgets, a.side)
    fits = fitting_points(a.target, dt, dev, a.batches, (a.context,), max(widths), console)
    console.print(describe(a.said, a.acc, cfg.by_depth), highlight=False, soft_wrap=True)
    console.print(f"draft cost c = {a.c:.3f} of a target step per level ({a.c_source})", highlight=False)
    runner = load_models([a.target], dev, dt, console, fast=cfg.fast, native={a.target: NATIVE_NEEDED},
                         fit=False)[a.target].runner  # fitting_points checked the fit, point by point
    costs, profiles = {}, {}
    with console.status("profiling verification"):
        for b, s in fits:
            profiles[b] = p = profile(runner, b, s, widths, ())
            costs[b] = relative_verify(p)
    note = disturbed_note(profiles)
    if note:
        console.print(note, style="yellow", highlight=False, soft_wrap=True)
    if a.side:
        console.print(f"each verification of {a.strategy} also feeds {a.side} side nodes (its window): a tree of n "
                      f"nodes is verified at n + {a.side + 1} tokens", highlight=False)
    choices = hardware_trees(a.acc, lambda b, w: costs[b](w + a.side), a.c, sorted(costs), cfg.budgets)
    console.print(choice_table(choices, a.target, dev, a.context))
    print_settings(choices, a.strategy, console)
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


def print_settings(choices: list[TreeChoice], strategy: str | None, console) -> None:
    """The settings that run each chosen tree (a static tree: `--gamma D --set tree_shape=...`); strategy: the
    run's, noted when it grows its trees itself (None: a shipped table's, no note)."""
    from sdbench.strategies.spec import tree_growers

    shaped = sorted(n for n, settings in tree_growers().items() if "tree_shape" in settings)
    if strategy is not None and strategy not in shaped:
        console.print(f"note: the shapes are run by a strategy that takes a static tree ({', '.join(shaped)}); "
                      f"{strategy} grows its trees from what it finds", highlight=False)
    for ch in choices:
        console.print(f"batch {ch.batch}, budget {ch.budget}: --gamma {ch.tree.max_depth} --set "
                      f"tree_shape=\"{ch.tree.to_vllm()}\"", highlight=False, soft_wrap=True)
