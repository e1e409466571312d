"""`sdbench sweep`: where speculative decoding stops paying, over batch size (or concurrency) x prompt length.

Each grid point is one `run` (commands/run.py's RunHarness, on one pair loaded once for the whole sweep): its
baseline and every strategy's configurations decode the same batches one after another, as `run` interleaves
them, through the one decode loop (under load: serve the same arrivals, commands/load.py). A point's rows are
written as its batches finish and merged into one Parquet file, SWEEP_ID-POINT.parquet, when it is done; the
sweep's folder OUT/SWEEP_ID holds those files, sweep.json (the settings, for --resume) and done.json (the
points finished). A resumed sweep skips finished points without touching their files, continues a static
point's finished batches, and serves an unfinished load point again. The analysis is reporting/sweep.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console

from sdbench.commands.roles import Role
from sdbench.commands.run import RunHarness, run_config
from sdbench.config import SWEEP_AXES, RunConfig, SweepConfig
from sdbench.data.prompts import run_positions
from sdbench.errors import Interrupted, SdbenchError
from sdbench.models.loading.pair import load_pair
from sdbench.reporting.plots import sweep_plots
from sdbench.reporting.results import read_results
from sdbench.reporting.rows import RunFields
from sdbench.reporting.sweep import best_points, frontier, print_frontier
from sdbench.reporting.writer import RunWriter, new_run_id
from sdbench.strategies import resolve_strategy, strategy

SETTINGS, DONE = "sweep.json", "done.json"


@dataclass(frozen=True)
class Point:
    axis: str  # "batch" or "concurrency"
    size: int
    prompt_len: int

    @property
    def name(self) -> str:
        return f"{self.axis[0]}{self.size}-L{self.prompt_len}"

    @property
    def label(self) -> str:
        return f"{self.axis} {self.size}, {self.prompt_len}-token prompts"


def grid(cfg: SweepConfig) -> list[Point]:
    """Every point, prompt length by prompt length (a sweep cut short has whole columns of the heat-map)."""
    return [Point(cfg.axis, size, length) for length in cfg.prompt_lens for size in cfg.sizes]


def check_grid(cfg: SweepConfig) -> None:
    if cfg.axis not in SWEEP_AXES:
        raise SdbenchError(f"sweep axis {cfg.axis}: use one of {', '.join(SWEEP_AXES)}")
    for option, values in ((f"--{cfg.axis}", cfg.sizes), ("--prompt-len", cfg.prompt_lens)):
        if not values:
            raise SdbenchError(f"sweep {option}: the grid is empty; give at least one value")
        if min(values) < 1:
            raise SdbenchError(f"sweep {option}: every value must be at least 1")
    if not cfg.strategies:
        raise SdbenchError("sweep: give at least one --strategy")
    if len(set(cfg.strategies)) != len(cfg.strategies):
        raise SdbenchError(f"sweep --strategy {','.join(cfg.strategies)}: each strategy once")
    unknown = set(cfg.scoped) - set(cfg.strategies)
    if unknown:
        raise SdbenchError(f"--set {sorted(unknown)[0]}.KEY=VALUE: no --strategy {sorted(unknown)[0]} in this sweep")
    if cfg.run.drafts and not any(strategy(resolve_strategy(s).base).needs_draft for s in cfg.strategies):
        raise SdbenchError("--draft: none of the strategies drafts with a model; drop --draft or add one that does")


def member_config(cfg: SweepConfig, name: str, point: Point) -> RunConfig:
    """The `run` configuration of one strategy at one point: a static batch of `size` prompts, or `size`
    requests in flight (a closed loop: every request arrives at once); at least `size` prompts."""
    base = cfg.run
    drafts = base.drafts if strategy(resolve_strategy(name).base).needs_draft else ()
    run = replace(base, strategy=name, drafts=drafts, options={**base.options, **cfg.scoped.get(name, {})},
                  prompt_len=point.prompt_len, limit=max(base.limit, point.size), resume=None)
    if point.axis == "batch":
        return replace(run, batch_size=point.size, request_rates=(), concurrencies=())
    return replace(run, batch_size=1, request_rates=(), concurrencies=(point.size,))


class PointHarness(RunHarness):
    """One point: the baseline once, then every strategy's configurations, on the same batches (or arrivals),
    as one `run`. Each strategy is planned by its own RunHarness; the roles are theirs, named per strategy when the
    sweep has several (`strategy:ngram`)."""

    def __init__(self, cfgs: list[RunConfig], console: Console, pair, runners: dict, sweep_id: str, run_id: str):
        super().__init__(cfgs[0], Console(quiet=True), pair=pair, run_id=run_id)  # its notes: said by members
        self.console = console
        self.members = [RunHarness(c, console, pair=pair) for c in cfgs]
        self.runners, self.sweep_id = runners, sweep_id

    def plan_roles(self, pair) -> list[Role]:
        roles = []
        for member in self.members:
            own = replace(pair, drafts=[self.runners[d] for d in member.cfg.drafts])
            for role in member.plan_roles(own):
                roles.append(role if len(self.members) == 1 else replace(role, name=f"{role.name}:{member.choice.name}"))
        return roles

    def run_fields(self, pair) -> RunFields:
        return replace(super().run_fields(pair), sweep=self.sweep_id)


class Sweep:
    """Plans the grid (every point's every strategy checked before anything loads), loads the pair once,
    measures the points not done yet, then writes the analysis."""

    def __init__(self, cfg: SweepConfig, console: Console, sweep_id: str | None = None):
        """sweep_id: the id of a sweep measured elsewhere (a Ray task measuring one of its points)."""
        self.console = console
        if cfg.resume:
            cfg = load_sweep(cfg.run.out, cfg.resume)
        check_grid(cfg)
        self.cfg = cfg
        names = "-".join(resolve_strategy(s).name for s in cfg.strategies)
        self.sweep_id = sweep_id or cfg.resume or new_run_id(f"sweep-{names}")
        self.folder = Path(cfg.run.out) / self.sweep_id
        self.points = grid(cfg)
        quiet = Console(quiet=True)
        self.planned = {(p, s): RunHarness(member_config(cfg, s, p), quiet)
                        for p in self.points for s in cfg.strategies}  # bad settings fail here, before loading

    def run(self, remote=None) -> Path:
        """Measures the points not done yet, here or through `remote(sweep)`, whose `run(todo, done)` measures them
        elsewhere (commands/sweep_ray.py: each a Ray task)."""
        done = self._done()
        todo = [p for p in self.points if p.name not in done]
        if remote is not None:
            points = remote(self)  # a cluster is reached before anything is written
            self._save()
            try:
                points.run(todo, done)
            except (KeyboardInterrupt, Interrupted):
                raise self._interrupted(done) from None
            return self.folder
        pair, runners = self.load() if todo else (None, {})
        self._save()  # only now: a sweep whose models never loaded leaves nothing behind
        started = time.perf_counter()
        try:
            for i, point in enumerate(self.points):
                if point.name in done:
                    self.console.print(f"point {i + 1}/{len(self.points)}: {point.label}: done earlier, kept",
                                       highlight=False)
                    continue
                self.console.print(f"point {i + 1}/{len(self.points)}: {point.label} "
                                   f"({time.perf_counter() - started:.0f} s so far)", style="bold", highlight=False)
                self.measure(point, pair, runners)
                done.append(point.name)
                self.mark(done)
        except (KeyboardInterrupt, Interrupted):
            raise self._interrupted(done) from None
        return self.folder

    def measure(self, point: Point, pair, runners: dict) -> Path:
        run_id = f"{self.sweep_id}-{point.name}"
        resume = None
        if RunWriter(self.folder, run_id).exists():
            if point.axis == "batch":
                resume = run_id  # its finished batches stay; the rest is decoded
            else:
                self.forget(run_id)  # a load point serves every request again: arrivals are not resumable
        cfgs = [replace(self.planned[point, s].cfg, resume=resume, out=str(self.folder)) for s in self.cfg.strategies]
        return PointHarness(cfgs, self.console, pair, runners, self.sweep_id, run_id).run()

    def load(self, points: list[Point] | None = None):
        """The pair for every point (or those given): the drafts every strategy needs, probed over the longest
        point's context (which is checked to fit before anything is measured)."""
        benches = [b for (p, _), b in self.planned.items() if points is None or p in points]
        drafts = tuple(dict.fromkeys(d for b in benches for d in b.cfg.drafts))
        widest = max(benches, key=lambda b: (b.cfg.prompt_len, b.cfg.limit))
        cfg = replace(widest.cfg, drafts=drafts, gammas=(max(g for b in benches for g in b.cfg.gammas),))
        native = {name: why for b in benches for name, why in b.plan.native().items()}
        pair = load_pair(cfg, widest.device, widest.dtype, self.console, native)
        run_positions(cfg, pair)
        return pair, dict(zip(drafts, pair.drafts))

    def _save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        _write_json(self.folder / SETTINGS, asdict(replace(self.cfg, resume=None)))

    def _done(self) -> list[str]:
        path = self.folder / DONE
        return list(json.loads(path.read_text())) if path.is_file() else []

    def mark(self, done: list[str]) -> None:
        _write_json(self.folder / DONE, done)

    def forget(self, run_id: str) -> None:
        for path in (self.folder / f"{run_id}.parquet", self.folder / f"{run_id}.config.json"):
            path.unlink(missing_ok=True)
        shutil.rmtree(self.folder / f"{run_id}.parts", ignore_errors=True)

    def _interrupted(self, done: list[str]) -> Interrupted:
        kept = any(self.folder.glob("*.parquet")) or any(self.folder.glob("*.parts"))
        if not kept:
            shutil.rmtree(self.folder, ignore_errors=True)
            return Interrupted("interrupted before any point finished a batch: nothing was saved")
        return Interrupted(f"interrupted: {len(done)}/{len(self.points)} points are done and saved in {self.folder}; "
                           f"continue with `sdbench sweep --resume {self.sweep_id} --out {self.cfg.run.out}`")


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=2, default=str))
    os.replace(tmp, path)


