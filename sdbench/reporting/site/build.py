"""`sdbench site RESULTS... --out DIR`: a static site of every run, sweep, tune study, bench file and reproduction
under the paths given. The leaderboard (index.html), a page per run, the other kinds' pages (site/kinds.py) and
every table's CSV and Parquet under data/; the libraries under assets/ (site/assets.py). Nothing needs a server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from rich.console import Console

from sdbench import __version__
from sdbench.paths import output_dir
from sdbench.reporting.bounds import bound_notes
from sdbench.reporting.owned import check_folder, publish, staged
from sdbench.reporting.site import charts, kinds
from sdbench.reporting.site.assets import check_libraries, write_assets
from sdbench.reporting.site.board import leaderboard, position_text, summaries
from sdbench.reporting.site.html import Column, chart, downloads, filters, notice, page, table
from sdbench.reporting.site.kinds import write_table
from sdbench.reporting.site.sources import Found, Run, collect
from sdbench.reporting.stats import MIN_PROMPTS


@dataclass
class Built:
    out: Path
    runs: int
    pages: int
    problems: int
    seconds: float


def _x(v) -> str:
    return f"{float(v):.2f}x"


def _f2(v) -> str:
    return f"{float(v):.2f}"


def _lossless(v) -> str:
    return "yes" if bool(v) else "NO"


def _yes(v) -> bool:
    return v is not None and not pd.isna(v) and bool(v)


def board_columns(depth: int = 0) -> list[Column]:
    """The leaderboard's columns (also a run page's table); links climb `depth` folders to the site's root."""
    up = "../" * depth
    return [
        Column("strategy", "strategy"), Column("settings", "settings", clip=True), Column("target", "target"),
        Column("draft", "draft"), Column("data set", "dataset"), Column("category", "category"),
        Column("turn", "turn"), Column("batch", "batch_size", numeric=True),
        Column("context", "prompt_len", numeric=True), Column("γ", "gamma", lambda v: f"{float(v):g}", numeric=True),
        Column("prompts", "n_prompts", numeric=True), Column("speedup", "speedup", _x, numeric=True),
        Column("95 % interval", "interval"), Column("accepted length per step", "mean_accepted_len", _f2, numeric=True),
        Column("acceptance", "acceptance_rate", _f2, numeric=True), Column("lossless", "lossless", _lossless),
        Column("tokens/s", "tokens_per_s", lambda v: f"{float(v):.1f}", numeric=True),
        Column("predicted", "predicted_speedup", _x, numeric=True), Column("hardware", "hardware"),
        Column("device", "device"), Column("dtype", "dtype"),
        Column("run", "run_id", link=lambda r: f"{up}runs/{r['run_id']}.html"), Column("note", "note"),
        Column("by position", "by_position"),
    ]


def shown(board: pd.DataFrame) -> pd.DataFrame:
    """The board with the cells that join several figures: the interval, acceptance by position, a note."""
    out = board.copy()
    out["interval"] = [f"{lo:.2f}–{hi:.2f}" if pd.notna(lo) and pd.notna(hi) else
                       "too few prompts" if pd.notna(n) and n < MIN_PROMPTS else None
                       for lo, hi, n in zip(board["speedup_low"], board["speedup_high"], board["n_prompts"])]
    out["by_position"] = [position_text(r) for r in board["acceptance_by_position"]]
    notes = []
    for partial, random, distorted, busy, bound in zip(board["partial"], board["weights_say_nothing"],
                                                       board["distorted"], board["busy"], board["speedup_bound"]):
        said = (["partial run"] if isinstance(partial, str) else []) + (["random weights"] if random else [])
        said += [f"above its bound {bound:.2f}x: one side's time moved"] if _yes(distorted) else []
        said += ["busy machine"] if _yes(busy) else []
        notes.append(", ".join(said))
    out["note"] = notes
    return out


