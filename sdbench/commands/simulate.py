"""`sdbench simulate dsi`: expected latency of plain decoding, SI and DSI for one setting (given, measured at
the models' shapes, or read from an sdbench run), offline and online (analysis/dsi_sim.py), then the DSI paper's
heat-map over the drafter latency and the acceptance rate (analysis/dsi_heatmap.py), written as Parquet and PNG.
"""

from __future__ import annotations

import math

from rich.table import Table

from sdbench.analysis.dsi_heatmap import heatmap, heatmap_summary, plot_heatmap, table_lookahead
from sdbench.analysis.dsi_sim import (Setting, measured_setting, offline, online, profile_from_results,
                                      workers_warning)
from sdbench.analysis.theory import dsi_latency_per_token, dsi_workers_needed, si_latency_per_token
from sdbench.config import SimulateDSIConfig
from sdbench.errors import SdbenchError
from sdbench.paths import output_dir


def run_simulation(cfg: SimulateDSIConfig, console) -> tuple:
    """Table for one setting (offline and online; measured too when `cfg.from_results` names an sdbench run, whose
    acceptance rate `cfg.a` replaces only when its weights are random), then the heat-map grid as Parquet and
    PNG under `cfg.out`. Returns (parquet path, png path)."""
    s, measured = setting(cfg, console)
    s.check()
    if cfg.repeats < 1:
        raise SdbenchError("--repeats must be at least 1")
    warning = workers_warning(s)
    if warning:
        console.print(warning, style="yellow", highlight=False)
    with console.status("simulating"):
        off, on = offline(s), online(s, cfg.repeats, cfg.seed)
        ideal = online(s, cfg.repeats, cfg.seed, preemptive=True)
    console.print(_setting_table(s, off, on, ideal, measured))
    if "forward_baseline" in measured:
        console.print(f"measured target forward: {measured['forward_baseline']:.4g} s in the baseline, "
                      f"{measured['forward_workers']:.4g} s per verification inside the strategy's workers "
                      "(the simulation uses the latter)")
    console.print(_notes(s, on))
    console.print(table_rule_line(s))
    with console.status("heat-map"):
        frame = heatmap(s.workers, cfg.grid, cfg.kmax)
    folder = output_dir(cfg.out)
    parquet, png = folder / "dsi-heatmap.parquet", folder / "dsi-heatmap.png"
    frame.to_parquet(parquet, index=False)
    plot_heatmap(frame, png)
    console.print(heatmap_summary(frame))
    console.print(f"wrote {parquet} and {png}")
    return parquet, png


def setting(cfg: SimulateDSIConfig, console) -> tuple[Setting, dict]:
    """The setting as given, or with the latencies measured at the models' shapes (--target), or read from a
    run (--from); and what the run measured ({} otherwise)."""
    if cfg.target is not None and cfg.from_results:
        raise SdbenchError("--target measures the latencies and --from reads them from a run: give one of them")
    s = Setting(cfg.target_latency, cfg.c, 0.8 if cfg.a is None else cfg.a, cfg.k, cfg.workers, cfg.tokens)
    if cfg.target is not None:
        draft = cfg.draft or cfg.target
        s = measured_setting(s, cfg.target, draft, cfg.context, cfg.device, cfg.dtype, console)
        console.print(f"measured at {cfg.context} tokens of context: one {cfg.target} forward {s.target_s * 1e3:.1f} "
                      f"ms, drafter latency c = {s.c:.3f} ({draft} / {cfg.target}); acceptance rate a = {s.a} as "
                      "given", highlight=False)
    if cfg.from_results:
        return profile_from_results(list(cfg.from_results), random_a=cfg.a)
    return s, {}


def _setting_table(s: Setting, off: dict, on: dict, ideal: dict, measured: dict):
    table = Table(title=f"latency of {s.tokens} tokens, in the unit of the target forward = {s.target_s:.4g}; "
                        f"c={s.c:.3g}, a={s.a:.3g}, k={s.k}, {_workers(s.workers)}")
    columns = ["algorithm", "offline", "online", "online (preemptive)", "speedup vs plain (online)"]
    if measured:
        columns.append("measured")
    for col in columns:
        table.add_column(col, justify="right" if col != "algorithm" else "left")
    for name, label in (("plain", "plain decoding"), ("si", f"SI (k={s.k})"), ("dsi", f"DSI (k={s.k})")):
        row = [label, _fmt_s(off[name]), _fmt_s(on[name]), _fmt_s(ideal[name]), f"{on['plain'] / on[name]:.2f}x"]
        if measured:
            key = {"plain": "plain", "si": "draft", "dsi": "dsi"}[name]
            row.append(_fmt_s(measured[key]) if key in measured else "")
        table.add_row(*row)
    if off["dsi_enough"] != off["dsi"]:
        table.add_row(f"DSI, {dsi_workers_needed(s.c, s.k)} workers (the paper's bound)", _fmt_s(off["dsi_enough"]),
                      "", "", "")
    table.add_row("DSI, paper's count", _fmt_s(off["dsi_paper"]), "", "", "")
    return table


def _notes(s: Setting, on: dict) -> str:
    best = min(on["si"], on["plain"])
    busy = ", ".join(f"{b:.0%}" for b in on["busy"])
    return (f"workers the paper asks for: ceil(1/(k·c)) = {dsi_workers_needed(s.c, s.k)}; online DSI: busy {busy}; "
            f"{on['cancelled']:.1f} cancelled verifications per run of {on['verifications']:.1f}; "
            f"DSI {'<=' if on['dsi'] <= best * 1.0001 else '>'} min(SI, plain) online")


def table_rule_line(s: Setting) -> str:
    """What the paper's latency-table rule picks for this c and worker count, and the offline speedups then."""
    k = table_lookahead(s.c, s.workers)
    if k is None:
        return (f"the paper's table rule (smallest k of 1, 5, 10 with ceil(1/(k·c)) <= workers) finds no lookahead "
                f"for c={s.c:.3g} with {_workers(s.workers)}")
    si, dsi = si_latency_per_token(s.a, s.c, k), dsi_latency_per_token(s.a, s.c, k, workers=s.workers)
    return (f"the paper's table rule picks k={k} for c={s.c:.3g} with {_workers(s.workers)}: offline DSI/SI "
            f"{si / dsi:.2f}x, DSI/plain {1 / dsi:.2f}x, SI/plain {1 / si:.2f}x")


def _workers(n: int) -> str:
    return f"{n} worker" + ("s" if n != 1 else "")


def _fmt_s(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else "-"
