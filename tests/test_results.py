"""Recording results: the Parquet writer/reader, the aggregates, the tables and the environment."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from datetime import datetime

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from sdbench import env as envmod
from sdbench.errors import SdbenchError
from sdbench.reporting.report import print_report
from sdbench.reporting.results import read_results
from sdbench.reporting.schema import COLUMNS
from sdbench.reporting.summary import per_position_rates, summarize
from sdbench.reporting.tables import summary_table
from sdbench.reporting.writer import RunWriter, new_run_id
from tests.conftest import skip_unless_ci


def row(prompt_id: str, repeat: int = 0, role: str = "strategy", **extra) -> dict:
    return {"role": role, "strategy": "draft", "prompt_id": prompt_id, "repeat": repeat, "batch_id": 0,
            "new_tokens": 5, "output_ids": [1, 2, 3, 4, 5], **extra}


# --- writer and reader -------------------------------------------------------------------------------


def test_new_run_id_shape():
    run_id = new_run_id("Draft Model", now=datetime(2026, 11, 22, 15, 30, 12))
    assert re.fullmatch(r"20261122-153012-draft-model-[0-9a-f]{4}", run_id)
    assert re.fullmatch(r"\d{8}-\d{6}-ngram-[0-9a-f]{4}", new_run_id("ngram"))


def test_writer_round_trip_parts_then_finalize(tmp_path):
    writer = RunWriter(tmp_path, "r1", env={"device": "cpu", "hardware": "cpu:x", "cpu_count": 8})
    first = writer.append([row("p1", lossless=True), row("p2")])
    second = writer.append([row("p3", accepted_per_position=[3, 1], output_ids=np.array([7, 8]))])
    assert first.name == "part-00001.parquet" and second.name == "part-00002.parquet"
    assert sorted(p.name for p in writer.parts_dir.iterdir()) == ["part-00001.parquet", "part-00002.parquet"]

    # Parts are readable before finalize: an interrupted process loses nothing.
    assert list(read_results([writer.parts_dir])["prompt_id"]) == ["p1", "p2", "p3"]

    final = writer.finalize()
    assert final == tmp_path / "r1.parquet" and not writer.parts_dir.exists()
    df = read_results([final])
    assert list(df.columns) == list(COLUMNS)
    assert list(df["prompt_id"]) == ["p1", "p2", "p3"]
    assert set(df["run_id"]) == {"r1"} and set(df["device"]) == {"cpu"} and set(df["hardware"]) == {"cpu:x"}
    assert list(df["output_ids"].iloc[2]) == [7, 8]
    assert list(df["accepted_per_position"].iloc[2]) == [3, 1]
    assert df["accepted_per_position"].iloc[0] is None
    assert list(df["lossless"].astype(object).where(df["lossless"].notna(), None)) == [True, None, None]
    assert df["gamma"].isna().all() and str(df["repeat"].dtype) == "Int64"
    assert pq.read_schema(final).field("output_ids").type == pa.list_(pa.int32())
    assert df["timestamp"].str.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d$").all()
    assert writer.finalize() == final  # idempotent
    assert len(read_results([tmp_path])) == 3


def test_keyboard_interrupt_keeps_finished_rows(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with RunWriter(tmp_path, "r2") as writer:
            writer.append([row("p1"), row("p2")])
            writer.append([row("p3")])
            raise KeyboardInterrupt
    assert not (tmp_path / "r2.parts").exists()
    assert list(read_results([tmp_path / "r2.parquet"])["prompt_id"]) == ["p1", "p2", "p3"]


def test_other_errors_leave_durable_parts_for_resume(tmp_path):
    with pytest.raises(RuntimeError):
        with RunWriter(tmp_path, "r3") as writer:
            writer.append([row("p1")])
            raise RuntimeError("strategy bug")
    assert not (tmp_path / "r3.parquet").exists()
    assert RunWriter(tmp_path, "r3").done_keys() == {("strategy", "p1", 0, 1)}


def test_resume_sees_final_file_and_parts(tmp_path):
    with RunWriter(tmp_path, "r4") as writer:
        writer.append([row("p1", role="baseline"), row("p1")])
    resumed = RunWriter(tmp_path, "r4")
    assert resumed.exists()
    assert resumed.done_keys() == {("baseline", "p1", 0, 1), ("strategy", "p1", 0, 1)}
    part = resumed.append([row("p2", repeat=1)])
    assert part.name == "part-00002.parquet"  # never reuses a name already merged
    assert resumed.done_keys() == {("baseline", "p1", 0, 1), ("strategy", "p1", 0, 1), ("strategy", "p2", 1, 1)}
    resumed.finalize()
    assert list(read_results([tmp_path])["prompt_id"]) == ["p1", "p1", "p2"]
    assert RunWriter(tmp_path, "fresh").done_keys() == set()


def test_crash_between_merge_and_cleanup_does_not_duplicate(tmp_path):
    writer = RunWriter(tmp_path, "r5")
    writer.append([row("p1")])
    writer.append([row("p2")])
    kept = tmp_path / "kept"
    shutil.copytree(writer.parts_dir, kept)
    writer.finalize()
    shutil.copytree(kept, writer.parts_dir)  # as if the process died before removing the parts
    assert len(read_results([tmp_path])) == 2
    assert RunWriter(tmp_path, "r5").done_keys() == {("strategy", "p1", 0, 1), ("strategy", "p2", 0, 1)}
    RunWriter(tmp_path, "r5").finalize()
    assert list(read_results([tmp_path / "r5.parquet"])["prompt_id"]) == ["p1", "p2"]


def test_unknown_or_mistyped_column_rejected(tmp_path):
    writer = RunWriter(tmp_path, "r6")
    with pytest.raises(ValueError, match=r"'lossles' \(did you mean 'lossless'\?\)"):
        writer.append([row("p1", lossles=True)])
    with pytest.raises(ValueError, match="'prompt_tokens'"):
        writer.append([row("p1", prompt_tokens="many")])
    assert not writer.parts_dir.exists()


def test_reads_older_and_newer_files(tmp_path):
    pq.write_table(pa.table({"run_id": ["old"], "role": ["baseline"], "prompt_id": ["p1"],
                             "repeat": pa.array([0], pa.int32())}), tmp_path / "old.parquet")
    newer = RunWriter(tmp_path, "new")
    newer.append([row("p2")])
    newer.finalize()
    table = pq.read_table(tmp_path / "new.parquet").append_column("added_later", pa.array([1.5]))
    pq.write_table(table, tmp_path / "new.parquet")

    df = read_results([tmp_path])
    assert list(df.columns) == [*COLUMNS, "added_later"]
    assert list(df["run_id"]) == ["new", "old"]
    assert df["new_tokens"].isna().tolist() == [False, True]
    assert df["added_later"].iloc[0] == 1.5 and math.isnan(df["added_later"].iloc[1])


def test_read_errors_are_one_line(tmp_path):
    with pytest.raises(SdbenchError, match="not found"):
        read_results([tmp_path / "nope.parquet"])
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SdbenchError, match="not a results file"):
        read_results([tmp_path / "notes.txt"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SdbenchError, match="no .parquet results"):
        read_results([tmp_path / "empty"])
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(SdbenchError, match="cannot read results file") as caught:
        read_results([tmp_path / "bad.parquet"])
    assert "\n" not in str(caught.value)
    pq.write_table(pa.table({"run_id": pa.array([], pa.string())}), tmp_path / "none.parquet")
    with pytest.raises(SdbenchError, match="no result rows"):
        read_results([tmp_path / "none.parquet"])


# --- aggregates -------------------------------------------------------------------------------------


def frame() -> pd.DataFrame:
    """One run: 2 batches of 2 prompts per role; rows of a batch share wall_s, draft_s and verify_s. Counts as
    sdbench.engine.metrics defines them: the prefill gives each row's first token, steps commit the rest."""
    rows = []
    tokens = {"p1": 10, "p2": 20, "p3": 30, "p4": 10}
    category = {"p1": "qa", "p2": "qa", "p3": "code", "p4": "code"}
    batch = {"p1": 0, "p2": 0, "p3": 1, "p4": 1}
    for p, n in tokens.items():
        rows.append(dict(run_id="r", role="baseline", strategy="draft", prompt_id=p, repeat=0,
                         category=category[p], batch_id=batch[p], new_tokens=n, steps=n - 1, accepted=0,
                         drafted=0, wall_s=2.0 if batch[p] == 0 else 4.0, lossless=None,
                         predicted_speedup=math.nan))
    steps = {"p1": 4, "p2": 6, "p3": 10, "p4": 5}
    lossless = {"p1": True, "p2": True, "p3": None, "p4": False}
    predicted = {"p1": 2.5, "p2": math.nan, "p3": 3.0, "p4": 4.0}
    for p, n in tokens.items():
        rows.append(dict(run_id="r", role="strategy", strategy="draft", prompt_id=p, repeat=0,
                         category=category[p], batch_id=batch[p], new_tokens=n, steps=steps[p],
                         accepted=n - 1 - steps[p], drafted=4 * steps[p], wall_s=1.0, draft_s=0.25, verify_s=0.5,
                         lossless=lossless[p], predicted_speedup=predicted[p],
                         accepted_per_position=[3, 2] if p == "p1" else [1, 0, 0],
                         drafted_per_position=[4, 4] if p == "p1" else [4, 4, 4]))
    return pd.DataFrame(rows)


