"""The one decode loop: propose -> verify -> commit -> observe -> record.

Every strategy runs through `generate`; plain decoding is the proposer that proposes nothing. Speculation
parallelism (DSI) changes the control flow itself: it has its own decoder (dsi/decoder.py), which the command
chooses (sdbench/decoders.py) and which still commits by the same rule (engine/step.py) and counts by the same
definitions (engine/metrics.py).

Serving under load (`serve`) runs the same rounds with an admission point between them: a `Scheduler`
(engine/scheduler.py) frees the slots of finished requests and hands over arrived ones, which are prefilled into
their slot and join the running batch (continuous batching at step granularity).
"""

from __future__ import annotations

import torch

from sdbench.config import SamplingConfig
from sdbench.engine.clock import Marks, now
from sdbench.engine.counters import BatchResult, RowStats
from sdbench.engine.hidden import Taps, TargetStates
from sdbench.engine.runner import Runner
from sdbench.engine.sampling import choose
from sdbench.engine.scheduler import Scheduler
from sdbench.engine.state import DecodeState, Proposal, needed_capacity
from sdbench.engine.step import Round, verify_and_commit
from sdbench.engine.tree import TreeBatch
from sdbench.errors import SdbenchError
from sdbench.forward_step import Step


def generate(target: Runner, proposer, prompts: list[list[int]], *, max_new_tokens: int, sampling: SamplingConfig,
           eos_ids=(), generator: torch.Generator | None = None, capacity: int = 0, rounds=None) -> BatchResult:
    """Decode a batch of prompts with the target, drafting through `proposer`.

    capacity: the least KV length to allocate (a warm-up passes the longest batch's, so that static-shape
    caches and their CUDA graphs are made during the warm-up and reused by the measured batches). rounds: what
    runs once the prompts are prefilled, their first tokens committed and the proposer begun, as
    rounds(target, proposer, state, rows) [default: the decoding's rounds; a probe times the proposer's
    drafting on the started state instead, as `bench` does]."""
    if max_new_tokens < 1:
        raise SdbenchError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    if proposer.decoder != "sequential":  # this loop would decode plainly and look right: refuse instead
        raise ValueError(f"strategy '{proposer.name}' runs on the '{proposer.decoder}' decoder, not this loop: "
                         "call sdbench.decoders.decoder_for(proposer)")
    capacity = max(capacity, needed_capacity(max(len(p) for p in prompts), max_new_tokens, proposer.max_lookahead))
    rows = [RowStats() for _ in prompts]
    t_start = now(target.device)
    cache = target.new_cache(len(prompts), capacity)
    state = DecodeState.for_prompts(prompts, max_new_tokens, capacity, eos_ids=eos_ids, sampling=sampling,
                                    generator=generator, device=target.device, target_cache=cache)
    try:
        check_trees(target, proposer, cache)
        return _run(target, proposer, state, prompts, rows, t_start, rounds or _rounds)
    finally:  # caches go back for reuse by the next generation when shapes are static (CUDA graphs),
        # in the order they were taken, so that each is taken again for the same role with its graphs
        target.release(cache)
        proposer.end()


def _run(target: Runner, proposer, state: DecodeState, prompts, rows: list[RowStats], t_start: float,
         rounds) -> BatchResult:
    dev = state.device
    taps = _taps(proposer)
    first, _ = choose(target.prefill(state.target_cache, prompts, taps=taps), state.sampling, state.generator)
    for b, t in enumerate(first.tolist()):
        state.commit(b, [t])
    ttft = now(dev) - t_start
    t0 = now(dev)
    proposer.begin(state)
    if taps is not None:  # the prompts' states: a head drafts from them
        proposer.see_target(TargetStates(taps.states(), [0] * state.batch, [len(p) for p in prompts]))
    setup = now(dev) - t0
    for r in rows:  # the draft's own prefill (or cache compression) is drafting cost too
        r.draft_s += setup

    rounds(target, proposer, state, rows)
    wall = now(dev) - t_start
    return BatchResult([state.generated(b) for b in range(state.batch)], state.prompt_lengths, rows, wall, ttft,
                       [proposer.row_stats(b) for b in range(state.batch)],
                       setup_s=setup, width_varied=_varied(state.target_cache))


def _varied(cache) -> int | None:
    """The target cache's count of width-varied forwards (kv/cache.py `varied`); None for a cache that keeps none."""
    return getattr(cache, "varied", None)


