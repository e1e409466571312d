"""The one verify-and-commit step: a verifier's logits over proposed drafts -> the tokens each row commits.

Used by the decode loop (the target verifying a strategy's proposal), by every verifying level of a polybasic
chain (a model verifying the level below it), and by DSI's ledger (a worker's logits judged at the committed
frontier). The acceptance maths is `sampling.verify` (a tree proposal: `sampling.verify_tree`, whose accepted
path is then committed as a chain's accepted drafts are); the commit rule (token budget, EOS) is `state.admit`,
applied by whatever holds the rows (`Rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from sdbench.config import SamplingConfig
from sdbench.engine.sampling import verify, verify_tree
from sdbench.engine.state import Proposal
from sdbench.engine.tree import Tree, TreeBatch


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
    accept_s: float = 0.0  # the verdict, its sampling and the commit, after the forward (the loop's)
    forward_at: Any = None  # the loop's mark once the target's forward was queued
    trees: tuple[Tree, ...] | None = None  # a tree proposal's trees, as verified
    paths: list[list[int]] | None = None  # per row the accepted nodes of its tree, from the root's child down
    width: int | None = None  # tokens per row of the verifying forward (the loop's; None: drafts + 1 per row)
    side_argmax: list[list[int]] | None = None  # per row the target's argmax at each of its side nodes
    # (Proposal.side), whatever the sampling; None: the proposal fed none

    def rejected(self, b: int) -> bool:
        """Whether the verifier rejected one of row b's drafts (a cut by EOS or the budget is not a rejection);
        in a tree, whether the accepted path ends at a node with children (all of them rejected)."""
        if self.trees is None:
            return self.accepted[b] < self.drafted[b]
        path = self.paths[b]
        return self.active[b] and bool(self.trees[b].children_of(path[-1] if path else -1))

    def counts(self, b: int) -> dict:
        """Row b's keyword arguments for `RowStats.add_step` beyond the counts: whether the verifier rejected a
        draft, how many it accepted, the forward's width and, for a tree, the tree and its accepted path."""
        out = {"rejected": self.rejected(b), "verified": self.accepted[b], "width": self.width}
        if self.trees is not None:
            out.update(tree=self.trees[b], path=self.paths[b])
        return out


def accept(proposal: Proposal, logits: torch.Tensor, sampling: SamplingConfig,
           generator: torch.Generator | None) -> tuple[list[int], list[int]]:
    """The verifier's verdict on the host: accepted drafts and the correction or bonus token, per row.

    logits [B, G+1, V]: the verifier's at the last committed token and at each draft. Reading the verdict back
    is the round's one wait for the device."""
    dev = logits.device
    verdict = verify(proposal.tokens.to(dev), proposal.lengths.to(dev), proposal.probs, logits, sampling, generator)
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
                      generator: torch.Generator | None, active: list[bool] | None = None) -> Round:
    """`accept`, then `commit_round`: the step every verifier runs."""
    if proposal.trees is None:
        accepted, nxt = accept(proposal, logits, sampling, generator)
        rnd = commit_round(rows, proposal.tokens.tolist(), proposal.lengths.tolist(), accepted, nxt, active)
    else:
        paths, accepted, nxt, drafts = accept_tree(proposal, logits, sampling, generator)
        rnd = commit_round(rows, drafts, proposal.lengths.tolist(), accepted, nxt, active)
        rnd.trees, rnd.paths = proposal.trees, paths
    return rnd


def accept_tree(proposal: Proposal, logits: torch.Tensor, sampling: SamplingConfig,
                generator: torch.Generator | None):
    """`accept` for a tree proposal. logits [B, N+1, V]: the verifier's at the root (the last committed token)
    and after each node. -> per row (accepted path's nodes, accepted count, next token, the path's tokens)."""
    dev = logits.device
    tokens = proposal.tokens.to(dev)
    verdict = verify_tree(TreeBatch.of(proposal.trees, dev), tokens, proposal.probs, logits, sampling, generator)
    accepted = verdict.accepted.tolist()
    path = verdict.path.tolist()
    paths = [p[:a] for p, a in zip(path, accepted)]
    drafts = tokens.gather(1, verdict.path.clamp(min=0)).tolist()
    return paths, accepted, verdict.next_token.tolist(), [d[:a] for d, a in zip(drafts, accepted)]
