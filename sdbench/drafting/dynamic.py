"""EAGLE-2's dynamic draft tree (Li et al., EMNLP 2024, arXiv 2406.16858): a tree whose shape the drafter's own
confidence chooses, per row and per round. No model here: a drafter supplies its log-probabilities at the nodes
it is asked to expand (`grow`'s `expand`; the draft model's is in drafting/model.py), so any drafter that
scores tokens after a tree path can reuse it.

A node's SCORE is the log of its cumulative draft probability: the sum of the drafter's log-probabilities of the
tokens on its path. Growing `depth` levels with `topk` = K:
  expansion  the root's K likeliest tokens are the depth-1 candidates; at each depth the K best-scored
             candidates (the FRONTIER) are expanded, each by its own K likeliest tokens: K^2 candidates one
             level deeper, of which the next frontier is again the K best. `depth` drafter calls in all.
  reranking  of all K + (depth - 1) K^2 candidates, the `nodes` best-scored are kept. A child never scores
             above its parent (a probability is at most 1), and ties go to the earlier candidate (a parent is
             always earlier than its child), so the kept nodes are ANCESTOR-CLOSED: a tree.
Children are the drafter's top-K tokens, distinct and deterministic: verified with p one-hot (sampling.py).
The log-probabilities are those of the run's sampling distribution, at temperature 1 under greedy decoding
(`log_probs`), for every drafter alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sdbench.engine.sampling import probs_from_logits
from sdbench.engine.tree import Tree
from sdbench.errors import SdbenchError


@dataclass(frozen=True)
class DynamicTree:
    """The settings of a dynamic tree: K children per expanded node, `depth` levels, at most `nodes` kept."""

    topk: int
    depth: int
    nodes: int

    def __post_init__(self):
        if min(self.topk, self.depth, self.nodes) < 1:
            raise SdbenchError(f"a dynamic tree needs topk, depth and nodes of at least 1 (got topk={self.topk}, "
                               f"depth={self.depth}, nodes={self.nodes})")

    @property
    def candidates(self) -> int:
        """How many nodes the expansion scores: K + (depth - 1) K^2."""
        return self.topk + (self.depth - 1) * self.topk ** 2

    def __len__(self) -> int:
        """The most nodes a round proposes."""
        return min(self.nodes, self.candidates)

    @property
    def widest(self) -> int:
        return self.topk

    @property
    def slots(self) -> int:
        """The most slots past the context a round writes: its nodes, or the expanded nodes fed to the drafter's
        last call (K per level above the last), whichever is more."""
        return max(len(self), self.topk * (self.depth - 1))

    def to_depth(self, depth: int) -> "DynamicTree":
        return DynamicTree(self.topk, min(self.depth, depth), self.nodes)


@dataclass
class Expanded:
    """The nodes expanded so far, as one tree per row that a drafter feeds to score the frontier: K per level,
    level by level, each level's K in frontier order (best first); the frontier is the last K."""

    tokens: torch.Tensor  # [B, M] long: each node's token
    parents: torch.Tensor  # [B, M] long: parent's index among these M, -1 for the root's children

    def trees(self) -> list[Tree]:
        return [Tree(tuple(r)) for r in self.parents.tolist()]


Expand = Callable[[Expanded], torch.Tensor]  # the expanded nodes -> [B, K, V] log-probs after each frontier node


def grow(spec: DynamicTree, root_logp: torch.Tensor, expand: Expand) -> tuple[list[Tree], torch.Tensor]:
    """The dynamic tree of each row (module docstring): root_logp [B, V] the drafter's log-probabilities after the
    last committed token; `expand` gives them after each frontier node. Returns each row's tree (nodes numbered
    level by level, siblings in the drafter's rank order) and its tokens [B, N], N = len(spec) in every row."""
    K = spec.topk
    logp, tokens = _top(root_logp, K)  # [B, K] each
    B = tokens.shape[0]
    score, parent = logp, torch.full_like(tokens, -1)  # the candidates: [B, P], P growing level by level
    frontier = torch.arange(K, device=tokens.device).expand(B, K)  # candidate indices, best first
    fed_tokens, fed_parents = tokens, torch.full_like(tokens, -1)  # `Expanded` nodes
    for d in range(1, spec.depth):
        child_logp, child_tokens = _top(expand(Expanded(fed_tokens, fed_parents)), K)  # [B, K, K] each
        start = score.shape[1]
        new_score = (score.gather(1, frontier)[..., None] + child_logp).flatten(1)  # [B, K * K]
        score = torch.cat([score, new_score], 1)
        tokens = torch.cat([tokens, child_tokens.flatten(1)], 1)
        parent = torch.cat([parent, frontier.repeat_interleave(K, 1)], 1)
        best = _best(new_score, K)  # [B, K] among the new candidates
        frontier = start + best
        up = (d - 1) * K + best // K  # each new frontier node's parent among the fed nodes
        fed_tokens = torch.cat([fed_tokens, tokens.gather(1, frontier)], 1)
        fed_parents = torch.cat([fed_parents, up], 1)
    return keep_best(parent, score, tokens, len(spec))


def keep_best(parents: torch.Tensor, score: torch.Tensor, tokens: torch.Tensor,
              nodes: int) -> tuple[list[Tree], torch.Tensor]:
    """Reranking: of the candidates parents [B, P] (parents first: parents[b, i] < i, -1 for the root's
    children), score [B, P] and tokens [B, P], the `nodes` best-scored per row, ancestor-closed whatever the
    scores (a node counts at most its parent's score), ties to the earlier candidate. Returns each row's tree of
    the kept nodes (in candidate order) and their tokens [B, n], n = min(nodes, P)."""
    B, P = score.shape
    n = min(nodes, P)
    capped = score.clone()
    for i in range(P):  # parents first: one pass caps every node at its path's lowest score
        up = parents[:, i]
        above = capped.gather(1, up.clamp(min=0)[:, None]).squeeze(1)
        capped[:, i] = torch.where(up >= 0, torch.minimum(capped[:, i], above), capped[:, i])
    kept = _best(capped, n).sort(1).values  # [B, n] candidate indices, parents first
    renumber = torch.full((B, P), -1, dtype=torch.long, device=score.device)
    renumber.scatter_(1, kept, torch.arange(n, device=score.device).expand(B, n))
    up = parents.gather(1, kept)
    new_parents = torch.where(up >= 0, renumber.gather(1, up.clamp(min=0)), -1)
    return [Tree(tuple(r)) for r in new_parents.tolist()], tokens.gather(1, kept)


def log_probs(logits: torch.Tensor, sampling) -> torch.Tensor:
    """A drafter's scores [..., V] from its logits: the log-probabilities of its sampling distribution, or at
    temperature 1 under greedy decoding."""
    if sampling.greedy:
        return logits.float().log_softmax(-1)
    return probs_from_logits(logits, sampling).log()


def _best(score: torch.Tensor, k: int) -> torch.Tensor:
    """[B, k] indices of the k best scores per row of score [B, C], best first, ties to the lower index."""
    return torch.sort(score, dim=1, descending=True, stable=True).indices[:, :k]


def _top(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k likeliest tokens of logp [..., V]: (their log-probabilities, at most 0, and tokens), each [..., k]."""
    top = logp.topk(k, -1)
    return top.values.clamp(max=0.0), top.indices
