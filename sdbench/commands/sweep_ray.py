"""`sdbench sweep --ray auto|ADDRESS`: every point not done yet as one Ray task on a cluster.

A task measures its point as a local sweep would (commands/sweep.py: the same planning, the same PointHarness, the
pair loaded on its node for that point) into a folder of its own, and returns the point's files; the driver writes
them into the sweep's folder (replacing anything an earlier, interrupted attempt left of that point) and marks the
point done, so a point is recorded once, and `--resume` skips it. A task whose node dies is retried by Ray on
another node (MAX_RETRIES); an error inside a task (a model missing on that node) is one line naming the point and
the host.

Each task runs alone on its node's devices: on a GPU it takes one whole GPU (Ray hands each task its own device
through CUDA_VISIBLE_DEVICES); on CPUs it asks for as many CPUs as the smallest node of the cluster has, so no two
points ever share a node's cores, and its torch threads are set to that count. Points are spread over the nodes
(Ray's SPREAD scheduling), each node taking the next point when it is free. The figures of a point are
therefore those of the point run alone. Every node needs sdbench installed and the models and data sets reachable
by the names the sweep gives.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from dataclasses import asdict, replace

from sdbench.errors import MissingPackageError, SdbenchError
from sdbench.reporting.schema import first_line

MAX_RETRIES = 3  # a point whose node dies is run again on another, this many times at most
CONNECT_TIMEOUT_S = 5.0


def _check_reachable(address: str) -> None:
    """HOST:PORT (or ray://HOST:PORT) answers a connection within seconds: Ray itself would retry for minutes."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise SdbenchError(f"--ray {address}: give auto or the cluster's HOST:PORT (e.g. 10.0.0.5:6379)")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise SdbenchError(f"--ray {address}: no Ray cluster there ({e.strerror or e}); start one with "
                           f"`ray start --head` and give its address, or auto on its head node") from None


def connect(address: str):
    """Ray, connected to the cluster at `address` ("auto": the one `ray start` began on this machine)."""
    _check_reachable(address)
    try:
        import ray
    except ImportError:
        raise MissingPackageError("ray", "sweep --ray", "pip install 'sdbench[ray]'` or `pip install ray==2.60.0") \
            from None
    if not ray.is_initialized():
        try:
            ray.init(address=address, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise SdbenchError(f"--ray {address}: no Ray cluster there ({first_line(e)}); start one with "
                               f"`ray start --head` and give its address, or auto on its head node") from None
    return ray


def task_resources(ray, device: str) -> tuple[dict, int]:
    """(Ray resources of one point's task, its torch threads; 0: leave them): a whole GPU, or as many CPUs as the
    cluster's smallest node has."""
    if device.startswith("cuda") or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0):
        return {"num_gpus": 1, "num_cpus": 1}, 0
    cpus = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU")]
    if not cpus:
        raise SdbenchError("--ray: the cluster has no node with CPUs to run a point on")
    return {"num_cpus": min(cpus)}, int(min(cpus))


def measure_point(raw: dict, sweep_id: str, name: str, threads: int) -> dict:
    """A Ray task: one point of the sweep measured on this node; returns its files (name -> bytes) and where it ran."""
    import ray
    import torch
    from rich.console import Console

    from sdbench.commands.sweep import Sweep, sweep_config

    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sdbench-point-") as out:
        sweep = Sweep(sweep_config(raw, out), Console(quiet=True), sweep_id=sweep_id)
        point = next(p for p in sweep.points if p.name == name)
        pair, runners = sweep.load([point])
        sweep.measure(point, pair, runners)
        run_id = f"{sweep_id}-{name}"
        files = {p.name: p.read_bytes() for p in sweep.folder.iterdir()
                 if p.is_file() and p.name in (f"{run_id}.parquet", f"{run_id}.config.json")}
    return {"files": files, "host": socket.gethostname(), "node": ray.get_runtime_context().get_node_id(),
            "seconds": time.perf_counter() - started}


class RayPoints:
    """The points of one sweep as Ray tasks; connects (or fails in one line) when made, before anything is written."""

    def __init__(self, sweep, address: str):
        self.sweep, self.address = sweep, address
        self.ray = connect(address)
        self.resources, self.threads = task_resources(self.ray, sweep.cfg.run.device)

    def run(self, todo: list, done: list[str]) -> None:
        ray, sweep = self.ray, self.sweep
        task = ray.remote(measure_point).options(max_retries=MAX_RETRIES, retry_exceptions=False,
                                                 scheduling_strategy="SPREAD", **self.resources)
        raw = asdict(replace(sweep.cfg, resume=None))
        pending = {task.remote(raw, sweep.sweep_id, p.name, self.threads): p for p in todo}
        total, started = len(sweep.points), time.perf_counter()
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        sweep.console.print(f"{len(pending)} points as Ray tasks on {nodes} node{'s' if nodes != 1 else ''} "
                            f"({self.address}), each with {self._asked()}", highlight=False)
        try:
            while pending:
                (ready,), _ = ray.wait(list(pending), num_returns=1)
                point = pending.pop(ready)
                result = self._result(ready, point)
                self._write(point, result["files"])
                done.append(point.name)
                sweep.mark(done)
                sweep.console.print(f"point {len(done)}/{total}: {point.label}: done on {result['host']} (node "
                                    f"{result['node'][:12]}) in "
                                    f"{result['seconds']:.0f} s ({time.perf_counter() - started:.0f} s so far)",
                                    highlight=False)
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise

    def _asked(self) -> str:
        return ", ".join(f"{v:g} {k.removeprefix('num_').upper()}" for k, v in self.resources.items())

    def _result(self, ref, point) -> dict:
        from ray.exceptions import RayError, RayTaskError

        try:
            return self.ray.get(ref)
        except RayTaskError as e:  # the task itself raised: its own first line
            cause = getattr(e, "cause", None) or e
            raise SdbenchError(f"sweep point {point.label}: {first_line(cause)}") from None
        except RayError as e:  # its node died more than MAX_RETRIES times, or Ray lost it
            raise SdbenchError(f"sweep point {point.label}: Ray could not run it ({first_line(e)})") from None

    def _write(self, point, files: dict[str, bytes]) -> None:
        """The point's files into the sweep's folder, each whole (a temporary name, then renamed)."""
        run_id = f"{self.sweep.sweep_id}-{point.name}"
        if f"{run_id}.parquet" not in files:
            raise SdbenchError(f"sweep point {point.label}: its task returned no results file")
        self.sweep.forget(run_id)  # what an interrupted local attempt left of this point
        for name, data in files.items():
            tmp = self.sweep.folder / f".{name}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, self.sweep.folder / name)
