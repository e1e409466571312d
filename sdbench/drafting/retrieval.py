"""Retrieval drafting (REST): continuations of the context's longest suffix found in a datastore, as a token tree.

The datastore (drafting/datastore.py) is a corpus in the target's token ids, its documents joined by SEP, with a
suffix array over it: every occurrence of a token string is then one contiguous range of the array, found by
binary search. Drafting takes the longest suffix of a row's context (max_suffix tokens down to min_suffix) that
occurs at all, the continuations of up to `max_matches` of its occurrences, and merges them into a trie counting
how many continuations pass through each node; the `nodes` most frequent nodes are the tree verified.
"""

from __future__ import annotations

import numpy as np
import torch

from sdbench.engine.state import DecodeState, Proposal
from sdbench.engine.tree import Tree
from sdbench.errors import SdbenchError

SEP = -1  # between documents: no suffix matches across it, no continuation runs past it
DRAFT_NAME = "rest"


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """The start positions of tokens' suffixes in lexicographic order (a suffix that is a prefix of another sorts
    first), by prefix doubling: each pass sorts by the (rank of the first k tokens, rank of the next k) pairs, so
    O(n log^2 n) with numpy's sort. tokens: [n] int. -> [n] int64."""
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64).reshape(-1)
    k = 1
    while True:
        second = np.full(n, -1, dtype=np.int64)  # past the end: before every token
        if k < n:
            second[: n - k] = rank[k:]
        order = np.lexsort((second, rank))
        r, s = rank[order], second[order]
        new = np.empty(n, dtype=np.int64)
        new[order] = np.concatenate(([0], ((r[1:] != r[:-1]) | (s[1:] != s[:-1])).cumsum()))
        rank = new
        if rank.max() == n - 1 or k >= n:  # every suffix told apart
            return order.astype(np.int64)
        k *= 2


def occurrences(tokens: np.ndarray, suffixes: np.ndarray, pattern: np.ndarray) -> tuple[int, int]:
    """The range [lo, hi) of the suffix array whose suffixes start with `pattern` (lo == hi: none), by binary
    search. tokens: [n]; suffixes: [n], suffix_array(tokens); pattern: [m]."""
    want = tuple(pattern.tolist())
    lo = _bound(tokens, suffixes, want, 0, after=False)
    return lo, _bound(tokens, suffixes, want, lo, after=True)


def _bound(tokens: np.ndarray, suffixes: np.ndarray, want: tuple[int, ...], lo: int, after: bool) -> int:
    """The first index from lo whose suffix's first len(want) tokens are >= want (after: > want)."""
    m, hi = len(want), len(suffixes)
    while lo < hi:
        mid = (lo + hi) // 2
        s = int(suffixes[mid])
        head = tuple(tokens[s: s + m].tolist())
        if head < want or (after and head == want):
            lo = mid + 1
        else:
            hi = mid
    return lo


def continuations(tokens: np.ndarray, suffixes: np.ndarray, context: np.ndarray, depth: int, max_matches: int,
                  max_suffix: int, min_suffix: int) -> np.ndarray:
    """The depth tokens after each of (up to max_matches of) the occurrences of the longest suffix of `context`
    (max_suffix tokens down to min_suffix) that occurs in the datastore, in suffix-array order, SEP from the end
    of its document on; occurrences at a document's very end are left out. -> [k, depth] (k = 0: no suffix of
    those lengths occurs). tokens must end with SEP (as `datastore.index` makes them)."""
    for m in range(min(max_suffix, len(context)), min_suffix - 1, -1):
        lo, hi = occurrences(tokens, suffixes, context[len(context) - m:])
        if hi > lo:
            starts = suffixes[lo: min(hi, lo + max_matches)] + m  # [k]
            conts = tokens[np.minimum(starts[:, None] + np.arange(depth), len(tokens) - 1)]  # [k, depth]
            conts[np.cumsum(conts == SEP, axis=1) > 0] = SEP
            return conts[conts[:, 0] != SEP] if depth else conts
    return np.zeros((0, depth), dtype=tokens.dtype)


