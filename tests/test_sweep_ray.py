"""`sdbench sweep --ray ADDRESS` on a real two-node Ray cluster started by the test (ray.cluster_utils.Cluster:
a head and a second node, each its own raylet with 2 CPUs): every point measured once, the second node's points
hung (its workers frozen) and then the node killed mid-sweep, those points run again on the head, and every
point's tokens equal to a local sweep's on the same grid; an unreachable cluster is one line."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pandas as pd
import psutil
import pytest

from sdbench.reporting.results import read_results
from tests.conftest import run_cli, skip_unless_ci
from tests.references import tiny_model_dir

GRID = ["--batch", "1,2,3", "--prompt-len", "16,24,32,40"]
POINTS = [f"b{b}-L{length}" for length in (16, 24, 32, 40) for b in (1, 2, 3)]
DONE = re.compile(r"point (\d+)/12: .*: done on \S+ \(node (\w+)\)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("sweep-ray") / "tiny")


def _args(tiny, out) -> list[str]:
    return ["sweep", "--target", str(tiny), "--limit", "3", "--max-new-tokens", "6", "--gamma", "3", "--device", "cpu",
            "--no-probe", "--out", str(out), *GRID, "-s", "ngram", "-s", "draft", "--draft", str(tiny)]


def _points(folder) -> dict[str, pd.DataFrame]:
    return {name: read_results([folder / f"{folder.name}-{name}.parquet"]) for name in POINTS}


def _freeze_workers(node, frozen: set) -> None:
    """SIGSTOP the node's Ray workers that are measuring a point (Ray titles such a process after its task): the
    point hangs mid-task."""
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    for child in raylet.children(recursive=True):
        try:
            if child.pid not in frozen and "measure_point" in " ".join(child.cmdline()):
                child.send_signal(signal.SIGSTOP)
                frozen.add(child.pid)
        except psutil.NoSuchProcess:
            pass


def _read(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def test_a_sweep_on_two_nodes_survives_a_node_killed_and_equals_a_local_one(cluster, tiny, tmp_path, capsys):
    """The second node's worker is frozen while it measures a point, so that point hangs; once the head has done
    every other point, the second node is killed: its points must be run again on the head, each recorded once."""
    made, second = cluster
    out = tmp_path / "ray"
    env = {**os.environ, "SDBENCH_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "sdbench", *_args(tiny, out), "--ray", made.address],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines, frozen, killed_at, last = [], set(), None, time.monotonic()
    incoming: queue.Queue = queue.Queue()
    threading.Thread(target=_read, args=(proc.stdout, incoming), daemon=True).start()
    deadline = time.monotonic() + 400
    while True:
        if killed_at is None:
            _freeze_workers(second, frozen)
        try:
            line = incoming.get(timeout=0.05)
        except queue.Empty:
            line = ""
        if line is None:
            break
        if line:
            lines.append(line)
            last = time.monotonic() if DONE.search(line) else last
        done = sum(1 for x in lines if DONE.search(x))
        if killed_at is None and frozen and done and time.monotonic() - last > 4:  # the head is out of points
            made.remove_node(second, allow_graceful=False)
            killed_at = done
        assert time.monotonic() < deadline, "".join(lines)
    assert proc.wait(timeout=60) == 0, "".join(lines)
    assert killed_at is not None and killed_at < 12, "".join(lines)  # a point hung on the frozen node
    done = [DONE.search(line) for line in lines if DONE.search(line)]
    assert [int(d.group(1)) for d in done] == list(range(1, 13)), "".join(lines)  # each point recorded once
    assert all(not second.node_id.startswith(d.group(2)) for d in done)  # the frozen node finished none
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    assert sorted(json.loads((folder / "done.json").read_text())) == sorted(POINTS)
    assert not list(folder.glob("*.parts"))
    code, _, err = run_cli(capsys, *_args(tiny, tmp_path / "local"))
    assert code == 0, err
    (local,) = [p for p in (tmp_path / "local").iterdir() if p.is_dir()]
    remote_points, local_points = _points(folder), _points(local)
    for name in POINTS:
        keys = ["role", "prompt_id", "repeat"]
        mine = remote_points[name].sort_values(keys).reset_index(drop=True)
        theirs = local_points[name].sort_values(keys).reset_index(drop=True)
        assert not mine.duplicated(keys).any() and len(mine) == len(theirs) == 9  # 3 prompts x 3 roles
        assert mine[keys].equals(theirs[keys])
        assert [list(x) for x in mine["output_ids"]] == [list(x) for x in theirs["output_ids"]], name
        assert mine["lossless"].dropna().all()


def test_an_unreachable_cluster_is_one_line_before_anything_is_written(tiny, tmp_path, capsys):
    if importlib.util.find_spec("ray") is None:
        skip_unless_ci("needs the `ray` extra")
    code = subprocess.run([sys.executable, "-m", "sdbench", *_args(tiny, tmp_path / "o"), "--ray", "127.0.0.1:9"],
                          capture_output=True, text=True, timeout=120)
    assert code.returncode == 2, code.stderr
    assert code.stderr.strip().startswith("error: --ray 127.0.0.1:9: no Ray cluster there")
    assert len(code.stderr.strip().splitlines()) == 1 and not any((tmp_path / "o").iterdir())  # no sweep begun
