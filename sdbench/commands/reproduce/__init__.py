"""`sdbench reproduce PAPER`: a paper's experiment scaled to this machine, its claims beside the measurements.

One module per paper, each with `reproduce(cfg: ReproduceConfig, folder, console) -> Report`; the shared
parts (claims, report folder, page) are in common.py. A paper is added by writing its module and pointing
its line in `papers` at it.
"""

from __future__ import annotations

from rich.console import Console

from sdbench.commands.reproduce.common import Claim, ReproduceConfig, claims_table, write_report
from sdbench.registry import Registry

papers: Registry = Registry("paper")
papers.add("dsi", "sdbench.commands.reproduce.dsi:reproduce",
           "Distributed Speculative Inference of Large Language Models (Timor et al., arXiv 2405.14105)")
papers.add("magicdec", "sdbench.commands.reproduce.magicdec:reproduce",
           "MagicDec: Breaking the Latency-Throughput Tradeoff for Long Context Generation with Speculative Decoding "
           "(Sadhukhan, Chen et al., arXiv 2408.11049, ICLR 2025)")
papers.add("adaptive", "sdbench.commands.reproduce.adaptive:reproduce",
           "A Drop-In Solution for On-the-Fly Adaptation of Speculative Decoding in Large Language Models "
           "(Liu, Park, Shen, ACL 2025)")
papers.add("polybasic", "sdbench.commands.reproduce.polybasic:reproduce",
           "Polybasic Speculative Decoding Through a Theoretical Perspective "
           "(Wang et al., ICML 2025, arXiv 2510.26527)")


def run_paper(name: str, cfg: ReproduceConfig, console=None) -> list[Claim]:
    """Run one paper's reproduction, write its report folder, print its claims; return the claims."""
    console = console or Console()
    entry = papers.entry(name)
    reproduce = entry.load()
    folder = cfg.folder(entry.name)
    report = reproduce(cfg, folder, console)
    page = write_report(report, folder)
    console.print(claims_table(report.claims, title=f"{entry.name}: {report.title}"))
    for note in report.notes:
        console.print(note, highlight=False)
    console.print(f"report: {page}", highlight=False)
    return report.claims
