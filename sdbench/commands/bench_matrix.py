"""`sdbench bench --target A --target B ... [--ray auto|ADDRESS]`: the same bench for several targets, one after
another here or each as a Ray task on a cluster (commands/cluster.py: each task alone on its node's CPUs or on one
GPU, run again elsewhere when its node dies).

Each target is an ordinary `bench` (commands/bench.py run_peers: the same systems, checks and tables), with its
own draft when --draft is given once per target, in order. With --out DIR each writes DIR/NAME/bench.parquet (NAME:
the target's name), so `report` and `site` read every one; a task's printed tables come back and are printed under
its target's name.
"""

from __future__ import annotations

import io
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from rich.console import Console

from sdbench.commands.cluster import connect, describe, run_tasks, task_resources, where
from sdbench.config import BenchConfig
from sdbench.errors import SdbenchError
from sdbench.paths import output_dir

WIDTH = 160  # a task's tables are recorded at this width and printed as text


def target_configs(base: BenchConfig, targets: list[str], drafts: list[str]) -> list[BenchConfig]:
    """One bench per target: every target drafting for itself (no --draft), one draft for all (a single target), or
    --draft given once per target, in order."""
    if drafts and len(drafts) != len(targets) and not (len(targets) == 1 and len(drafts) == 1):
        raise SdbenchError(f"--draft given {len(drafts)} times for {len(targets)} targets: give it once per --target, "
                           "in the same order, or not at all")
    if len(set(targets)) != len(targets):
        raise SdbenchError("--target: each target once")
    names = _names(targets)
    return [replace(base, target=t, draft=drafts[i] if drafts else "",
                    out=str(Path(base.out) / names[i]) if base.out and len(targets) > 1 else base.out)
            for i, t in enumerate(targets)]


def _names(targets: list[str]) -> list[str]:
    """A folder name per target: its own name (a path's last part), made unique."""
    from sdbench.commands.tune import slug

    names: list[str] = []
    for t in targets:
        name = slug(Path(t).name if Path(t).exists() else t) or "target"
        names.append(name if name not in names else f"{name}-{len(names) + 1}")
    return names


def run_matrix(cfgs: list[BenchConfig], console: Console, ray: str | None = None) -> None:
    """Every target's bench: here, one after another, or as Ray tasks (ray: the cluster's address, or auto)."""
    from sdbench.commands.bench import check_bench, run_peers

    for cfg in cfgs:
        check_bench(cfg)  # every target's settings before anything loads
    if ray is None:
        for cfg in cfgs:
            console.rule(f"bench: {cfg.target}")
            run_peers(cfg, console)
        return
    cluster = connect(ray)
    resources, threads = task_resources(cluster, cfgs[0].device)
    console.print(f"{len(cfgs)} targets as Ray tasks {describe(cluster, ray, resources)}", highlight=False)
    calls = {f"bench --target {c.target}": (asdict(c), threads) for c in cfgs}
    by_label = dict(zip(calls, cfgs))

    def landed(label: str, result: dict) -> None:
        cfg = by_label[label]
        console.rule(f"bench: {cfg.target} (on {result['host']}, node {result['node'][:12]}, "
                     f"{result['seconds']:.0f} s)")
        console.out(result["text"], highlight=False)
        if cfg.out and result["bench"] is not None:
            path = output_dir(cfg.out) / "bench.parquet"
            path.write_bytes(result["bench"])
            console.print(f"results: {path}", highlight=False)

    run_tasks(cluster, bench_task, calls, resources, landed)


def bench_task(raw: dict, threads: int) -> dict:
    """A Ray task: one target's bench on this node; its printed tables, its bench.parquet (bytes) and where it ran."""
    import torch

    from sdbench.commands.bench import run_peers

    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    recorded = Console(record=True, file=io.StringIO(), width=WIDTH)
    with tempfile.TemporaryDirectory(prefix="sdbench-bench-") as out:
        cfg = BenchConfig(**{**raw, "heads": tuple(raw.get("heads") or ()), "out": out if raw.get("out") else None})
        run_peers(cfg, recorded)
        written = Path(out) / "bench.parquet"
        data = written.read_bytes() if written.is_file() else None
    return {"text": recorded.export_text(), "bench": data, **where(), "seconds": time.perf_counter() - started}
