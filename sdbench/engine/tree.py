"""Token trees: a proposal that branches, as parent indices (no model, no cache here).

A tree of N drafted nodes hangs below the ROOT, the last committed token. Node i has parent parents[i] < i
(-1: a child of the root), so any order that lists parents first is a valid order, and the chain of γ drafts
is parents = [-1, 0, 1, ..., γ-2]. Siblings are ranked by index: the sibling proposed first (the drafter's
best guess) has the smallest index and is tried first by verification (sampling.verify_tree).

Rows: everything per node that verification reads is laid out over N + 1 ROWS, row 0 for the root and row
i + 1 for node i (the target's distributions q [N+1, V]: row 0 after the last committed token, row i + 1
after node i; `children` [N+1] lists each row's children). Row = node + 1 throughout.

Positions: with prefix_len tokens before the tree (the root included, i.e. the committed length L), node i
sits at position prefix_len - 1 + depth[i] (root children at L, as the chain's draft j at L + j). The decode
loop's verifying forward also feeds the root, at start = L - 1: `with_root()` is that forward's tree (N + 1
nodes, the root first), placed with prefix_len = L - 1; for the chain it is the chain one longer.
"""

from __future__ import annotations

import ast
import heapq
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from sdbench.errors import SdbenchError

Path = tuple[int, ...]  # sibling ranks from the root down to a node: (0,) is the root's first child


