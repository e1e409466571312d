"""Numbers that cannot be true: a speedup above the bound its accepted length sets is flagged and said (which side's
time moved), too few prompts give no interval, and a busy machine is measured and said — by hand, on fake timings,
and beside a real busy loop."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest
from rich.console import Console

from sdbench.busy import BUSY, Busy, Window, weighted
from sdbench.commands.roles import EveryRole
from sdbench.engine.formulas import speedup_bound
from sdbench.reporting.bounds import beyond, rows_distorted
from sdbench.reporting.compare import compare_frames
from sdbench.reporting.report import print_report
from sdbench.reporting.stats import Interval, doubt
from sdbench.reporting.summary import summarize
from sdbench.reporting.sweep import best_points

from tests.conftest import run_cli


def rows(prompts: int = 6, base_s: float = 1.0, strategy_s: float = 0.5, steps: int = 21, tokens: int = 32,
         base_ttft: float = 0.05, busy: float = 0.0, params: str = '{"gamma": 4}') -> pd.DataFrame:
    """Per prompt a baseline row (tokens in base_s) and a strategy row (tokens in strategy_s over `steps` rounds:
    accepted length (tokens - 1) / steps), each prompt its own batch."""
    out = []
    for p in range(prompts):
        common = dict(run_id="run", prompt_id=f"p{p}", batch_id=p, repeat=0, category="c", new_tokens=tokens,
                      busy_others=busy, cpu_steal=0.0)
        out.append(dict(common, role="baseline", strategy="autoregressive", params="{}", steps=tokens - 1,
                        wall_s=base_s, ttft_s=base_ttft, verify_s=base_s - base_ttft, accepted=0, drafted=0))
        out.append(dict(common, role="strategy", strategy="ngram", params=params, steps=steps, wall_s=strategy_s,
                        ttft_s=0.05, verify_s=strategy_s * 0.8, accepted=tokens - 1 - steps, drafted=4 * steps))
    return pd.DataFrame(out)


def overall(summary: pd.DataFrame, role: str = "strategy") -> pd.Series:
    return summary[(summary["role"] == role) & (summary["category"] == "ALL")].iloc[0]


def report_text(df: pd.DataFrame) -> str:
    console = Console(record=True, width=250)
    print_report(df, console)
    return console.export_text()


def test_the_bound_by_hand():
    assert speedup_bound(2.0) == 2.0  # never above the accepted length
    assert speedup_bound(2.0, t1=0.010, t_verify=0.016) == pytest.approx(1.25)  # L x T(1) / T(verify)
    assert speedup_bound(2.0, t1=0.010, t_verify=0.008) == 2.0  # a verification read cheaper than T(1): still L
    assert speedup_bound(1.5, workers=3) == pytest.approx(4.5)  # three workers verifying at once
    assert math.isnan(speedup_bound(math.nan))
    assert beyond(Interval(1.10), 1.0) and not beyond(Interval(1.02), 1.0)  # 3 % slack for the clocks' noise
    assert not beyond(Interval(1.10, 0.98, 1.2), 1.0)  # its interval reaches down to the bound: not shown above it
    assert beyond(Interval(1.10, 1.05, 1.2), 1.0)


def test_a_slowed_baseline_is_flagged_and_the_line_says_it_moved():
    """Accepted length 31/21 = 1.48, speedup 3x: a round (0.45 s / 21 steps = 21 ms) cannot take less than the
    baseline's token (0.95 s / 31 = 31 ms) on a quiet machine."""
    df = rows(base_s=1.5, strategy_s=0.5, busy=0.0)
    df.loc[df["role"] == "baseline", "busy_others"] = 0.45
    row = overall(summarize(df))
    assert row["mean_accepted_len"] == pytest.approx(31 / 21)
    assert row["speedup"] == pytest.approx(3.0) and row["speedup_bound"] == pytest.approx(31 / 21)
    assert row["distorted"] and row["busy"]
    said = row["distortion"]
    assert "3.00x is above 1.48x" in said and "the baseline's time moved" in said
    assert f"plain decoding took {1.45 / 31 * 1e3:.3g} ms a token" in said and "the baseline 45%" in said
    text = report_text(df)
    assert "3.00x ±0.00!" in text and "ngram busy" in text and "measured on a busy machine" in text
    assert "the baseline's time moved" in text


