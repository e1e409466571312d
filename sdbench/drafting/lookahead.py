"""Lookahead decoding's two structures, per row (strategies/lookahead.py runs them): the Jacobi window and the
n-gram pool. Host-side token ids only: no model here.

The window holds up to N - 1 LEVELS of W tokens, level 0 the oldest. Level l's tokens are guesses for columns
l .. l + W - 1, column c being the position c after the last committed token (the root). It is fed to the
target's verifying forward as a token tree (`Window.tree`): level 0 is a chain below the root, and the level-l
token at column c hangs from the level-(l - 1) token at column c - 1. A node thus sees the prefix, level 0 up to
where its diagonal starts, then its diagonal: the sequence it was guessed from (the paper's attention mask), and
sits at depth c + 1, so at the position of its column.

The target's argmax after each newest-level node is a guess for the next column: the W of them are the next
level (`Window.advance`). Once the window holds N - 1 levels, each diagonal - level 0 at column i, level 1 at
i + 1, ..., the newest level, then the new guess - is an N-gram, which the pool keeps under its first token; then
the oldest level goes and every level moves down one (its tokens now guessing one column earlier: the window
moves on by one whatever a step committed, as the reference implementation rolls its levels).

The pool (`Pool`) keeps, per key token, its G most recent distinct (N - 1)-token continuations, newest first. Each
step verifies those of the last committed token as a trie (`candidates`): shared prefixes merged, siblings in
the order their newest n-gram was added.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache

from sdbench.engine.tree import Tree


@lru_cache(maxsize=64)  # a handful of shapes per run, asked for every row and step
def window_tree(levels: int, width: int) -> Tree:
    """The tree of a window of `levels` levels of `width` tokens, node l * width + i the level-l token at column
    l + i: level 0 a chain below the root, level l's i-th token the child of level l - 1's i-th (column one to
    the left)."""
    chain = tuple(range(-1, width - 1))
    return Tree(chain + tuple((l - 1) * width + i for l in range(1, levels) for i in range(width)))


class Window:
    """One row's Jacobi window (module docstring): `levels` [k][W], level 0 the oldest, k <= N - 1."""

    def __init__(self, first: list[int], ngram: int):
        self.width, self.ngram = len(first), ngram
        self.levels: list[list[int]] = [list(first)]

    @classmethod
    def from_context(cls, context: list[int], width: int, ngram: int) -> "Window":
        """Level 0 from the context's last `width` tokens (repeated from its start when shorter), the reference
        implementation's start from the prompt's own tokens."""
        tail = context[-width:]
        return cls([tail[i % len(tail)] for i in range(width)], ngram)

    @property
    def full(self) -> bool:
        return len(self.levels) == self.ngram - 1

    @property
    def tree(self) -> Tree:
        return window_tree(len(self.levels), self.width)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(t for level in self.levels for t in level)

    def advance(self, guesses: list[int]) -> list[tuple[int, ...]]:
        """Take the target's argmax after each node of the window (in `tree` order); return the N-grams of a full
        window's diagonals (none while it fills), then add the newest level (dropping the oldest when full)."""
        new = list(guesses[-self.width:])  # after the newest level's nodes
        if len(new) != self.width or len(guesses) != len(self.levels) * self.width:
            raise ValueError(f"a window of {len(self.levels)}x{self.width} nodes got {len(guesses)} guesses")
        grams = []
        if self.full:
            grams = [tuple(level[i] for level in self.levels) + (new[i],) for i in range(self.width)]
            self.levels.pop(0)
        self.levels.append(new)
        return grams


class Pool:
    """Per key token, at most `size` distinct continuations, the newest first (a continuation added again moves
    to the front)."""

    def __init__(self, size: int):
        self.size = size
        self.by_key: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, gram: tuple[int, ...]) -> None:
        """An n-gram: its first token the key, the rest the continuation."""
        held = self.by_key.setdefault(gram[0], OrderedDict())
        held[gram[1:]] = None
        held.move_to_end(gram[1:], last=False)
        while len(held) > self.size:
            held.popitem(last=True)

    def seed(self, context: list[int], ngram: int) -> None:
        """The context's own n-grams, in order, so the latest is the newest."""
        for j in range(len(context) - ngram + 1):
            self.add(tuple(context[j : j + ngram]))

    def get(self, key: int) -> list[tuple[int, ...]]:
        return list(self.by_key.get(key, ()))


def candidates(conts: list[tuple[int, ...]], depth: int) -> tuple[Tree, list[int]]:
    """The trie of the continuations cut to `depth` tokens, shared prefixes merged, nodes numbered in the order
    first met (parents first; siblings in their continuations' order). -> (tree, a token per node)."""
    parents: list[int] = []
    tokens: list[int] = []
    child: dict[tuple[int, int], int] = {}
    for cont in conts:
        at = -1
        for t in cont[:depth]:
            node = child.get((at, t))
            if node is None:
                node = child[(at, t)] = len(parents)
                parents.append(at)
                tokens.append(t)
            at = node
    return Tree(tuple(parents)), tokens