def pick(summary: pd.DataFrame, role: str, category: str) -> pd.Series:
    hit = summary[(summary["role"] == role) & (summary["category"] == category)]
    assert len(hit) == 1
    return hit.iloc[0]


def test_summarize_counts_batch_wall_time_once():
    summary = summarize(frame())
    assert len(summary) == 6  # (baseline, strategy) x (qa, code, ALL)
    assert pick(summary, "baseline", "qa")["tokens_per_s"] == 15.0  # 30 tokens / 2 s, not / 4 s
    assert pick(summary, "baseline", "code")["tokens_per_s"] == 10.0
    assert pick(summary, "baseline", "ALL")["tokens_per_s"] == 70 / 6
    assert pick(summary, "strategy", "qa")["tokens_per_s"] == 30.0
    assert pick(summary, "strategy", "ALL")["tokens_per_s"] == 35.0
    assert pick(summary, "strategy", "ALL")["wall_s"] == 2.0
    assert pick(summary, "strategy", "ALL")["new_tokens"] == 70
    assert pick(summary, "strategy", "ALL")["n_prompts"] == 4


def test_summarize_speedup_acceptance_and_split():
    summary = summarize(frame())
    assert pick(summary, "strategy", "qa")["speedup"] == 2.0
    assert pick(summary, "strategy", "code")["speedup"] == 4.0
    assert pick(summary, "strategy", "ALL")["speedup"] == pytest.approx(3.0, rel=1e-12)
    assert pick(summary, "baseline", "ALL")["speedup"] == 1.0
    for category in ("qa", "code", "ALL"):
        base = pick(summary, "baseline", category)
        assert base["mean_accepted_len"] == 1.0 and math.isnan(base["acceptance_rate"])
    assert pick(summary, "strategy", "qa")["mean_accepted_len"] == 2.8  # (30 - 2 first tokens) / 10 steps
    assert pick(summary, "strategy", "code")["mean_accepted_len"] == 38 / 15
    assert pick(summary, "strategy", "ALL")["mean_accepted_len"] == 66 / 25
    assert pick(summary, "strategy", "qa")["acceptance_rate"] == 0.45  # 18 / 40
    assert pick(summary, "strategy", "ALL")["acceptance_rate"] == 0.41  # 41 / 100
    overall = pick(summary, "strategy", "ALL")
    assert (overall["draft_s"], overall["verify_s"]) == (0.5, 1.0)
    assert overall["draft_share"] == 0.5 / 1.5
    assert pick(summary, "strategy", "qa")["predicted_speedup"] == 2.5
    # the rows' predictions combined by their decode tokens, as their tokens and times are: p1 9 tokens at 2.5x,
    # p3 29 at 3x, p4 9 at 4x (p2 has none), not the plain mean 9.5 / 3
    assert overall["predicted_speedup"] == pytest.approx(47 / (9 / 2.5 + 29 / 3 + 9 / 4), rel=1e-12)
    assert math.isnan(pick(summary, "baseline", "ALL")["predicted_speedup"])


