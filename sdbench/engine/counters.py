"""The counters a decoding keeps, by engine/metrics.py's definitions: a prompt's (`RowStats`) and a batch's
(`BatchResult`) over a generation, acceptance by depth and rank (`tries`), a system's decoding in rounds over a
measurement (`Rounds`, with how a drafter spends a round's forwards), and an adaptive strategy's per-row figures."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from sdbench.engine.formulas import mean_accepted_length
from sdbench.engine.tree import Tree
from sdbench.stats_record import StatsRecord


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
    verify_s: float = 0.0  # ... the target's verifying forwards
    accept_s: float = 0.0  # ... the verdicts, their sampling and commits (engine/loop.py `_rounds`)
    observe_s: float = 0.0  # ... the proposer's bookkeeping after each verdict
    loop_s: float = 0.0  # ... the loop's own between rounds
    tree_steps: int = 0  # token trees: see the module docstring
    tree_nodes: int = 0
    sibling_accepts: int = 0
    verified_width: int = 0
    verified_widths: dict = field(default_factory=dict)  # width -> steps whose verifying forward had that many
    tried_per_depth_rank: list[list[int]] = field(default_factory=list)  # [d][r], see the module docstring
    accepted_per_depth_rank: list[list[int]] = field(default_factory=list)

    def add_step(self, drafted: int, accepted: int, draft_s: float, verify_s: float,
                 rejected: bool | None = None, *, verified: int | None = None, tree: Tree | None = None,
                 path=None, width: int | None = None, accept_s: float = 0.0) -> None:
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
        self.accept_s += accept_s
        w = drafted + 1 if width is None else width
        self.verified_width += w
        self.verified_widths[w] = self.verified_widths.get(w, 0) + 1
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
    # the target's forwards past the prefill whose rows' arithmetic depended on the step's width (kv/cache.py
    # `varied`): 0, every verification was plain decoding's bits; None, not known (another process verified: DSI)
    width_varied: int | None = None

    @property
    def new_tokens(self) -> int:
        return sum(len(o) for o in self.output_ids)


@dataclass
class Rounds:
    """A system's decoding over a measurement, summed over its prompts."""

    tokens: int = 0  # new tokens after each prompt's first
    seconds: float = 0.0  # time after each prompt's first token
    rounds: int = 0  # target verifications (plain decoding: one per token)
    drafted: int = 0
    accepted: int = 0
    requests: int = 0  # prompts decoded
    setup_s: float = 0.0  # of `seconds`: the proposer's setup (sdbench's systems; 0 where not timed apart)
    host_s: float = 0.0  # of `seconds`: the rounds' work outside drafting and verifying forwards (`metrics.host_s`)
    widths: dict = field(default_factory=dict)  # verification width -> rounds (sdbench's systems; {} for an engine's)

    def add(self, tokens: int, seconds: float, rounds: int, drafted: int = 0, accepted: int = 0,
            setup_s: float = 0.0, host_s: float = 0.0, widths: dict | None = None) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.rounds += rounds
        self.drafted += drafted
        self.accepted += accepted
        self.requests += 1
        self.setup_s += setup_s
        self.host_s += host_s
        for w, n in (widths or {}).items():
            self.widths[w] = self.widths.get(w, 0) + n

    def width_shares(self) -> dict[int, float]:
        """Verification width -> its share of the rounds' verifications; {} where the widths are not known."""
        total = sum(self.widths.values())
        return {w: n / total for w, n in sorted(self.widths.items())} if total else {}

    @property
    def tokens_per_round(self) -> float:
        """sdbench's mean accepted length (its tokens are already those after each first)."""
        return mean_accepted_length(self.tokens, self.rounds, rows=0)

    @property
    def drafts_per_round(self) -> float:
        return self.drafted / self.rounds if self.rounds else math.nan

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.nan


# How a drafter's round spends its draft forwards, in one-token draft forwards, g the round's drafts and w(k) the
# draft's own forward over k tokens over its one-token forward:
CHAIN = "chain"  # g forwards of one token (sdbench's draft model; a lookup drafts with no forward)
MIRROR = "mirror"  # the draft also runs the round's verification batch, then g forwards: w(g + 1) + g (llama.cpp)
WIDE_FIRST = "wide-first"  # the first of its g forwards runs over the verification batch: w(g + 1) + g - 1 (vLLM)
BLOCK = "block"  # one forward drafts the round's whole block, whatever g (DFlash, DSpark: c is that forward's cost)


@dataclass(frozen=True)
class AdaptiveRowStats(StatsRecord):
    """One row's strategy_stats under an adaptive strategy (gamma 0 = a plain step)."""

    OPTIONAL = ("selected", "exploring")  # select=prompt only

    gamma_mean: float | None = None  # over the row's rounds; None without a round
    gamma_hist: dict[int, int] = field(default_factory=dict)  # rounds at each gamma asked of the drafter
    drafts: dict[str, int] = field(default_factory=dict)  # rounds drafted per candidate
    switches: int = 0  # rounds whose candidate differs from the previous drafting round's
    alpha: dict[str, float] = field(default_factory=dict)  # per candidate that drafted: its fitted alpha
    selected: str | None = None  # select=prompt: the drafter the prompt used
    exploring: bool | None = None  # select=prompt: a candidate whose cost was not measured yet, not the model's pick

    def to_dict(self) -> dict:
        return {**super().to_dict(), "gamma_hist": {str(g): n for g, n in sorted(self.gamma_hist.items())}}

    @classmethod
    def from_dict(cls, data) -> "AdaptiveRowStats":
        stats = super().from_dict(data)  # JSON keys are strings: gamma_hist's are gammas
        return replace(stats, gamma_hist={int(g): int(n) for g, n in stats.gamma_hist.items()})
