"""Every metric formula, defined once; every strategy (DSI included) counts by these definitions.

Counted per prompt (row), from token ids, for the baseline and every strategy alike:
  committed        the tokens a row committed after its prompt (the `new_tokens` column): the first comes
                   from the prefill, every later one from a step; never more than --max-new-tokens, and
                   nothing after an EOS
  steps            target verifications that committed tokens after the first token (plain decoding: one
                   per token after the first, so steps = new_tokens - 1)
  drafted          drafted tokens the target verified in those steps (a round's lookahead is capped to what
                   the row can still commit, so no step verifies a draft beyond the token budget)
  accepted         drafted tokens that were committed: accepted by the verifier and not cut by an EOS
                   before them or by the budget (a draft the verifier accepted but that was thrown away is
                   not accepted)
  mean accepted length   (new_tokens - 1) / steps: tokens committed per step, the target's own correction
                   or bonus token included (1.0 = plain decoding); it never exceeds what was committed,
                   and equals (accepted + steps) / steps unless an EOS or the budget cut a step's own token
  acceptance rate  accepted / drafted
  per-position rates     accepted_per_position[j] / drafted_per_position[j]: of the steps that drafted a
                   token at position j (0-based), the share whose draft j was committed
  rejections       steps whose verifier rejected one of their drafts (the alpha fit's failures; a step cut
                   by EOS or the budget is censored, not rejected)
Token trees (a proposal that branches, engine/tree.py) count by the same names: a tree step's drafted are its
nodes, its accepted the committed nodes of its accepted path (one per depth), so mean accepted length still
includes the bonus token; positions are depths (drafted_per_position[j]: steps whose tree reached depth j + 1);
a tree step is rejected when its accepted path ends at a node with children. Beside them, per row:
  tree_steps       steps that verified a tree
  tree_nodes       the nodes those steps drafted (mean tree size: tree_nodes / tree_steps)
  sibling_accepts  committed nodes that were not their parent's first child: what the branches won over the
                   tree's first path (0 for a chain)
  verified_width   tokens per row of the steps' verifying forwards, summed (mean verification width:
                   verified_width / steps): the last committed token plus the drafts, padded to the batch's
                   widest proposal that round, as the forward runs it (plain decoding: 1 per step)
Acceptance by depth and sibling rank (`tries`), for chains and trees alike (a chain is a tree of rank-0 nodes),
by the verifier's verdict (an accepted node that an EOS or the budget then cut still counts as accepted):
  tried_per_depth_rank[d][r]     steps in which the rank-r child of the accepted path's node at depth d (0:
                   the root) was tried: that node was accepted (or is the root), it has a rank-r child, and
                   its children of lower rank were all rejected
  accepted_per_depth_rank[d][r]  of those, the steps in which that child was accepted
  so accepted_per_depth_rank / tried_per_depth_rank is the conditional acceptance of a rank-r child at depth
  d + 1 given that it was tried: what analysis/trees.py predicts a tree's accepted length from.
Timed per batch (every row of a batch carries its batch's values):
  wall_s           from the start of the first prefill to the last committed token
  ttft_s           the time to first tokens: from the start of a prefill to that pass's first committed
                   token, summed over the passes (one pass for a batch decoded together; one per prompt for
                   a strategy that decodes a batch one prompt after another, such as DSI)
  decode time      wall_s - ttft_s: the time spent committing every token after each row's first; the
                   decode-phase rate is (new_tokens - 1 per row) / decode time
  tpot_s           decode time / (new_tokens - 1) (`time_per_output_token`)
  setup_s          the proposer's setup inside the decode time (a draft model's own prefill of the prompts, a
                   sparse cache's compression), also counted in draft_s; 0 for plain decoding
  draft_s, verify_s      the batch's proposing and verifying time over the steps the row was active

Served under load (`run --request-rate/--concurrency`; engine/scheduler.py), per request, from the times its
tokens were committed (chunk = the tokens one round committed for it; the first chunk is its prefill's token),
as offsets from the start of serving; the names are vLLM's benchmark_serving's where the meaning is the same:
  ttft_ms          first chunk - arrival: queueing, the prefill and the first token (vLLM: the same, but
                   measured by a client across HTTP, detokenisation and streaming; here inside the engine)
  itl_ms           the gaps between successive chunks (one per round that committed tokens for the request;
                   several tokens per chunk under speculation, as in vLLM's streamed chunks)
  e2el_ms          last chunk - arrival, so e2el = ttft + sum(itl)
  tpot_ms          (e2el - ttft) / (new_tokens - 1); NaN for a one-token answer (vLLM records 0 there: see
                   `meets_slo`)
  queue_ms         the wait for a slot: scheduled - arrival (not in vLLM's client-side view)
  prefill_ms       the request's own prefill and first token; the draft's own prefill of it is in draft_s
  new_tokens       counted from token ids, as above (vLLM counts what the server reports, or re-tokenises)
Timed per call in `bench` (`commands/bench._measure`, one loop for sdbench's systems, transformers' and each
engine's), as perf_counter times: start (the call made), first (its first new token available: the call's end less
the time the system itself saw after its first token, from its decode loop, transformers' streamer or the engine's
stream) and end (the call returned):
  ttft             first - start; over several calls their median (`reporting/latency.py`)
  tpot             `time_per_output_token`: (end - first) / (new_tokens - 1), NaN for a one-token answer; over
                   several calls (`decode_time_per_token`) the times after the first token over the tokens after
                   it, each summed over the calls of two tokens or more: the reciprocal of their decode rate
Per run (one role at one load point; `serving_summary`):
  duration_s       from the first arrival (time 0) to the last committed token
  request_throughput     completed requests / duration_s
  output_throughput      sum(new_tokens) / duration_s
  total_token_throughput (sum(prompt_tokens) + sum(new_tokens)) / duration_s
  request_goodput  requests meeting every --slo bound / duration_s (null without --slo; vLLM's --goodput)
  pNN_<latency>    the NNth percentile (numpy's linear interpolation, as vLLM) over requests, and for itl_ms
                   over every gap of every request (vLLM's flattened ITLs); tpot_ms over requests with more
                   than one token (vLLM: the same)
A slot of the running batch is verified in every round, running or not (idle slots hold a placeholder, as
finished rows of a batch do), where vLLM's scheduler forwards only running requests: at light load a round
costs what a round of the full batch costs.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from sdbench.engine import iid_model
from sdbench.engine.tree import Tree
from sdbench.errors import SdbenchError


def now(device: torch.device | str | None = None) -> float:
    """perf_counter after the device has finished its queued work."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Marks:
    """Phase timestamps that need no wait of their own: CUDA events on a GPU, read once the round's results
    have reached the host anyway (the one wait per round), perf_counter elsewhere. The time between two
    marks is then the device's time from one to the other, as a synchronised clock would measure it."""

    def __init__(self, device: torch.device | str | None = None):
        self.cuda = device is not None and torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        """Time from mark a to mark b; on a GPU, only after the work before b has finished."""
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class Spans:
    """A sum of durations taken without waiting for the device: each span is a pair of `Marks`, read only when
    `settle` is called after the work has reached the host anyway (the decode loop's one wait per round)."""

    def __init__(self, device: torch.device | str | None = None):
        self.marks = Marks(device)
        self.pending: list = []

    def start(self):
        return self.marks.mark()

    def stop(self, start) -> None:
        self.pending.append((start, self.marks.mark()))

    def settle(self) -> float:
        """Seconds of the spans stopped since the last settle."""
        seconds = sum(self.marks.seconds(a, b) for a, b in self.pending)
        self.pending.clear()
        return seconds


