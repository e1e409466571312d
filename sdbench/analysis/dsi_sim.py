"""Expected end-to-end latency of plain decoding, SI and DSI, offline and online.

Model (the DSI paper's): one target forward costs `target_s` whatever it verifies, one draft forward costs
c·target_s, and each drafted token is right with probability a, independently (given a right prefix).

- offline: counting forwards. Closed forms in sdbench.analysis.theory (plain: 1 per token; SI: (k·c + 1) / Omega;
  DSI: the renewal formula `dsi_latency_per_token`). The DSI row honours the worker count: with N workers
  at most N verifications overlap, so window i of a cycle starts at s_i = max(s_{i-1} + k·c, s_{i-N} + 1)
  (`dsi_window_starts`), and a cycle of J accepted drafts costs min(s_ceil(J/k) + 1, J + 1) target forwards.
  With N >= ceil(1/(k·c)) (the paper's bound) this is the paper's count; with fewer workers it is slower,
  as the online simulation is. Fast enough for a heat-map over (c, a) (analysis/dsi_heatmap.py).
- online: a timed event simulation (simulated clock, nothing sleeps) of SI and of DSI as sdbench runs it:
  the same Ledger as the real orchestrator, N workers, a drafter that is never interrupted mid-forward and
  workers that finish a cancelled verification before taking the next one (as real ones do). With
  `preemptive=True` the drafter restarts at once and cancelled verifications free their worker at once:
  the idealisation the offline formula makes.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from dataclasses import dataclass

from sdbench.analysis import costs  # the module: tests replace costs.measured_costs
from sdbench.analysis.theory import (alpha_from_tokens_per_step, dsi_latency_per_token, dsi_workers_needed,
                                     si_latency_per_token)
from sdbench.dsi.ledger import Ledger
from sdbench.dsi.orchestrator import DSIRowStats
from sdbench.engine.formulas import specbench_mean_accepted_tokens
from sdbench.engine.iid_model import fit_alpha
from sdbench.errors import SdbenchError
from sdbench.reporting import results  # the module: tests replace results.read_results


@dataclass(frozen=True)
class Setting:
    target_s: float = 1.0  # one target forward (seconds, or 1.0 to count forwards)
    c: float = 0.1  # one draft forward / one target forward
    a: float = 0.8  # per-token acceptance rate
    k: int = 4  # lookahead: drafts per verification
    workers: int = 7  # DSI target workers
    tokens: int = 1000  # tokens to generate

    def check(self) -> "Setting":
        if not (self.target_s > 0 and self.c > 0 and 0 <= self.a <= 1 and self.k >= 1 and self.workers >= 1
                and self.tokens >= 1):
            raise SdbenchError("need --target-latency > 0, --c > 0, 0 <= --a <= 1, --k >= 1, --workers >= 1 "
                               "and --tokens >= 1")
        return self


def offline(s: Setting) -> dict[str, float]:
    """Expected latency (same unit as target_s) of generating s.tokens tokens, by counting forwards. "dsi" has
    s.workers workers (see the module docstring); "dsi_enough" the paper's ceil(1/(k·c)) or more."""
    scale = s.tokens * s.target_s
    return {
        "plain": scale,
        "si": scale * si_latency_per_token(s.a, s.c, s.k),
        "dsi": scale * dsi_latency_per_token(s.a, s.c, s.k, workers=s.workers),
        "dsi_enough": scale * dsi_latency_per_token(s.a, s.c, s.k),
        "dsi_paper": scale * dsi_latency_per_token(s.a, s.c, s.k, bonus=False, workers=s.workers),
    }


def workers_warning(s: Setting) -> str | None:
    """The warning line when fewer workers are given than the paper's bound, else None."""
    need = dsi_workers_needed(s.c, s.k)
    if s.workers >= need:
        return None
    return (f"warning: {s.workers} worker{'s' * (s.workers != 1)} is fewer than the paper's bound ceil(1/(k·c)) = "
            f"{need} for c={s.c:.3g}, k={s.k}: drafting waits for workers, and the offline DSI row counts that")


@dataclass
class DSIRun:
    latency: float
    busy: list[float]  # per worker: fraction of the run it spent verifying
    cancelled: int
    redundant: int
    verifications: int


