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
from sdbench.errors import SdbenchError
from sdbench.strategies.base import BuildContext, Option, Proposer, need_gamma


class DSI(Proposer):
    name = "dsi"
    decoder = "dsi"
    options = (
        Option("workers", 2, "target workers: processes on the CPU, one GPU each on CUDA"),
        Option("backend", "process", "where workers run: process (this machine) or ray (a Ray cluster, or "
                                     "Ray's local one)", str),
        Option("threads", 0, "torch threads per worker and for the drafter; 0 = cores / (workers + 1)"),
    )

    def __init__(self, draft, gamma: int, workers: int = 2, backend: str = "process", threads: int = 0):
        need_gamma(self.name, gamma)
        if workers < 1:
            raise SdbenchError(f"--set workers={workers}: need at least 1")
        if threads < 0:
            raise SdbenchError(f"--set threads={threads}: need 0 (automatic) or more")
        from sdbench.dsi.pools import BACKENDS

        if backend not in BACKENDS:
            raise SdbenchError(f"--set backend={backend}: use one of {', '.join(BACKENDS)}")
        super().__init__(gamma)
        self.draft, self.workers, self.backend, self.threads = draft, workers, backend, threads

    def params(self) -> dict:
        return {"gamma": self.gamma, "workers": self.workers, "backend": self.backend}

    @classmethod
    def check(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        greedy_only(sampling)
        cls(None, gamma, **options)  # the constructor checks every setting and touches no model

    @classmethod
    def build(cls, ctx: BuildContext) -> Proposer:
        if not ctx.drafts or isinstance(ctx.drafts[0], str):
            raise SdbenchError("strategy 'dsi' needs a draft model: pass --draft MODEL (the target itself works)")
        return cls(ctx.drafts[0], ctx.gamma, **ctx.options)

