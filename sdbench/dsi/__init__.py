"""Distributed speculative inference (DSI): speculation parallelism over a pool of target workers.

ledger.py        the bookkeeping of one generation (committed tokens, drafts, verification jobs), pure Python;
                 the real orchestrator and the simulator drive the same Ledger
worker.py        one target replica with its own KV cache (the code every backend runs)
pools.py         backends: worker processes (torch.multiprocessing) or Ray actors
orchestrator.py  the real decode: a drafter thread plus result handling, over a pool
(analysis/dsi_sim.py: expected latency of plain decoding, SI and DSI, offline and online, on the same Ledger)
"""
