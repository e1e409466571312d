"""DSI on real models: a drafter thread and a result loop around one Ledger, over a pool of target workers.

Two threads share the ledger under one lock:
- the drafter thread drafts one token at a time (the draft model lives in this process, with its own KV
  cache) whenever the ledger wants one, and sends every completed window to an idle worker. It never waits
  for a verification, only for a free worker when a full window is already waiting (pool saturated).
- the calling thread waits for answers, judges them through sdbench.engine.sampling (greedy verification), commits,
  cancels what a rejection invalidated, and sends the next jobs.
Neither forward can be interrupted: a draft begun on a prefix that a rejection discards is dropped when it
completes, and a worker finishes a cancelled verification before it takes the next one (the simulator's
default, non-preemptive mode models exactly this).
"""

from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from sdbench.config import SamplingConfig
from sdbench.dsi.ledger import Job, Ledger
from sdbench.dsi.pools import WorkerFailed
from sdbench.dsi.worker import Task
from sdbench.drafting.model import ModelDrafter
from sdbench.engine.metrics import RowStats, now
from sdbench.engine.state import DecodeState, Proposal, needed_capacity
from sdbench.engine.step import accept

_seq_ids = itertools.count()
POLL_S = 0.5  # how often the waiting thread checks the drafter and the workers' health
STALL_S = 600.0  # no answer for this long while jobs are out: give up