def counted_trie(conts: np.ndarray, nodes: int) -> tuple[Tree, list[int], list[int]]:
    """The trie of the continuations (conts: [k, depth], each ending at its first SEP), each node counting the
    continuations through it, cut to its `nodes` most frequent nodes (ties: the shallower, then the one seen
    first). A node never counts more than its parent, so the kept nodes hang together; they are numbered in that
    order (parents first, siblings most frequent first). -> (tree, a token per node, a count per node)."""
    parent: list[int] = []
    token: list[int] = []
    depth: list[int] = []
    count: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent, token) -> node, in the order first seen
    if len(conts):  # equal continuations inserted once, with their number (frequent suffixes repeat a lot)
        rows, first, weight = np.unique(conts, axis=0, return_index=True, return_counts=True)
        order = np.argsort(first, kind="stable")
        for row, w in zip(rows[order].tolist(), weight[order].tolist()):
            at = -1
            for t in row:
                if t == SEP:
                    break
                node = child.get((at, t))
                if node is None:
                    node = child[(at, t)] = len(parent)
                    parent.append(at)
                    token.append(t)
                    depth.append(depth[at] + 1 if at >= 0 else 1)
                    count.append(0)
                count[node] += w
                at = node
    kept = sorted(range(len(parent)), key=lambda i: (-count[i], depth[i], i))[:nodes]
    index = {old: new for new, old in enumerate(kept)}
    return (Tree(tuple(index[parent[i]] if parent[i] >= 0 else -1 for i in kept)), [token[i] for i in kept],
            [count[i] for i in kept])


def check_retrieval(strategy: str, tree_nodes: int, max_matches: int, max_suffix: int, min_suffix: int) -> None:
    if tree_nodes < 1:
        raise SdbenchError(f"{strategy} needs --set tree_nodes=N with N >= 1 (got {tree_nodes})")
    if max_matches < 1:
        raise SdbenchError(f"{strategy} needs --set max_matches=N with N >= 1 (got {max_matches})")
    if not 1 <= min_suffix <= max_suffix:
        raise SdbenchError(f"{strategy} needs 1 <= min_suffix <= max_suffix (got --set min_suffix={min_suffix}, "
                           f"max_suffix={max_suffix})")


class RetrievalDrafter:
    """REST as a drafter: per row, the counted trie of the datastore's continuations of the context's longest
    matching suffix, at most tree_nodes nodes and as deep as the row's limit. Deterministic: no draft
    probabilities, so verification treats every node as one-hot (engine/sampling.py verify_tree)."""

    def __init__(self, tokens: np.ndarray, suffixes: np.ndarray, tree_nodes: int = 16, max_matches: int = 5000,
                 max_suffix: int = 16, min_suffix: int = 2):
        check_retrieval(DRAFT_NAME, tree_nodes, max_matches, max_suffix, min_suffix)
        self.name = DRAFT_NAME
        self.tokens, self.suffixes = tokens, suffixes  # [n], [n]
        self.tree_nodes, self.max_matches = tree_nodes, max_matches
        self.max_suffix, self.min_suffix = max_suffix, min_suffix

    def begin(self, state: DecodeState) -> None:
        pass

    def begin_rows(self, state: DecodeState, rows: list[int]) -> None:
        pass  # nothing kept per row: each lookup reads the row's context afresh

    def catch_up(self, ctx: torch.Tensor, lengths: list[int]) -> int:
        return 0

    def tree_for(self, context: np.ndarray, depth: int) -> tuple[Tree, list[int]]:
        conts = continuations(self.tokens, self.suffixes, context, depth, self.max_matches, self.max_suffix,
                              self.min_suffix)
        tree, tokens, _ = counted_trie(conts, self.tree_nodes)
        return tree, tokens

    def draft(self, ctx: torch.Tensor, lengths: list[int], limits: list[int]) -> Proposal:
        made = [self.tree_for(ctx[b, :n].numpy(), k) if k > 0 else (Tree(()), [])
                for b, (n, k) in enumerate(zip(lengths, limits))]
        return Proposal.of_trees(made)

    def end(self) -> None:
        pass
