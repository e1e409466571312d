"""Which decoder runs a proposer: the one decode loop (engine/loop.py), DSI's (dsi/decoder.py), or an engine's
server (`run --engine`: servers/runs.py).

A strategy declares it (`Proposer.decoder`); the command asks here and calls the decoder, so the loop never
hands control back to a strategy. Every decoder takes engine.loop.generate's arguments and returns its
BatchResult, counted by engine/metrics.py's definitions.
"""

from __future__ import annotations

from sdbench.dsi.decoder import generate as dsi_generate
from sdbench.engine.loop import generate

SEQUENTIAL = "sequential"
DECODERS = (SEQUENTIAL, "dsi", "engine")


def decoder_for(proposer):
    """The decode function for this proposer."""
    if proposer.decoder == SEQUENTIAL:
        return generate
    if proposer.decoder == "dsi":
        return dsi_generate
    if proposer.decoder == "engine":
        from sdbench.servers.runs import generate as engine_generate  # the HTTP client: only a run --engine

        return engine_generate
    raise ValueError(f"unknown decoder {proposer.decoder!r} (known: {', '.join(DECODERS)})")
