"""What a site is built from: every results file under the paths given, each known kind read as it is written.

- runs: sdbench's result rows (`<run_id>.parquet`, a partial run's `.parts`), with the configuration saved beside
  them (`<run_id>.config.json`) and why a partial run stopped;
- bench files (`bench --out`: a `system` column, no `run_id`): the carry-over tables;
- tune studies (`tune/<study>/trials/trials.parquet`), whose trials' own runs are runs too;
- reproductions (a folder with `claims.parquet` and report.html: `sdbench reproduce`);
- comparisons (`compare --out`: compare.parquet beside its configurations' verdicts and lossy rows);
- problems: a file that cannot be read or is none of these, said on the site and on the terminal, never fatal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from sdbench.errors import SdbenchError
from sdbench.reporting.results import read_results
from sdbench.reporting.schema import first_line
from sdbench.reporting.writer import part_files, run_sources


@dataclass
class Run:
    run_id: str
    rows: pd.DataFrame
    files: list[Path]
    config: dict | None = None
    partial: str | None = None  # why the run stopped before its end; None: it ran to its end


@dataclass
class Found:
    runs: dict[str, Run] = field(default_factory=dict)
    benches: list[Path] = field(default_factory=list)
    studies: list[Path] = field(default_factory=list)
    reproductions: list[Path] = field(default_factory=list)
    comparisons: list[Path] = field(default_factory=list)
    problems: list[tuple[Path, str]] = field(default_factory=list)

    def rows(self) -> pd.DataFrame:
        """Every run's rows as one frame (empty when there is no run)."""
        frames = [r.rows for r in self.runs.values()]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _files(path: Path) -> list[Path]:
    """The Parquet files under a path, and the .parts folders of runs that never merged theirs."""
    if path.is_file():
        return [path]
    found = [p for p in sorted(path.rglob("*.parquet")) if p.is_file() and not p.parent.name.endswith(".parts")]
    found += [p for p in sorted(path.rglob("*.parts")) if p.is_dir() and not p.with_suffix(".parquet").is_file()]
    return found


def kind(path: Path) -> str:
    """run, bench, study, reproduction, comparison or part (a reproduction's or comparison's other tables);
    SdbenchError for anything else."""
    if path.is_dir():
        return "run"
    if path.suffix != ".parquet":
        raise SdbenchError("not a Parquet file")
    try:
        names = set(pq.read_schema(path).names)
    except Exception as e:  # whatever Arrow says of a file it cannot read
        raise SdbenchError(f"cannot be read as Parquet ({first_line(e)})") from e
    if {"run_id", "role", "prompt_id"} <= names:
        return "run"
    if "system" in names and "run_id" not in names:
        return "bench"
    if path.name == "trials.parquet" and {"study", "trial"} <= names:
        return "study"
    if path.name == "claims.parquet":
        return "reproduction"
    if path.name == "compare.parquet" and {"metric", "change", "regressed"} <= names:
        return "comparison"
    if (path.parent / "claims.parquet").is_file() or (path.parent / "compare.parquet").is_file():
        return "part"
    raise SdbenchError("not a results file sdbench writes (no run_id, system, trial or claim columns)")


def collect(paths: list[str]) -> Found:
    """Everything under `paths`; a path that does not exist is the caller's error (SdbenchError)."""
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        raise SdbenchError(f"results path not found: {', '.join(missing)}")
    found, seen = Found(), set()
    for path in (f.resolve() for p in paths for f in _files(Path(p))):
        if path in seen:
            continue
        seen.add(path)
        try:
            what = kind(path)
            if what == "run":
                _add_run(found, path)
            elif what in ("bench", "study"):
                (found.benches if what == "bench" else found.studies).append(path)
            elif what == "reproduction":
                found.reproductions.append(path.parent)
            elif what == "comparison":
                found.comparisons.append(path)
        except SdbenchError as e:
            found.problems.append((path, str(e).removeprefix(f"{path}: ")))
    return found


def _add_run(found: Found, path: Path) -> None:
    if path.is_dir():
        sources, final = part_files(path), path.with_suffix(".parquet")
    else:
        sources, final = run_sources(path, path.with_suffix(".parts")), path
    if not sources:
        return
    rows = read_results(sources)
    for run_id, group in rows.groupby("run_id", sort=False):
        config = final.with_name(f"{run_id}.config.json")
        partial = group["unfinished"].dropna().iloc[0] if "unfinished" in group and group["unfinished"].notna().any() \
            else None
        found.runs[str(run_id)] = Run(str(run_id), group.drop(columns=["unfinished"], errors="ignore"),
                                      [final] if final.is_file() else sources,
                                      _config(config), partial)


def _config(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
