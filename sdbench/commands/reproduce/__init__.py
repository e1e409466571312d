"""`sdbench reproduce PAPER`: a paper's experiment scaled to this machine, its claims beside the measurements.

One module per paper, each with `reproduce(cfg: ReproduceConfig, folder, console) -> Report`; the shared
parts (claims, report folder, page) are in common.py. A paper is added by writing its module and pointing
its line in `papers` at it (a target of None means "not implemented yet").
"""

from __future__ import annotations

from sdbench.commands.reproduce.common import Claim, ReproduceConfig, claims_table, write_report
from sdbench.errors import SdbenchError
from sdbench.registry import Registry

papers: Registry = Registry("paper")
papers.add("dsi", "sdbench.commands.reproduce.dsi:reproduce",
           "Distributed Speculative Inference of Large Language Models (Timor et al., arXiv 2405.14105)")
papers.add("magicdec", "sdbench.commands.reproduce.magicdec:reproduce",
           "MagicDec: Breaking the Latency-Throughput Tradeoff for Long Context Generation with Speculative Decoding "
           "(Sadhukhan, Chen et al., arXiv 2408.11049, ICLR 2025)")
papers.add("adaptive", None, "On-the-fly adaptive speculative decoding")
papers.add("polybasic", None, "Polybasic speculative decoding (chains of drafters)")


class NotImplementedPaper(SdbenchError):
    """A registered paper whose reproduction is not written yet."""


def run_paper(name: str, cfg: ReproduceConfig, console=None) -> list[Claim]:
    """Run one paper's reproduction, write its report folder, print its claims; return the claims."""
    from rich.console import Console

    console = console or Console()
    entry = papers.entry(name)
    reproduce = entry.load()
    if reproduce is None:
        raise NotImplementedPaper(f"reproduce {entry.name}: not implemented yet")
    folder = cfg.folder(entry.name)
    report = reproduce(cfg, folder, console)
    page = write_report(report, folder)
    console.print(claims_table(report.claims, title=f"{entry.name}: {report.title}"))
    for note in report.notes:
        console.print(note, highlight=False)
    console.print(f"report: {page}", highlight=False)
    return report.claims
