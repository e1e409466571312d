"""The check's steps that run existing commands as they are: the CUDA tests (pytest), `bench` per model
(`commands/bench.measure_peers`) and DSI runs (`commands/run.RunHarness`). Each returns a `plan.Section`."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pandas as pd

from sdbench.commands import run as run_module  # the module: tests replace run.RunHarness
from sdbench.commands.bench import GENERIC_ROW, measure_peers
from sdbench.commands.gpucheck.plan import LLAMA_1B, LLAMA_8B, Ctx, Section, free, write_prompts
from sdbench.commands.reproduce.common import FAILS, HOLDS, UNTESTABLE, Claim
from sdbench.config import BenchConfig, RunConfig
from sdbench.dsi.orchestrator import DSIRowStats
from sdbench.dsi.pools import shutdown_pools
from sdbench.models.loading import pair as pair_module  # the module: tests replace pair.load_pair
from sdbench.models.loading.memory import GIB
from sdbench.reporting import results  # the module: tests replace results.read_results

REPO = Path(__file__).resolve().parents[3]  # the checkout holding sdbench/ and tests/
MARK = "pytest.mark.cuda"
TARGET_ROOFLINE, TARGET_VS_TRANSFORMERS = 0.8, 1.3  # the targets at Llama-3.1-8B's shape on an H100


# ---- the CUDA tests --------------------------------------------------------------------------------------


def cuda_test_files(folder: Path = REPO / "tests") -> list[Path]:
    """The test modules holding a test marked `cuda`: only they are collected, so modules that import packages
    a GPU machine may lack (Optuna for the tuner's tests) are never imported there."""
    if not folder.is_dir():
        return []
    return [p for p in sorted(folder.glob("test_*.py")) if MARK in p.read_text(encoding="utf-8")]


def junit_rows(report: Path) -> list[dict]:
    """One row per test case of a pytest JUnit XML report: test, outcome, seconds, message."""
    rows = []
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag, said in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            found = case.find(tag)
            if found is not None:
                outcome, message = said, _first_line(found.get("message") or "")
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                     "seconds": float(case.get("time") or 0.0), "message": message})
    return rows


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:200] if text.strip() else ""


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1][:200] if text.strip() else ""


def cuda_tests(ctx: Ctx) -> Section:
    """`pytest -m cuda` over the modules that hold such tests, in a child process; a test that fails, or any
    test skipped while a GPU is here, fails the call."""
    files = cuda_test_files()
    claim = "the CUDA tests pass (pytest -m cuda)"
    if not files:
        why = "no tests/ folder beside the package (an installed copy): run the check from the repository"
        return Section("cuda-tests", pd.DataFrame([{"test": "-", "outcome": "not run", "message": why}]),
                       [Claim(claim, "not run", UNTESTABLE, why)])
    report = ctx.work / "cuda-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
           *(str(f.relative_to(REPO)) for f in files)]
    with ctx.console.status(f"running the CUDA tests: pytest -m cuda over {len(files)} modules"):
        try:
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(60.0, ctx.left()))
        except subprocess.TimeoutExpired:
            done = None
    rows = junit_rows(report) if report.is_file() else []
    if done is None or not rows:
        said = "timed out" if done is None else _last_line(done.stdout + done.stderr) or f"exit {done.returncode}"
        line = f"the CUDA tests did not run to the end: {said}"
        return Section("cuda-tests", pd.DataFrame([{"test": "-", "outcome": "not run", "message": line}]),
                       [Claim(claim, "not run", FAILS, line)], [line])
    frame = pd.DataFrame(rows)
    counts = frame["outcome"].value_counts().to_dict()
    measured = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    bad = frame[frame["outcome"].isin(["failed", "error"])]
    on_gpu = ctx.torch_device.type == "cuda"
    if len(bad) or (on_gpu and counts.get("skipped")):
        first = (bad if len(bad) else frame[frame["outcome"] == "skipped"]).iloc[0]
        line = f"CUDA tests: {measured}; first: {first['test']} ({first['message'] or first['outcome']})"
        return Section("cuda-tests", frame, [Claim(claim, measured, FAILS, line)], [line])
    if not on_gpu:
        return Section("cuda-tests", frame, [Claim(claim, measured, UNTESTABLE, "no CUDA device: every CUDA test "
                                                                               "skips; they ran to collection")])
    return Section("cuda-tests", frame, [Claim(claim, measured, HOLDS)])


