"""One DSI target worker: a target replica with its own KV cache. Every backend runs this same class (inside
a worker process, or as a Ray actor).

The cache is position-indexed, so the worker only remembers which tokens its cache holds (`cached`). A job
sends the full input sequence; the worker feeds what its cache lacks from the first position where they
differ (a continuation of what it verified before reuses the whole prefix; after a rejection, the prefix up
to the rejected draft) and returns the target logits at the positions the job predicts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sdbench.forward_step import Step
from sdbench.engine.clock import now
from sdbench.kv.cache import set_prompt_lengths
from sdbench.models.forward.generic import make_runner


@dataclass
class Task:
    seq: int  # which generation (a new one starts a new cache)
    job: int
    capacity: int  # cache slots the generation needs
    tokens: list[int]  # the job's inputs: committed prefix + drafts
    start: int  # first predicted position; predictions cover start..len(tokens)
    prompt: int = 0  # the generation's prompt length (its tokens rotate as one prefill rotates them)


@dataclass
class Answer:
    seq: int
    job: int
    worker: int
    logits: torch.Tensor  # [width + 1, V] float32 on the CPU
    busy_s: float  # time spent on this task


def worker_device(kind: str, index: int) -> str:
    """Worker i's device: one GPU each (round robin when there are fewer GPUs than workers), else the CPU."""
    if kind == "cuda" and torch.cuda.is_available():
        return f"cuda:{index % torch.cuda.device_count()}"
    return "cpu"


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class TargetWorker:
    def __init__(self, model, device: str, threads: int, index: int = 0, name: str = "target", fast: bool = False,
                 kind: str = "native"):
        """fast: the runner's fast path, built here: on the CPU from the received plain weights (packed weights
        are private to a process and never travel), on a GPU as this process's own CUDA graphs. kind: the
        runner the target's own process probed and runs ("native" or "generic"); the replica is not probed
        again: it is the same runner over the same weights, in the same dtype and with the same fast path."""
        if threads > 0:
            torch.set_num_threads(threads)
        self.index = index
        self.runner = make_runner(model.to(device), name, kind, fast)
        self.seq: int | None = None
        self.cache = None
        self.cached: list[int] = []

    def ready(self) -> int:
        return self.index

    def run(self, task: Task) -> Answer:
        t0 = now()  # the answer is read back to the host below, which waits for the device
        if task.seq != self.seq or self.cache is None or self.cache.capacity < task.capacity:
            self.cache = self.runner.new_cache(1, task.capacity)
            set_prompt_lengths(self.cache, [task.prompt])
            self.seq, self.cached = task.seq, []
        # keys for tokens[:start - 1] must be in the cache; the forward then runs from the first missing one
        keep = common_prefix(self.cached, task.tokens, task.start - 1)
        feed = torch.tensor([task.tokens[keep:]], dtype=torch.long)
        logits = self.runner.run(self.cache, Step(feed, [keep]))[0, task.start - 1 - keep :]
        self.cached = list(task.tokens)
        logits = logits.float().cpu()
        return Answer(task.seq, task.job, self.index, logits, now() - t0)
