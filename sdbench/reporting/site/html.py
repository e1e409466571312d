"""The site's HTML: a page's shell (its assets and navigation, relative so the site opens from the file system and
any static host), tables that DataTables makes sortable and filterable, filters above them, charts plotly.js draws
from their figure's JSON, notices and downloads. Every text is escaped here.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from typing import Callable

import pandas as pd

NAV = (("index.html", "Leaderboard"), ("runs.html", "Runs"), ("sweeps.html", "Sweeps"),
       ("studies.html", "Tune studies"), ("engines.html", "Engines"), ("reproductions.html", "Reproductions"), ("comparisons.html", "Comparisons"))


def esc(text) -> str:
    return html.escape("" if text is None else str(text))


@dataclass(frozen=True)
class Column:
    """A table column: its header, the frame's column, how a value shows, and optionally a link per row."""

    header: str
    field: str
    show: Callable = str
    link: Callable | None = None  # row -> href (relative to the page), or None for no link on that row
    numeric: bool = False
    clip: bool = False  # a long text: cut to the column's width, whole on hover


def missing(value) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def _cell(column: Column, row) -> str:
    value = row.get(column.field)
    text = "–" if missing(value) else column.show(value)
    order = ""
    if column.numeric:
        order = f' data-order="{-1e300 if missing(value) else float(value):.17g}"'
    href = column.link(row) if column.link else None
    body = f'<a href="{esc(href)}">{esc(text)}</a>' if href else esc(text)
    clip = f' class="sd-clip" title="{esc(text)}"' if column.clip else ""
    return f"<td{order}{clip}>{body}</td>"


def table(frame: pd.DataFrame, columns: list[Column], table_id: str, caption: str = "") -> str:
    """A table DataTables enhances (sorting, search); numbers sort by value, not by their text."""
    head = "".join(f"<th>{esc(c.header)}</th>" for c in columns)
    body = "\n".join("<tr>" + "".join(_cell(c, row) for c in columns) + "</tr>"
                     for row in frame.to_dict("records"))
    cap = f"<caption>{esc(caption)}</caption>" if caption else ""
    return (f'<table id="{esc(table_id)}" class="sd-table display compact">{cap}<thead><tr>{head}</tr></thead>'
            f"<tbody>\n{body}\n</tbody></table>")


def filters(frame: pd.DataFrame, columns: list[Column], table_id: str, names: dict[str, str]) -> str:
    """A select per named column (field -> its default choice, "" for all), filtering the table on exact values."""
    index = {c.field: i for i, c in enumerate(columns)}
    out = []
    for field, default in names.items():
        values = sorted({str(v) for v in frame[field].dropna()} if field in frame else set())
        options = [f'<option value=""{" selected" if not default else ""}>all</option>']
        options += [f'<option value="{esc(v)}"{" selected" if v == default else ""}>{esc(v)}</option>' for v in values]
        header = columns[index[field]].header
        out.append(f'<label>{esc(header)} <select class="sd-filter" data-table="{esc(table_id)}" '
                   f'data-column="{index[field]}" data-name="{esc(field)}">{"".join(options)}</select></label>')
    return f'<div class="sd-filters">{"".join(out)}</div>'


def chart(figure: dict | None, chart_id: str) -> str:
    """A chart plotly.js draws from the figure's JSON (nothing when there is no figure)."""
    if figure is None:
        return ""
    data = json.dumps(figure, allow_nan=False).replace("</", "<\\/")
    return (f'<div class="sd-chart" id="{esc(chart_id)}"></div>'
            f'<script type="application/json" class="sd-figure" data-for="{esc(chart_id)}">{data}</script>')


def notice(lines: list[str], kind: str = "warn") -> str:
    if not lines:
        return ""
    items = "".join(f"<li>{esc(line)}</li>" for line in lines)
    return f'<div class="sd-notice sd-{kind}"><ul>{items}</ul></div>'


def downloads(links: list[tuple[str, str]]) -> str:
    """Links to a table's files, e.g. [("data/leaderboard.csv", "CSV"), ...]."""
    items = " · ".join(f'<a class="sd-download" href="{esc(href)}" download>{esc(label)}</a>' for href, label in links)
    return f'<p class="sd-downloads">Download: {items}</p>'


def facts(pairs: list[tuple[str, object]]) -> str:
    """A definition list of the pairs whose value is known."""
    items = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in pairs if not missing(v) and v != "")
    return f'<dl class="sd-facts">{items}</dl>'


def page(title: str, body: str, depth: int = 0, built: str = "") -> str:
    """A whole page: `depth` folders below the site's root (its links climb back with ../)."""
    up = "../" * depth
    nav = " ".join(f'<a href="{up}{href}">{esc(name)}</a>' for href, name in NAV)
    assets = (f'<link rel="stylesheet" href="{up}assets/tables.css"><link rel="stylesheet" href="{up}assets/site.css">'
              f'<script src="{up}assets/plotly.min.js"></script><script src="{up}assets/tables.js"></script>'
              f'<script src="{up}assets/site.js" defer></script>')
    foot = f'<footer>built by sdbench {esc(built)}</footer>' if built else ""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)} · sdbench</title>'
            f'{assets}</head>\n<body><nav class="sd-nav">{nav}</nav>\n<h1>{esc(title)}</h1>\n{body}\n{foot}'
            f"</body></html>\n")
