"""Where DSI's target workers run: processes on this machine, or Ray actors (a Ray cluster, or Ray's local one).

Both run the same `TargetWorker`. A pool offers `ensure(n)` (start workers up to n), `submit(worker, task)`,
`poll(timeout) -> [Answer]` and `close()`. Starting workers is slow (each imports torch and transformers and
receives the target's weights), so pools are kept per (backend, target model, threads) for the life of the
process and shared by every DSI configuration that asks for at most as many workers; `shutdown_pools` (also
run at exit) stops them.

Process workers receive the target model itself through torch.multiprocessing: CPU tensors travel as shared
memory, so on the CPU the replicas share one copy of the weights (each has its own KV cache); on CUDA worker
i moves its replica to GPU i. The runner's fast path does not travel with the model (packed weights and CUDA
graphs are private to a process): a worker whose target runs it builds its own, from the shared plain weights.
The model is serialised in the calling thread, so a model that cannot be sent fails at once; a worker that
cannot build its replica, or dies, is reported as soon as its message (or its exit) arrives. Workers start from a fork server that has already imported torch and
transformers (a fresh process per worker costs seconds of imports each; on a small machine that is most of
a short benchmark); where there is no fork server (Windows), they are spawned.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import threading
import time
import traceback

from sdbench.dsi.worker import Answer, Task, TargetWorker, worker_device
from sdbench.errors import MissingPackageError, SdbenchError
from sdbench.models.forward.generic import runner_kind

START_TIMEOUT_S = 600.0


def arithmetic_env() -> dict:
    """This process's settings that change what a replica computes (sdbench's block products' activations), for a
    worker to take as its own."""
    from sdbench.models.forward.cpukernel import ACTIVATIONS_ENV

    return {k: os.environ[k] for k in (ACTIVATIONS_ENV,) if k in os.environ}


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_threads(workers: int) -> int:
    """Torch threads per process when the user set none: the cores shared by the workers and the drafter."""
    return max(1, cpu_cores() // (workers + 1))



def _drain(results, timeout: float) -> list:
    """Everything waiting on a results queue, after waiting up to `timeout` for the first item; [] if none."""
    try:
        items = [results.get(timeout=timeout)]
    except queue.Empty:
        return []
    while True:
        try:
            items.append(results.get_nowait())
        except queue.Empty:
            return items


class WorkerFailed(SdbenchError):
    """A worker could not start or failed a task: one line naming the worker and why (`details` holds the
    worker's traceback, where there is one)."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


def _why(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    first = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _error(index: int, stage: str, error: BaseException) -> tuple:
    """What a worker sends back on failure: ("error", index, one line, full traceback)."""
    return "error", index, f"DSI worker {index} {stage}: {_why(error)}", traceback.format_exc()


def _serve(device: str, threads: int, index: int, name: str, fast: bool, kind: str, tasks, results,
           env: dict | None = None) -> None:
    """A worker process: receive the model, build the replica, then answer tasks until told to stop (None). env:
    the caller's settings its arithmetic depends on (a fork server started earlier holds older ones)."""
    os.environ.update(env or {})
    try:
        model = pickle.loads(tasks.get())
        worker = TargetWorker(model, device, threads, index, name, fast, kind)
    except Exception as e:
        results.put(_error(index, "failed to start", e))
        return
    del model
    results.put(("ready", index))
    while True:
        task = tasks.get()
        if task is None:
            return
        try:
            results.put(worker.run(task))
        except Exception as e:
            results.put(_error(index, "failed", e))


class ProcessPool:
    def __init__(self, model, name: str, device_kind: str, threads: int, fast: bool = False, runner: str = "native"):
        import torch.multiprocessing as mp  # only the process backend starts workers

        self.model, self.name, self.kind, self.threads, self.fast = model, name, device_kind, threads, fast
        self.runner = runner  # the replicas' runner kind: "native" or "generic"
        if "forkserver" in mp.get_all_start_methods():
            # takes effect when the server starts (the first pool); the model's own module comes along
            mp.set_forkserver_preload(["sdbench.dsi.worker", "sdbench.models.forward.runner", "transformers.modeling_utils",
                                       type(model).__module__])
            self.ctx = mp.get_context("forkserver")
        else:
            self.ctx = mp.get_context("spawn")
        self.results = self.ctx.Queue()
        self.tasks, self.procs = [], []

    @property
    def size(self) -> int:
        return len(self.procs)

    def ensure(self, n: int) -> None:
        starting = set()
        while len(self.procs) < n:
            i = len(self.procs)
            payload = self._payload(i)
            tasks = self.ctx.Queue()
            proc = self.ctx.Process(target=_serve, name=f"sdbench-dsi-worker-{i}", daemon=True,
                                    args=(worker_device(self.kind, i), self.threads, i, self.name, self.fast,
                                          self.runner, tasks, self.results, arithmetic_env()))
            proc.start()
            # through the queue, not as a start argument: a fork server passes at most 256 file descriptors
            # per start, and every shared tensor of the model takes one
            tasks.put(payload)
            self.tasks.append(tasks)
            self.procs.append(proc)
            starting.add(i)
        deadline = time.monotonic() + START_TIMEOUT_S
        while starting:
            try:
                msg = self.results.get(timeout=1.0)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"DSI workers {sorted(starting)} did not start in {START_TIMEOUT_S:.0f} s")
                continue
            self._raise_if_error(msg)
            if isinstance(msg, tuple) and msg[0] == "ready":
                starting.discard(msg[1])

    def _payload(self, index: int) -> bytes:
        """The model serialised for worker `index` (shared tensors travel as file descriptors, each usable
        once: one payload per worker). Done here rather than in the queue's feeder thread, whose errors
        would only be printed, leaving the worker waiting."""
        from multiprocessing.reduction import ForkingPickler  # only the process backend sends the model

        try:
            return bytes(ForkingPickler.dumps(self.model))
        except Exception as e:
            raise WorkerFailed(f"DSI worker {index} could not be sent the target model: {_why(e)}") from None

    def submit(self, worker: int, task: Task) -> None:
        self.tasks[worker].put(task)

    def poll(self, timeout: float) -> list[Answer]:
        msgs = _drain(self.results, timeout)
        if not msgs:
            self._check_alive()
            return []
        for msg in msgs:
            self._raise_if_error(msg)
        return msgs

    @staticmethod
    def _raise_if_error(msg) -> None:
        if isinstance(msg, tuple) and msg[0] == "error":
            raise WorkerFailed(msg[2], msg[3])

    def _check_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise WorkerFailed(f"DSI worker {i} exited unexpectedly (exit code {proc.exitcode})")

    def close(self) -> None:
        for tasks, proc in zip(self.tasks, self.procs):
            if proc.is_alive():
                tasks.put(None)
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
        self.tasks, self.procs = [], []


class RayPool:
    """Workers as Ray actors. Ray connects to the cluster RAY_ADDRESS names, or starts a local one."""

    def __init__(self, model, name: str, device_kind: str, threads: int, fast: bool = False, runner: str = "native"):
        try:
            import ray  # optional: an extra (pip install "sdbench[ray]")
        except ImportError:
            raise MissingPackageError("ray", "the DSI Ray backend",
                                      "pip install 'sdbench[ray]'` or `pip install ray==2.60.0") from None
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
        self.ray, self.model, self.name, self.kind, self.threads = ray, model, name, device_kind, threads
        self.fast, self.runner = fast, runner
        try:
            self.model_ref = ray.put(model)
        except Exception as e:
            raise WorkerFailed(f"DSI Ray workers could not be sent the target model: {_why(e)}") from None
        self.actor = ray.remote(TargetWorker)
        self.actors = []
        self.results: queue.Queue = queue.Queue()  # futures of finished tasks, in finishing order

    @property
    def size(self) -> int:
        return len(self.actors)

    def ensure(self, n: int) -> None:
        gpus = self.ray.cluster_resources().get("GPU", 0) if self.kind == "cuda" else 0
        while len(self.actors) < n:
            # an actor given a GPU sees only that one (Ray sets CUDA_VISIBLE_DEVICES); num_cpus=0 lets more
            # actors than cores share a small machine
            options = {"num_cpus": 0, "num_gpus": min(1.0, gpus / n)} if gpus else {"num_cpus": 0}
            device = "cuda" if gpus else "cpu"
            self.actors.append(self.actor.options(**options).remote(self.model_ref, device, self.threads,
                                                                    len(self.actors), self.name, self.fast,
                                                                    self.runner))
        for i, actor in enumerate(self.actors):  # they start side by side: wait for each in turn
            try:
                self.ray.get(actor.ready.remote(), timeout=START_TIMEOUT_S)
            except Exception as e:
                cause = getattr(e, "cause", None) or e  # a RayTaskError wraps the worker's own exception
                raise WorkerFailed(f"DSI Ray worker {i} failed to start: {_why(cause)}", str(e)) from None

    def submit(self, worker: int, task: Task) -> None:
        self.actors[worker].run.remote(task).future().add_done_callback(self.results.put)

    def poll(self, timeout: float) -> list[Answer]:
        futures = _drain(self.results, timeout)
        try:
            return [f.result() for f in futures]
        except Exception as e:  # a RayTaskError carries the worker's traceback
            cause = getattr(e, "cause", None) or e
            raise WorkerFailed(f"DSI Ray worker failed: {_why(cause)}", str(e)) from None

    def close(self) -> None:
        # at exit Ray may already be shut down (its own exit hook runs first): the actors went with it, and
        # ray.kill would start a fresh local cluster only to fail
        if self.ray.is_initialized():
            for actor in self.actors:
                self.ray.kill(actor)
        self.actors = []


BACKENDS = {"process": ProcessPool, "ray": RayPool}
_pools: dict[tuple, object] = {}
_lock = threading.Lock()


def get_pool(backend: str, runner, workers: int, threads: int):
    """A pool of at least `workers` replicas of runner's model (started on first use, then kept)."""
    if backend not in BACKENDS:
        raise SdbenchError(f"--set backend={backend}: use one of {', '.join(BACKENDS)}")
    fast = runner.fast  # workers build the same fast path the target runs (CPU packing, or CUDA graphs)
    kind = runner_kind(runner)  # and the same runner: native, or generic where the target fell back to it
    key = (backend, id(runner.model), runner.device.type, threads, kind, fast)
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = BACKENDS[backend](runner.model, runner.name, runner.device.type, threads, fast, kind)
        try:
            pool.ensure(workers)
        except BaseException:
            _pools.pop(key).close()
            raise
    return pool


def discard_pool(pool) -> None:
    """Stop a pool that failed or was interrupted mid-generation, so the next use starts afresh."""
    with _lock:
        for key in [k for k, p in _pools.items() if p is pool]:
            del _pools[key]
    pool.close()


def shutdown_pools() -> None:
    with _lock:
        for pool in _pools.values():
            pool.close()
        _pools.clear()


atexit.register(shutdown_pools)