def mean_accepted_length(new_tokens: float, steps: float, rows: int = 1) -> float:
    """Tokens committed per step: every token but each row's first (the prefill's) comes from a step. Over
    several rows, their new tokens and steps summed."""
    return (new_tokens - rows) / steps if steps else math.nan


def acceptance_rate(accepted: int, drafted: int) -> float:
    return accepted / drafted if drafted else math.nan


def specbench_mean_accepted_tokens(accepted: float, steps: float) -> float:
    """Spec-Bench's "#Mean accepted tokens" (evaluation/speed.py): the mean over every step of all prompts of
    the step's accepted drafts + 1. From sdbench's counts: (accepted + steps) / steps. It equals sdbench's
    mean accepted length unless an EOS or the budget cut a step; Spec-Bench also counts a step's accepted
    drafts past the cut, which sdbench does not record, so on such runs Spec-Bench itself would print a little
    more."""
    return (accepted + steps) / steps if steps else math.nan


def vllm_mean_acceptance_length(accepted: float, drafts: float) -> float:
    """vLLM's "Mean acceptance length" (v1 spec-decode metrics): 1 + accepted / num_drafts, where num_drafts
    counts only the steps that proposed at least one token (drafted_per_position[0] here). A step with no
    draft (a prompt-lookup miss) is left out, where sdbench's mean accepted length counts it as 1 token."""
    return 1.0 + accepted / drafts if drafts else math.nan


