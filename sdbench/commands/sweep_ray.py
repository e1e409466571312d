"""`sdbench sweep --ray auto|ADDRESS`: every point not done yet as one Ray task on a cluster (commands/cluster.py:
reaching it, what a task asks for, how each runs alone on its node, retries when a node dies).

A task measures its point as a local sweep would (commands/sweep.py: the same planning, the same PointHarness, the
pair loaded on its node for that point) into a folder of its own, and returns the point's files; the driver writes
them into the sweep's folder (replacing anything an earlier, interrupted attempt left of that point) and marks the
point done, so a point is recorded once, and `--resume` skips it. Every node needs sdbench installed and the models
and data sets reachable by the names the sweep gives.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, replace

from sdbench.commands.cluster import connect, describe, run_tasks, task_resources, where
from sdbench.commands.sweep import Sweep, sweep_config
from sdbench.errors import SdbenchError


def measure_point(raw: dict, sweep_id: str, name: str, threads: int) -> dict:
    """A Ray task: one point of the sweep measured on this node; returns its files (name -> bytes) and where it ran."""
    import torch
    from rich.console import Console

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
    return {"files": files, **where(), "seconds": time.perf_counter() - started}


class RayPoints:
    """The points of one sweep as Ray tasks; connects (or fails in one line) when made, before anything is written."""

    def __init__(self, sweep, address: str):
        self.sweep, self.address = sweep, address
        self.ray = connect(address)
        self.resources, self.threads = task_resources(self.ray, sweep.cfg.run.device)

    def run(self, todo: list, done: list[str]) -> None:
        sweep = self.sweep
        raw = asdict(replace(sweep.cfg, resume=None))
        total, started = len(sweep.points), time.perf_counter()
        sweep.console.print(f"{len(todo)} points as Ray tasks {describe(self.ray, self.address, self.resources)}",
                            highlight=False)
        calls = {_Label(p): (raw, sweep.sweep_id, p.name, self.threads) for p in todo}

        def landed(label, result: dict) -> None:
            self._write(label.point, result["files"])
            done.append(label.point.name)
            sweep.mark(done)
            sweep.console.print(f"point {len(done)}/{total}: {label.point.label}: done on {result['host']} (node "
                                f"{result['node'][:12]}) in {result['seconds']:.0f} s "
                                f"({time.perf_counter() - started:.0f} s so far)", highlight=False)

        run_tasks(self.ray, measure_point, calls, self.resources, landed)

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


class _Label:
    """A point as run_tasks names it in an error: 'sweep point batch 2, 256-token prompts'."""

    def __init__(self, point):
        self.point = point

    def __str__(self) -> str:
        return f"sweep point {self.point.label}"
