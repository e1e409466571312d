"""The site's pages beside the leaderboard: the list of runs (and each run's facts and files), sweeps with their
frontier, tune studies with their trials and best settings, bench files with their carry-over against each engine,
reproductions with their claims, and comparisons (`compare --out`) with what regressed; plus the lines that name
each file the site could not use.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd

from sdbench import __version__
from sdbench.paths import output_dir
from sdbench.reporting.carry import from_frame
from sdbench.reporting.labels import labelled
from sdbench.reporting.load import load_rows, summarize_load
from sdbench.reporting.site import charts
from sdbench.reporting.site.command import run_command
from sdbench.reporting.site.html import Column, chart, downloads, esc, facts, notice, page, table
from sdbench.reporting.site.sources import Found, Run
from sdbench.reporting.sweep import best_points, frontier


def write_table(out: Path, frame: pd.DataFrame, name: str) -> list[tuple[str, str]]:
    """data/NAME.csv and .parquet; returns their download links (relative to the site's root)."""
    data = output_dir(out / "data" / Path(name).parent)
    stem = Path(name).name
    flat = frame.copy()
    for column in flat.columns:  # lists (acceptance by position) as text in the CSV, kept as lists in Parquet
        if flat[column].map(lambda v: isinstance(v, (list, tuple))).any():
            flat[column] = flat[column].map(lambda v: " ".join(f"{x:.4g}" for x in v) if isinstance(v, (list, tuple))
                                            else v)
    flat.to_csv(data / f"{stem}.csv", index=False)
    frame.to_parquet(data / f"{stem}.parquet", index=False)
    return [(f"data/{name}.csv", "CSV"), (f"data/{name}.parquet", "Parquet")]


def problem_lines(found: Found) -> list[str]:
    return [f"{path}: {reason}" for path, reason in found.problems]


def run_files(out: Path, run: Run) -> list[tuple[str, str]]:
    """The run's rows (one Parquet file, as read back) and saved configuration under data/runs/; their links from
    the run's page."""
    folder = out / "data" / "runs"
    folder.mkdir(parents=True, exist_ok=True)
    run.rows.to_parquet(folder / f"{run.run_id}.parquet", index=False)
    links = [(f"../data/runs/{run.run_id}.parquet", "result rows (Parquet)")]
    if run.config is not None:
        (folder / f"{run.run_id}.config.json").write_text(json.dumps(run.config, indent=2))
        links.append((f"../data/runs/{run.run_id}.config.json", "configuration (JSON)"))
    return links


LOAD_COLUMNS = ("request_rate", "concurrency", "strategy", "completed", "request_throughput", "output_throughput",
                "vs_baseline", "request_goodput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms",
                "lossless")


def served_table(out: Path, run: Run) -> str:
    """A run's requests served under load: throughput against the baseline's on the same arrivals, and latencies
    (reporting/load.py, as `report` prints them); nothing for a run of batches."""
    served = run.rows[load_rows(run.rows)]
    if served.empty:
        return ""
    summary = summarize_load(labelled(served))
    frame = summary[[c for c in LOAD_COLUMNS if c in summary]]
    return ("<h2>Served under load</h2><p>vs_baseline: output tokens/s over the baseline's on the same arrivals; "
            "latencies in ms.</p>" + _frame_table(frame, "served")
            + downloads([(f"../{h}", t) for h, t in write_table(out, frame, f"runs/{run.run_id}-served")]))


def run_facts(run: Run) -> str:
    """What the run measured, on what, and the command that runs it again."""
    first = run.rows.iloc[0]
    strategies = ", ".join(sorted(set(run.rows.loc[run.rows["role"] != "baseline", "strategy"].dropna())))
    pairs = [("strategies", strategies), ("target", first.get("target")),
             ("draft", ", ".join(sorted(set(run.rows["draft"].dropna()) - {""}))),
             ("data set", first.get("dataset")), ("prompts", run.rows["prompt_id"].nunique()),
             ("repeats", run.rows["repeat"].nunique()), ("started", first.get("timestamp")),
             ("hardware", first.get("hardware")), ("cpu", first.get("cpu")), ("gpu", first.get("gpu")),
             ("device", first.get("device")), ("dtype", first.get("dtype")),
             ("torch", first.get("torch_version")), ("transformers", first.get("transformers_version")),
             ("sdbench", first.get("sdbench_version")), ("git commit", first.get("git_commit")),
             ("read from", ", ".join(str(f) for f in run.files))]
    command = (f'<p>Runs it again:</p><pre class="sd-command">{esc(run_command(run.config))}</pre>'
               if run.config is not None else "<p>No saved configuration beside this run's results.</p>")
    return facts(pairs) + command


def runs_page(found: Found, board: pd.DataFrame) -> str:
    rows = []
    for run in found.runs.values():
        first = run.rows.iloc[0]
        mine = board[board["run_id"] == run.run_id]
        lossless = run.rows["lossless"].dropna()
        rows.append({"run_id": run.run_id, "timestamp": first.get("timestamp"), "target": first.get("target"),
                     "strategies": ", ".join(dict.fromkeys(mine["strategy"])), "dataset": first.get("dataset"),
                     "prompts": run.rows["prompt_id"].nunique(), "hardware": first.get("hardware"),
                     "status": f"partial: {run.partial}" if run.partial else "complete",
                     "lossless": f"{int(lossless.astype(bool).sum())}/{len(lossless)}" if len(lossless) else "–"})
    columns = [Column("run", "run_id", link=lambda r: f"runs/{r['run_id']}.html"), Column("started", "timestamp"),
               Column("target", "target"), Column("strategies", "strategies"), Column("data set", "dataset"),
               Column("prompts", "prompts", numeric=True), Column("hardware", "hardware"), Column("status", "status"),
               Column("lossless rows", "lossless")]
    frame = pd.DataFrame(rows, columns=[c.field for c in columns])
    body = notice(problem_lines(found), "error") + (table(frame, columns, "runs") if rows else "<p>No runs.</p>")
    return page("Runs", body, built=__version__)


def sweeps_page(out: Path, rows: pd.DataFrame) -> str:
    points = best_points(rows) if not rows.empty and "sweep" in rows else pd.DataFrame()
    if points.empty:
        return page("Sweeps", "<p>No sweep among these results (`sdbench sweep` writes them).</p>", built=__version__)
    front = frontier(points)
    body = ["<h2>Best setting at each point</h2>", _frame_table(points, "points"),
            downloads(write_table(out, points, "sweeps/points")),
            "<h2>Where speculative decoding stops paying</h2>", _frame_table(front, "frontier"),
            downloads(write_table(out, front, "sweeps/frontier"))]
    body += [chart(charts.frontier_map(points, s), f"chart-frontier-{i}")
             for i, s in enumerate(points["sweep"].unique())]
    return page("Sweeps", "\n".join(body), built=__version__)


def _frame_table(frame: pd.DataFrame, table_id: str) -> str:
    """A frame as it is, numbers with 3 significant digits."""
    def show(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    columns = [Column(str(c), str(c), show, numeric=pd.api.types.is_numeric_dtype(frame[c])) for c in frame.columns]
    return table(frame, columns, table_id)


def _bucket(found: Found, folder: Path) -> dict:
    """A study's batch size and prompt length: those of its trials' runs (written under its folder)."""
    for run in found.runs.values():
        if any(folder in f.parents for f in run.files):
            first = run.rows.iloc[0]
            return {"batch_size": first.get("batch_size"), "prompt_len": first.get("prompt_len")}
    return {"batch_size": None, "prompt_len": None}


def studies_page(out: Path, found: Found) -> str:
    """Per study its trials and best trial per machine; first, the best settings per batch size over the studies
    (`tune --batch 1,4` makes one study per batch size)."""
    body, best_rows = [], []
    for i, path in enumerate(found.studies):
        trials = pd.read_parquet(path)
        name = str(trials["study"].iloc[0]) if len(trials) else path.parent.parent.name
        done = trials[trials["state"] == "COMPLETE"].dropna(subset=["value"])
        best = done.loc[done.groupby("hardware", dropna=False)["value"].idxmax()] if len(done) else done
        best_rows += [{**_bucket(found, path.parent.parent), **row} for row in best.to_dict("records")]
        body += [f"<h2>Study {esc(name)}</h2>", f"<p>{len(trials)} trials, {len(done)} complete; from {esc(path)}</p>",
                 "<h3>Best trial per machine</h3>", _frame_table(best, f"best-{i}"), "<h3>Every trial</h3>",
                 _frame_table(trials, f"trials-{i}"), downloads(write_table(out, trials, f"studies/{i}-trials"))]
    if best_rows:
        frame = pd.DataFrame(best_rows).sort_values(["batch_size", "prompt_len"], kind="stable", na_position="last")
        body = ["<h2>Best settings per batch size</h2>", _frame_table(frame, "best-per-batch"),
                downloads(write_table(out, frame, "studies/best-per-batch"))] + body
    return page("Tune studies", "\n".join(body) or "<p>No tune study among these results.</p>", built=__version__)


def engines_page(out: Path, found: Found) -> str:
    body = []
    for i, path in enumerate(found.benches):
        carried = from_frame(pd.read_parquet(path))
        frame = pd.DataFrame([vars(r) for r in carried])
        body += [f"<h2>{esc(path)}</h2>",
                 _frame_table(frame, f"carry-{i}") if len(frame) else "<p>A bench file without carry-over rows.</p>",
                 chart(charts.carry_bars(carried), f"chart-carry-{i}"),
                 downloads((write_table(out, frame, f"engines/{i}-carry") if len(frame) else [])
                           + _copy(out, path, f"engines/{i}-bench.parquet"))]
    return page("Engines", "\n".join(body) or "<p>No bench file among these results (`sdbench bench --out`).</p>",
                built=__version__)


def reproductions_page(out: Path, found: Found) -> str:
    body = []
    for i, folder in enumerate(found.reproductions):
        target = out / "reproductions" / f"{i}-{folder.name}"
        shutil.copytree(folder, target, dirs_exist_ok=True)
        claims = pd.read_parquet(folder / "claims.parquet")
        link = f'<p><a href="reproductions/{esc(target.name)}/report.html">the full report</a></p>' \
            if (folder / "report.html").is_file() else ""
        body += [f"<h2>{esc(folder.name)}</h2>", link, _frame_table(claims, f"claims-{i}"),
                 downloads(write_table(out, claims, f"reproductions/{i}-claims"))]
    return page("Reproductions", "\n".join(body) or "<p>No reproduction among these results.</p>", built=__version__)


def comparisons_page(out: Path, found: Found) -> str:
    """Each `compare --out`: its verdict, per configuration the change's interval, the regressed prompts first."""
    body = []
    for i, path in enumerate(found.comparisons):
        deltas = pd.read_parquet(path).sort_values("regressed", ascending=False, kind="stable")
        configs, lossy = (pd.read_parquet(path.with_name(n)) if path.with_name(n).is_file() else pd.DataFrame()
                          for n in ("compare-configurations.parquet", "compare-lossy.parquet"))
        sides = deltas.iloc[0] if len(deltas) else {}
        said = [f"{int(deltas['regressed'].sum())} of {len(deltas)} matched comparisons regressed",
                f"{len(lossy)} rows broke losslessness"]
        if len(configs):
            said.append(f"{int((configs['verdict'] == 'regression').sum())} configurations' intervals say regression")
        failed = (bool(deltas["regressed"].any()) or len(lossy) > 0
                  or (len(configs) > 0 and bool((configs["verdict"] == "regression").any())))
        body += [f"<h2>{esc(path.parent.name)}</h2>",
                 facts([("baseline", sides.get("baseline_paths")), ("current", sides.get("current_paths"))]),
                 notice(said, "error" if failed else "info"), "<h3>Per configuration</h3>",
                 _frame_table(configs, f"configs-{i}") if len(configs) else "<p>–</p>",
                 "<h3>Per prompt (regressions first)</h3>", _frame_table(deltas.drop(
                     columns=["baseline_paths", "current_paths"], errors="ignore"), f"deltas-{i}"),
                 downloads(write_table(out, deltas, f"comparisons/{i}-compare")
                           + (write_table(out, configs, f"comparisons/{i}-configurations") if len(configs) else []))]
        if len(lossy):
            body += ["<h3>Rows whose output differed from plain decoding</h3>", _frame_table(lossy, f"lossy-{i}")]
    return page("Comparisons", "\n".join(body) or "<p>No comparison among these results (`sdbench compare --out`)."
                "</p>", built=__version__)


def _copy(out: Path, path: Path, name: str) -> list[tuple[str, str]]:
    (out / "data" / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, out / "data" / name)
    return [(f"data/{name}", "the bench file (Parquet)")]


def other_pages(out: Path, found: Found, board: pd.DataFrame, rows: pd.DataFrame) -> dict[str, str]:
    """rows: every run's rows (Found.rows())."""
    return {"runs.html": runs_page(found, board), "sweeps.html": sweeps_page(out, rows),
            "studies.html": studies_page(out, found), "engines.html": engines_page(out, found),
            "reproductions.html": reproductions_page(out, found), "comparisons.html": comparisons_page(out, found)}
