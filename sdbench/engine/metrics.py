"""Every metric, defined once here; every strategy (DSI included) counts by these definitions. This module holds a
row's figures (`RowMetrics`, `row_metrics`) and the cost model's predicted speedups from them; the formulas over
plain numbers are in engine/formulas.py, the counters a decoding keeps (`RowStats`, `BatchResult`, `tries`,
`Rounds`) in engine/counters.py, the clocks in engine/clock.py, serving under load in engine/serving.py.

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
  draft_s, verify_s      the batch's proposing time (the proposer's propose) and the target's verifying forwards
                         over the steps the row was active
  accept_s, observe_s, loop_s   the same for a round's other parts: the verdicts with their sampling and commits,
                         the proposer's bookkeeping after each verdict, the loop's own work between rounds; with
                         setup_s and the rounds' draft_s and verify_s they sum to the decode time (engine/loop.py)

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
Timed per call in `bench` (`commands/bench.measure_systems`, one loop for sdbench's systems, transformers' and each
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
from dataclasses import dataclass, field

from sdbench.engine import iid_model
from sdbench.engine.counters import BatchResult, RowStats
from sdbench.engine.formulas import acceptance_rate, mean_accepted_length, rate, time_per_output_token


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
    accept_s: float = 0.0  # a round's parts after its forward (engine/loop.py `_rounds`)
    observe_s: float = 0.0
    loop_s: float = 0.0

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def mean_accepted_len(self) -> float:
        return mean_accepted_length(self.new_tokens, self.steps)

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.accepted, self.drafted)


def counted_fields(stats: RowStats) -> dict:
    """RowMetrics' counters of one prompt's RowStats."""
    return dict(steps=stats.steps, drafted=stats.drafted, accepted=stats.accepted,
                accepted_per_position=list(stats.accepted_per_position),
                drafted_per_position=list(stats.drafted_per_position), draft_s=stats.draft_s, verify_s=stats.verify_s,
                accept_s=stats.accept_s, observe_s=stats.observe_s, loop_s=stats.loop_s, tree_steps=stats.tree_steps, tree_nodes=stats.tree_nodes, sibling_accepts=stats.sibling_accepts,
                verified_width=stats.verified_width,
                tried_per_depth_rank=[list(r) for r in stats.tried_per_depth_rank],
                accepted_per_depth_rank=[list(r) for r in stats.accepted_per_depth_rank])


def row_metrics(result: BatchResult, b: int) -> RowMetrics:
    """Row b of a decoded batch."""
    n = len(result.output_ids[b])
    return RowMetrics(
        output_ids=list(result.output_ids[b]), prompt_tokens=result.prompt_tokens[b], **counted_fields(result.rows[b]),
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

    Tokens per round (`_tokens_per_step`: the i.i.d. model's, alpha fitted to the row's accepted lengths) over a
    round's cost in the baseline's target forwards: drafting c per drafted token (draft_s), verification v
    (verify_s) and the host's h (`host_s`: acceptance, bookkeeping and loop), each per round over the baseline's
    time per forward, against the baseline's own h_b per token: Omega / (gamma c + v + h) * (1 + h_b). Whatever
    the model leaves out (acceptance that is not i.i.d., the budget cutting the last step short) shows as the gap
    to the measured speedup.
    """
    if not (stats.steps and baseline.steps and baseline.verify_s > 0):
        return math.nan
    target_forward = baseline.verify_s / baseline.steps
    plain = 1.0 + host_s(baseline) / baseline.steps / target_forward
    round_cost = (stats.draft_s + stats.verify_s + host_s(stats)) / stats.steps / target_forward
    return _tokens_per_step(stats) * plain / round_cost


def host_s(stats) -> float:
    """A row's round time outside drafting and the verifying forwards: verdicts, commits, the proposer's
    bookkeeping after them and the loop's own (RowStats or RowMetrics)."""
    return stats.accept_s + stats.observe_s + stats.loop_s


def round_s(stats) -> float:
    """A row's whole round time: drafting (with the proposer's setup), verifying forwards and `host_s`."""
    return stats.draft_s + stats.verify_s + host_s(stats)


def _tokens_per_step(stats: RowStats) -> float:
    """Tokens a round of this row is expected to commit, bonus included. A chain: the i.i.d. model's, alpha fitted
    to its accepted lengths, over the rounds' own numbers of drafts (`iid_model.expected_tokens_given_drafts`:
    prompt lookup drafts 0-gamma, a confidence cut fewer than gamma; Omega(gamma, alpha) when every round drafts
    gamma). A row that verified token trees: its measured tokens per round, since the chain's model does not
    describe a tree (with gamma the tree's node count it would count every node as a position of one chain); the
    tree cost model proper, from acceptance by depth and rank, is `analysis/trees.py` (`report --explain`,
    `predict tree`)."""
    if stats.tree_steps:
        return 1.0 + stats.accepted / stats.steps
    if not stats.drafted:
        return 1.0
    alpha = iid_model.fit_alpha(stats.accepted, stats.rejections)
    return iid_model.expected_tokens_given_drafts(alpha, stats.drafted_per_position, stats.steps)


def predicted_batch_speedup(rows: list[RowStats], baseline: list[RowStats], new_tokens: list[int]) -> float:
    """The cost model's speedup of one static batch, whose rows share every round and its wall clock.

    A static batch runs until its slowest row is done: row b is expected to take (n_b - 1) / Omega_b rounds
    for its n_b - 1 tokens after the first (Omega_b its expected tokens per round, `_tokens_per_step`), so the
    batch takes the most of these; plain decoding takes max_b(n_b - 1)
    of its rounds. A round costs its whole time (`round_s`: drafting, verification, acceptance and bookkeeping),
    read from the row active in the most rounds, over the baseline's time per round. With one row this is
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
    round_cost = round_s(longest) / longest.steps / (round_s(base) / base.steps)
    plain = max(new_tokens) - 1
    return plain / (rounds * round_cost) if rounds > 0 and round_cost > 0 else math.nan