def test_a_slowed_prefill_is_told_from_a_slowed_decode():
    """The decode speedup within its bound, the end-to-end one above it: the baseline's first tokens took longer."""
    df = rows(base_s=3.0, base_ttft=2.5, strategy_s=0.4, steps=12)  # L = 31/12 = 2.58, speedup 7.5x
    row = overall(summarize(df))
    assert row["decode_speedup"] < row["speedup_bound"] < row["speedup"]
    assert row["distorted"] and "plain decoding's first tokens took 2.5e+03 ms" in row["distortion"]


def test_a_quiet_run_prints_as_before():
    df = rows(base_s=1.0, strategy_s=0.8, steps=15, busy=0.01)  # L = 2.07, speedup 1.25x
    row = overall(summarize(df))
    assert not row["distorted"] and not row["busy"] and row["distortion"] is None
    assert row["busy_others"] == pytest.approx(0.01)
    text = report_text(df)
    assert "!" not in text.split("speedup ±")[0] and "busy machine" not in text and "time moved" not in text
    plain = rows(base_s=1.0, strategy_s=0.99, steps=31)  # nothing accepted (L = 1): 1.01x is the clocks' noise
    assert not overall(summarize(plain))["distorted"]


def test_two_prompts_give_no_significance():
    df = rows(prompts=2, base_s=1.0, strategy_s=0.5, steps=10)  # a clear 2x, on two prompts only
    row = overall(summarize(df))
    assert math.isnan(row["speedup_low"]) and math.isnan(row["speedup_high"])
    line = next(x for x in report_text(df).splitlines() if x.startswith("│ ngram") and "ALL" in x)
    assert "2.00x?" in line and "±" not in line
    assert "an interval needs at least 5" in doubt(Interval(2.0, units=2), 1.0, 2, "trial 0")
    assert overall(summarize(rows(prompts=5, strategy_s=0.5, steps=10)))["speedup_low"] > 1.0


def test_concurrent_workers_raise_the_bound():
    df = rows(base_s=1.5, strategy_s=0.5, params=json.dumps({"gamma": 4, "workers": 4}))
    row = overall(summarize(df))
    assert row["speedup_bound"] == pytest.approx(4 * 31 / 21) and not row["distorted"]


def test_compare_never_calls_a_speedup_above_its_bound_a_gain():
    base = rows(base_s=1.0, strategy_s=0.9, steps=21).assign(run_id="b")
    for frame in (base,):
        frame["speedup"] = [1.0 if r == "baseline" else 1.0 / 0.9 for r in frame["role"]]
    current = rows(base_s=1.5, strategy_s=0.5, steps=21).assign(run_id="c")  # 3x at accepted length 1.48
    current["speedup"] = [1.0 if r == "baseline" else 3.0 for r in current["role"]]
    assert rows_distorted(current[current["role"] == "strategy"])
    verdicts = compare_frames(base, current).configurations
    assert set(verdicts.loc[verdicts["metric"] == "speedup", "verdict"]) == {"above its bound"}
    honest = rows(base_s=1.5, strategy_s=0.5, steps=8).assign(run_id="c")  # 3x at accepted length 3.9
    honest["speedup"] = current["speedup"]
    verdicts = compare_frames(base, honest).configurations
    assert set(verdicts.loc[verdicts["metric"] == "speedup", "verdict"]) == {"faster"}


def test_a_sweep_point_is_never_won_by_a_distorted_setting():
    fair = rows(base_s=1.0, strategy_s=0.7, steps=15).assign(run_id="a", strategy="ngram", sweep="s", batch_size=1,
                                                              prompt_len=100, params='{"gamma": 2}')
    bent = rows(base_s=1.5, strategy_s=0.5, steps=21).assign(run_id="a", sweep="s", batch_size=1, prompt_len=100,
                                                              params='{"gamma": 6}')
    both = pd.concat([fair, bent[bent["role"] == "strategy"]], ignore_index=True).assign(draft="")
    [point] = best_points(both).to_dict("records")
    assert point["setting"] == "gamma=2" and not point["distorted"]