def vllm_draft_acceptance_rate(accepted: float, drafted: float) -> float:
    """vLLM's "Draft acceptance rate": accepted / drafted tokens, the same ratio as sdbench's acceptance rate."""
    return acceptance_rate(accepted, drafted)


def rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else math.nan


def time_per_output_token(after_first: float, new_tokens: int) -> float:
    """The time after an answer's first token over the tokens after it (in after_first's unit); NaN for an
    answer of one token, which has no token after its first to time (vLLM records 0 there)."""
    return after_first / (new_tokens - 1) if new_tokens > 1 else math.nan


def decode_time_per_token(answers) -> float:
    """`time_per_output_token` over (after_first, new_tokens) pairs: their times after the first token over their
    tokens after it, each summed over the answers of two tokens or more; NaN where there is none."""
    timed = [(s, n) for s, n in answers if n > 1]
    if not timed:
        return math.nan
    return time_per_output_token(sum(s for s, _ in timed), 1 + sum(n - 1 for _, n in timed))


def tries(tree: Tree, path) -> list[tuple[int, int, bool]]:
    """(d, r, accepted) for every node one verification tried (module docstring: acceptance by depth and rank),
    from the root down. tree: the step's tree; path: the nodes the verifier accepted, from the root's child down.
    Verification tries a node's children in rank order until one is accepted, then goes on below it; after the
    last accepted node it tries all of that node's children and accepts none."""
    out: list[tuple[int, int, bool]] = []
    at = -1
    for d in range(len(path) + 1):
        nxt = path[d] if d < len(path) else None
        for r, child in enumerate(tree.children_of(at)):
            out.append((d, r, child == nxt))
            if child == nxt:
                break
        at = nxt
    return out


def chain_tries(drafted: int, accepted: int) -> list[tuple[int, int, bool]]:
    """`tries` of a chain of `drafted` drafts of which the verifier accepted the first `accepted` (no tree built)."""
    return [(d, 0, d < accepted) for d in range(min(accepted + 1, drafted))]


def _count_try(tried: list[list[int]], accepted: list[list[int]], d: int, r: int, ok: bool) -> None:
    """One try of (d, r) into the two [d][r] tables, kept the same shape."""
    for table in (tried, accepted):
        table.extend([] for _ in range(d + 1 - len(table)))
        table[d].extend([0] * (r + 1 - len(table[d])))
    tried[d][r] += 1
    accepted[d][r] += ok


