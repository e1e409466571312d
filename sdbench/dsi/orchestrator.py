"""DSI on real models: a drafter thread and a result loop around one Ledger, over a pool of target workers.

Two threads share the ledger under one lock:
- the drafter thread (DraftThread) drafts one token at a time (the draft model lives in this process, with
  its own KV cache) whenever the ledger wants one, and sends every completed window to an idle worker. It
  never waits for a verification, only for a free worker when a full window is already waiting (pool
  saturated).
- the calling thread (RowDecode, one prompt's decode) waits for answers, judges them through
  sdbench.engine.sampling (greedy verification), commits, cancels what a rejection invalidated, and sends
  the next jobs.
Each counts its own: the drafter its drafting time, the calling thread the workers' answers and the steps (a
step takes the drafting time spent since the previous one from the drafter, under the lock).
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
from sdbench.drafting.model import ModelDrafter
from sdbench.dsi.ledger import Job, Ledger
from sdbench.dsi.pools import WorkerFailed
from sdbench.dsi.worker import Task
from sdbench.engine.clock import now
from sdbench.engine.counters import RowStats
from sdbench.engine.state import DecodeState, Proposal, needed_capacity
from sdbench.engine.step import accept
from sdbench.stats_record import StatsRecord

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


@dataclass(frozen=True)
class DSIRowStats(StatsRecord):
    """One row's strategy_stats under DSI: what the pool did, and the latencies `sdbench simulate dsi --from`
    reads. None: not recorded (an older file), or nothing to divide by (no draft, no answer)."""

    OPTIONAL = ("backend",)  # added by the decoder (dsi/decoder.py), which knows the pool

    workers: int | None = None
    lookahead: int | None = None
    wall_s: float | None = None
    ttft_s: float | None = None
    busy: list[float] = field(default_factory=list)  # per worker: the share of the row's wall time it verified
    cancelled: int | None = None  # verifications a rejection made useless
    redundant: int | None = None
    verifications: int | None = None
    drafted_total: int | None = None  # every drafted token, discarded ones included
    rejections: int | None = None
    draft_s_per_token: float | None = None
    verify_s_per_job: float | None = None
    # the same two without the prefills (the prompt's verifications, the drafter's first call): the decode phase
    verify_s_per_decode_job: float | None = None
    draft_s_per_decode_token: float | None = None
    backend: str | None = None


@dataclass
class RowOutcome:
    tokens: list[int]  # generated (prompt excluded)
    stats: RowStats
    extras: dict  # DSIRowStats.to_dict()
    wall_s: float
    ttft_s: float


class DraftThread:
    """The drafter thread: drafts one token whenever the ledger wants one and sends every completed window to
    an idle worker (`send`); it never waits for a verification. What it counts is its own, written under the
    calling thread's lock (`cond`), which reads it under the same lock."""

    def __init__(self, ledger: Ledger, drafter: PromptDrafter, cond: threading.Condition, send):
        self.ledger, self.drafter, self.cond, self.send = ledger, drafter, cond, send
        self.stopping = False
        self.drafting = False  # a draft forward is running (the ledger may not want another meanwhile)
        self.error: BaseException | None = None  # what stopped the thread, raised by the calling thread
        self.draft_s = 0.0  # all drafting time, discarded drafts included
        self.first_s = 0.0  # the first call, which catches up on the prompt (the drafter's prefill)
        self.made = 0
        self.unassigned_s = 0.0  # drafting time not yet attributed to a committing step
        self.thread = threading.Thread(target=self._loop, name="sdbench-dsi-drafter", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join()
        self.drafter.end()

    def take_unassigned(self) -> float:
        """Under the lock: the drafting time since the last committing step, which goes to the next one."""
        spent, self.unassigned_s = self.unassigned_s, 0.0
        return spent

    def check(self) -> None:
        """Under the lock: raise what the drafter hit, or a stall (nothing running, nothing to draft)."""
        if self.error is not None:
            raise self.error
        if not self.ledger.running and not self.drafting and not self.ledger.want_draft():
            raise RuntimeError("DSI stalled: no verification running and nothing to draft")

    def _loop(self) -> None:
        try:
            while (work := self._wait_for_work()) is not None:
                tokens, ticket = work
                t0 = now()  # no device wait of its own: next_token reads its token back
                token = self.drafter.next_token(tokens)
                self._drafted(token, ticket, now() - t0)
        except BaseException as e:  # surfaced by the calling thread
            with self.cond:
                self.error, self.drafting = e, False

    def _wait_for_work(self):
        """(tokens, ticket) once the ledger wants a draft; None once asked to stop."""
        with self.cond:
            while not self.stopping and not self.ledger.want_draft():
                self.cond.wait()
            if self.stopping:
                return None
            self.drafting = True
            return list(self.ledger.tokens), self.ledger.ticket()

    def _drafted(self, token: int, ticket, spent: float) -> None:
        with self.cond:
            self.drafting = False
            if not self.made:
                self.first_s = spent
            self.draft_s += spent
            self.unassigned_s += spent
            self.made += 1
            if self.ledger.add_draft(token, ticket):  # dropped when a commit moved its position meanwhile
                self.send(self.ledger.dispatch())


@dataclass
class _Answers:
    """The workers' answers to one row, counted by the calling thread alone."""

    busy: list[float]  # each worker's busy seconds
    count: int = 0
    warm_ids: set = field(default_factory=set)  # the verifications of the bare prompt (the workers' prefill)
    warm_busy_s: float = 0.0
    warm_count: int = 0

    def record(self, answer) -> None:
        self.busy[answer.worker] += answer.busy_s
        self.count += 1
        if answer.job in self.warm_ids:
            self.warm_busy_s += answer.busy_s
            self.warm_count += 1


class RowDecode:
    """One prompt decoded with DSI (`run`): start the workers on the prompt, draft in a second thread
    (DraftThread), take answers until the ledger is done, stop the drafter, drain the workers."""

    def __init__(self, pool, draft_runner, prompt: list[int], *, lookahead: int, workers: int, max_new_tokens: int,
                 eos, sampling: SamplingConfig, generator):
        self.pool, self.sampling, self.generator = pool, sampling, generator
        self.seq = next(_seq_ids)
        self.prompt_len = len(prompt)
        self.capacity = needed_capacity(len(prompt), max_new_tokens, lookahead)
        self.ledger = Ledger(prompt, lookahead=lookahead, max_new_tokens=max_new_tokens, workers=workers, eos=eos)
        self.cond = threading.Condition()
        self.drafts = DraftThread(self.ledger, PromptDrafter(draft_runner, prompt, self.capacity, sampling),
                                  self.cond, self.send)
        self.answers = _Answers([0.0] * workers)
        self.stats = RowStats()
        self.ttft: float | None = None
        self.t0 = 0.0

    def run(self) -> RowOutcome:
        # this thread never waits for the device: it does no GPU work of its own (the workers are other
        # processes), and a synchronisation here while the drafter thread captures a CUDA graph would break it
        self.t0 = now()
        self._start_workers()
        self.drafts.start()
        try:
            self._take_answers()
            wall = now() - self.t0
        finally:
            self.drafts.stop()
        _drain(self.pool, self.ledger, self.seq)  # after a failure the caller discards the pool instead
        extras = _extras(self.ledger, self.drafts, self.answers, self.stats, wall, self.ttft)
        return RowOutcome(self.ledger.generated(), self.stats, extras, wall, self.ttft)

    def send(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.pool.submit(job.worker, Task(self.seq, job.id, self.capacity, self.ledger.inputs(job), job.start,
                                             self.prompt_len))

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
            self.answers.warm_ids = {job.id for job in warm}
            self.send(warm)

    def _take_answers(self) -> None:
        """Until the ledger is done: wait for answers, judge and commit them, send the next jobs."""
        waited = 0.0
        while True:
            with self.cond:
                if self.ledger.done:
                    return
                self.drafts.check()
            if waited > STALL_S:
                raise WorkerFailed(f"DSI workers gave no answer for {STALL_S:.0f} s")
            answers = [a for a in self.pool.poll(POLL_S) if a.seq == self.seq]
            waited = 0.0 if answers else waited + POLL_S
            with self.cond:
                for answer in answers:
                    self._take(answer)
                self.send(self.ledger.dispatch())
                self.cond.notify_all()

    def _take(self, answer) -> None:
        """One worker's answer (under the lock): its busy time, then every step it lets the ledger commit."""
        self.answers.record(answer)
        for step in self.ledger.finish(answer.job, answer.worker, answer, self.judge):
            self._count(step)

    def _count(self, step) -> None:
        """The prompt's verification gives the first token, as a prefill does: not a step (engine/metrics.py),
        and its drafting time goes on to the first step. Accepted = drafts committed (an EOS may cut accepted
        ones), as the decode loop counts."""
        if self.ttft is None:
            self.ttft = now() - self.t0
            return
        self.stats.add_step(step.drafted, min(step.accepted, step.committed), self.drafts.take_unassigned(),
                            step.job.result.busy_s, rejected=step.accepted < step.drafted)


def _extras(ledger: Ledger, drafts: DraftThread, answers: _Answers, stats: RowStats, wall: float,
            ttft: float) -> dict:
    """The row's strategy_stats (DSIRowStats, as its dict)."""
    return DSIRowStats(
        workers=ledger.workers, lookahead=ledger.k, wall_s=wall, ttft_s=ttft,
        busy=[round(b / wall, 4) for b in answers.busy],
        cancelled=ledger.cancelled, redundant=ledger.redundant, verifications=ledger.dispatched,
        drafted_total=drafts.made, rejections=stats.rejections,
        draft_s_per_token=drafts.draft_s / drafts.made if drafts.made else None,
        verify_s_per_job=sum(answers.busy) / answers.count if answers.count else None,
        verify_s_per_decode_job=_ratio(sum(answers.busy) - answers.warm_busy_s, answers.count - answers.warm_count),
        draft_s_per_decode_token=_ratio(drafts.draft_s - drafts.first_s, drafts.made - 1),
    ).to_dict()


def _ratio(total: float, count: int) -> float | None:
    return total / count if count > 0 else None


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
