"""`sdbench run --request-rate R / --concurrency C`: the prompts served as requests arriving over time.

A load point is a request rate (Poisson arrivals drawn from the seed; inf: every request at once) and a cap on
the requests in flight (the running batch's slots: --concurrency, else --batch-size). At each point and repeat,
the arrival times are drawn once and every role (the baseline and each strategy configuration) serves the same
requests at the same times through the one decode loop (`engine.loop.serve`). One row per request and role;
each point's rows are one part on disk, written as the point finishes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from sdbench.commands.divergence import judge_rows
from sdbench.config import RunConfig
from sdbench.engine.loop import serve
from sdbench.engine.metrics import format_slo, predicted_speedup, rate, served_row_metrics, speedup
from sdbench.engine.scheduler import Request, Scheduler, arrival_times
from sdbench.env import peak_memory, reset_peak_memory
from sdbench.errors import SdbenchError
from sdbench.models.names import weights_of
from sdbench.strategies import strategy, strategy_registry


@dataclass(frozen=True)
class LoadPoint:
    rate: float  # requests/s; inf: all arrive at once
    slots: int  # requests in flight at most

    @property
    def label(self) -> str:
        return f"rate {self.rate:g}/s, concurrency {self.slots}"


def load_points(cfg: RunConfig) -> list[LoadPoint]:
    """Every (rate, concurrency) pair asked for: --request-rate alone caps the flight at --batch-size,
    --concurrency alone has every request arrive at once (a closed loop)."""
    rates = cfg.request_rates or (math.inf,)
    caps = cfg.concurrencies or (cfg.batch_size,)
    return [LoadPoint(r, c) for r in rates for c in caps]


def check_load(cfg: RunConfig, base: str, options: dict) -> None:
    """Refuse, before any model loads, what serving under load cannot do."""
    if cfg.slo and not cfg.under_load:
        raise SdbenchError("--slo applies to runs under load: add --request-rate or --concurrency")
    if cfg.concurrencies and cfg.batch_size != 1:
        raise SdbenchError("--batch-size and --concurrency both set how many requests run together: give one "
                           "(under load, --batch-size caps the flight only when --concurrency is not given)")
    if cfg.resume:
        raise SdbenchError("--resume does not continue runs under load yet: start the run again")
    if cfg.turns is not None and cfg.turns > 1:
        raise SdbenchError("--turns: under load each prompt's first turn is one request; later turns are not served")
    reason = strategy(base).join_refusal(options)
    if reason:
        able = [e.name for e in strategy_registry if not e.target.join_refusal(e.target.settings({}))]
        raise SdbenchError(f"strategy '{base}' cannot serve requests joining a running batch "
                           f"(--request-rate/--concurrency): {reason}; strategies that can: {', '.join(able)}")


def serve_points(bench, pair, roles, prompts, encoded, writer, common, progress) -> None:
    """Every load point and repeat, every role on the same arrivals; a part written per point and repeat."""
    cfg = bench.cfg
    points = load_points(cfg)
    task = progress.add_task(bench.choice.name, total=cfg.repeats * len(points) * len(roles))
    for repeat in range(cfg.repeats):
        for point_id, point in enumerate(points):
            arrivals = arrival_times(len(encoded), point.rate, [cfg.sampling.seed, repeat])
            results = {}
            for role, proposer in roles:
                progress.update(task, description=f"{role}: {point.label}")
                reset_peak_memory(str(bench.device))
                done = _serve(bench, pair, proposer, encoded, arrivals, point.slots, repeat, point_id)
                results[role] = (done, peak_memory(str(bench.device)))
                progress.advance(task)
            rows = _rows(bench, dict(roles), prompts, results, point, repeat, point_id, common)
            judge_rows(pair.target, rows, {p.id: ids for p, ids in zip(prompts, encoded)})
            writer.append(rows)
            if bench.on_batch is not None:
                bench.on_batch(rows)


def _serve(bench, pair, proposer, encoded, arrivals, slots: int, repeat: int, point_id: int) -> Scheduler:
    cfg = bench.cfg
    requests = [Request(i, ids, at, cfg.max_new_tokens) for i, (ids, at) in enumerate(zip(encoded, arrivals))]
    seed = cfg.sampling.seed * 1_000_003 + repeat * 10_007 + point_id
    gen = torch.Generator(bench.device).manual_seed(seed)
    return serve(pair.target, proposer, Scheduler(requests, slots), sampling=cfg.sampling, eos_ids=pair.eos,
                 generator=gen)


def _rows(bench, proposers, prompts, results, point: LoadPoint, repeat: int, point_id: int, common) -> list[dict]:
    """One row per request and role; speedup and lossless against the baseline's row for the same request."""
    cfg = bench.cfg
    base = {}
    rows = []
    for role, (done, (mem, mem_kind)) in results.items():
        name, params, drafts = bench._describe(role, proposers[role])
        served = [served_row_metrics(req, done.duration_s, cfg.slo) for req in done.requests]
        throughput = rate(sum(r["new_tokens"] for r in served), done.duration_s)
        for req, metrics in zip(done.requests, served):
            p = prompts[req.index]
            row = {**common, **metrics, "batch_tokens_per_s": throughput}
            row.update(role=role, strategy=name, params=params, draft=drafts, category=p.category, prompt_id=p.id,
                       repeat=repeat, batch_id=point_id, batch_size=point.slots, peak_mem_bytes=mem,
                       mem_kind=mem_kind, gamma=json.loads(params).get("gamma"), predicted_speedup=math.nan,
                       turn=1, depth=p.depth, request_rate=point.rate, concurrency=point.slots,
                       slo=format_slo(cfg.slo) or None, weights=weights_of([cfg.target, *drafts.split(",")]))
            if role == "baseline":
                base[req.index] = (row, req)
            elif req.index in base:
                brow, breq = base[req.index]
                row["speedup"] = speedup(row["tokens_per_s"], brow["tokens_per_s"])
                row["predicted_speedup"] = predicted_speedup(req.stats, breq.stats)  # DSI is never served
                if cfg.sampling.greedy:
                    row["lossless"] = req.output_ids == breq.output_ids
            rows.append(row)
    return rows