@dataclass
class RowStats:
    """One prompt's counters over a generation."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # steps whose verifier rejected one of their drafted tokens
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: steps whose draft j was committed
    drafted_per_position: list[int] = field(default_factory=list)  # [j]: steps that drafted a token at j
    draft_s: float = 0.0  # the batch's drafting time over the steps this row was active
    verify_s: float = 0.0
    tree_steps: int = 0  # token trees: see the module docstring
    tree_nodes: int = 0
    sibling_accepts: int = 0
    verified_width: int = 0
    tried_per_depth_rank: list[list[int]] = field(default_factory=list)  # [d][r], see the module docstring
    accepted_per_depth_rank: list[list[int]] = field(default_factory=list)

    def add_step(self, drafted: int, accepted: int, draft_s: float, verify_s: float,
                 rejected: bool | None = None, *, verified: int | None = None, tree: Tree | None = None,
                 path=None, width: int | None = None) -> None:
        """accepted: drafts committed (see the module docstring); verified: drafts the verifier accepted
        (default: accepted); rejected: the verifier rejected a draft (default: its last try failed, so for a
        chain fewer verified than drafted); width: the verifying forward's tokens per row (default drafted + 1).
        A tree step: tree, the step's tree, and path, the nodes the verifier accepted (the first `accepted`
        of them committed)."""
        if tree is not None:
            rank = tree.rank
            self.tree_steps += 1
            self.tree_nodes += drafted
            self.sibling_accepts += sum(rank[i] > 0 for i in path[:accepted])
            found = tries(tree, path)
        else:
            found = chain_tries(drafted, accepted if verified is None else verified)
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += (bool(found) and not found[-1][2]) if rejected is None else bool(rejected)
        self.draft_s += draft_s
        self.verify_s += verify_s
        self.verified_width += drafted + 1 if width is None else width
        for d, r, ok in found:
            _count_try(self.tried_per_depth_rank, self.accepted_per_depth_rank, d, r, ok)
        reached = drafted if tree is None else tree.max_depth
        for counts, n in ((self.drafted_per_position, reached), (self.accepted_per_position, accepted)):
            counts.extend([0] * (n - len(counts)))
            for j in range(n):
                counts[j] += 1


@dataclass
class BatchResult:
    """The outcome of decoding one batch of prompts."""

    output_ids: list[list[int]]  # new tokens per row (prompt excluded)
    prompt_tokens: list[int]
    rows: list[RowStats]
    wall_s: float  # prefill to last token, the whole batch
    ttft_s: float  # prefill to first token, summed over the passes (see the module docstring)
    extras: list[dict] = field(default_factory=list)  # per row: the proposer's row_stats()
    setup_s: float = 0.0  # the proposer's begin(), inside the decode time (see the module docstring)

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.output_ids)


@dataclass(frozen=True)
class ServedLatencies:
    """A request's latencies served under load (see the module docstring); times in s from serving's start."""

    arrival_s: float
    scheduled_s: float
    token_s: list[float]  # when each chunk of its tokens was committed (the first: its first token)
    chunk_tokens: list[int]  # tokens in each chunk
    ttft_ms: float
    e2el_ms: float
    itl_ms: list[float]
    tpot_ms: float
    queue_ms: float
    prefill_ms: float
    slo_met: bool | None  # every --slo bound kept; None without --slo
    duration_s: float  # the role's whole serving time at this load point


@dataclass(frozen=True)
class RowMetrics:
    """One prompt's measured figures: a row of a decoded batch, or a request served under load (`served`)."""

    output_ids: list[int]  # the committed tokens after the prompt
    prompt_tokens: int
    steps: int
    drafted: int
    accepted: int
    accepted_per_position: list[int]
    drafted_per_position: list[int]
    draft_s: float
    verify_s: float
    wall_s: float
    tokens_per_s: float
    batch_tokens_per_s: float
    ttft_s: float
    tpot_s: float
    setup_s: float
    strategy_stats: dict  # the proposer's own per-row figures (Proposer.row_stats)
    served: ServedLatencies | None = None
    tree_steps: int = 0  # token trees and acceptance by depth and rank: see the module docstring
    tree_nodes: int = 0
    sibling_accepts: int = 0
    verified_width: int = 0
    tried_per_depth_rank: list[list[int]] = field(default_factory=list)
    accepted_per_depth_rank: list[list[int]] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def mean_accepted_len(self) -> float:
        return mean_accepted_length(self.new_tokens, self.steps)

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.accepted, self.drafted)


def _counted(stats: RowStats) -> dict:
    """RowMetrics' counters of one prompt's RowStats."""
    return dict(steps=stats.steps, drafted=stats.drafted, accepted=stats.accepted,
                accepted_per_position=list(stats.accepted_per_position),
                drafted_per_position=list(stats.drafted_per_position), draft_s=stats.draft_s, verify_s=stats.verify_s,
                tree_steps=stats.tree_steps, tree_nodes=stats.tree_nodes, sibling_accepts=stats.sibling_accepts,
                verified_width=stats.verified_width,
                tried_per_depth_rank=[list(r) for r in stats.tried_per_depth_rank],
                accepted_per_depth_rank=[list(r) for r in stats.accepted_per_depth_rank])


def row_metrics(result: BatchResult, b: int) -> RowMetrics:
    """Row b of a decoded batch."""
    n = len(result.output_ids[b])
    return RowMetrics(
        output_ids=list(result.output_ids[b]), prompt_tokens=result.prompt_tokens[b], **_counted(result.rows[b]),
        wall_s=result.wall_s, tokens_per_s=rate(n, result.wall_s),
        batch_tokens_per_s=rate(result.new_tokens, result.wall_s), ttft_s=result.ttft_s,
        tpot_s=time_per_output_token(result.wall_s - result.ttft_s, n), setup_s=result.setup_s,
        strategy_stats=result.extras[b] if b < len(result.extras) else {},
    )


def speedup(tokens_per_s: float, baseline_tokens_per_s: float) -> float:
    return tokens_per_s / baseline_tokens_per_s if baseline_tokens_per_s > 0 else math.nan