def serve(target: Runner, proposer, scheduler: Scheduler, *, sampling: SamplingConfig, eos_ids=(),
          generator: torch.Generator | None = None, capacity: int = 0) -> Scheduler:
    """Serve the scheduler's requests as they arrive (continuous batching at step granularity): a running batch
    of scheduler.slots rows, which requests join as slots free and leave at EOS or their budget. Returns the
    scheduler, whose requests now hold their tokens, times and counters, and duration_s the whole serving time.

    The rounds are the ones `generate` runs; between rounds the loop admits (`_admit`)."""
    if not proposer.rows_join:  # the command refuses it earlier, in its own words
        raise SdbenchError(f"strategy '{proposer.name}' cannot take requests joining a running batch")
    longest = max(len(r.prompt) for r in scheduler.requests)
    most = max(r.max_new_tokens for r in scheduler.requests)
    capacity = max(capacity, needed_capacity(longest, most, proposer.max_lookahead))
    cache = target.new_cache(scheduler.slots, capacity)
    state = DecodeState.idle(scheduler.slots, capacity, eos_ids=eos_ids, sampling=sampling, generator=generator,
                             device=target.device, target_cache=cache)
    rows = [RowStats() for _ in range(scheduler.slots)]  # each slot's: its request's counters once one joins
    try:
        check_trees(target, proposer, cache)
        proposer.begin(state)
        scheduler.start()
        _rounds(target, proposer, state, rows, scheduler)
        scheduler.duration_s = scheduler.elapsed()
        scheduler.width_varied = _varied(cache)
        return scheduler
    finally:
        target.release(cache)
        proposer.end()


def some_rounds(target: Runner, proposer, state: DecodeState, rows: list[RowStats], most: int) -> None:
    """At most `most` of the decoding's rounds, as `generate` runs them (a probe times its rounds one at a time)."""
    _rounds(target, proposer, state, rows, most=most)


def _rounds(target: Runner, proposer, state: DecodeState, rows: list[RowStats], admission: Scheduler | None = None,
            most: int | None = None) -> None:
    """propose -> verify -> commit -> observe -> record, until every row is done (or `most` rounds have run); with
    an admission point (serving under load), until the scheduler has no request left, admitting between rounds.

    A round's time by part, each between two marks of the one clock (`RoundClock`): drafting (the proposer's
    propose), verification (the target's forward), acceptance (the verdict, its sampling, the commit and what the
    target's cache and states keep of it), the proposer's bookkeeping after the verdict (observe) and the loop's
    own (recording, the wait for the next round)."""
    clock, played = RoundClock(state.device), 0
    while most is None or played < most:
        played += 1
        clock.top()
        if admission is not None:
            _admit(target, proposer, state, rows, admission)
            if admission.finished:
                break
        if all(state.done):
            if admission is None:
                break
            continue  # requests that joined already finished (a one-token budget, an EOS first): free them
        t0 = clock.marks.mark()
        proposal = proposer.propose(state)
        t1 = clock.marks.mark()
        if proposal is not None:  # cut to what each row can still commit (the proposer observes the cut)
            proposal = proposal.fit(state.lookahead(proposal.tokens.shape[1]))
        rnd = _verify(target, proposer, state, proposal or Proposal.empty(state.batch), clock.marks)
        t3 = clock.marks.mark()
        # the verdict has reached the host (the round's one wait), so every mark of the round up to it can be read
        rnd.draft_s, rnd.verify_s = clock.marks.seconds(t0, t1), clock.marks.seconds(t1, rnd.forward_at)
        rnd.accept_s = clock.marks.seconds(rnd.forward_at, t3)
        clock.settle(rows)  # the previous round's bookkeeping, done before this round's wait
        at = admission.elapsed() if admission is not None else None
        for b in range(state.batch):
            if rnd.active[b]:
                rows[b].add_step(rnd.drafted[b], rnd.committed[b], rnd.draft_s, rnd.verify_s, accept_s=rnd.accept_s,
                                 **rnd.counts(b))
                if admission is not None:
                    admission.running[b].committed(at, rnd.kept[b])
        t4 = clock.marks.mark()
        proposer.observe(state, proposal, rnd)
        clock.observed(t3, t4, [b for b in range(state.batch) if rnd.active[b]])
    clock.settle(rows, wait=True)


class RoundClock:
    """The marks of a round's parts after its verdict: the loop's recording, the proposer's observe and the loop's
    own work until the top of the next round (an admission under load is none of them). Observe may queue device
    work, so they are read at the next round's verdict, or after a wait at the end."""

    def __init__(self, device):
        self.marks = Marks(device)
        self.device = device
        self.pending = None  # (verdict's mark, observe's start, its end, the rows that took part[, the next top])

    def top(self) -> None:
        if self.pending is not None and len(self.pending) == 4:
            self.pending += (self.marks.mark(),)

    def observed(self, verdict, start, active: list[int]) -> None:
        self.pending = (verdict, start, self.marks.mark(), active)

    def settle(self, rows: list[RowStats], wait: bool = False) -> None:
        """Add the pending round's observe and loop seconds to the rows that took part in it."""
        if self.pending is None:
            return
        if wait:
            now(self.device)
        verdict, start, end, active, *top = self.pending
        self.pending = None
        observe_s = self.marks.seconds(start, end)
        loop_s = self.marks.seconds(verdict, start) + (self.marks.seconds(end, top[0]) if top else 0.0)
        for b in active:
            rows[b].observe_s += observe_s
            rows[b].loop_s += loop_s