def index_page(out: Path, found: Found, board: pd.DataFrame, paths: list[str]) -> str:
    lines = kinds.problem_lines(found)
    if not found.runs:
        lines.insert(0, f"no runs found under {', '.join(paths)}")
    partial = sorted({r for r in board["run_id"][board["partial"].notna()]})
    body = [notice(lines, "error"),
            notice([f"run {r} stopped before its end: {found.runs[r].partial}" for r in partial])]
    body.append("<p>Each speedup is against the plain decoding of its own run, on the same prompts; rows of different "
                "machines are never pooled (the hardware column names each). Click a header to sort; the filters and "
                "the search box choose the rows.</p>")
    columns = board_columns()
    body.append(filters(board, columns, "leaderboard", {"strategy": "", "target": "", "dataset": "",
                                                         "category": "ALL", "turn": "ALL", "hardware": ""}))
    body.append(table(shown(board), columns, "leaderboard"))
    body.append(downloads(write_table(out, board, "leaderboard")))
    body.append(chart(charts.gamma_lines(board), "chart-gamma"))
    return page("Leaderboard", "\n".join(body), built=__version__)


def run_page(out: Path, run: Run, summary: pd.DataFrame) -> str:
    """runs/RUN_ID.html: the run's facts and command, its table, charts and files."""
    board = leaderboard(summary)
    links = [(f"../{h}", label) for h, label in write_table(out, board, f"runs/{run.run_id}-summary")]
    files = kinds.run_files(out, run)
    body = [notice([f"this run stopped before its end: {run.partial}"] if run.partial else []),
            notice(bound_notes(summary)), kinds.run_facts(run), downloads(files + links)]
    columns = board_columns(depth=1)
    if len(board):
        body.append(filters(board, columns, "run-table", {"category": "ALL", "turn": "ALL"}))
        body.append(table(shown(board), columns, "run-table"))
    body.append(kinds.served_table(out, run))
    for name, figure in (("speedup", charts.speedup_bars(board)), ("acceptance", charts.acceptance_lines(board)),
                         ("parts", charts.round_parts(summary)), ("gamma", charts.gamma_lines(board))):
        body.append(chart(figure, f"chart-{name}"))
    return page(f"Run {run.run_id}", "\n".join(body), depth=1, built=__version__)


def build_site(paths: list[str], out: str | Path, console: Console) -> Built:
    """Builds the site; every problem with a file is one line on the terminal and a notice on the index. The folder
    is a new one or an earlier site's: a rebuild replaces only the files the earlier build wrote (reporting/owned.py),
    so it shows only what is there now and never removes a file of the user's."""
    started = time.perf_counter()
    check_libraries()
    check_folder(Path(out))
    found = collect(paths)
    folder = output_dir(out)
    with staged(folder) as staging:
        pages = write_pages(staging, found, paths, console)
        publish(staging, folder)
    for line in kinds.problem_lines(found):
        console.print(f"site: {line}", highlight=False)
    if not found.runs:
        console.print(f"site: no runs found under {', '.join(paths)}", highlight=False)
    return Built(folder, len(found.runs), pages, len(found.problems), time.perf_counter() - started)


def write_pages(folder: Path, found: Found, paths: list[str], console: Console) -> int:
    """Every page, table and asset of the site under `folder`; returns the number of pages."""
    write_assets(folder)
    rows = found.rows()
    summary = summaries(rows, {r.run_id: r.partial for r in found.runs.values() if r.partial})
    board = leaderboard(summary)
    pages = {"index.html": index_page(folder, found, board, paths)}
    for i, (run_id, run) in enumerate(found.runs.items()):
        if console.is_terminal:  # progress where someone watches; logs get the summary line alone
            console.print(f"site: run {i + 1}/{len(found.runs)}: {run_id}", highlight=False)
        pages[f"runs/{run_id}.html"] = run_page(folder, run, summary[summary["run_id"] == run_id])
    pages.update(kinds.other_pages(folder, found, board, rows))
    for name, text in pages.items():
        output_dir((folder / name).parent).joinpath(Path(name).name).write_text(text, encoding="utf-8")
    return len(pages)
