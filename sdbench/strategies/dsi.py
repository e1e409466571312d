"""Distributed speculative inference (DSI): speculation parallelism over a pool of target workers.

The drafter never waits for a verification: every `gamma` drafted tokens go to an idle target worker while
drafting goes on, a verification of the bare committed prefix always runs beside them, and a rejection
cancels every verification built on the rejected draft and restarts drafting from the target's token.
With about 1/(gamma·c) workers (c = draft forward / target forward) it is never slower than plain decoding
and faster than sequential SD in expectation (`sdbench simulate dsi` shows where). The output is the
target's: verification is sdbench.engine.sampling's greedy rule.

This strategy runs on its own decoder (dsi/decoder.py, chosen by the command through sdbench/decoders.py:
speculation parallelism changes control flow) and counts by sdbench.engine.metrics' definitions: the verification of the bare prompt gives the first token (the time to it is the TTFT, as a
prefill's), a step is each later verification that committed tokens, `drafted` counts the drafts it judged
and `accepted` those of them it committed, draft_s is all drafting time (discarded drafts included) and
verify_s the committing verifications' time. The batch's wall time and TTFT are both sums over its prompts
(decoded one after another), so wall - TTFT is the decode phase of every prompt, as for every strategy. Per row it
records the workers, each one's busy fraction, cancelled and redundant verifications and the wall time.

Greedy decoding only: results arrive out of order, and a seed-reproducible lossless sampler across them is
not implemented, so temperature > 0 is refused. A batch is decoded one prompt after another.
"""

from __future__ import annotations

from sdbench.dsi.decoder import greedy_only
from sdbench.dsi.pools import BACKENDS
from sdbench.errors import SdbenchError
from sdbench.strategies.base import Proposer
from sdbench.strategies.spec import BuildContext, Option, Strategy, need_gamma, register


class DSI(Proposer):
    name = "dsi"
    decoder = "dsi"

    def __init__(self, draft, gamma: int, workers: int = 2, backend: str = "process", threads: int = 0):
        super().__init__(gamma)
        self.draft, self.workers, self.backend, self.threads = draft, workers, backend, threads

    def params(self) -> dict:
        return {"gamma": self.gamma, "workers": self.workers, "backend": self.backend}


@register
class DSIStrategy(Strategy):
    name = "dsi"
    help = ("distributed speculative inference: drafting never waits, windows verified on a pool of target "
            "workers (--set workers=N backend=process|ray), greedy only")
    aliases = ("distributed",)
    options = (
        Option("workers", 2, "target workers: processes on the CPU, one GPU each on CUDA"),
        Option("backend", "process", "where workers run: process (this machine) or ray (a Ray cluster, or "
                                     "Ray's local one)", str),
        Option("threads", 0, "torch threads per worker and for the drafter; 0 = cores / (workers + 1)"),
    )
    needs_draft = model_draft = True
    proposer = DSI

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        if sampling is not None:
            greedy_only(sampling)
        need_gamma(cls.name, gamma)
        if options["workers"] < 1:
            raise SdbenchError(f"--set workers={options['workers']}: need at least 1")
        if options["threads"] < 0:
            raise SdbenchError(f"--set threads={options['threads']}: need 0 (automatic) or more")
        if options["backend"] not in BACKENDS:
            raise SdbenchError(f"--set backend={options['backend']}: use one of {', '.join(BACKENDS)}")

    @classmethod
    def build(cls, ctx: BuildContext) -> DSI:
        return DSI(ctx.drafts[0], ctx.gamma, **ctx.options)