# ---- bench: plain decoding against transformers' fastest configuration, batch 1 ----------------------------


def _kind(system: str, graphs_asked: bool) -> str:
    if system.startswith("transformers"):
        return "transformers"
    if system == GENERIC_ROW:
        return "generic runner"
    if "no fast path" in system:
        return "eager"
    return "cuda graphs" if graphs_asked else "fast path"


def bench_model(ctx: Ctx, model: str) -> Section:
    """`bench` at one model's shape, batch 1, plain decoding only: transformers' generate in its fastest
    configuration here, sdbench eager, sdbench through the fast path (CUDA graphs on a GPU) and the generic
    runner; share of the memory roofline and T(gamma + 1) / T(1)."""
    s = ctx.sizes
    prompts = write_prompts(ctx.work / "bench-prompts.jsonl", s.bench_prompts, s.bench_prompt_chars)
    ctx.console.print(f"bench {model}: batch 1, {s.bench_tokens} new tokens x {s.bench_prompts} prompts x "
                      f"{s.bench_repeats} repeats", highlight=False)
    peers = measure_peers(BenchConfig(model, model, str(prompts), s.bench_prompts, s.bench_tokens, s.gamma, ctx.device,
                                      s.dtype, 0, s.bench_repeats, generate=s.generate, autoregressive_only=True),
                          ctx.console)
    free(ctx.device)
    ref = peers.results[0]
    fell_back = peers.graphs_asked and not peers.graphs
    rows = [{"model": model, "system": m.system, "kind": _kind(m.system, peers.graphs_asked),
             "tokens_per_s": m.tokens_per_s, "tokens_per_s_min": min(m.rates()), "tokens_per_s_max": max(m.rates()),
             "vs_transformers": m.tokens_per_s / ref.tokens_per_s, "of_roofline": m.tokens_per_s / peers.roofline,
             "same_output": m.outputs == ref.outputs, "roofline_tokens_per_s": peers.roofline,
             "bandwidth_gb_s": peers.bandwidth.bytes_per_s / 1e9, "weight_gib": peers.weight_bytes / GIB,
             "gamma": s.gamma,
             "verify_cost": peers.verify_cost, "generate": peers.picked.line(), "graphs_asked": peers.graphs_asked,
             "graphs": peers.graphs, "fell_back": fell_back} for m in peers.results]
    frame = pd.DataFrame(rows)
    section = Section("bench", frame, notes=[f"{model}: {peers.picked.line()}"])
    if fell_back:
        section.failures.append(f"bench {model}: CUDA graphs fell back to the eager forward (see the warning above)")
    if model == LLAMA_8B:
        section.checks.append(_target_claim(ctx, frame))
    return section


def _target_claim(ctx: Ctx, frame) -> Claim:
    fast = frame[frame["kind"].isin(["cuda graphs", "fast path"])].iloc[0]
    measured = (f"{fast['tokens_per_s']:.1f} tokens/s, {fast['of_roofline']:.0%} of the memory roofline, "
                f"{fast['vs_transformers']:.2f}x transformers ({frame.iloc[0]['system']})")
    verdict, why = ctx.verdict_or_untestable(fast["of_roofline"] >= TARGET_ROOFLINE
                                             and fast["vs_transformers"] >= TARGET_VS_TRANSFORMERS)
    return Claim(f"{LLAMA_8B}, batch 1: sdbench autoregressive reaches {TARGET_ROOFLINE:.0%} of the HBM roofline "
                 f"and {TARGET_VS_TRANSFORMERS}x transformers' fastest configuration", measured, verdict, why)


# ---- DSI on the one GPU --------------------------------------------------------------------------------------