def test_predictions_that_are_right_row_by_row_combine_to_the_measured_decode_speedup():
    """Two prompts, 11 tokens each (10 after the first), plain decoding 10 s of decode each; the strategy decodes
    the first in 5 s (2x) and the second in 10 s (1x), and each row's prediction is exactly its own speedup. The
    run's decode speedup is 20 tokens / 15 s over 20 / 20 s = 4/3; the plain mean of the rows' predictions,
    1.5, would call a perfect model 12 % off."""
    rows = []
    for role, decode in (("baseline", (10.0, 10.0)), ("strategy", (5.0, 10.0))):
        for i, d in enumerate(decode):
            rows.append(dict(run_id="r", role=role, strategy="ngram", prompt_id=f"p{i}", repeat=0, category="qa",
                             batch_id=i, new_tokens=11, steps=10 if role == "baseline" else 6, accepted=0,
                             drafted=0, wall_s=1.0 + d, ttft_s=1.0, lossless=True,
                             predicted_speedup=math.nan if role == "baseline" else 10.0 / d))
    overall = pick(summarize(pd.DataFrame(rows)), "strategy", "ALL")
    assert overall["decode_speedup"] == pytest.approx(4 / 3)
    assert overall["predicted_speedup"] == pytest.approx(4 / 3)


