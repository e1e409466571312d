"""Requests served under load (`run --request-rate/--concurrency`), by engine/metrics.py's definitions: each
request's latencies, the SLO it was held to, and a role's summary at one load point."""

from __future__ import annotations

import math
import re

import numpy as np

from sdbench.engine.formulas import rate, time_per_output_token
from sdbench.engine.metrics import RowMetrics, ServedLatencies, counted_fields
from sdbench.errors import SdbenchError

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")  # the latencies an SLO may bound (vLLM's --goodput keys)
_SLO_ITEM = re.compile(r"^(\w+):(\d+(?:\.\d*)?|\.\d+)(ms|s)?$")


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft:500ms,tpot:50ms' -> {"ttft": 500.0, "tpot": 50.0} (milliseconds; a bare number is ms, as vLLM's)."""
    slo: dict[str, float] = {}
    for item in (text or "").replace(" ", "").split(","):
        m = _SLO_ITEM.match(item)
        if not m or m.group(1) not in SLO_METRICS or m.group(1) in slo:
            raise SdbenchError(f"--slo {text}: expected distinct METRIC:VALUE[ms|s] items joined by commas, METRIC "
                               f"one of {', '.join(SLO_METRICS)} (e.g. ttft:500ms,tpot:50ms)")
        slo[m.group(1)] = float(m.group(2)) * (1000.0 if m.group(3) == "s" else 1.0)
    return slo


def format_slo(slo: dict[str, float]) -> str:
    return ",".join(f"{k}:{v:g}ms" for k, v in slo.items())


def meets_slo(latencies: dict, slo: dict[str, float]) -> bool | None:
    """Whether a request kept every bound (None without an SLO). A one-token answer has no TPOT: it keeps a
    TPOT bound (vLLM counts its TPOT as 0)."""
    if not slo:
        return None
    return all(not latencies[f"{k}_ms"] > bound for k, bound in slo.items())  # NaN TPOT passes


def request_metrics(req, slo: dict[str, float], duration_s: float) -> ServedLatencies:
    """The latencies of a request served under load (engine/scheduler.py's Request)."""
    t, n = req.token_s, sum(req.chunk_tokens)
    ttft = (t[0] - req.arrival_s) * 1e3 if t else math.nan
    e2el = (t[-1] - req.arrival_s) * 1e3 if t else math.nan
    tpot = time_per_output_token(e2el - ttft, n)
    met = meets_slo({"ttft_ms": ttft, "tpot_ms": tpot, "e2el_ms": e2el}, slo)
    return ServedLatencies(arrival_s=req.arrival_s, scheduled_s=req.scheduled_s, token_s=list(t),
                           chunk_tokens=list(req.chunk_tokens), ttft_ms=ttft, e2el_ms=e2el,
                           itl_ms=[(b - a) * 1e3 for a, b in zip(t, t[1:])], tpot_ms=tpot,
                           queue_ms=(req.scheduled_s - req.arrival_s) * 1e3, prefill_ms=req.prefill_s * 1e3,
                           slo_met=met, duration_s=duration_s)


def _spread(values: list[float], name: str) -> dict:
    v = np.asarray([x for x in values if not math.isnan(x)], dtype=float)
    stats = {f"mean_{name}": float(v.mean()) if len(v) else math.nan}
    for q in PERCENTILES:
        stats[f"p{q}_{name}"] = float(np.percentile(v, q)) if len(v) else math.nan
    return stats


def serving_summary(requests: list[dict], duration_s: float) -> dict:
    """The run-level figures of one role at one load point, from its requests' rows (request_metrics' columns
    plus prompt_tokens and new_tokens). Names as vLLM's benchmark_serving result (see the module docstring)."""
    out_tokens = sum(r["new_tokens"] for r in requests)
    good = [r["slo_met"] for r in requests]
    summary = {
        "completed": len(requests), "duration_s": duration_s,
        "request_throughput": rate(len(requests), duration_s),
        "output_throughput": rate(out_tokens, duration_s),
        "total_token_throughput": rate(out_tokens + sum(r["prompt_tokens"] for r in requests), duration_s),
        "request_goodput": math.nan if any(g is None for g in good) else rate(sum(map(bool, good)), duration_s),
    }
    for name in LATENCIES:
        values = [x for r in requests for x in r[name]] if name == "itl_ms" else [r[name] for r in requests]
        summary.update(_spread(values, name))
    return summary


def served_row_metrics(req, duration_s: float, slo: dict[str, float], throughput: float) -> RowMetrics:
    """A request served under load. The batch figures take the request's view: wall_s is the whole serving
    time (the role's "batch"), tokens_per_s the request's own tokens over its e2el, ttft_s and tpot_s its TTFT
    and TPOT in seconds; throughput: the role's output tokens/s at this load point (batch_tokens_per_s)."""
    served = request_metrics(req, slo, duration_s)
    return RowMetrics(
        output_ids=list(req.output_ids), prompt_tokens=len(req.prompt), **counted_fields(req.stats), wall_s=duration_s,
        tokens_per_s=rate(len(req.output_ids), served.e2el_ms / 1e3), batch_tokens_per_s=throughput,
        ttft_s=served.ttft_ms / 1e3, tpot_s=served.tpot_ms / 1e3, setup_s=0.0, strategy_stats=req.extras,
        served=served,
    )