def dsi_runs(ctx: Ctx) -> Section:
    """`run --strategy dsi` at LLAMA_1B's shape, the target drafting for itself, with each worker count of the
    sizes, all workers on the one device; every run beside plain decoding of the same prompts."""
    s = ctx.sizes
    prompts = write_prompts(ctx.work / "dsi-prompts.jsonl", s.dsi_prompts, s.bench_prompt_chars)
    base = RunConfig(target=LLAMA_1B, drafts=(LLAMA_1B,), strategy="dsi", dataset=str(prompts), limit=s.dsi_prompts,
                     max_new_tokens=s.dsi_tokens, gammas=(s.dsi_gamma,), device=ctx.device, dtype=s.dtype,
                     out=str(ctx.work / "runs"))
    configs = [replace(base, options={"workers": str(w)}) for w in s.dsi_workers]
    first = run_module.RunHarness(configs[0], ctx.console)
    pair = pair_module.load_pair(first.cfg, first.device, first.dtype, ctx.console)
    rows, checks, skipped = [], [], []
    try:
        for cfg, workers in zip(configs, s.dsi_workers):
            if ctx.left() <= 0:
                skipped.append(workers)
                continue
            ctx.console.print(f"dsi at {LLAMA_1B}: {workers} workers on one {first.device.type} device",
                              highlight=False)
            df = results.read_results([str(run_module.RunHarness(cfg, ctx.console, pair=pair).run())])
            rows += _dsi_rows(df, workers)
            checks.append(_lossless_claim(f"dsi, {workers} workers", df))
    finally:
        shutdown_pools()
        del pair
        free(ctx.device)
    frame = pd.DataFrame(rows)
    notes = [f"DSI with {', '.join(map(str, skipped))} workers not run: the part's time budget was spent"] * bool(skipped)
    return Section("dsi", frame, checks, [c.why for c in checks if c.verdict == FAILS], notes)


def _dsi_rows(df, workers: int) -> list[dict]:
    """Per role: mean tokens/s, time per output token, speedup and lossless share; DSI's own numbers (busy
    fractions, cancelled verifications) averaged over its rows."""
    out = []
    for role, group in df.groupby("role", sort=False):
        row = {"workers": workers, "role": role, "strategy": str(group["strategy"].iloc[0]), "rows": len(group),
               "tokens_per_s": float(group["tokens_per_s"].mean()), "tpot_ms": float(group["tpot_s"].mean()) * 1e3,
               "ttft_s": float(group["ttft_s"].mean())}
        if "speedup" in group:
            row["speedup"] = float(group["speedup"].mean())
        if "lossless" in group and role != "baseline":
            row["lossless_share"] = float(group["lossless"].astype(bool).mean())
        if role != "baseline":
            row.update(_numbers(group["strategy_stats"]))
        out.append(row)
    return out


def _numbers(stats) -> dict:
    """Mean of every number (a list: its mean) in the rows' DSIRowStats, as dsi_<field> columns."""
    sums: dict[str, list[float]] = {}
    for text in stats:
        for key, value in DSIRowStats.from_dict(results.parse_stats(text)).to_dict().items():
            if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
                value = sum(value) / len(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                sums.setdefault(f"dsi_{key}", []).append(float(value))
    return {k: sum(v) / len(v) for k, v in sums.items()}


def _lossless_claim(what: str, df) -> Claim:
    """Greedy output equal to plain decoding's on every row, or differing only at ties (`commands/divergence`)."""
    rows = df[df["role"] != "baseline"]
    same = int(rows["lossless"].astype(bool).sum())
    kinds = rows["divergence"].value_counts().to_dict() if "divergence" in rows else {}
    varied = int(rows["width_invariant"].eq(False).sum()) if "width_invariant" in rows else 0
    measured = f"{same} of {len(rows)} rows identical to plain decoding" + "".join(
        f", {n} {k}" for k, n in sorted(kinds.items())) + (
        f"; {varied} verified on products chosen per shape (not width-invariant: ties judged)" if varied else "")
    if kinds.get("real"):
        return Claim(f"{what}: lossless", measured, FAILS, f"{what}: {kinds['real']} row(s) diverge from plain "
                                                           "decoding beyond a tie")
    return Claim(f"{what}: lossless", measured, HOLDS, "differences at ties only" if kinds else "")
