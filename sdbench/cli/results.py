"""Commands over results already written: list, report, profile, compare and the schedules tune wrote."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sdbench.cli.params import console
from sdbench.commands.schedule_formats import schedule_formats
from sdbench.reporting.profile_formats import profile_formats


def list_(what: Annotated[str, typer.Argument(help="strategies, datasets, models or engines")]):
    """What is registered, and whether each model/dataset/engine is available offline right now."""
    from sdbench.commands.listing import show

    show(what, console)


def report(
    paths: Annotated[list[str], typer.Argument(help="Parquet files, .parts folders, result folders, or quoted patterns of them ('fleet/*/current')")],
    plots: Annotated[Optional[str], typer.Option(help="also write PNG plots into this folder")] = None,
    html: Annotated[Optional[str], typer.Option(help="also write one self-contained HTML page: tables and plots")] = None,
    by: Annotated[Optional[list[str]], typer.Option("--by", help="split the summary by these columns (repeatable), e.g. --by turn [default: category]")] = None,
    explain: Annotated[bool, typer.Option("--explain", help="also break each speedup into the factors that multiply to it, and show other tools' definitions")] = False,
):
    """Print the tables of earlier runs; optionally PNG plots and an HTML page."""
    from sdbench.reporting.carry import bench_files, print_bench
    from sdbench.reporting.report import marked_partial, print_report
    from sdbench.reporting.results import read_results
    from sdbench.reporting.sweep import print_frontier

    benches = bench_files(paths)
    for path in benches:  # `bench --out`'s files: their carry-over tables
        print_bench(path, console)
    paths = [p for p in paths if p not in benches]
    if benches and not paths:
        return
    df = marked_partial(read_results(paths))
    print_report(df, console, by=tuple(by or ()))
    print_frontier(df, console)  # rows of a sweep: its best setting per point and where SD stops paying
    if explain:
        from sdbench.analysis.tree_explain import explain_trees
        from sdbench.reporting.explain import print_explain

        print_explain(df, console, explain_trees(df))
    if plots or html:
        from sdbench.reporting.html import export

        for path in export(df, plots, html):
            console.print(f"wrote {path}", highlight=False)


def profile(
    paths: Annotated[list[str], typer.Argument(help="results as `report` takes them: Parquet files, .parts folders, result folders, or quoted patterns of them")],
    format: Annotated[str, typer.Option("--format", help=f"{', '.join(profile_formats.names())} (docs/results.md, 'Speculation profiles')")] = "json",
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="file to write [default: print it]")] = None,
    run: Annotated[Optional[str], typer.Option("--run", help="only this run's configurations: its RUN_ID")] = None,
    strategy: Annotated[Optional[str], typer.Option("--strategy", help="only this configuration: its label as the tables show it ('draft gamma=2') or its strategy")] = None,
):
    """Acceptance by draft position of each configuration, conditional and marginal, as JSON or engines' synthetic rates."""
    from sdbench.commands.profile import write_profile

    write_profile(paths, format, out, run, strategy, console)


def compare(
    baseline: Annotated[str, typer.Argument(help="baseline results: Parquet file, folder, or a quoted pattern of "
                                                 "folders ('fleet/*/baseline'; several machines: matched per hardware)")],
    current: Annotated[str, typer.Argument(help="current results: Parquet file, folder, or a quoted pattern of "
                                                "folders ('fleet/*/current')")],
    max_regression: Annotated[float, typer.Option(help="percent drop of a median that fails the gate")] = 5.0,
    across: Annotated[str, typer.Option(help="settings the two sides may differ in, e.g. max-new-tokens,dtype "
                                             "(max-new-tokens, temperature, top-p, seed, dtype, fast)")] = "",
    out: Annotated[Optional[str], typer.Option("--out", help="also write the comparison as Parquet into this folder "
                                                             "(`sdbench site` shows it)")] = None,
):
    """Regression gate: tokens/s and speedup deltas per matched prompt; exit 1 on a regression or lossy output,
    2 on bad input or on results run with different settings (unless --across names them)."""
    from sdbench.reporting.compare import run_compare

    run_compare([baseline], [current], max_regression, console, across, out)


def site(
    paths: Annotated[list[str], typer.Argument(help="results folders and files: runs, sweeps, tune studies, bench files, "
                                                    "reproductions (searched recursively)")],
    out: Annotated[str, typer.Option("--out", "-o", help="folder to write the site into")] = "site",
):
    """A static site of many runs and machines: a sortable, filterable leaderboard, a page per run with its charts
    and command, sweeps, tune studies, engines' carry-over and reproductions; opens from the file system."""
    from sdbench.reporting.site.build import build_site

    built = build_site(paths, out, console)
    console.print(f"site: {built.runs} runs, {built.pages} pages in {built.seconds:.1f} s: {built.out / 'index.html'}",
                  highlight=False)


schedule_app = typer.Typer(no_args_is_help=True, help="Schedules that `tune --batch` wrote: show or export them.")
ScheduleName = Annotated[str, typer.Argument(help="the schedule preset's name")]


@schedule_app.command("show")
def schedule_show(name: ScheduleName):
    """The schedule's entries: batch size (and prompt length), settings, tuned value."""
    from sdbench.commands.schedule import show_schedule

    show_schedule(name, console)


@schedule_app.command("export")
def schedule_export(
    name: ScheduleName,
    format: Annotated[str, typer.Option("--format", help=f"{', '.join(schedule_formats.names())} (docs/commands.md, 'schedule export')")] = "vllm",
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="file to write [default: print it]")] = None,
    batch: Annotated[Optional[int], typer.Option("--batch", help="only the bucket a server of this batch size runs (its slots: llama.cpp -np, SGLang --max-running-requests)")] = None,
):
    """The schedule in the form each engine loads as it is: vLLM's --speculative-config, TensorRT-LLM's YAML,
    SGLang's and llama.cpp's server arguments, or sdbench's json."""
    from sdbench.commands.schedule import export_schedule

    export_schedule(name, format, out, console, batch)
