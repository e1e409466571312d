"""Results folders for the site's tests: runs written by RunWriter from rows whose figures a test computes again
by hand, and one file of each other kind sdbench writes (sweep rows, tune trials, a bench file, a reproduction)."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd

from sdbench.reporting.compare import compare_frames, write_comparison
from sdbench.reporting.results import read_results
from sdbench.reporting.writer import RunWriter

CATEGORIES = {"p1": "writing", "p2": "writing", "p3": "math"}


def run_rows(strategy: str, hardware: str, scale: float, gamma: int = 4, dataset: str = "mt-bench",
             extra: dict | None = None) -> list[dict]:
    """Baseline and `strategy` rows for three prompts and two repeats; each prompt its own batch, the same as the
    baseline's. The strategy's wall times are the baseline's over `scale` give or take a per-prompt wobble, so its
    speedup is near `scale`."""
    out, batch = [], 0
    for repeat in range(2):
        for i, (prompt, category) in enumerate(CATEGORIES.items()):
            tokens = 40 + 8 * i
            base_wall = 0.5 + 0.1 * i + 0.03 * repeat
            common = {"target": "smollm2-135m", "dataset": dataset, "category": category, "prompt_id": prompt,
                      "repeat": repeat, "batch_size": 1, "new_tokens": tokens, "hardware": hardware, "device": "cpu",
                      "dtype": "float32", "timestamp": "2026-11-28T10:00:00+00:00", "max_new_tokens": 64,
                      **(extra or {})}
            wall = base_wall / scale * (1 + 0.05 * (i - 1))
            out.append({**common, "role": "baseline", "strategy": "autoregressive", "params": "{}", "draft": "",
                        "batch_id": batch, "wall_s": base_wall, "ttft_s": 0.05, "steps": tokens - 1,
                        "drafted": 0, "accepted": 0, "lossless": True, "tokens_per_s": tokens / base_wall,
                        "speedup": 1.0})
            drafted = [10 + i, 9, 7, 4][:gamma]
            accepted = [8 + i, 6, 3 + repeat, 1][:gamma]
            out.append({**common, "role": "strategy", "strategy": strategy, "params": json.dumps({"gamma": gamma}),
                        "gamma": gamma, "draft": "", "batch_id": batch, "ttft_s": 0.05,
                        "wall_s": wall, "tokens_per_s": tokens / wall, "speedup": base_wall / wall,
                        "steps": 12 + i + repeat,
                        "drafted": sum(drafted), "accepted": sum(accepted), "accepted_per_position": accepted,
                        "drafted_per_position": drafted, "lossless": True})
            batch += 1
    return out


def write_run(folder: Path, run_id: str, rows: list[dict], config: dict | None = None, finish: bool = True) -> Path:
    writer = RunWriter(folder, run_id)
    writer.append(rows)
    if config is not None:
        (Path(folder) / f"{run_id}.config.json").write_text(json.dumps(config))
    if not finish:
        writer.mark_unfinished("RuntimeError: out of memory at prompt p3")
        return writer.parts_dir
    return writer.finalize()


def expected(rows: list[dict], role: str = "strategy") -> dict:
    """The leaderboard's figures by hand from the rows: speedup as a ratio of summed tokens over summed wall
    times, accepted length as tokens after each row's first per step, acceptance as accepted over drafted."""
    frame = pd.DataFrame(rows)
    mine, base = frame[frame["role"] == role], frame[frame["role"] == "baseline"]
    rate = mine["new_tokens"].sum() / mine["wall_s"].sum()
    drafted = [sum(col) for col in zip(*mine["drafted_per_position"])]
    accepted = [sum(col) for col in zip(*mine["accepted_per_position"])]
    return {"speedup": rate / (base["new_tokens"].sum() / base["wall_s"].sum()),
            "mean_accepted_len": (mine["new_tokens"].sum() - len(mine)) / mine["steps"].sum(),
            "acceptance_rate": mine["accepted"].sum() / mine["drafted"].sum(),
            "by_position": [a / d for a, d in zip(accepted, drafted)], "tokens_per_s": rate}


def other_kinds(folder: Path) -> None:
    """A sweep's runs, a tune study's trials, a bench file, a reproduction and a comparison under `folder`."""
    for size in (1, 2, 4):
        rows = run_rows("ngram", "cpu:machine-a", 1.6 / size, extra={"sweep": "sw1", "batch_size": size,
                                                                       "prompt_len": 256})
        write_run(folder / "sweep", f"sweep-b{size}", rows)
    trials = pd.DataFrame({"study": ["s1"] * 3, "trial": [0, 1, 2], "state": ["COMPLETE", "COMPLETE", "FAIL"],
                           "value": [1.2, 1.5, None], "strategy": ["ngram"] * 3, "gamma": [2, 4, 8],
                           "hardware": ["cpu:machine-a"] * 3})
    (folder / "tune" / "s1" / "trials").mkdir(parents=True)
    trials.to_parquet(folder / "tune" / "s1" / "trials" / "trials.parquet", index=False)
    write_run(folder / "tune" / "s1", "trial-1", run_rows("ngram", "cpu:machine-a", 1.5, extra={"batch_size": 2}))
    bench = pd.DataFrame({"system": ["sdbench ngram", "llama.cpp ngram"], "engine": ["sdbench", "llama.cpp"],
                          "decode_speedup": [1.4, 1.2], "carried_speedup": [1.5, 1.3],
                          "own_predicted_speedup": [1.45, 1.25]})
    bench.to_parquet(folder / "bench.parquet", index=False)
    repro = folder / "repro-magicdec"
    repro.mkdir()
    pd.DataFrame({"claim": ["speedup grows with batch"], "verdict": ["holds"]}).to_parquet(repro / "claims.parquet")
    (repro / "report.html").write_text("<!DOCTYPE html><html><body><p>report</p></body></html>")
    base = write_run(folder / "gate", "gate-base", run_rows("ngram", "cpu:machine-a", 1.5))
    current = write_run(folder / "gate", "gate-current", run_rows("ngram", "cpu:machine-a", 1.0))
    result = compare_frames(read_results([base]), read_results([current]))
    write_comparison(result, folder / "gate" / "compared", [base], [current])


class _Table(HTMLParser):
    def __init__(self, table_id: str):
        super().__init__()
        self.table_id, self.inside, self.rows, self.cell = table_id, False, [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table" and dict(attrs).get("id") == self.table_id:
            self.inside = True
        elif self.inside and tag == "tr":
            self.rows.append([])
        elif self.inside and tag in ("td", "th"):
            self.cell = ""

    def handle_endtag(self, tag):
        if tag == "table":
            self.inside = False
        elif self.inside and tag in ("td", "th") and self.cell is not None:
            self.rows[-1].append(self.cell.strip())
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data


def table_rows(page: str, table_id: str) -> list[dict]:
    """A table of a page as written (before any script runs): one {header: text} per body row."""
    parser = _Table(table_id)
    parser.feed(page)
    header, *rows = parser.rows
    return [dict(zip(header, row)) for row in rows]