def load_sweep(out: str, sweep_id: str) -> SweepConfig:
    """The settings an interrupted sweep was started with (OUT/SWEEP_ID/sweep.json)."""
    path = Path(out) / sweep_id / SETTINGS
    if not path.is_file():
        raise SdbenchError(f"--resume {sweep_id}: no sweep of that id under {out}")
    return replace(sweep_config(json.loads(path.read_text()), out), resume=sweep_id)


def sweep_config(raw: dict, out: str) -> SweepConfig:
    """A SweepConfig from its JSON form (sweep.json, or what a Ray task is given), writing under `out`."""
    raw = dict(raw)
    run = replace(run_config(dict(raw.pop("run"))), out=out)
    for key in ("strategies", "sizes", "prompt_lens"):
        raw[key] = tuple(raw[key])
    return SweepConfig(run=run, **raw)


def run_sweep(cfg: SweepConfig, console: Console, remote=None) -> Path:
    """Measure the grid (or what is left of it; remote: see Sweep.run), then print and write the analysis; returns
    the sweep's folder."""
    sweep = Sweep(cfg, console)
    folder = sweep.run(remote)
    df = read_results([folder])
    print_frontier(df, console)
    points = best_points(df)
    points.to_csv(folder / "points.csv", index=False)
    frontier(points).to_csv(folder / "frontier.csv", index=False)
    for plot in sweep_plots(df):
        (folder / f"{plot.name}.png").write_bytes(plot.png)
    console.print(f"results: {folder} (points.csv, frontier.csv, the heat-map PNG; `sdbench report {folder}`)",
                  highlight=False)
    return folder
