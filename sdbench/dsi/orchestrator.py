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


class PromptDrafter:
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


class RowDecode:
    """One prompt decoded with DSI: start the workers on the prompt, draft in a second thread, take answers
    until the ledger is done, stop the drafter, drain the workers (`run`)."""

    def __init__(self, pool, draft_runner, prompt: list[int], *, lookahead: int, workers: int, max_new_tokens: int,
                 eos, sampling: SamplingConfig, generator):
        self.pool, self.sampling, self.generator = pool, sampling, generator
        self.seq = next(_seq_ids)
        self.capacity = needed_capacity(len(prompt), max_new_tokens, lookahead)
        self.ledger = Ledger(prompt, lookahead=lookahead, max_new_tokens=max_new_tokens, workers=workers, eos=eos)
        self.drafter = PromptDrafter(draft_runner, prompt, self.capacity, sampling)
        self.cond = threading.Condition()
        self.shared = _Shared(busy=[0.0] * workers)
        self.stats = RowStats()
        self.ttft: float | None = None
        self.t0 = 0.0

    def run(self) -> RowOutcome:
        # this thread never waits for the device: it does no GPU work of its own (the workers are other
        # processes), and a synchronisation here while the drafter thread captures a CUDA graph would break it
        self.t0 = now()
        self._start_workers()
        drafting = threading.Thread(target=_draft_loop, args=(self.ledger, self.drafter, self.cond, self.shared,
                                                              self.send), name="sdbench-dsi-drafter", daemon=True)
        drafting.start()
        try:
            self._take_answers()
            wall = now() - self.t0
        finally:
            self._stop_drafter(drafting)
        _drain(self.pool, self.ledger, self.seq)  # after a failure the caller discards the pool instead
        extras = _extras(self.ledger, self.shared, self.stats, wall, self.ttft)
        return RowOutcome(self.ledger.generated(), self.stats, extras, wall, self.ttft)

    def send(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.pool.submit(job.worker, Task(self.seq, job.id, self.capacity, self.ledger.inputs(job), job.start))

    def judge(self, job: Job, frontier: int, drafts: list[int]):
        """The greedy verdict on `drafts` after `frontier` from a job's logits: (accepted, next token)."""
        logits = job.result.logits[frontier - job.start :]  # [n + 1, V]: predictions at frontier..end
        proposal = Proposal(torch.tensor([drafts], dtype=torch.long), torch.tensor([len(drafts)]))
        accepted, nxt = accept(proposal, logits[None], self.sampling, self.generator)
        return accepted[0], nxt[0]

    def _start_workers(self) -> None:
        """The verifications of the bare prompt: the workers' prefill, and the first token."""
        with self.cond:
            warm = self.ledger.warm()
            self.shared.warm_ids = {job.id for job in warm}
            self.send(warm)

    def _take_answers(self) -> None:
        """Until the ledger is done: wait for answers, judge and commit them, send the next jobs."""
        waited = 0.0
        while True:
            with self.cond:
                if self.ledger.done:
                    return
                _check(self.ledger, self.shared, waited)
            answers = [a for a in self.pool.poll(POLL_S) if a.seq == self.seq]
            waited = 0.0 if answers else waited + POLL_S
            with self.cond:
                for answer in answers:
                    self._take(answer)
                self.send(self.ledger.dispatch())
                self.cond.notify_all()

    def _take(self, answer) -> None:
        """One worker's answer (under the lock): its busy time, then every step it lets the ledger commit."""
        shared = self.shared
        shared.busy[answer.worker] += answer.busy_s
        shared.answers += 1
        if answer.job in shared.warm_ids:
            shared.warm_busy_s += answer.busy_s
            shared.warm_answers += 1
        for step in self.ledger.finish(answer.job, answer.worker, answer, self.judge):
            self._count(step)

    def _count(self, step) -> None:
        """The prompt's verification gives the first token, as a prefill does: not a step (engine/metrics.py),
        and its drafting time goes on to the first step. Accepted = drafts committed (an EOS may cut accepted
        ones), as the decode loop counts."""
        if self.ttft is None:
            self.ttft = now() - self.t0
            return
        self.stats.add_step(step.drafted, min(step.accepted, step.committed), self.shared.unassigned_draft_s,
                            step.job.result.busy_s, rejected=step.accepted < step.drafted)
        self.shared.unassigned_draft_s = 0.0

    def _stop_drafter(self, drafting: threading.Thread) -> None:
        with self.cond:
            self.shared.stop = True
            self.cond.notify_all()
        drafting.join()
        self.drafter.end()


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


def _draft_loop(ledger: Ledger, drafter: PromptDrafter, cond: threading.Condition, shared: _Shared, send) -> None:
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
