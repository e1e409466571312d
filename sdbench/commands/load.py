"""`sdbench run --request-rate R / --concurrency C`: the prompts served as requests arriving over time.

A load point is a request rate (Poisson arrivals drawn from the seed; inf: every request at once) and a cap on
the requests in flight (the running batch's slots: --concurrency; without it every arrival is admitted, as
`vllm bench serve` does without --max-concurrency: one slot per request). At each point and repeat,
the arrival times are drawn once and every role (the baseline and each strategy configuration) serves the same
requests at the same times through the one decode loop (`engine.loop.serve`). One row per request and role;
each point's rows are one part on disk, written as the point finishes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from sdbench.commands.divergence import invariant, judged_output, same_arithmetic
from sdbench.commands.roles import BASELINE, EveryRole, Measured, Measuring
from sdbench.config import RunConfig
from sdbench.engine.formulas import rate
from sdbench.engine.loop import serve
from sdbench.engine.metrics import RowMetrics, predicted_speedup
from sdbench.engine.scheduler import Request, Scheduler, arrival_times
from sdbench.engine.serving import format_slo, served_row_metrics
from sdbench.errors import SdbenchError
from sdbench.models.loading.names import weights_of
from sdbench.reporting.rows import Judged, Place, RunFields, result_row
from sdbench.strategies import strategy, strategy_registry


@dataclass(frozen=True)
class LoadPoint:
    rate: float  # requests/s; inf: all arrive at once
    slots: int  # requests in flight at most

    @property
    def label(self) -> str:
        return f"rate {self.rate:g}/s, concurrency {self.slots}"


def load_points(cfg: RunConfig, requests: int) -> list[LoadPoint]:
    """Every (rate, concurrency) pair asked for: --request-rate alone admits every arrival (a slot for each of
    the `requests`, so none waits for one), --concurrency alone has every request arrive at once (a closed loop)."""
    rates = cfg.request_rates or (math.inf,)
    caps = cfg.concurrencies or (requests,)
    return [LoadPoint(r, c) for r in rates for c in caps]


def check_load(cfg: RunConfig, base: str, options: dict) -> None:
    """Refuse, before any model loads, what serving under load cannot do."""
    if cfg.slo and not cfg.under_load:
        raise SdbenchError("--slo applies to runs under load: add --request-rate or --concurrency")
    if cfg.batch_size != 1:
        raise SdbenchError("--batch-size sets static batches; under load --concurrency caps the requests in flight "
                           "(without it every arrival is admitted)")
    if cfg.resume:
        raise SdbenchError("--resume does not continue runs under load yet: start the run again")
    if cfg.turns is not None and cfg.turns > 1:
        raise SdbenchError("--turns: under load each prompt's first turn is one request; later turns are not served")
    reason = strategy(base).join_refusal(options)
    if reason:
        able = [e.name for e in strategy_registry if not e.target.join_refusal(e.target.settings({}))]
        raise SdbenchError(f"strategy '{base}' cannot serve requests joining a running batch "
                           f"(--request-rate/--concurrency): {reason}; strategies that can: {', '.join(able)}")


def serve_points(bench, on: Measuring, prompts, encoded, writer, progress) -> None:
    """Every load point and repeat, every role on the same arrivals; a part written per point and repeat.
    bench: the run's RunHarness; on: its loaded pair, roles and row fields."""
    cfg, pair, every = bench.cfg, on.pair, on.every
    points = load_points(cfg, len(encoded))
    task = progress.add_task(bench.choice.name, total=cfg.repeats * len(points) * len(every.roles))
    for repeat in range(cfg.repeats):
        for point_id, point in enumerate(points):
            arrivals = arrival_times(len(encoded), point.rate, [cfg.sampling.seed, repeat])
            measured = every.measure(
                lambda role: _serve(bench, pair, role.proposer, encoded, arrivals, point.slots, repeat, point_id),
                started=lambda role: progress.update(task, description=f"{role.name}: {point.label}"),
                done=lambda role: progress.advance(task))
            at = replace(on.fields, batch_size=point.slots, request_rate=point.rate, concurrency=point.slots,
                         slo=format_slo(cfg.slo) or None)
            rows = _rows(bench, pair, measured, prompts, encoded, at, Place("", "", repeat, point_id))
            writer.append(rows)
            if bench.on_batch is not None:
                bench.on_batch(rows)


def _serve(bench, pair, proposer, encoded, arrivals, slots: int, repeat: int, point_id: int) -> Scheduler:
    cfg = bench.cfg
    requests = [Request(i, ids, at, cfg.max_new_tokens) for i, (ids, at) in enumerate(zip(encoded, arrivals))]
    seed = cfg.sampling.group_seed(repeat, point_id)
    gen = torch.Generator(bench.device).manual_seed(seed)
    return serve(pair.target, proposer, Scheduler(requests, slots), sampling=cfg.sampling, eos_ids=pair.eos,
                 generator=gen)


def _rows(bench, pair, measured: list[Measured[Scheduler]], prompts, encoded, fields: RunFields,
          at: Place) -> list[dict]:
    """One row per request and role; speedup, lossless and a divergence judged against the baseline's row for the
    same request before the row is made (encoded: the prompts' token ids)."""
    cfg, greedy = bench.cfg, bench.cfg.sampling.greedy
    served = {m.role.name: _served(m.result, cfg.slo) for m in measured}
    base = EveryRole.baseline(measured)
    base_requests = {req.index: req for req in base.requests} if base is not None else {}
    rows = []
    for m in measured:
        weights = weights_of([cfg.target, *m.role.drafts])
        for req in m.result.requests:
            p, judged = prompts[req.index], Judged(None, greedy, width_invariant=invariant(m.result))
            breq = base_requests.get(req.index)
            if breq is not None:  # DSI is never served
                predicted = math.nan if m.role.is_baseline else predicted_speedup(req.stats, breq.stats)
                divergence = judged_output(pair.target, encoded[req.index], breq.output_ids, req.output_ids,
                                           greedy, same_arithmetic(m.result, base))
                judged = Judged(served[BASELINE][req.index], greedy, predicted, divergence=divergence,
                                width_invariant=invariant(m.result))
            place = replace(at, category=p.category, prompt_id=p.id, depth=p.depth)
            rows.append(result_row(fields, m.role, place, served[m.role.name][req.index], judged, m.memory, weights,
                                   m.busy))
    return rows


def _served(done: Scheduler, slo: dict) -> dict[int, RowMetrics]:
    """Request index -> its metrics."""
    throughput = rate(sum(len(req.output_ids) for req in done.requests), done.duration_s)
    return {req.index: served_row_metrics(req, done.duration_s, slo, throughput) for req in done.requests}