@contextlib.contextmanager
def busy_loops(n: int):
    """n processes spinning, not children of this one (started through a shell that exits at once): the machine's
    other work, as a neighbour's job would be."""
    started = subprocess.run(
        ["sh", "-c", " ".join([f'{sys.executable} -c "while True: pass" >/dev/null 2>&1 & echo $!;'] * n)],
        capture_output=True, text=True, check=True, start_new_session=True)
    pids = [int(p) for p in started.stdout.split()]
    try:
        time.sleep(0.3)
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_busy_loop_beside_a_measurement_is_reported():
    with Window() as quiet:
        _spin(0.5)  # sdbench's own work is not others' work
    cores = len(os.sched_getaffinity(0))
    with busy_loops(cores):
        with Window() as beside:
            time.sleep(1.0)
        measured = EveryRole(["a"], "cpu").measure(lambda role: time.sleep(0.5))
    assert quiet.busy.others < BUSY and not quiet.busy.busy
    assert beside.busy.others > 0.5 and beside.busy.busy
    assert measured[0].busy.others > 0.5
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    try:
        with Window() as own:
            time.sleep(1.0)  # sdbench's own child (an engine's server) spinning: sdbench's work
    finally:
        child.wait()
    assert own.busy.others < BUSY
    together = weighted([(Busy(0.5, 0.0), 1.0), (Busy(0.1, 0.2), 3.0), (Busy(), 5.0)])
    assert together.others == pytest.approx(0.2) and together.steal == pytest.approx(0.15)


def test_a_run_beside_a_busy_loop_says_so(tmp_path, capsys):
    with busy_loops(len(os.sched_getaffinity(0))):
        code, out, err = run_cli(capsys, "run", "--target", "smollm2-135m", "--strategy", "ngram", "--limit", "2",
                                 "--max-new-tokens", "12", "--out", str(tmp_path))
    assert code == 0, err
    [path] = tmp_path.glob("*.parquet")
    df = pd.read_parquet(path)
    assert (df["busy_others"] > BUSY).all(), df["busy_others"].tolist()
    assert "measured on a busy machine" in out and "baseline busy" in out
    summary = summarize(df)
    row = overall(summary)
    assert row["busy"] and (not row["distorted"] or "time moved" in row["distortion"])
    assert row["speedup"] <= row["speedup_bound"] * 1.03 or row["distorted"]  # nothing above its bound unflagged


def test_bench_marks_a_system_measured_on_a_busy_machine(tmp_path):
    from sdbench.commands.bench_table import SystemMeasurement, _table, write_bench

    quiet = SystemMeasurement("transformers generate", False, tokens=[32], seconds=[1.0], outputs=[[1, 2]],
                              load=[(Busy(0.01, 0.0), 1.0)])
    busy = SystemMeasurement("sdbench autoregressive (fast)", True, tokens=[32], seconds=[2.0], outputs=[[1, 2]],
                             load=[(Busy(0.02, 0.0), 1.0), (Busy(0.62, 0.0), 1.0)])
    console = Console(record=True, width=300)
    console.print(_table([quiet, busy], 100.0, {}, "bench"))
    text = console.export_text()
    assert "sdbench autoregressive (fast) (busy)" in text and "transformers generate (busy)" not in text
    assert "sdbench autoregressive (fast): others 32%" in text
    path = write_bench([quiet, busy], str(tmp_path), {"device": "cpu", "dtype": "float32"})
    written = pd.read_parquet(path).set_index("system")["busy_others"]
    assert written.to_dict() == pytest.approx({"transformers generate": 0.01, "sdbench autoregressive (fast)": 0.32})


def test_the_site_says_a_distorted_and_busy_row(tmp_path):
    from sdbench.reporting.site.board import leaderboard, summaries
    from sdbench.reporting.site.build import shown

    df = rows(base_s=1.5, strategy_s=0.5, busy=0.3)
    board = shown(leaderboard(summaries(df.assign(target="t", dataset="d", turn=1, batch_size=1, gamma=4))))
    every = board[board["category"] == "ALL"].iloc[0]
    assert "above its bound 1.48x" in every["note"] and "busy machine" in every["note"]
    few = shown(leaderboard(summaries(rows(prompts=3).assign(target="t", dataset="d", turn=1, batch_size=1, gamma=4))))
    assert set(few["interval"]) == {"too few prompts"}
