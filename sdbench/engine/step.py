"""The one verify-and-commit step: a verifier's logits over proposed drafts -> the tokens each row commits.

Used by the decode loop (the target verifying a strategy's proposal), by every verifying level of a polybasic
chain (a model verifying the level below it), and by DSI's ledger (a worker's logits judged at the committed
frontier). The acceptance maths is `sampling.verify`; the commit rule (token budget, EOS) is `state.admit`,
applied by whatever holds the rows (`Rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sdbench.config import SamplingConfig
from sdbench.engine.metrics import Marks
from sdbench.engine.sampling import verify
from sdbench.engine.state import Proposal


class Rows(Protocol):
    """Committed sequences that a round commits into (DecodeState, DSI's Ledger). A `done` list of finished
    rows is read only by a round not told which rows take part."""

    def commit(self, b: int, new: list[int]) -> int:
        """Append by the commit rule; returns how many of `new` were kept."""


@dataclass
class Round:
    """One verification of a batch, per row: drafts verified, drafts the verifier accepted, drafts committed
    (an EOS or the budget may cut accepted ones) and tokens committed (accepted drafts plus the verifier's own
    token, after the cut). Rows not taking part have zeros. The loop adds the round's measured times."""

    drafted: list[int]
    accepted: list[int]
    committed: list[int]
    kept: list[int]
    active: list[bool]
    draft_s: float = 0.0
    verify_s: float = 0.0
    verified_at: Any = None  # the loop's mark once the verification was queued (see verify_and_commit)

    def rejected(self, b: int) -> bool:
        """Whether the verifier rejected one of row b's drafts (a cut by EOS or the budget is not a rejection)."""
        return self.accepted[b] < self.drafted[b]


def accept(proposal: Proposal, logits: torch.Tensor, sampling: SamplingConfig,
           generator: torch.Generator | None, queued=None) -> tuple[list[int], list[int]]:
    """The verifier's verdict on the host: accepted drafts and the correction or bonus token, per row.

    logits [B, G+1, V]: the verifier's at the last committed token and at each draft. Reading the verdict back
    is the round's one wait for the device; `queued()`, when given, is called once the verification is queued,
    before that wait (the loop marks the end of its verify phase there)."""
    dev = logits.device
    verdict = verify(proposal.tokens.to(dev), proposal.lengths.to(dev), proposal.probs, logits, sampling, generator)
    if queued is not None:
        queued()
    return verdict.accepted.tolist(), verdict.next_token.tolist()


def commit_round(rows: Rows, drafts: list[list[int]], drafted: list[int], accepted: list[int], nxt: list[int],
                 active: list[bool] | None = None) -> Round:
    """Commit, per taking-part row, its accepted drafts plus the verifier's token. active: rows taking part
    (default: those not done)."""
    active = [not d for d in rows.done] if active is None else list(active)
    n = len(drafted)
    committed, kept = [0] * n, [0] * n
    for b in range(n):
        if active[b]:
            kept[b] = rows.commit(b, drafts[b][: accepted[b]] + [nxt[b]])
            committed[b] = min(accepted[b], kept[b])
    return Round([d if a else 0 for d, a in zip(drafted, active)],
                 [x if a else 0 for x, a in zip(accepted, active)], committed, kept, active)


def verify_and_commit(rows: Rows, proposal: Proposal, logits: torch.Tensor, sampling: SamplingConfig,
                      generator: torch.Generator | None, active: list[bool] | None = None,
                      clock: Marks | None = None) -> Round:
    """`accept`, then `commit_round`: the step every verifier runs. clock: marks the round's `verified_at` once
    the verification is queued, before the wait."""
    at = []
    accepted, nxt = accept(proposal, logits, sampling, generator,
                           None if clock is None else lambda: at.append(clock.mark()))
    rnd = commit_round(rows, proposal.tokens.tolist(), proposal.lengths.tolist(), accepted, nxt, active)
    rnd.verified_at = at[0] if at else None
    return rnd
