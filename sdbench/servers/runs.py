"""`run --engine`: a run's role decoded by an engine's server instead of sdbench's loop, one prompt per request, each
reply turned into the BatchResult the loop returns and counted by engine/metrics.py's definitions: the tokens the
stream gave, timed from the client (prefill included), the engine's own drafted and accepted counters, and one
target step per token after the first that was not an accepted draft."""

from __future__ import annotations

from dataclasses import replace

from sdbench.config import SamplingConfig
from sdbench.engine.counters import BatchResult, RowStats
from sdbench.servers.engines import Engine, EngineRole, Reply, reply_rounds, request_seed
from sdbench.strategies.base import Proposer

ENGINE_DECODER = "engine"  # sdbench/decoders.py: the server decodes, not the loop


class EngineDecoding(Proposer):
    """A role of a run that an engine's server decodes: it proposes nothing to sdbench's loop, which never runs it
    (its decoder is the server's). `system` is its server's EngineSystem while the run's servers are up. url: the
    user's own server (--engine-url), which decodes as it was started."""

    decoder = ENGINE_DECODER

    def __init__(self, engine: Engine, role: EngineRole, url: str | None = None):
        super().__init__(role.gamma)
        self.engine, self.role, self.url = engine, role, url
        self.name = engine.name
        self.system = None  # servers/systems.py EngineSystem

    @property
    def counted(self) -> bool:
        """Its replies carry acceptance counters to record (a user's server may run any decoding)."""
        return self.role.speculative or self.url is not None

    def params(self) -> dict:
        if self.url is not None:
            return {"gamma": None, "engine": self.engine.name, "url": self.url}
        params = {"gamma": self.role.gamma, "engine": self.engine.name,
                  "decoding": self.engine.own_names[self.role.strategy]}
        if self.role.strategy not in ("autoregressive", "ngram", "draft"):  # a trained head's strategy
            params["head"] = self.role.draft
        return params


def row_stats(reply: Reply, counted: bool, gamma: int | None = None) -> RowStats:
    """A reply's counters as a row's: every token after the first is an accepted draft or a target step's own, so
    steps = (new tokens - 1) - accepted (`reply_rounds`, γ the role's); without counters, one step per token after
    the first."""
    if not counted or reply.drafted is None:
        return RowStats(steps=max(len(reply.tokens) - 1, 0))
    steps, drafted, accepted = reply_rounds(reply, gamma)
    return RowStats(steps=steps, drafted=drafted, accepted=accepted)


def generate(target, proposer: EngineDecoding, prompts: list[list[int]], *, max_new_tokens: int,
             sampling: SamplingConfig = SamplingConfig(), generator=None, **_) -> BatchResult:
    """engine/loop.generate's counterpart for an engine's role: each prompt one request (one after another, so the
    batch's wall and first-token times are summed over them, as for any decoder that runs prompts in turn). A
    sampled request's seed comes from the generator's (the run's seed, repeat and batch) and the prompt."""
    if proposer.system is None:
        raise RuntimeError(f"{proposer.engine.name}: no server is running for this role")
    outputs, rows, extras, wall, first = [], [], [], 0.0, 0.0
    for prompt in prompts:
        asked = None
        if not sampling.greedy:
            base = generator.initial_seed() if generator is not None else sampling.seed
            asked = replace(sampling, seed=request_seed(base, prompt))
        reply = proposer.system.ask(prompt, max_new_tokens, asked)
        proposer.system.settle()  # timed by its own reply: the wait for the server to go quiet is not
        outputs.append(reply.tokens)
        rows.append(row_stats(reply, proposer.counted, None if proposer.url is not None else proposer.role.gamma))
        extras.append({"engine_accepted_per_position": reply.accepted_by_position}
                      if reply.accepted_by_position else {})
        wall += reply.seconds
        first += reply.ttft if reply.ttft is not None else reply.seconds
    return BatchResult(outputs, [len(p) for p in prompts], rows, wall, first, extras)
