"""`sdbench gpu-check`: one command that measures a GPU, for machines that reach no network.

Every model is `MODEL@random` (nothing is downloaded; with no tokenizer at hand a byte tokenizer stands in)
and every measurement is an existing command's code: the CUDA tests, `bench` (`commands/bench.measure_peers`),
`predict magicdec`'s profile and cost model (`analysis/costs`), `run` (`commands/run.RunHarness`) for MagicDec and
DSI. The work is split into three parts, each meant to finish within 9 minutes on one H100, and each writes
one folder of at most 8 files (`page.write_part`); `--merge` joins the parts' folders into one page.

  part 1: the CUDA tests; bench at Llama-3.2-1B's and Llama-3.2-3B's shapes
  part 2: bench at Llama-3.1-8B's shape; the token tree its verification costs favour for each shipped acceptance
          table (`trees.tree_costs`); its step costs over batch x context through the graphs (no point may fall
          back to the eager forward), and MagicDec's predicted speedup on them
  part 3: one MagicDec run at Llama-3.1-8B's shape in the paper's regime with its prediction; DSI with 2 and
          4 workers on the one device at Llama-3.2-1B's shape

`--tiny` runs the same parts on the same models shrunk to two layers (`plan.TINY`): the CPU rehearsal the
tests run end to end.

This module, plan.py and page.py (and reproduce/common.py, which they import) load neither torch nor pandas at
import: the preflight first names, in one line, a package the GPU machine lacks. What needs them is imported
inside the functions that run after it.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from sdbench.commands.gpucheck.page import write_part
from sdbench.commands.gpucheck.plan import (GPU, LLAMA_1B, LLAMA_3B, LLAMA_8B, TINY, Ctx, Section, free, preflight,
                                            settings)
from sdbench.commands.reproduce.common import FAILS, Claim
from sdbench.errors import CheckFailed, SdbenchError
from sdbench.options import split_list

PARTS = (1, 2, 3)
BUDGET_S = 510.0  # a part starts no new measurement after this: 8.5 minutes, under a 10-minute limit per call


def steps(part: int):
    """(label, fn(ctx) -> Section or [Section]) of one part, in order."""
    from sdbench.commands.gpucheck import costs, sections, trees  # torch and pandas: after the preflight

    return {
        1: [("the CUDA tests", sections.cuda_tests),
            (f"bench at {LLAMA_1B}", lambda ctx: sections.bench_model(ctx, LLAMA_1B)),
            (f"bench at {LLAMA_3B}", lambda ctx: sections.bench_model(ctx, LLAMA_3B))],
        2: [(f"bench at {LLAMA_8B}", lambda ctx: sections.bench_model(ctx, LLAMA_8B)),
            (f"tree costs at {LLAMA_8B}", trees.tree_costs),  # before the step costs: theirs is the grid that
            (f"step costs at {LLAMA_8B}", costs.step_costs)],  # stops at the part's budget
        3: [(f"magicdec at {LLAMA_8B}", costs.magicdec_run),
            (f"dsi at {LLAMA_1B}", sections.dsi_runs)],
    }[part]


def parse_parts(text: str) -> tuple[int, ...]:
    """'all', '2' or '1,3' -> the parts, in order; anything else is one line."""
    if text.strip().lower() == "all":
        return PARTS
    try:
        parts = tuple(int(x) for x in split_list(text, "--part"))
    except (ValueError, SdbenchError):
        parts = ()
    if not parts or any(p not in PARTS for p in parts):
        raise SdbenchError(f"--part {text}: use 1, 2, 3, a list like 1,3, or all")
    return tuple(sorted(set(parts)))


def run_check(parts: tuple[int, ...], device: str, tiny: bool, out: str, console, budget_s: float = BUDGET_S) -> list:
    """Run the parts one after another, each into out/part-N/; returns the pages written. Raises CheckFailed
    (exit 1) after writing, naming the first check that must hold and did not."""
    preflight(parts, device)
    sizes = TINY if tiny else GPU
    pages, failures = [], []
    with settings(tiny), tempfile.TemporaryDirectory(prefix="sdbench-gpu-check-") as work:
        for part in parts:
            ctx = Ctx(sizes, device, console, Path(work), time.perf_counter() + budget_s)
            page, failed = run_part(part, ctx, Path(out) / f"part-{part}")
            pages.append(page)
            failures += failed
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise CheckFailed(f"gpu-check: {failures[0]}{more}; see {pages[-1]}")
    return pages


def run_part(part: int, ctx: Ctx, folder: Path) -> tuple[Path, list[str]]:
    """Each step of the part in turn, the folder rewritten after each (a call stopped by its time limit still
    leaves what finished); a step that raises is recorded as failed (one line) and the part goes on."""
    started = time.perf_counter()
    done: list[Section] = []
    notes: list[str] = []
    page = folder
    todo = steps(part)
    for i, (label, fn) in enumerate(todo, 1):
        ctx.console.rule(f"gpu-check part {part}, step {i}/{len(todo)}: {label} "
                         f"({time.perf_counter() - started:.0f} s in)")
        if ctx.left() <= 0:
            notes.append(f"{label}: not run, the part's time budget was spent")
            continue
        before = len(done)
        try:
            made = fn(ctx)
        except Exception as err:  # noqa: BLE001 - one step's failure is recorded and the part goes on: a GPU
            # machine is lent for minutes, and the steps after it still measure
            text = str(err).strip().splitlines()
            done.append(_failed_step(label, str(err) if isinstance(err, SdbenchError) else
                                     f"{type(err).__name__}: {text[0][:300] if text else ''}"))
            free(ctx.device)
        else:
            done += made if isinstance(made, list) else [made]
        for line in (n for s in done[before:] for n in s.notes + s.failures):
            ctx.console.print(f"note: {line}", highlight=False, soft_wrap=True)
        page = write_part(folder, part, done, _setup(ctx, part, started), notes + [n for s in done for n in s.notes])
    ctx.console.print(f"gpu-check part {part}: {page} ({time.perf_counter() - started:.0f} s)", highlight=False)
    return page, [f for s in done for f in s.failures]


def _failed_step(label: str, message: str) -> Section:
    import pandas as pd  # after the preflight (see the module's docstring)

    line = f"{label} failed: {message}"
    return Section("errors", pd.DataFrame([{"step": label, "error": message}]),
                   [Claim(f"{label} runs", "failed", FAILS, message)], [line])


def _setup(ctx: Ctx, part: int, started: float) -> dict:
    from sdbench.env import environment  # loads torch: after the preflight (see the module's docstring)

    env = environment(str(ctx.torch_device), ctx.sizes.dtype)
    keys = ("device", "dtype", "gpu", "gpu_memory_bytes", "cpu", "cpu_count", "torch_version", "transformers_version",
            "sdbench_version", "git_commit", "python_version", "platform")
    return {"part": part, "sizes": "tiny (CPU rehearsal)" if ctx.sizes.tiny else "real shapes",
            **{k: env.get(k) for k in keys}, "seconds": round(time.perf_counter() - started, 1),
            "weights": "random (MODEL@random): step costs, speeds and memory are meaningful, acceptance is not"}
