"""`sdbench bench` over several targets: each target's bench (every system, its outputs checked against
transformers) one after another here, and as Ray tasks on a real two-node cluster with the same systems and tokens;
a --draft count that does not match the targets is one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pandas as pd
import pytest

from tests.conftest import run_cli
from tests.references import tiny_model_dir

TARGET_LINE = re.compile(r"bench: (\S+) \(on \S+, node (\w+),")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    targets = [tiny_model_dir(root / "tiny-a", seed=0), tiny_model_dir(root / "tiny-b", seed=1)]
    data = root / "prompts.csv"
    data.write_text("prompt\n" + "".join(f"\"{' '.join(f'w{(k * i) % 90}' for i in range(9)) * 2}\"\n"
                                         for k in (3, 7)))
    args = ["bench", "--target", str(targets[0]), "--target", str(targets[1]), "--dataset", str(data), "--limit", "2",
            "--max-new-tokens", "12", "--repeats", "1"]
    return args, root


def _benches(out) -> dict[str, pd.DataFrame]:
    return {name: pd.read_parquet(out / name / "bench.parquet").sort_values("system").reset_index(drop=True)
            for name in ("tiny-a", "tiny-b")}


def test_a_matrix_here_and_on_a_ray_cluster(setup, cluster, tmp_path, capsys, monkeypatch):
    args, root = setup
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    code, out, err = run_cli(capsys, *args, "--out", str(tmp_path / "here"))
    assert code == 0, err
    assert out.count("bench: ") >= 2 and "tiny-a" in out and "tiny-b" in out
    here = _benches(tmp_path / "here")
    for frame in here.values():
        assert len(frame) == 8 and frame["same_output"].all() and (frame["tokens"] == 24).all()
    assert set(here["tiny-a"]["model"]) != set(here["tiny-b"]["model"])  # each file its own target's
    made, _ = cluster
    env = {**os.environ, "SDBENCH_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "sdbench", *args, "--out", str(tmp_path / "ray"), "--ray",
                           made.address], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    ran = TARGET_LINE.findall(done.stdout)
    assert sorted(os.path.basename(t) for t, _ in ran) == ["tiny-a", "tiny-b"], done.stdout
    assert "2 targets as Ray tasks on 2 nodes" in done.stdout and done.stdout.count("verification cost T(") == 2
    there = _benches(tmp_path / "ray")
    for name in ("tiny-a", "tiny-b"):
        mine, theirs = there[name], here[name]
        assert list(mine["system"]) == list(theirs["system"])
        assert list(mine["tokens"]) == list(theirs["tokens"]) and mine["same_output"].all()


def test_a_draft_per_target_or_none(setup, capsys):
    args, _ = setup
    code, _, err = run_cli(capsys, *args, "--draft", "smollm2-135m")
    assert code == 2 and err.strip() == ("error: --draft given 1 times for 2 targets: give it once per --target, in "
                                         "the same order, or not at all")


def test_each_target_gets_its_own_draft_folder_and_settings(capsys, tmp_path, monkeypatch):
    """What the command line asks each target's bench to do (nothing loads: the benches are caught): three targets
    and three drafts pair in order, never the first draft for all nor the reverse order; every other option is each
    bench's; each writes OUT/NAME, NAME the target's own (a folder's last part, numbered where two share one). Without
    --draft each target drafts for itself; one target with one draft is one bench writing OUT itself; two drafts for
    three targets is one line."""
    import sdbench.commands.bench as bench
    import sdbench.commands.bench_matrix as bench_matrix

    asked = []
    monkeypatch.setattr(bench_matrix, "run_matrix", lambda cfgs, console, ray=None: asked.append((cfgs, ray)))
    monkeypatch.setattr(bench, "run_peers", lambda cfg, console: asked.append(([cfg], "here")))
    for sub in ("x/tiny", "y/tiny"):
        (tmp_path / sub).mkdir(parents=True)
    targets = ["qwen2.5-coder-1.5b", str(tmp_path / "x" / "tiny"), str(tmp_path / "y" / "tiny")]
    drafts = ["qwen2.5-coder-0.5b", "smollm2-135m", "llama-68m"]
    out = str(tmp_path / "out")
    common = ["--gamma", "3", "--limit", "5", "--dtype", "bfloat16", "--repeats", "4", "--out", out]
    code, _, err = run_cli(capsys, "bench", *(a for t in targets for a in ("--target", t)),
                           *(a for d in drafts for a in ("--draft", d)), *common, "--ray", "auto")
    assert code == 0, err
    [(cfgs, ray)] = asked
    assert ray == "auto"
    assert [(c.target, c.draft, c.draft_model) for c in cfgs] == [(t, d, d) for t, d in zip(targets, drafts)]
    assert [c.out for c in cfgs] == [f"{out}/qwen2.5-coder-1.5b", f"{out}/tiny", f"{out}/tiny-3"]
    assert {(c.gamma, c.limit, c.dtype, c.repeats) for c in cfgs} == {(3, 5, "bfloat16", 4)}

    asked.clear()
    code, _, err = run_cli(capsys, "bench", "--target", targets[0], "--target", targets[1], *common)
    assert code == 0, err
    [(cfgs, ray)] = asked
    assert ray is None and [(c.target, c.draft, c.draft_model) for c in cfgs] == [(t, "", t) for t in targets[:2]]

    asked.clear()
    code, _, err = run_cli(capsys, "bench", "--target", targets[1], "--draft", drafts[2], *common)
    assert code == 0, err
    [([cfg], where)] = asked
    assert where == "here" and (cfg.target, cfg.draft, cfg.out) == (targets[1], drafts[2], out)

    asked.clear()
    code, _, err = run_cli(capsys, "bench", *(a for t in targets for a in ("--target", t)), "--draft", drafts[0],
                           "--draft", drafts[1], *common)
    assert code == 2 and not asked and err.strip() == (
        "error: --draft given 2 times for 3 targets: give it once per --target, in the same order, or not at all")