def test_summarize_without_baseline_gives_nan_speedup():
    df = frame()
    summary = summarize(df[df["role"] == "strategy"])
    assert summary["speedup"].isna().all() and len(summary) == 3


def test_lossless_aggregation_with_nulls():
    summary = summarize(frame())
    assert pick(summary, "strategy", "qa")["lossless"] is True
    assert pick(summary, "strategy", "code")["lossless"] is False  # None and False -> False
    assert pick(summary, "strategy", "ALL")["lossless"] is False
    assert pick(summary, "baseline", "ALL")["lossless"] is None
    df = frame()
    df["lossless"] = pd.array([None] * 4 + [True, None, True, None], dtype="boolean")
    assert pick(summarize(df), "strategy", "ALL")["lossless"] is True


def test_configurations_sharing_a_name_are_not_pooled():
    df = frame()
    df.loc[df["prompt_id"].isin(["p3", "p4"]) & (df["role"] == "strategy"), "params"] = '{"gamma": 8}'
    df["params"] = df["params"].fillna('{"gamma": 4}')
    labels = set(summarize(df)["strategy"])
    assert labels == {"baseline", "draft gamma=4", "draft gamma=8"}


def test_per_position_rates_pad_lists():
    [(run_id, strategy, rates)] = per_position_rates(frame())
    assert (run_id, strategy) == ("r", "draft")
    assert rates == [(3 + 3) / 16, (2 + 0) / 16, 0 / 12]


def test_decode_speedup_leaves_the_shared_prefill_out():
    df = frame().assign(ttft_s=0.5)  # every batch spends 0.5 s on prefill and the first token
    overall = summarize(df)
    base, strat = pick(overall, "baseline", "ALL"), pick(overall, "strategy", "ALL")
    # 70 tokens, 4 of them first tokens; decode time: baseline (2 - .5) + (4 - .5) = 5 s, strategy 2 * .5 = 1 s
    assert base["decode_tokens_per_s"] == pytest.approx(66 / 5.0)
    assert strat["decode_tokens_per_s"] == pytest.approx(66 / 1.0)
    assert strat["decode_speedup"] == pytest.approx(5.0) and strat["speedup"] == pytest.approx(3.0)


def test_summary_table_renders():
    summary = summarize(frame())
    table = summary_table(summary, title="demo")
    console = Console(record=True, width=160)
    console.print(table)
    text = console.export_text()
    lines = [line for line in text.splitlines() if line.startswith("│")]
    assert [line.split("│")[2].strip() for line in lines] == ["qa", "qa", "code", "code", "ALL", "ALL"]
    assert lines[-1].split("│")[1].strip() == "draft"
    cells = [c.strip() for c in lines[-1].split("│")[1:-1]]
    # two batches give no interval (?); 3x is above what an accepted length of 2.64 allows (!)
    assert cells == ["draft", "ALL", "4", "35.0", "3.00x?!", "–", "3.03x", "2.64", "41.0%", "33.3%", "✗"]
    qa_base = [c.strip() for c in lines[0].split("│")[1:-1]]
    assert qa_base == ["baseline", "qa", "2", "15.0", "1.00x", "–", "–", "1.00", "–", "–", "–"]
    assert table.rows[-1].style == "bold" and table.rows[-2].style == "bold" and table.rows[0].style is None


def test_print_report_shows_environment_and_positions():
    df = frame().assign(device="cpu", dtype="float32", torch_version="2.13.0", transformers_version="5.0",
                        sdbench_version="0.1.0", git_commit="abc1234-dirty", hardware="cpu:X x8/16GiB",
                        target="tiny", dataset="mt-bench")
    console = Console(record=True, width=160)
    print_report(df, console)
    text = console.export_text()
    assert "cpu · float32 · torch 2.13.0 · transformers 5.0 · sdbench 0.1.0 @ abc1234-dirty · cpu:X x8/16GiB" in text
    assert "tiny · mt-bench · r" in text
    assert "Acceptance rate by draft position" in text
    position_row = [line for line in text.splitlines() if line.startswith("│")][-1]
    assert [c.strip() for c in position_row.split("│")[1:-1]] == ["draft", "37.5%", "12.5%", "0.0%"]


