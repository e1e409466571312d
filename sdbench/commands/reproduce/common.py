"""What every paper's reproduction shares: the claims, the report folder and its one self-contained page.

A paper's module returns a Report: its claims (the paper's words, the measured counterpart, a verdict and
why), the measurements as tables, the figures as PNG bytes and the setup. `write_report` writes the folder:
one Parquet file per table (claims.parquet too), one PNG per figure and report.html, whose first section is
the claims table, then the figures, the tables and the setup (device, dtype, versions, commit).

gpu-check imports this module before its preflight has checked that the packages it needs are installed, so
torch (through the sdbench modules that load it), pandas, numpy and matplotlib are imported inside the functions
that use them.
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.table import Table

from sdbench.config import DEFAULT_OUT, DEFAULT_TARGET
from sdbench.paths import output_dir

HOLDS = "holds"
FAILS = "does not hold here"
UNTESTABLE = "cannot be tested here"
VERDICTS = (HOLDS, FAILS, UNTESTABLE)
COLOURS = {HOLDS: "green", FAILS: "red", UNTESTABLE: "yellow"}
HTML_COLOURS = {HOLDS: "#d9f2d9", FAILS: "#f9d6d5", UNTESTABLE: "#fcf1c7"}


@dataclass(frozen=True)
class ReproduceConfig:
    target: str = DEFAULT_TARGET
    draft: str | None = None  # None: the target drafts for itself
    quick: bool = False  # a few minutes on a small CPU
    out: str | None = None  # None: results/reproduce-PAPER
    device: str = "auto"
    dtype: str = "float32"

    @property
    def drafter(self) -> str:
        return self.draft or self.target

    @property
    def small_draft(self) -> str:
        """--draft, else the target's int8 copy where one can be made (float32 on a CPU), else the target: the
        cheaper model that magicdec's small draft, adaptive's model candidate and polybasic's middle level use."""
        from sdbench.models.loading.pair import resolve_device  # not at import: see the module's docstring
        from sdbench.models.loading.variants import split_variant

        if self.draft:
            return self.draft
        cpu = resolve_device(self.device).type == "cpu"
        if cpu and self.dtype == "float32" and split_variant(self.target)[1] is None:
            return f"{self.target}@int8"
        return self.target

    def folder(self, paper: str) -> Path:
        return output_dir(self.out or f"{DEFAULT_OUT}/reproduce-{paper}")


@dataclass(frozen=True)
class Claim:
    """One claim of a paper beside what was measured here."""

    claim: str  # the paper's claim, in words
    measured: str  # the measured counterpart, as text
    verdict: str  # HOLDS, FAILS or UNTESTABLE
    why: str = ""  # what the verdict rests on (always given for UNTESTABLE)
    value: float | None = None  # the measured number, when one sums it up
    where: str = ""  # where in the paper

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, not {self.verdict!r}")
        if self.verdict == UNTESTABLE and not self.why:
            raise ValueError("a claim that cannot be tested here must say why")


@dataclass(frozen=True)
class Figure:
    name: str  # file name without .png
    title: str
    png: bytes


@dataclass
class Report:
    paper: str  # registry name, e.g. "dsi"
    title: str  # the paper's title and authors
    claims: list[Claim]
    tables: dict = field(default_factory=dict)  # name -> DataFrame (written as NAME.parquet)
    figures: list[Figure] = field(default_factory=list)
    setup: dict = field(default_factory=dict)  # environment and settings
    notes: list[str] = field(default_factory=list)  # plain sentences shown under the claims
    heading: str = ""  # the page's title [default: sdbench reproduce PAPER]


ENVIRONMENT_KEYS = ("device", "dtype", "cpu", "cpu_count", "gpu", "torch_version", "transformers_version",
                    "sdbench_version", "git_commit", "platform", "python_version")


def environment_facts(cfg: ReproduceConfig) -> dict:
    """The machine and software a reproduction ran on (the first rows of every report's setup)."""
    from sdbench.env import environment  # not at import: see the module's docstring
    from sdbench.models.loading.pair import resolve_device

    env = environment(str(resolve_device(cfg.device)), cfg.dtype)
    return {key: env.get(key) for key in ENVIRONMENT_KEYS}


def verdict(ok: bool) -> str:
    return HOLDS if ok else FAILS