def _admit(target: Runner, proposer, state: DecodeState, rows: list[RowStats], sched: Scheduler) -> None:
    """The admission point between rounds: finished requests leave their slots, arrived requests take the free
    ones. A joining request is prefilled alone into its slot of the target's cache (a row starts at position
    0 again), its first token committed, and the proposer told (a draft model prefills its own cache row)."""
    for b in sched.leaving(state.done):
        sched.leave(b, state.generated(b), proposer.row_stats(b))
    joins = sched.joining()
    for b, req in joins:
        req.scheduled_s = sched.elapsed()
        first, _ = choose(target.prefill(state.target_cache.row(b), [req.prompt]), state.sampling, state.generator)
        state.restart(b, req.prompt, req.max_new_tokens)
        state.commit(b, first.tolist())  # read back to the host: the prefill has finished
        at = sched.elapsed()
        req.prefill_s = at - req.scheduled_s
        req.committed(at, 1)
        rows[b] = req.stats
    if joins:
        t0 = now(state.device)
        proposer.begin_rows(state, [b for b, _ in joins])
        setup = now(state.device) - t0
        for _, req in joins:  # the draft's own prefill is drafting cost, as in `generate`
            req.stats.draft_s += setup


def _taps(proposer) -> Taps | None:
    """The target's states to keep when the proposer reads them, else None (nothing is kept)."""
    layers = getattr(proposer, "hidden_layers", ())
    return Taps(layers) if layers else None


def _verify(target: Runner, proposer, state: DecodeState, proposal: Proposal, marks: Marks) -> Round:
    """One target forward over [last committed token, drafts...] per row, then the verify-and-commit step;
    a proposer that reads the target's hidden states is then given those of the tokens just committed to the
    target's cache (the last committed token and the accepted drafts).

    The target cache holds every committed token but the last; writing from there overwrites whatever a
    rejected draft left behind, which is the whole of rewinding. A tree proposal is one tree forward (the last
    committed token as every tree's root), after which each row's cache keeps its accepted path in order, and a
    proposer reading the target's states is given those of the root and the accepted path, in order.
    """
    start = [n - 1 for n in state.lengths]
    taps = _taps(proposer)
    tokens, trees = proposal.block(state.last_tokens())
    # a tree's forward takes each row's tree, with its root
    step = Step(tokens, start, taps=taps, tree=None if trees is None else TreeBatch.of(trees))
    logits = target.run(state.target_cache, step)  # [B, T, V]
    forward_at = marks.mark()
    # side nodes (after each row's drafts) are no candidates: verification reads the drafts' rows only
    rnd = verify_and_commit(state, proposal, logits[:, : proposal.tokens.shape[1] + 1], state.sampling,
                            state.generator)
    rnd.width, rnd.forward_at = tokens.shape[1], forward_at
    if proposal.side is not None:
        rnd.side_argmax = _side_argmax(logits, proposal.side_columns())
    if proposal.trees is not None:
        _keep_paths(state.target_cache, start, rnd)
    if taps is not None:
        count = [a + 1 if on else 0 for a, on in zip(rnd.accepted, rnd.active)]
        states = taps.states()  # [B, G+1, S] (a tree's: the root's, then each node's)
        if proposal.trees is not None:
            states = _path_states(states, rnd)
        proposer.see_target(TargetStates(states, start, count))
    return rnd


def _side_argmax(logits: torch.Tensor, columns: list[list[int]]) -> list[list[int]]:
    """The target's argmax [B][S_b] at each row's side-node columns of logits [B, T, V] (read after the verdict,
    so no further wait)."""
    width = max(map(len, columns), default=0)
    if not width:
        return [[] for _ in columns]
    index = torch.tensor([c + [0] * (width - len(c)) for c in columns], dtype=torch.long, device=logits.device)
    best = logits.gather(1, index[..., None].expand(-1, -1, logits.shape[-1])).argmax(-1).tolist()  # [B, S]
    return [row[: len(c)] for row, c in zip(best, columns)]


def _path_states(states: torch.Tensor, rnd: Round) -> torch.Tensor:
    """The states [B, G+1, S] of a tree forward's nodes (the root first) -> those of each row's root and accepted
    path, in order [B, T, S]: the committed tokens' states, as a chain's forward gives them (as `_keep_paths`
    keeps their keys)."""
    rows = [[0] + [i + 1 for i in path] for path in rnd.paths]
    index = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for b, row in enumerate(rows):
        index[b, : len(row)] = torch.tensor(row)
    index = index.to(states.device)[..., None].expand(-1, -1, states.shape[-1])
    return states.gather(1, index)


def _keep_paths(cache, start: list[int], rnd: Round) -> None:
    """After a tree forward, each taking-part row's cache keeps its accepted path at start + 1, ... (a path of
    the first nodes in order is already there)."""
    for b, path in enumerate(rnd.paths):
        if rnd.active[b] and path != list(range(len(path))):
            cache.keep_path(b, start[b], [i + 1 for i in path])  # node i of a tree is node i + 1 of its block


def check_trees(target: Runner, proposer, cache) -> None:
    """Refuse, before anything runs, a tree-proposing strategy on a runner or cache without tree forwards."""
    if not getattr(proposer, "proposes_trees", False):
        return
    why = target.tree_refusal(cache, nodes=proposer.max_lookahead + 1)  # the verifying forward: drafts and root
    if why:
        raise SdbenchError(why)