# --- environment ------------------------------------------------------------------------------------


ENV_KEYS = {"device", "dtype", "python_version", "torch_version", "transformers_version", "sdbench_version",
            "git_commit", "platform", "cpu", "cpu_count", "threads", "memory_bytes", "gpu", "gpu_memory_bytes",
            "hardware"}


def test_environment_keys_and_no_git(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert envmod.git_commit(str(tmp_path)) is None
    envmod.git_commit.cache_clear()

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(envmod.subprocess, "run", no_git)
    try:
        env = envmod.environment("cpu", "float32")
    finally:
        envmod.git_commit.cache_clear()
    assert set(env) == ENV_KEYS
    assert env["git_commit"] is None and env["device"] == "cpu" and env["dtype"] == "float32"
    assert env["hardware"].startswith("cpu:") and env["gpu"] is None


def test_hardware_fingerprint():
    gib = 1024**3
    assert envmod.hardware_fingerprint("cpu", "Xeon", 8, 16 * gib, None) == "cpu:Xeon x8/16GiB"
    assert envmod.hardware_fingerprint("cuda:1", "Xeon", 8, 16 * gib, "NVIDIA H100") == "cuda:NVIDIA H100"
    assert envmod.hardware_fingerprint("cpu", None, None, None, None) == "cpu:? x?/?"


def test_git_commit_marks_dirty_tree(tmp_path):
    if shutil.which("git") is None:
        skip_unless_ci("needs git")

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("1")
    git("add", "a.txt")
    git("commit", "-q", "-m", "one")
    sha = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    assert envmod.git_commit(str(tmp_path)) == sha
    (tmp_path / "work").mkdir()  # untracked files (a work or results folder) leave the code as committed
    (tmp_path / "work" / "notes.txt").write_text("x")
    envmod.git_commit.cache_clear()
    assert envmod.git_commit(str(tmp_path)) == sha
    (tmp_path / "a.txt").write_text("2")
    envmod.git_commit.cache_clear()
    assert envmod.git_commit(str(tmp_path)) == f"{sha}-dirty"
    envmod.git_commit.cache_clear()


def test_peak_memory_on_cpu_is_labelled_process_wide():
    envmod.reset_peak_memory("cpu")
    peak, kind = envmod.peak_memory("cpu")
    assert peak > 0 and kind.startswith("process_peak_rss")


def test_summary_is_the_same_after_a_parquet_round_trip(tmp_path):
    # DataFrame fills absent lists with NaN; a row dict simply leaves them out.
    records = [{k: v for k, v in r.items() if isinstance(v, list) or not k.endswith("_per_position")}
               for r in frame().to_dict("records")]
    with RunWriter(tmp_path, "r") as writer:
        writer.append(records[:4])
        writer.append(records[4:])
    df = read_results([tmp_path])
    assert str(df["lossless"].dtype) == "boolean" and str(df["new_tokens"].dtype) == "Int64"
    summary = summarize(df)
    assert pick(summary, "strategy", "ALL")["tokens_per_s"] == 35.0
    assert pick(summary, "strategy", "ALL")["mean_accepted_len"] == 66 / 25
    assert pick(summary, "strategy", "code")["lossless"] is False
    assert pick(summary, "baseline", "ALL")["lossless"] is None
    assert per_position_rates(df)[0][2] == [6 / 16, 2 / 16, 0 / 12]


def test_a_cell_with_no_number_to_show_is_a_dash():
    from sdbench.reporting.cells import fmt, numeric

    missing = (None, math.nan, math.inf, pd.NA, "n/a")
    assert [fmt(v, "{:.2f}") for v in missing] == ["–"] * len(missing)
    assert (fmt(1.234, "{:.2f}x"), fmt(np.int64(3), "{:.0f}"), fmt(0.5, "{:.1%}")) == ("1.23x", "3", "50.0%")
    assert np.isnan(numeric(pd.Series(["1.5", None, "x"]))[1:]).all() and numeric(pd.Series(["1.5"]))[0] == 1.5