@dataclass(frozen=True)
class Tree:
    """N drafted nodes below the root; see the module docstring for the row and position conventions."""

    parents: tuple[int, ...]  # [N] parent of node i, < i; -1 for a child of the root

    def __post_init__(self):
        parents = tuple(int(a) for a in self.parents)
        object.__setattr__(self, "parents", parents)
        for i, a in enumerate(parents):
            if not -1 <= a < i:
                raise SdbenchError(f"tree node {i} has parent {a}: a parent must be -1 (the root) or an "
                                   f"earlier node")

    # constructors

    @classmethod
    def chain(cls, gamma: int) -> "Tree":
        """γ drafts in a line: the chain the rest of sdbench verifies, as a tree."""
        if gamma < 0:
            raise SdbenchError(f"a chain has at least 0 drafted tokens (got {gamma})")
        return cls(tuple(range(-1, gamma - 1)))

    @classmethod
    def from_vllm(cls, spec: str | Sequence[Sequence[int]]) -> "Tree":
        """vLLM's static tree notation: a list of rank paths, e.g. "[(0,), (1,), (0, 0), (0, 1)]" (the root's
        first and second child, then two children of the first). Nodes are numbered breadth-first (by depth,
        then by rank path), the order vLLM sorts them into, whatever the order written."""
        text = spec if isinstance(spec, str) else repr(spec)
        if isinstance(spec, str):
            try:
                spec = ast.literal_eval(spec)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                raise SdbenchError(f"tree {text!r}: not a list of tuples of sibling ranks, such as "
                                   f"[(0,), (1,), (0, 0)]") from None
        if not isinstance(spec, (list, tuple)) or not all(
                isinstance(t, (list, tuple)) and t and all(isinstance(r, int) and not isinstance(r, bool)
                                                           for r in t) for t in spec):
            raise SdbenchError(f"tree {text!r}: not a list of non-empty tuples of sibling ranks, such as "
                               f"[(0,), (1,), (0, 0)]")
        if not spec:
            raise SdbenchError(f"tree {text!r} has no nodes")
        return cls.from_paths([tuple(t) for t in spec], text)

    @classmethod
    def from_paths(cls, paths: Sequence[Path], name: str | None = None) -> "Tree":
        """The tree of the given rank paths, numbered breadth-first. Each path's parent (the path less its
        last rank) and its elder siblings (lower last rank) must be present, each path once."""
        name = name if name is not None else repr(list(paths))
        ordered = sorted(paths, key=lambda t: (len(t), t))
        index: dict[Path, int] = {}
        for t in ordered:
            if t in index:
                raise SdbenchError(f"tree {name}: the node {t} is listed twice")
            if not t or min(t) < 0:
                raise SdbenchError(f"tree {name}: the node {t} is empty or has a negative rank")
            if len(t) > 1 and t[:-1] not in index:
                raise SdbenchError(f"tree {name}: the node {t} has no parent {t[:-1]} in the list")
            if t[-1] > 0 and t[:-1] + (t[-1] - 1,) not in index:
                raise SdbenchError(f"tree {name}: the node {t} has rank {t[-1]} without a sibling of rank "
                                   f"{t[-1] - 1}")
            index[t] = len(index)
        return cls(tuple(index[t[:-1]] if len(t) > 1 else -1 for t in ordered))

    @classmethod
    def topk_depth(cls, k: int, depth: int, budget: int) -> "Tree":
        """k children per node on each of `depth` levels, the best-ranked `budget` nodes kept.

        Without the drafter's scores, a node's rank is the sum of the sibling ranks on its path (a rank-r
        child counts as r steps of doubt; ties go to the shallower node, then the smaller rank path). A parent
        and an elder sibling always rank before a node, so the kept nodes form a tree whatever the budget;
        they are then numbered breadth-first. The full tree has k + k^2 + ... + k^depth nodes."""
        if k < 1 or depth < 1 or budget < 1:
            raise SdbenchError(f"a top-k tree needs k, depth and budget of at least 1 (got k={k}, "
                               f"depth={depth}, budget={budget})")
        # best-first: a node's successors (its first child, its next sibling) never rank before it
        heap, kept = [(0, 1, (0,))], []
        while heap and len(kept) < budget:
            score, d, t = heapq.heappop(heap)
            kept.append(t)
            if d < depth:
                heapq.heappush(heap, (score, d + 1, t + (0,)))
            if t[-1] + 1 < k:
                heapq.heappush(heap, (score + 1, d, t[:-1] + (t[-1] + 1,)))
        return cls.from_paths(kept)

    # structure

    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def depth(self) -> tuple[int, ...]:
        """[N] a node's distance from the root (1 for the root's children)."""
        d: list[int] = []
        for a in self.parents:
            d.append(1 if a < 0 else d[a] + 1)
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depth, default=0)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """[N+1] per row (0: the root, i + 1: node i) its children's node indices, by rank."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, a in enumerate(self.parents):
            kids[a + 1].append(i)
        return tuple(tuple(k) for k in kids)

    def children_of(self, node: int) -> tuple[int, ...]:
        """The children of node (-1: the root), by rank."""
        return self.children[node + 1]

    @cached_property
    def rank(self) -> tuple[int, ...]:
        """[N] a node's place among its siblings (0: proposed first)."""
        r = [0] * len(self)
        for kids in self.children:
            for j, c in enumerate(kids):
                r[c] = j
        return tuple(r)

    def path_to(self, node: int) -> tuple[int, ...]:
        """The nodes from the root's child down to node, both included."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return tuple(reversed(path))

    def rank_path(self, node: int) -> Path:
        """node's path in vLLM's notation (sibling ranks from the root)."""
        return tuple(self.rank[i] for i in self.path_to(node))

    def to_vllm(self) -> str:
        """This tree in vLLM's notation (`from_vllm` reads it back), nodes in this tree's order."""
        return repr([self.rank_path(i) for i in range(len(self))])

    @property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i in range(len(self)) if not self.children[i + 1])

    def paths(self) -> list[tuple[int, ...]]:
        """Every root-to-leaf path (node indices), leaves in index order."""
        return [self.path_to(leaf) for leaf in self.leaves]

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """[N, N] bool: node i sees node j iff j is i or one of its ancestors."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            mask[i, list(self.path_to(i))] = True
        return mask

    def positions(self, prefix_len: int) -> torch.Tensor:
        """[N] long: each node's position after prefix_len tokens (root included): prefix_len - 1 + depth."""
        return prefix_len - 1 + torch.tensor(self.depth, dtype=torch.long)

    def attention_mask(self, prefix_len: int) -> torch.Tensor:
        """[N, prefix_len + N] bool for a forward over the tree's nodes after prefix_len cached tokens: each
        node sees the whole prefix, its ancestors and itself (for the chain: the causal mask)."""
        return torch.cat([torch.ones(len(self), prefix_len, dtype=torch.bool), self.ancestors], 1)

    def to_depth(self, max_depth: int) -> tuple["Tree", tuple[int, ...]]:
        """The nodes of depth <= max_depth, renumbered in their order (a parent still comes first, and every
        kept node's ancestors are kept), and the kept nodes' indices in this tree."""
        if self.max_depth <= max_depth:
            return self, tuple(range(len(self)))
        kept = tuple(i for i, d in enumerate(self.depth) if d <= max_depth)
        new = {old: j for j, old in enumerate(kept)}
        return Tree(tuple(new[self.parents[i]] if self.parents[i] >= 0 else -1 for i in kept)), kept

    def with_root(self) -> "Tree":
        """The tree of the verifying forward that also feeds the root: N + 1 nodes, node 0 the root, node
        i + 1 this tree's node i (so node j of it is row j of the target's q)."""
        return Tree((-1,) + tuple(a + 1 for a in self.parents))

    def within(self, max_depth: int | None = None, max_nodes: int | None = None) -> "Tree":
        """This tree, refused if deeper than max_depth or with more nodes than max_nodes."""
        if max_depth is not None and self.max_depth > max_depth:
            raise SdbenchError(f"the tree is {self.max_depth} levels deep; at most {max_depth} are allowed")
        if max_nodes is not None and len(self) > max_nodes:
            raise SdbenchError(f"the tree has {len(self)} nodes; at most {max_nodes} are allowed")
        return self


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """One tree per row, padded to the largest N. Padding nodes are nobody's children (verification never
    reaches them) and see themselves only, so a mask built from `ancestors` has no empty row."""

    trees: tuple[Tree, ...]
    n_nodes: torch.Tensor  # [B] long: real nodes per row
    valid: torch.Tensor  # [B, N] bool: node i of row b is real
    parents: torch.Tensor  # [B, N] long, -1 for the root's children and for padding
    depth: torch.Tensor  # [B, N] long, 0 for padding
    children: torch.Tensor  # [B, N+1, K] long: per row (0: root, i + 1: node i) its children by rank, -1 past
    ancestors: torch.Tensor  # [B, N, N] bool

    @classmethod
    def of(cls, trees: Sequence[Tree], device: torch.device | str = "cpu") -> "TreeBatch":
        trees = tuple(trees)
        distinct = list(dict.fromkeys(trees))  # rows often share one shape: build each shape once
        ids = {t: u for u, t in enumerate(distinct)}
        which = torch.tensor([ids[t] for t in trees], dtype=torch.long)
        N = max((len(t) for t in distinct), default=0)
        K = max((len(k) for t in distinct for k in t.children), default=0)
        U = len(distinct)
        n_nodes = torch.tensor([len(t) for t in distinct], dtype=torch.long)
        parents = torch.full((U, N), -1, dtype=torch.long)
        depth = torch.zeros(U, N, dtype=torch.long)
        children = torch.full((U, N + 1, K), -1, dtype=torch.long)
        ancestors = torch.eye(N, dtype=torch.bool).repeat(U, 1, 1)
        for u, t in enumerate(distinct):
            n = len(t)
            parents[u, :n] = torch.tensor(t.parents, dtype=torch.long)
            depth[u, :n] = torch.tensor(t.depth, dtype=torch.long)
            for row, kids in enumerate(t.children):
                children[u, row, : len(kids)] = torch.tensor(kids, dtype=torch.long)
            ancestors[u, :n, :n] = t.ancestors
        valid = torch.arange(N)[None] < n_nodes[:, None]
        return cls(trees, *(x[which].to(device) for x in (n_nodes, valid, parents, depth, children, ancestors)))

    @cached_property
    def max_depth(self) -> int:
        return max((t.max_depth for t in set(self.trees)), default=0)

    def check_tokens(self, tokens: torch.Tensor) -> None:
        """Refuse tokens [B, N] that are not one per node of this batch (a runner's tree forward)."""
        if tuple(tokens.shape) != tuple(self.valid.shape):
            raise SdbenchError(f"a tree forward takes one token per node: tokens {tuple(tokens.shape)}, "
                               f"trees {tuple(self.valid.shape)}")

    def positions(self, prefix_lens: torch.Tensor) -> torch.Tensor:
        """[B, N] long: node positions after prefix_lens [B] tokens (root included); padding at its row's
        prefix_len (a position the row's next forward writes anyway)."""
        prefix_lens = prefix_lens.to(self.depth.device)[:, None]
        return torch.where(self.valid, prefix_lens - 1 + self.depth, prefix_lens)