def predicted_speedup(stats: RowStats, baseline: RowStats) -> float:
    """The cost model's speedup from this run's own measurements, for one row decoding on its own (batch 1, or a
    request served under load, which leaves its batch when it is done).

    alpha: fitted to the row's accepted lengths; gamma: mean drafted tokens per step; draft cost c: drafting
    time per drafted token over the baseline's time per target forward; verify cost v: time per
    verification over the same. A row that verified token trees: its measured tokens per round over the same
    round cost (`_tokens_per_step`). Whatever the model leaves out (bookkeeping, non-geometric acceptance, the
    budget cutting the last step short) shows as the gap to the measured speedup.
    """
    if not (stats.steps and baseline.steps and baseline.verify_s > 0):
        return math.nan
    target_forward = baseline.verify_s / baseline.steps
    if stats.tree_steps:
        return _tokens_per_step(stats) / ((stats.draft_s + stats.verify_s) / stats.steps / target_forward)
    gamma = stats.drafted / stats.steps
    c = stats.draft_s / stats.drafted / target_forward if stats.drafted else 0.0
    v = stats.verify_s / stats.steps / target_forward
    return iid_model.predicted_speedup(iid_model.fit_alpha(stats.accepted, stats.rejections), gamma, c, v)


def _tokens_per_step(stats: RowStats) -> float:
    """Tokens a round of this row is expected to commit, bonus included. A chain: Omega(gamma, alpha), alpha fitted
    to its accepted lengths and gamma its mean drafted tokens per step. A row that verified token trees: its
    measured tokens per round, since the chain's geometric model does not describe a tree (with gamma the tree's
    node count it would count every node as a position of one chain); the tree cost model proper, from acceptance
    by depth and rank, is `analysis/trees.py` (`report --explain`, `predict tree`)."""
    if stats.tree_steps:
        return 1.0 + stats.accepted / stats.steps
    gamma = stats.drafted / stats.steps if stats.steps else 0.0
    alpha = iid_model.fit_alpha(stats.accepted, stats.rejections) if gamma > 0 else 0.0
    return math.nan if math.isnan(alpha) else iid_model.expected_tokens_per_step(alpha, gamma)


def predicted_batch_speedup(rows: list[RowStats], baseline: list[RowStats], new_tokens: list[int]) -> float:
    """The cost model's speedup of one static batch, whose rows share every round and its wall clock.

    A static batch runs until its slowest row is done: row b is expected to take (n_b - 1) / Omega(gamma_b,
    alpha_b) rounds for its n_b - 1 tokens after the first (alpha_b fitted to its accepted lengths, gamma_b its
    mean drafted tokens per step; a row that verified trees: its measured tokens per round, `_tokens_per_step`),
    so the batch takes the most of these; plain decoding takes max_b(n_b - 1)
    target forwards. A round costs (gamma c + v) target forwards: its drafting and verification time, read from
    the row active in the most rounds, over the baseline's time per forward. With one row this is
    `predicted_speedup`; with rows whose acceptance differs (prompt lookup finding matches in some prompts and
    none in others) it is far below the mean of their own predictions, as the measured batch speedup is.
    """
    if not rows or len(rows) != len(baseline) or len(rows) != len(new_tokens):
        return math.nan
    base = max(baseline, key=lambda s: s.steps)
    longest = max(rows, key=lambda s: s.steps)
    if not (base.steps and base.verify_s > 0 and longest.steps):
        return math.nan
    rounds = 0.0
    for stats, n in zip(rows, new_tokens):
        if n <= 1:
            continue
        tokens = _tokens_per_step(stats)
        if math.isnan(tokens):
            return math.nan
        rounds = max(rounds, (n - 1) / tokens)
    round_cost = (longest.draft_s + longest.verify_s) / longest.steps / (base.verify_s / base.steps)
    plain = max(new_tokens) - 1
    return plain / (rounds * round_cost) if rounds > 0 and round_cost > 0 else math.nan


# ---- served under load ---------------------------------------------------------------------------------------
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
        output_ids=list(req.output_ids), prompt_tokens=len(req.prompt), **_counted(req.stats), wall_s=duration_s,
        tokens_per_s=rate(len(req.output_ids), served.e2el_ms / 1e3), batch_tokens_per_s=throughput,
        ttft_s=served.ttft_ms / 1e3, tpot_s=served.tpot_ms / 1e3, setup_s=0.0, strategy_stats=req.extras,
        served=served,
    )
