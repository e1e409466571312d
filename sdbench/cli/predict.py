"""Commands that predict rather than measure: predict, simulate and reproduce."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sdbench import config as C
from sdbench.cli.params import Dataset, Device, Dtype, Fast, Limit, MaxNew, Seed, Target, console
from sdbench.errors import SdbenchError
from sdbench.options import parse_counts


predict_app = typer.Typer(no_args_is_help=True, help="What the cost models predict, from given or profiled costs.")


@predict_app.command("speedup")
def predict_speedup(
    alpha: Annotated[float, typer.Option(help="per-token acceptance rate, 0..1")],
    gamma: Annotated[str, typer.Option("--gamma", "-g", help="lookahead, or a list like 1,2,4,8")] = "1,2,3,4,6,8",
    draft_cost: Annotated[float, typer.Option(help="one draft forward / one target forward")] = 0.1,
    verify_cost: Annotated[float, typer.Option(help="one verification of gamma+1 tokens / one target forward")] = 1.0,
    target: Annotated[Optional[str], typer.Option("--target", "-t", help="measure the costs at this model's shape "
                                                  "instead (MODEL@random works): --draft-cost/--verify-cost ignored")] = None,
    draft: Annotated[Optional[str], typer.Option("--draft", "-d", help="with --target: the draft model [default: the target]")] = None,
    context: Annotated[int, typer.Option(help="with --target: the prompt length the costs are measured at")] = 256,
    device: Device = "auto", dtype: Dtype = "float32",
    block: Annotated[bool, typer.Option("--block", help="a block drafter (DFlash, DSpark, P-EAGLE, PARD): one draft forward per round "
                                        "drafts all gamma tokens, --draft-cost is that forward's")] = False,
    overhead: Annotated[float, typer.Option(help="a round's cost beyond its forwards (host work, a draft's setup per "
                                            "round) / one target forward: bench's o; measured with --target")] = 0.0,
):
    """Expected tokens per step and speedup of draft-model SD under the i.i.d. acceptance model."""
    from sdbench.commands.predict_speedup import run_speedup

    run_speedup(alpha, parse_counts(gamma, low=1), draft_cost, verify_cost, console, target=target, draft=draft,
                context=context, device=device, dtype=dtype, block=block, overhead=overhead)


@predict_app.command("magicdec")
def predict_magicdec(
    target: Target = C.DEFAULT_TARGET,
    batch: Annotated[str, typer.Option(help="batch sizes to profile")] = "1,4,8",
    context: Annotated[str, typer.Option(help="context lengths (tokens) to profile")] = "256,1024,4096",
    gamma: Annotated[str, typer.Option("--gamma", "-g", help="lookaheads to consider")] = "1,2,3,4,6",
    budget: Annotated[str, typer.Option(help="draft KV budgets to consider")] = "64,256,512",
    alpha: Annotated[float, typer.Option(help="acceptance rate to assume where no run measured it")] = 0.8,
    from_results: Annotated[Optional[list[str]], typer.Option("--from", help="magicdec results: fit alpha per budget")] = None,
    device: Device = "auto", dtype: Dtype = "float32",
    out: Annotated[Optional[str], typer.Option(help="folder for the profile as Parquet")] = None,
    fast: Fast = True,
):
    """Profile target, sparse-draft and verify step times; predict the best gamma and budget per batch and
    context, and the critical sequence length above which self-speculation beats plain decoding."""
    from sdbench.commands.predict import run_predict

    if not 0.0 <= alpha <= 1.0:
        raise SdbenchError(f"--alpha {alpha}: expected a rate between 0 and 1")
    cfg = C.PredictMagicdecConfig(target, parse_counts(batch, "--batch", 1), parse_counts(context, "--context", 1),
                                  parse_counts(gamma, low=1), parse_counts(budget, "--budget", 1), alpha,
                                  tuple(from_results or ()), device, dtype, out, fast)
    run_predict(cfg, console)


@predict_app.command("chain")
def predict_chain(
    candidate: Annotated[str, typer.Option(help="model to insert into the chain, e.g. smollm2-135m@int8")],
    target: Target = C.DEFAULT_TARGET,
    draft: Annotated[Optional[list[str]], typer.Option("--draft", "-d", help="the chain as it is: one level per --draft, top down (ngram allowed last)")] = None,
    at: Annotated[int, typer.Option(help="insert under the target (0) or under the N-th --draft")] = 0,
    gamma: Annotated[int, typer.Option("--gamma", "-g", help="the bottom drafter's tokens per block")] = C.DEFAULT_GAMMA,
    mu: Annotated[str, typer.Option(help="tokens each middle level gathers before handing up (one value; default 2*gamma, doubling upwards)")] = "",
    dataset: Dataset = C.DEFAULT_DATASET, limit: Limit = C.DEFAULT_LIMIT, max_new_tokens: MaxNew = 48,
    profile_prompts: Annotated[int, typer.Option(help="prompts in the profiling pass")] = 2,
    profile_tokens: Annotated[int, typer.Option(help="tokens per prompt in the profiling pass")] = 16,
    device: Device = "cpu", dtype: Dtype = "float32", seed: Seed = 0,
    temperature: Annotated[float, typer.Option(help="the profiling pass again under sampling at this temperature, "
                                                    "for the accepted-length variance per level (0: greedy only)")] = 1.0,
):
    """Polybasic insertion test: predict from a short profiling pass whether inserting --candidate into the
    chain lowers the time per token, then measure both chains (and plain decoding) on the same prompts."""
    from sdbench.commands.predict_chain import run_chain_prediction

    run_chain_prediction(C.PredictChainConfig(target, tuple(draft or ()), candidate, at, gamma, mu, dataset, limit,
                                              max_new_tokens, profile_prompts, profile_tokens, device, dtype, seed,
                                              temperature), console)


@predict_app.command("tree")
def predict_tree(
    results: Annotated[Optional[list[str]], typer.Argument(help="a run's results (files or folders) that measured a tree")] = None,
    acceptance: Annotated[Optional[str], typer.Option(help="a shipped acceptance table instead of results (needs --target and --draft-cost; an unknown NAME lists the known)")] = None,
    budget: Annotated[str, typer.Option(help="node budgets: the most drafted nodes a tree may have")] = "4,8,16,32",
    batch: Annotated[Optional[str], typer.Option(help="batch sizes to profile [default: the run's; with --acceptance 1]")] = None,
    by_depth: Annotated[bool, typer.Option("--by-depth", help="acceptance per depth and rank (default: per rank, pooled over depths)")] = False,
    draft_cost: Annotated[Optional[float], typer.Option(help="one draft level / one target step [default: measured by the run against its baseline]")] = None,
    target: Annotated[Optional[str], typer.Option("--target", "-t", help="the model whose verification is profiled [default: the run's target]")] = None,
    context: Annotated[Optional[int], typer.Option(help="context length the costs are profiled at [default: the run's mean prompt + half its new tokens; with --acceptance 1024]")] = None,
    device: Device = "auto",
    dtype: Annotated[Optional[str], typer.Option(help="float32, bfloat16 or float16 [default: the run's]")] = None,
    fast: Fast = True,
    strategy: Annotated[Optional[str], typer.Option("--strategy", "-s", help="the rows of this strategy or preset only (a run with --compare holds several)")] = None,
):
    """The token tree with the most predicted tokens/s per batch size and node budget, from the run's acceptance by
    depth and sibling rank (or a shipped table's) and the cost of verifying N tokens profiled on this machine
    (Sequoia's programme)."""
    from sdbench.commands.predict_tree import run_predict_tree

    if draft_cost is not None and not draft_cost >= 0:
        raise SdbenchError(f"--draft-cost {draft_cost}: expected 0 or more")
    cfg = C.PredictTreeConfig(tuple(results or ()), parse_counts(budget, "--budget", 1),
                              parse_counts(batch, "--batch", 1) if batch else (), by_depth, draft_cost, target,
                              context, device, dtype, fast, strategy, acceptance)
    run_predict_tree(cfg, console)


simulate_app = typer.Typer(no_args_is_help=True, help="Simulated latency of decoding algorithms (no models run).")


@simulate_app.command("dsi")
def simulate_dsi(
    target_latency: Annotated[float, typer.Option(help="one target forward (seconds; 1 = count forwards)")] = 1.0,
    c: Annotated[float, typer.Option("--c", help="drafter latency: one draft forward / one target forward")] = 0.1,
    a: Annotated[Optional[float], typer.Option("--a", help="per-token acceptance rate, 0..1 [default: 0.8; with "
                                               "--from the run's measured one, unless its weights are random]")] = None,
    k: Annotated[int, typer.Option("--k", help="lookahead: drafted tokens per verification")] = 4,
    workers: Annotated[int, typer.Option(help="DSI target workers")] = 7,
    tokens: Annotated[int, typer.Option(help="tokens to generate")] = 1000,
    repeats: Annotated[int, typer.Option(help="simulated generations averaged online")] = 20,
    grid: Annotated[int, typer.Option(help="heat-map resolution: grid+1 values of c and of a")] = 20,
    kmax: Annotated[int, typer.Option(help="largest lookahead the heat-map tries per cell")] = 200,
    seed: Seed = 0,
    from_results: Annotated[Optional[list[str]], typer.Option("--from", help="an sdbench run: take target latency, c, a, k and workers from it")] = None,
    target: Annotated[Optional[str], typer.Option("--target", "-t", help="measure the target latency and c at this "
                                                  "model's shape instead (MODEL@random works)")] = None,
    draft: Annotated[Optional[str], typer.Option("--draft", "-d", help="with --target: the drafter [default: the target]")] = None,
    context: Annotated[int, typer.Option(help="with --target: the prompt length the latencies are measured at")] = 256,
    device: Device = "auto", dtype: Dtype = "float32",
    out: Annotated[str, typer.Option(help="folder for dsi-heatmap.parquet and dsi-heatmap.png")] = C.DEFAULT_OUT,
):
    """Expected latency of plain decoding, SI and DSI (offline by counting, online by a timed simulation),
    and the DSI paper's four heat-map panels across drafter latency and acceptance."""
    from sdbench.commands.simulate import run_simulation

    run_simulation(C.SimulateDSIConfig(target_latency, c, a, k, workers, tokens, repeats, grid, kmax, seed,
                                       tuple(from_results or ()), target, draft, context, device, dtype, out), console)


def reproduce(
    paper: Annotated[str, typer.Argument(help="dsi, magicdec, adaptive or polybasic")],
    target: Target = C.DEFAULT_TARGET,
    draft: Annotated[Optional[str], typer.Option(
        "--draft", "-d", help="draft model [default: dsi the target itself; magicdec's small draft, adaptive's model "
        "candidate and polybasic's middle level the target's int8 copy on a float32 CPU]")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="fewer prompts and tokens: a few minutes on a small CPU")] = False,
    out: Annotated[Optional[str], typer.Option(help="report folder [default: results/reproduce-PAPER]")] = None,
    device: Device = "auto", dtype: Dtype = "float32",
):
    """A paper's experiment on this machine: its claims beside the measurements, each with a verdict, and a
    report folder (Parquet, PNGs, one self-contained HTML page with the claims first)."""
    from sdbench.commands.reproduce import ReproduceConfig, run_paper

    run_paper(paper, ReproduceConfig(target, draft, quick, out, device, dtype), console)