def child_picks(tree: Tree, nodes: tuple[int, ...]) -> tuple[list[int], list[int], list[int]]:
    """The children of `nodes` (-1: the root) as (child index, position of its parent in `nodes`, its rank)."""
    picks = [(c, m, r) for m, a in enumerate(nodes) for r, c in enumerate(tree.children_of(a))]
    return tuple(list(x) for x in zip(*picks)) if picks else ([], [], [])


def top_children(tokens: torch.Tensor, tree: Tree, logits: torch.Tensor, nodes: tuple[int, ...]) -> None:
    """Fill in the children of `nodes` (-1: the root) in tokens [B, N]: the child of rank r gets the (r + 1)-th
    likeliest token of logits [B, M, V] at its parent (M = len(nodes)). A drafter's deterministic children."""
    child, m, r = child_picks(tree, nodes)
    if not child:
        return
    top = logits.topk(max(r) + 1, -1).indices  # [B, M, k]
    tokens[:, child] = top[:, m, r].to(tokens.device)


# ---- a tree's settings, as strategies name them ----------------------------------------------------------------

def is_tree_setting(name: str) -> bool:
    """A strategy setting that shapes a token tree: by convention `tree` or `tree_*` (ngram's tree=K, a ranking
    drafter's tree_topk, tree_nodes, tree_shape). What refusals, trial tables and schedule exports read."""
    return name == "tree" or name.startswith("tree_")


def tree_text(options: dict) -> str:
    """The tree settings among a strategy's options, e.g. 'tree_topk=3 tree_nodes=8' or 'tree=2'; '' for a chain."""
    return " ".join(f"{k}={v}" for k, v in options.items() if is_tree_setting(k) and v)