def simulate_si(s: Setting, rng: random.Random) -> float:
    """One sequential SI generation: draft k (k·c), verify (1), commit the accepted drafts plus one token."""
    left, clock = s.tokens, 0.0
    while left > 0:
        k = min(s.k, left - 1)
        clock += (k * s.c + 1.0) * s.target_s
        accepted = 0
        while accepted < k and rng.random() < s.a:
            accepted += 1
        left -= accepted + 1
    return clock


def _right_until_wrong(job, frontier, drafts) -> tuple[int, int]:
    """The simulator's target: given a right prefix the right token is 0; a draft is 1 when it is wrong."""
    accepted = next((i for i, x in enumerate(drafts) if x != 0), len(drafts))
    return accepted, 0


def simulate_dsi(s: Setting, rng: random.Random, preemptive: bool = False) -> DSIRun:
    """One DSI generation on a simulated clock, driving the same Ledger as the real orchestrator."""
    led = Ledger([0], lookahead=s.k, max_new_tokens=s.tokens, workers=s.workers)
    t, d = s.target_s, s.c * s.target_s
    clock, events, ends, stopped = 0.0, [], {}, set()
    busy = [0.0] * s.workers
    draft_end = ticket = None

    def launch():
        for job in led.dispatch():
            heapq.heappush(events, (clock + t, job.id, job.worker))
            ends[job.id] = clock + t
            busy[job.worker] += t

    launch()
    while not led.done:
        if draft_end is None and led.want_draft():
            draft_end, ticket = clock + d, led.ticket()
        if draft_end is None and not events:
            raise RuntimeError("DSI simulation stalled: nothing to draft and nothing running")
        if draft_end is not None and (not events or draft_end <= events[0][0]):
            clock, draft_end = draft_end, None
            led.add_draft(0 if rng.random() < s.a else 1, ticket)  # dropped if its position moved meanwhile
        else:
            clock, job_id, worker = heapq.heappop(events)
            if job_id in stopped:
                continue
            version = led.version
            led.finish(job_id, worker, None, _right_until_wrong)
            if preemptive:
                if led.version != version:
                    draft_end = None
                for w in led.orphans():
                    jid = led.running.pop(w)
                    busy[w] -= ends[jid] - clock
                    stopped.add(jid)
        launch()
    for w, jid in led.running.items():  # still verifying when the last token came: not part of this run
        busy[w] -= max(0.0, ends[jid] - clock)
    return DSIRun(clock, [b / clock for b in busy], led.cancelled, led.redundant, led.dispatched)


def online(s: Setting, repeats: int = 20, seed: int = 0, preemptive: bool = False) -> dict:
    """Mean latencies over `repeats` simulated generations, plus DSI's worker figures."""
    rng = random.Random(seed)
    si = [simulate_si(s, rng) for _ in range(repeats)]
    runs = [simulate_dsi(s, rng, preemptive) for _ in range(repeats)]
    lat = [r.latency for r in runs]
    mean = sum(lat) / repeats
    return {
        "plain": s.tokens * s.target_s,
        "si": sum(si) / repeats,
        "dsi": mean,
        "dsi_sem": (sum((x - mean) ** 2 for x in lat) / max(repeats - 1, 1) / repeats) ** 0.5,
        "busy": [sum(r.busy[w] for r in runs) / repeats for w in range(s.workers)],
        "cancelled": sum(r.cancelled for r in runs) / repeats,
        "redundant": sum(r.redundant for r in runs) / repeats,
        "verifications": sum(r.verifications for r in runs) / repeats,
    }


# ---- measured settings -----------------------------------------------------------------------------------