def claims_frame(claims: list[Claim]):
    import pandas as pd  # not at import: see the module's docstring

    return pd.DataFrame([asdict(c) for c in claims], columns=list(Claim.__dataclass_fields__))


def claims_table(claims: list[Claim], title: str = "claims"):
    """The claims as a rich table: claim, measured here, verdict (coloured) and why."""
    table = Table(title=title, show_lines=True)
    for col, ratio in (("claim", 3), ("measured here", 3), ("verdict", 1), ("why", 3)):
        table.add_column(col, ratio=ratio, overflow="fold")
    for c in claims:
        table.add_row(c.claim, c.measured, f"[{COLOURS[c.verdict]}]{c.verdict}[/]", c.why)
    return table


def pyplot():
    """matplotlib's pyplot on the file-only backend: reports are written, never shown."""
    import matplotlib  # slow to import, and only figures need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(ax, positions, series) -> None:
    """One bar per (label, values) of `series` at each position, side by side within 0.8 of a unit."""
    import numpy as np  # not at import: see the module's docstring

    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series):
        ax.bar(np.asarray(positions, dtype=float) + (i - (len(series) - 1) / 2) * width, values, width, label=label)


def figure_png(fig) -> bytes:
    """A matplotlib figure as PNG bytes (the figure is closed)."""
    import matplotlib.pyplot as plt  # slow to import, and only figures need it

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_report(report: Report, folder: Path) -> Path:
    """Parquet per table, PNG per figure and report.html into `folder`; returns the page's path."""
    folder = output_dir(folder)
    claims_frame(report.claims).to_parquet(folder / "claims.parquet", index=False)
    for name, frame in report.tables.items():
        frame.to_parquet(folder / f"{name}.parquet", index=False)
    for fig in report.figures:
        (folder / f"{fig.name}.png").write_bytes(fig.png)
    page = folder / "report.html"
    page.write_text(render_page(report), encoding="utf-8")
    return page


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; margin: 1rem 0; font-size: 14px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; vertical-align: top; text-align: left; }
th { background: #f3f3f3; }
figure { margin: 1.5rem 0; }
figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { color: #555; font-size: 14px; }
"""


def render_page(report: Report) -> str:
    """One self-contained page: claims first, then figures (inlined as base64), tables and setup."""
    esc = html.escape
    rows = "\n".join(
        f'<tr style="background:{HTML_COLOURS[c.verdict]}"><td>{esc(c.claim)}</td><td>{esc(c.measured)}</td>'
        f"<td><b>{esc(c.verdict)}</b></td><td>{esc(c.why)}</td></tr>" for c in report.claims)
    notes = "".join(f"<p>{esc(n)}</p>" for n in report.notes)
    figures = "\n".join(
        f'<figure><img src="data:image/png;base64,{base64.b64encode(f.png).decode("ascii")}" '
        f'alt="{esc(f.title)}"><figcaption>{esc(f.title)}</figcaption></figure>' for f in report.figures)
    tables = "\n".join(f"<h3>{esc(name)}</h3>\n{_frame_html(frame)}" for name, frame in report.tables.items())
    setup = "\n".join(f"<tr><th>{esc(str(k))}</th><td>{esc(_fmt(v))}</td></tr>" for k, v in report.setup.items())
    title = report.heading or f"sdbench reproduce {report.paper}"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f"<style>{STYLE}</style></head>\n<body><h1>{esc(title)}</h1>\n<p>{esc(report.title)}</p>\n"
            f'<section id="claims"><h2>Claims</h2>\n<table><tr><th>claim</th><th>measured here</th><th>verdict</th>'
            f"<th>why</th></tr>\n{rows}\n</table>{notes}</section>\n"
            f'<section id="figures"><h2>Figures</h2>\n{figures or "<p>no figures</p>"}</section>\n'
            f'<section id="tables"><h2>Measurements</h2>\n{tables}</section>\n'
            f'<section id="setup"><h2>Setup</h2>\n<table>{setup}</table></section>\n</body></html>\n')


def _frame_html(frame) -> str:
    return frame.to_html(index=False, float_format=lambda x: f"{x:.4g}", na_rep="-", border=0)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else "-"
    return "-" if value is None else str(value)
