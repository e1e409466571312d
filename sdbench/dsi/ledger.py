"""The bookkeeping of one DSI generation: committed tokens, speculative drafts and verification jobs.

Pure Python, no models: the real orchestrator (sdbench.dsi.orchestrator) and the timed simulator
(sdbench.analysis.dsi_sim) drive the same Ledger, so the simulator predicts the algorithm that actually runs.

`tokens` holds the committed sequence (prompt included) followed by the drafts beyond it. A verification job
covers positions start..end (end = start + width): its inputs are tokens[:end] as they were when it was
sent, i.e. the committed prefix plus drafts, and it returns the target's prediction for each of those
positions (the token at p given tokens[:p]). A prediction is usable once every input before it is
committed. Jobs return in any order; whichever finished job reaches the committed frontier is judged
(greedy verification in sdbench.engine.sampling), and its accepted drafts plus the target's own token are
committed. When that token differs from the draft at its position, the drafts from there on are discarded
and every job whose inputs contained the rejected draft is cancelled; drafting restarts from the correction.

Dispatch policy (`dispatch`, one job per idle worker):
  1. the frontier: when no live job predicts the next uncommitted position, verify the committed prefix now,
     with whatever drafts (at most k) already follow it. This keeps one target forward always working on the
     committed sequence, which is what makes DSI never slower than plain decoding.
  2. windows: every k drafts not yet sent form the next job, its prefix including the earlier, still
     unverified drafts (speculation on speculation); the last drafts before the budget or a drafted EOS go
     out as a shorter window.
Drafting pauses only when a full window is waiting for a worker (the pool is saturated).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

from sdbench.engine.state import admit
from sdbench.engine.step import commit_round


@dataclass
class Job:
    id: int
    worker: int
    start: int  # first position it predicts
    width: int  # drafted tokens it verifies; its inputs are tokens[:end]
    done: bool = False
    result: Any = None  # the backend's answer (target logits), once done

    @property
    def end(self) -> int:
        """The last position it predicts (the bonus position)."""
        return self.start + self.width


@dataclass
class Step:
    """A verification that committed tokens: of the `drafted` drafts it judged, `accepted` were kept."""

    job: Job
    drafted: int
    accepted: int
    committed: int  # tokens committed (accepted drafts + the target's token, cut by EOS or the budget)
    rejected: bool  # the target's token replaced a draft


# judge(job, frontier, drafts) -> (accepted, next_token): drafts = the job's drafts at frontier..end-1
Judge = Callable[[Job, int, list], tuple]


class Ledger:
    def __init__(self, prompt: list[int], *, lookahead: int, max_new_tokens: int, workers: int, eos=()):
        if lookahead < 1 or max_new_tokens < 1 or workers < 1 or not prompt:
            raise ValueError("need a prompt, lookahead >= 1, max_new_tokens >= 1 and workers >= 1")
        self.tokens = list(prompt)
        self.prompt_len = self.committed = len(prompt)
        self.cap = len(prompt) + max_new_tokens  # positions < cap may be generated
        self.k, self.workers, self.eos = lookahead, workers, frozenset(eos)
        self.sent = self.committed  # drafts before this position are in some job
        self.live: dict[int, Job] = {}  # jobs whose answer may still be used (running or waiting their turn)
        self.running: dict[int, int] = {}  # worker -> job id, cancelled jobs included until they return
        self.version = 0  # bumped whenever drafts are discarded
        self.done = False
        self.drafted = self.dispatched = self.cancelled = self.redundant = 0
        self._ids = itertools.count()

    # ---- drafting ------------------------------------------------------------------------------------------
    def _can_extend(self) -> bool:
        if self.done or len(self.tokens) >= self.cap:
            return False
        return len(self.tokens) == self.committed or self.tokens[-1] not in self.eos

    def want_draft(self) -> bool:
        """Whether the drafter should draft the next token now (False while a full window waits)."""
        return self._can_extend() and len(self.tokens) - self.sent < self.k

    def ticket(self) -> tuple[int, int]:
        """What a draft started now will be for: (its position, the drafts' version)."""
        return len(self.tokens), self.version

    def add_draft(self, token: int, ticket: tuple[int, int] | None = None) -> bool:
        """Append a drafted token; with the ticket taken when drafting began, a draft whose position was
        meanwhile committed or discarded is dropped (returns False)."""
        if self.done or (ticket is not None and ticket != self.ticket()):
            return False
        self.tokens.append(int(token))
        self.drafted += 1
        return True

    # ---- dispatch ------------------------------------------------------------------------------------------
    def idle(self) -> list[int]:
        return [w for w in range(self.workers) if w not in self.running]

    def dispatch(self) -> list[Job]:
        """Jobs to send now, one per idle worker at most (see the module docstring for the policy)."""
        jobs = []
        for worker in self.idle():
            job = self._next_job(worker)
            if job is None:
                break
            jobs.append(job)
        return jobs

    def warm(self) -> list[Job]:
        """At the start, every idle worker verifies the bare prompt: the first answer gives the first token,
        and each worker's cache then holds the prompt before its first window arrives."""
        return [self._open(w, self.committed, 0) for w in self.idle()]

    def _next_job(self, worker: int) -> Job | None:
        if self.done:
            return None
        frontier = self.committed
        if not any(j.start <= frontier <= j.end for j in self.live.values()):
            return self._open(worker, frontier, min(self.k, len(self.tokens) - frontier))
        waiting = len(self.tokens) - self.sent
        if waiting >= self.k or (waiting > 0 and not self._can_extend()):
            return self._open(worker, self.sent, min(self.k, waiting))
        return None

    def _open(self, worker: int, start: int, width: int) -> Job:
        job = Job(next(self._ids), worker, start, width)
        self.live[job.id] = job
        self.running[worker] = job.id
        self.sent = max(self.sent, job.end)
        self.dispatched += 1
        return job

    def inputs(self, job: Job) -> list[int]:
        return self.tokens[: job.end]

    # ---- answers ---------------------------------------------------------------------------------------------
    def finish(self, job_id: int, worker: int, result: Any, judge: Judge) -> list[Step]:
        """A worker answered; commit whatever can be decided now. Returns the committing steps."""
        if self.running.get(worker) == job_id:
            del self.running[worker]
        job = self.live.get(job_id)
        if job is None:
            return []  # cancelled or made redundant while it ran
        job.done, job.result = True, result
        steps = []
        while not self.done:
            ready = [j for j in self.live.values() if j.done and j.start <= self.committed <= j.end]
            if not ready:
                break
            steps.append(self._commit_from(max(ready, key=lambda j: j.end), judge))
        return steps

    def _commit_from(self, job: Job, judge: Judge) -> Step:
        frontier = self.committed
        drafts = self.tokens[frontier : job.end]
        accepted, token = judge(job, frontier, drafts)
        del self.live[job.id]
        version = self.version
        rnd = commit_round(self, [drafts], [len(drafts)], [int(accepted)], [int(token)], [True])
        self._prune()
        return Step(job, len(drafts), int(accepted), rnd.kept[0], self.version != version)

    def commit(self, b: int, new: list[int]) -> int:
        """The one row's commit (engine/step.Rows): tokens by the commit rule (`admit`), each replacing the
        draft at its position when they differ (which discards the drafts after it)."""
        new, finished = admit(new, self.cap - self.committed, self.eos)
        for tok in new:
            p = self.committed
            if p < len(self.tokens) and self.tokens[p] != tok:
                self._discard_from(p)
            if p == len(self.tokens):
                self.tokens.append(tok)
            self.committed += 1
        self.done = self.done or finished
        return len(new)

    def _discard_from(self, p: int) -> None:
        """Drop the drafts from position p and cancel the jobs that read one of them."""
        del self.tokens[p:]
        self.sent = min(self.sent, p)
        self.version += 1
        for job in [j for j in self.live.values() if j.end > p]:
            del self.live[job.id]
            self.cancelled += 1

    def _prune(self) -> None:
        self.sent = max(self.sent, self.committed)
        for job in [j for j in self.live.values() if self.done or j.end < self.committed]:
            del self.live[job.id]
            self.redundant += 1

    def orphans(self) -> list[int]:
        """Workers still running a job nobody needs any more (a preemptive backend could stop them)."""
        return [w for w, jid in self.running.items() if jid not in self.live]

    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len : self.committed]