def profile_from_results(paths, a: float | None = None, random_a: float | None = None) -> tuple[Setting, dict]:
    """Target latency, c, a, k and workers measured by an sdbench run, and the measured latency of each side.

    The target forward is the one DSI's workers measured when the run recorded it (what DSI actually got:
    on a small machine the workers share the cores with each other and the drafter), else the baseline's;
    c is drafting time per drafted token (discarded drafts included) over it; a comes from the recorded
    rejections, else from inverting Omega on the mean accepted length. Where the run recorded them, both
    latencies are the decode phase's (the workers' prompt verifications and the drafter's first call, which
    are prefills, left out), and so is `measured`: the latency of the mean generation for the baseline
    ("plain") and the strategy (by name), from the time per token after the first (else from the wall time),
    and both forward latencies. `a`, when given, replaces the measured acceptance rate (a DSI run whose drafter
    never got ahead of the verifications judged no draft, so it measured none). `random_a` is the rate for a run
    with random weights (MODEL@random), whose measured acceptance says nothing; such a run needs one of the two.
    """
    df = results.read_results(paths)
    if "weights" in df and (df["weights"] == "random").any():  # its latencies hold, its acceptance says nothing
        a = a if a is not None else random_a
        if a is None:
            raise SdbenchError("--from: the run has random weights (MODEL@random), whose acceptance rate means "
                               "nothing; give the rate with --a (the latencies are taken from the run)")
    base, strat = df[df["role"] == "baseline"], df[df["role"].astype(str).str.startswith("strategy")]
    stats = _row_stats(strat)
    drafted = sum(st.drafted_total or 0 for st in stats)
    if base.empty or strat.empty or not base["steps"].sum() or not strat["drafted"].sum() and not drafted:
        raise SdbenchError("--from needs a run with baseline rows and a drafting strategy (e.g. dsi or draft)")
    params = json.loads(strat["params"].iloc[0] or "{}")
    baseline_forward = base["verify_s"].sum() / base["steps"].sum()
    target_s = _recorded_mean([st.verify_s_per_decode_job for st in stats]) \
        or _recorded_mean([st.verify_s_per_job for st in stats]) or baseline_forward
    draft_per_token = _recorded_mean([st.draft_s_per_decode_token for st in stats]) \
        or strat["draft_s"].sum() / (drafted or strat["drafted"].sum())
    k = int(params.get("gamma") or round(strat["drafted"].sum() / strat["steps"].sum()))
    a = a if a is not None else _measured_rate(strat, stats)
    tokens = max(int(round(strat["new_tokens"].mean())), 1)
    setting = Setting(float(target_s), float(draft_per_token / target_s), float(a), k,
                      int(params.get("workers", 1)), tokens)
    measured = {"plain": _per_token(base) * tokens, str(strat["strategy"].iloc[0]): _per_token(strat) * tokens,
                "forward_baseline": float(baseline_forward), "forward_workers": float(target_s)}
    return setting.check(), measured


def measured_setting(s: Setting, target: str, draft: str, context: int, device: str, dtype: str,
                     console) -> Setting:
    """`s` with the target latency and c measured at the models' shapes (`costs.measured_costs`: the median of
    a few forwards at the end of a `context`-token prompt, through the fast path); a, k, workers as given."""
    measured = costs.measured_costs(target, draft, [s.k], context, device, dtype, console)
    return Setting(measured.target_s, measured.c, s.a, s.k, s.workers, s.tokens)


def _row_stats(strat) -> list:
    """The strategy rows' stats as DSI records them (a field another strategy did not record is None)."""
    return [DSIRowStats.from_dict(results.parse_stats(x)) for x in strat["strategy_stats"]]


def _measured_rate(strat, stats: list) -> float:
    """a fitted to the recorded rejections when every row recorded them, else Omega inverted on the mean
    accepted length."""
    if all(st.rejections is not None for st in stats):
        a = fit_alpha(int(strat["accepted"].sum()), sum(st.rejections for st in stats))
        if math.isnan(a):
            raise SdbenchError("--from: the run judged no draft (its drafter never got ahead of the target), so "
                               "it measured no acceptance rate; simulate with --c and --a instead")
        return a
    return alpha_from_tokens_per_step(specbench_mean_accepted_tokens(strat["accepted"].sum(), strat["steps"].sum()),
                                      strat["drafted"].sum() / strat["steps"].sum())


def _recorded_mean(values: list) -> float | None:
    """The mean of a per-row statistic when every row recorded it, else None."""
    return sum(values) / len(values) if values and all(v is not None for v in values) else None


def _per_token(rows) -> float:
    """Seconds per token: of the decode phase when the rows recorded it, else of the whole generation."""
    if "tpot_s" in rows and rows["tpot_s"].notna().all():
        return float(rows["tpot_s"].mean())
    return float((rows["wall_s"] / rows["new_tokens"]).mean())
