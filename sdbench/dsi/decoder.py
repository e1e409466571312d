"""DSI's decoder: what `run` calls instead of the one decode loop for a strategy that declares `decoder = "dsi"`.

Speculation parallelism changes the control flow itself (drafting never waits for a verification), so it is a
decoder beside engine/loop.py's, chosen by the command (sdbench/decoders.py), not a proposer the loop hands
control back to. It decodes a batch one prompt after another (dsi/orchestrator.py) and counts by
engine/metrics.py's definitions (strategies/dsi.py says how).
"""

from __future__ import annotations

from sdbench.dsi.orchestrator import RowDecode, torch_threads
from sdbench.dsi.pools import default_threads, discard_pool, get_pool
from sdbench.engine.counters import BatchResult
from sdbench.errors import SdbenchError


def greedy_only(sampling) -> None:
    if not sampling.greedy:
        raise SdbenchError("strategy 'dsi' decodes greedily only: use --temperature 0")


def generate(target, proposer, prompts: list[list[int]], *, max_new_tokens: int, sampling, eos_ids=(),
             generator=None, capacity: int = 0) -> BatchResult:
    """Decode each prompt with DSI (proposer: strategies/dsi.py's settings and draft), one after another; the
    signature is engine.loop.generate's (capacity unused: every worker sizes its own cache)."""
    greedy_only(sampling)
    threads = proposer.threads or default_threads(proposer.workers)
    target.share_plain()  # workers receive the plain weights (packed ones cannot be shared)
    pool = get_pool(proposer.backend, target, proposer.workers, threads)
    outcomes = []
    try:
        with torch_threads(threads):
            for prompt in prompts:
                outcomes.append(RowDecode(pool, proposer.draft, list(prompt), lookahead=proposer.gamma,
                                          workers=proposer.workers, max_new_tokens=max_new_tokens, eos=eos_ids,
                                          sampling=sampling, generator=generator).run())
    except BaseException:  # workers may still be busy with this generation, or broken
        discard_pool(pool)
        raise
    extras = [{**o.extras, "backend": proposer.backend} for o in outcomes]
    return BatchResult([o.tokens for o in outcomes], [len(p) for p in prompts], [o.stats for o in outcomes],
                       sum(o.wall_s for o in outcomes), sum(o.ttft_s for o in outcomes), extras)
