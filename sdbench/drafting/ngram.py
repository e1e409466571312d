"""Prompt lookup: the tokens that followed the latest earlier occurrence of the context's suffix."""

from __future__ import annotations

import numpy as np
import torch

from sdbench.engine.state import DecodeState, Proposal
from sdbench.engine.tree import Tree
from sdbench.errors import SdbenchError

DRAFT_NAME = "ngram"  # `--draft ngram`: prompt lookup as a draft candidate, no model to load


def lookup(seq: np.ndarray, k: int, max_n: int, min_n: int = 1) -> np.ndarray:
    """Up to k tokens following the most recent earlier match of the longest suffix of seq (n-gram
    length from max_n down to min_n). seq: [L] int. Empty when nothing matches."""
    L = len(seq)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[: L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == seq[L - n :]).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return seq[start : start + k]
    return seq[:0]


def lookup_branches(seq: np.ndarray, k: int, max_n: int, min_n: int = 1, branches: int = 1) -> list[np.ndarray]:
    """Up to `branches` continuations of up to k tokens each, found as `lookup` finds one: matches of the
    longest suffix first, the most recent first within a length, then shorter suffixes. Each one adds a token
    sequence the earlier ones do not hold (neither equal to nor a prefix of one of them), so that as a trie
    (`trie`) each is a branch; the first is `lookup`'s."""
    L = len(seq)
    found: list[np.ndarray] = []
    seen: set[tuple[int, ...]] = set()  # every prefix of a continuation found so far
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[: L - 1], n)
        for hit in np.flatnonzero((windows == seq[L - n :]).all(axis=1))[::-1]:
            cont = seq[hit + n : hit + n + k]
            key = tuple(cont.tolist())
            if not key or key in seen:
                continue
            found.append(cont)
            seen.update(key[:j] for j in range(1, len(key) + 1))
            if len(found) == branches:
                return found
    return found


def trie(branches: list[np.ndarray]) -> tuple[Tree, list[int]]:
    """The token trie of token sequences below one root: common prefixes merged, so siblings are distinct
    tokens, ranked in the order the sequences come (the first sequence is the first path). -> (tree, a token
    per node)."""
    parents: list[int] = []
    tokens: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for seq in branches:
        at = -1
        for t in seq.tolist():
            if (at, t) not in child:
                child[(at, t)] = len(parents)
                parents.append(at)
                tokens.append(t)
            at = child[(at, t)]
    return Tree(tuple(parents)), tokens


def check_ngram(strategy: str, max_ngram: int, min_ngram: int, tree: int = 0) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise SdbenchError(f"{strategy} needs 1 <= min_ngram <= max_ngram (got --set min_ngram={min_ngram}, "
                           f"max_ngram={max_ngram})")
    if tree < 0:
        raise SdbenchError(f"{strategy} needs --set tree=K with K >= 1 branches, or 0 for a chain (got {tree})")


class NGramDrafter:
    """Prompt lookup as a drafter: deterministic (one-hot) drafts, trimmed to the longest match so that the
    verifier sees no padding. tree=K (K >= 1): a token tree per row instead, the trie of up to K continuations
    (`lookup_branches`), each at most as deep as the row's limit."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, tree: int = 0):
        check_ngram(DRAFT_NAME, max_ngram, min_ngram, tree)
        self.name = DRAFT_NAME
        self.max_ngram, self.min_ngram, self.tree = max_ngram, min_ngram, tree

    def begin(self, state: DecodeState) -> None:
        pass

    def begin_rows(self, state: DecodeState, rows: list[int]) -> None:
        pass  # no table: each lookup reads the row's own context, which `state` holds afresh

    def catch_up(self, ctx: torch.Tensor, lengths: list[int]) -> int:
        return 0

    def draft(self, ctx: torch.Tensor, lengths: list[int], limits: list[int]) -> Proposal:
        if self.tree:
            return self._draft_trees(ctx, lengths, limits)
        tokens = torch.zeros(len(lengths), max(limits, default=0), dtype=torch.long)
        found_lengths = torch.zeros(len(lengths), dtype=torch.long)
        for b, (n, k) in enumerate(zip(lengths, limits)):
            if k > 0:
                found = lookup(ctx[b, :n].numpy(), k, self.max_ngram, self.min_ngram)
                tokens[b, : len(found)] = torch.from_numpy(found)
                found_lengths[b] = len(found)
        return Proposal(tokens, found_lengths).fit(limits)

    def _draft_trees(self, ctx: torch.Tensor, lengths: list[int], limits: list[int]) -> Proposal:
        made = [trie(lookup_branches(ctx[b, :n].numpy(), k, self.max_ngram, self.min_ngram, self.tree))
                if k > 0 else (Tree(()), []) for b, (n, k) in enumerate(zip(lengths, limits))]
        return Proposal.of_trees(made)

    def end(self) -> None:
        pass