@contextmanager
def torch_threads(n: int):
    """Temporarily run this process's torch ops on n threads (the drafter shares the cores with the workers)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Drafter:
    """One token at a time after a token list, through the one model drafter (batch of one); its cache follows
    the list, rewinds included (drafting/prefix.py). It prefills the prompt on its first draft, in the drafter
    thread, so that the prefill counts as drafting time."""

    def __init__(self, runner, prompt: list[int], capacity: int, sampling: SamplingConfig):
        self.runner = runner
        self.state = DecodeState.for_prompts([prompt], 0, capacity, sampling=sampling, device=runner.device)
        self.model = ModelDrafter(runner)
        self.started = False

    def next_token(self, tokens: list[int]) -> int:
        """The draft after `tokens`, on the host (reading it back is the drafter's wait for its device)."""
        if not self.started:
            self.model.begin(self.state)
            self.started = True
        ctx = torch.tensor([tokens], dtype=torch.long)
        return int(self.model.draft(ctx, [len(tokens)], [1]).tokens[0, 0])

    def end(self) -> None:
        self.model.end()


@dataclass
class RowOutcome:
    tokens: list[int]  # generated (prompt excluded)
    stats: RowStats
    extras: dict
    wall_s: float
    ttft_s: float


@dataclass
class _Shared:
    """What the two threads share besides the ledger (guarded by the same lock)."""

    stop: bool = False
    drafting: bool = False
    error: BaseException | None = None
    draft_s: float = 0.0
    unassigned_draft_s: float = 0.0  # drafting time not yet attributed to a committing step
    drafts_made: int = 0
    answers: int = 0
    busy: list = field(default_factory=list)
    first_draft_s: float = 0.0  # the drafter's first call, which catches up on the prompt (its prefill)
    warm_ids: set = field(default_factory=set)  # the workers' verifications of the bare prompt (their prefill)
    warm_busy_s: float = 0.0
    warm_answers: int = 0


def decode_one(pool, draft_runner, prompt: list[int], *, lookahead: int, workers: int, max_new_tokens: int,
               eos, sampling: SamplingConfig, generator) -> RowOutcome:
    seq = next(_seq_ids)
    capacity = needed_capacity(len(prompt), max_new_tokens, lookahead)
    ledger = Ledger(prompt, lookahead=lookahead, max_new_tokens=max_new_tokens, workers=workers, eos=eos)
    drafter = Drafter(draft_runner, prompt, capacity, sampling)
    cond = threading.Condition()
    shared = _Shared(busy=[0.0] * workers)
    stats = RowStats()

    def send(jobs: list[Job]) -> None:
        for job in jobs:
            pool.submit(job.worker, Task(seq, job.id, capacity, ledger.inputs(job), job.start))

    def judge(job: Job, frontier: int, drafts: list[int]):
        logits = job.result.logits[frontier - job.start :]  # [n + 1, V]: predictions at frontier..end
        proposal = Proposal(torch.tensor([drafts], dtype=torch.long), torch.tensor([len(drafts)]))
        accepted, nxt = accept(proposal, logits[None], sampling, generator)
        return accepted[0], nxt[0]

    # this thread never waits for the device: it does no GPU work of its own (the workers are other processes),
    # and a synchronisation here while the drafter thread captures a CUDA graph would break the capture
    t0 = now()
    with cond:
        warm = ledger.warm()
        shared.warm_ids = {job.id for job in warm}
        send(warm)
    drafting = threading.Thread(target=_draft_loop, args=(ledger, drafter, cond, shared, send),
                                name="sdbench-dsi-drafter", daemon=True)
    drafting.start()
    ttft = None
    try:
        waited = 0.0
        while True:
            with cond:
                if ledger.done:
                    break
                _check(ledger, shared, waited)
            answers = [a for a in pool.poll(POLL_S) if a.seq == seq]
            waited = 0.0 if answers else waited + POLL_S
            with cond:
                for answer in answers:
                    shared.busy[answer.worker] += answer.busy_s
                    shared.answers += 1
                    if answer.job in shared.warm_ids:
                        shared.warm_busy_s += answer.busy_s
                        shared.warm_answers += 1
                    for step in ledger.finish(answer.job, answer.worker, answer, judge):
                        if ttft is None:  # the prompt's verification gives the first token, as a prefill does:
                            ttft = now() - t0  # not a step (engine/metrics.py); its drafting time goes on
                            continue
                        # accepted = drafts committed (an EOS may cut accepted ones), as the decode loop counts
                        stats.add_step(step.drafted, min(step.accepted, step.committed), shared.unassigned_draft_s,
                                       step.job.result.busy_s, rejected=step.accepted < step.drafted)
                        shared.unassigned_draft_s = 0.0
                send(ledger.dispatch())
                cond.notify_all()
        wall = now() - t0
    finally:
        with cond:
            shared.stop = True
            cond.notify_all()
        drafting.join()
        drafter.end()
    _drain(pool, ledger, seq)  # after a failure the caller discards the pool instead
    return RowOutcome(ledger.generated(), stats, _extras(ledger, shared, stats, wall, ttft), wall, ttft)


def _extras(ledger: Ledger, shared: _Shared, stats: RowStats, wall: float, ttft: float) -> dict:
    """The row's strategy_stats: what the pool did, and the latencies `sdbench simulate dsi --from` reads."""
    return {
        "workers": ledger.workers, "lookahead": ledger.k, "wall_s": wall, "ttft_s": ttft,
        "busy": [round(b / wall, 4) for b in shared.busy],
        "cancelled": ledger.cancelled, "redundant": ledger.redundant, "verifications": ledger.dispatched,
        "drafted_total": shared.drafts_made, "rejections": stats.rejections,
        "draft_s_per_token": shared.draft_s / shared.drafts_made if shared.drafts_made else None,
        "verify_s_per_job": sum(shared.busy) / shared.answers if shared.answers else None,
        # the same without the prefills (the prompt's verifications, the drafter's first call): the decode phase
        "verify_s_per_decode_job": _ratio(sum(shared.busy) - shared.warm_busy_s, shared.answers - shared.warm_answers),
        "draft_s_per_decode_token": _ratio(shared.draft_s - shared.first_draft_s, shared.drafts_made - 1),
    }


def _ratio(total: float, count: int) -> float | None:
    return total / count if count > 0 else None


def _draft_loop(ledger: Ledger, drafter: Drafter, cond: threading.Condition, shared: _Shared, send) -> None:
    try:
        while True:
            with cond:
                while not shared.stop and not ledger.want_draft():
                    cond.wait()
                if shared.stop:
                    return
                tokens, ticket = list(ledger.tokens), ledger.ticket()
                shared.drafting = True
            t0 = now()  # no device wait of its own: next_token reads its token back
            token = drafter.next_token(tokens)
            spent = now() - t0
            with cond:
                shared.drafting = False
                if not shared.drafts_made:
                    shared.first_draft_s = spent
                shared.draft_s += spent
                shared.unassigned_draft_s += spent
                shared.drafts_made += 1
                if ledger.add_draft(token, ticket):  # dropped when a commit moved its position meanwhile
                    send(ledger.dispatch())
    except BaseException as e:  # surfaced by the waiting thread
        with cond:
            shared.error, shared.drafting = e, False


def _check(ledger: Ledger, shared: _Shared, waited: float) -> None:
    """Called under the lock: raise what the drafter hit, or a stall that would otherwise hang the run."""
    if shared.error is not None:
        raise shared.error
    if not ledger.running and not shared.drafting and not ledger.want_draft():
        raise RuntimeError("DSI stalled: no verification running and nothing to draft")
    if waited > STALL_S:
        raise WorkerFailed(f"DSI workers gave no answer for {STALL_S:.0f} s")


def _drain(pool, ledger: Ledger, seq: int) -> None:
    """Wait for the verifications still running (cancelled or redundant) so every worker is idle for the next
    generation; not counted in its time."""
    waited = 0.0
    while ledger.running and waited < STALL_S:
        answers = pool.poll(POLL_S)
        waited = 0.0 if answers else waited + POLL_S
        for answer in answers:
            if answer.seq == seq and ledger.running.get(answer.worker) == answer.job:
                del ledger.running[answer.worker]
