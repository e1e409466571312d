"""`sdbench report --html FILE`: one self-contained page, the report's tables plus its plots inlined as base64;
and `export`, what `--plots DIR` and `--html FILE` write together."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import pandas as pd
from rich.console import Console

from sdbench.paths import output_dir
from sdbench.reporting.plots import render, write_plots
from sdbench.reporting.report import print_report
from sdbench.reporting.summary import summarize
from sdbench.reporting.sweep import print_frontier
from sdbench.reporting.tables import summary_table

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; }
pre.tables { font-size: 12px; line-height: 1.25; overflow-x: auto; background: #fff; }
figure { margin: 1.5rem 0; }
figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { color: #555; font-size: 14px; }
"""


def tables_html(df: pd.DataFrame, width: int = 150) -> str:
    """The tables `sdbench report` prints, as HTML with inline colours; per data set too when there are several."""
    console = Console(record=True, width=width, file=io.StringIO(), color_system="truecolor")
    print_report(df, console)
    print_frontier(df, console)
    if "dataset" in df and df["dataset"].nunique() > 1:
        console.print(summary_table(summarize(df, by=("dataset", "category")), title="by data set and category"))
    return console.export_html(inline_styles=True, code_format='<pre class="tables">{code}</pre>')


def page(df: pd.DataFrame, plots: list, title: str = "sdbench report") -> str:
    figures = "\n".join(
        f'<figure><img src="data:image/png;base64,{base64.b64encode(p.png).decode("ascii")}" '
        f'alt="{html.escape(p.title)}"><figcaption>{html.escape(p.title)}</figcaption></figure>'
        for p in plots
    )
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head>\n<body><h1>{html.escape(title)}</h1>\n{tables_html(df)}\n"
            f"<h2>Plots</h2>\n{figures or '<p>no plottable data</p>'}\n</body></html>\n")


def write_html(df: pd.DataFrame, path: str | Path, plots: list | None = None) -> Path:
    path = Path(path)
    output_dir(path.parent, "--html")
    path.write_text(page(df, render(df) if plots is None else plots), encoding="utf-8")
    return path


def export(df: pd.DataFrame, plots_dir: str | None, html_file: str | None) -> list[Path]:
    """What `sdbench report --plots/--html` writes; the plots are drawn once for both."""
    plots = render(df)
    written = write_plots(df, plots_dir, plots) if plots_dir else []
    if html_file:
        written.append(write_html(df, html_file, plots))
    return written
