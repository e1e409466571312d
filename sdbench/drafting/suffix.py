"""Suffix decoding's index and its speculation tree (strategies/suffix.py runs them).

A corpus is a flat token array in which -1 separates documents (no token equals it, so no match runs across a
separator). A context's suffix is matched as a suffix tree would match it, from the context's last token
leftwards: the occurrences of the last token, kept while the tokens before them go on agreeing with the
context, up to `max_depth` tokens (`match`). The occurrences of the longest suffix found are that suffix's node
of the corpus's suffix tree; what follows them is the node's subtree, read on demand (`grow`): a child's count is
how many occurrences go on with its token, its probability that count over its parent's.

Two corpora are searched for every row: the row's own context (prompt and output so far), scanned as it stands,
and the cache of earlier responses (`ResponseCache`), which keeps each token's positions so that a lookup
reads only the occurrences of the context's last token. Memory is linear in the tokens held, whatever the depth.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sdbench.engine.tree import Tree
from sdbench.errors import SdbenchError

SEP = -1  # between documents of a corpus


def match(corpus: np.ndarray, ends: np.ndarray, context: np.ndarray, max_depth: int) -> tuple[int, np.ndarray]:
    """The longest suffix of `context` (at most max_depth tokens) that occurs in `corpus` ending at one of `ends`
    (candidate positions holding context[-1]). -> (its length m, the positions where its occurrences end);
    (0, empty) when no candidate is given."""
    if not len(ends) or not len(context):
        return 0, ends[:0]
    m = 1
    while m < min(max_depth, len(context)):
        before = ends - m
        ok = before >= 0
        ok[ok] = corpus[before[ok]] == context[-1 - m]
        if not ok.any():
            break
        ends = ends[ok]
        m += 1
    return m, ends


@dataclass(frozen=True)
class Speculation:
    """A speculation tree: nodes in the order they were chosen (parents first, siblings by score), each node's
    token and score (its path's empirical probability), and the match it grew from."""

    parents: tuple[int, ...]
    tokens: tuple[int, ...]
    scores: tuple[float, ...]
    match_len: int = 0

    @property
    def score(self) -> float:
        """The expected number of accepted nodes, were the empirical probabilities the target's."""
        return float(sum(self.scores))

    @property
    def tree(self) -> Tree:
        return Tree(self.parents)

    @property
    def is_chain(self) -> bool:
        return all(a == i - 1 for i, a in enumerate(self.parents))


NOTHING = Speculation((), (), ())


def _children(corpus: np.ndarray, at: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """The tokens following positions `at` (separators and the corpus's end excluded), each with the positions
    where it occurs, most frequent first, then the most recently seen first."""
    nxt = at + 1
    nxt = nxt[nxt < len(corpus)]
    tok = corpus[nxt]
    nxt, tok = nxt[tok != SEP], tok[tok != SEP]
    if not len(tok):
        return []
    values, inverse, counts = np.unique(tok, return_inverse=True, return_counts=True)
    latest = np.full(len(values), -1)
    np.maximum.at(latest, inverse, nxt)
    order = np.lexsort((-latest, -counts))
    return [(int(values[i]), nxt[inverse == i]) for i in order]


def grow(corpus: np.ndarray, ends: np.ndarray, match_len: int, budget: int, min_prob: float,
         branch: bool = True) -> Speculation:
    """The speculation below the node whose occurrences end at `ends`: best first by score (a node's score is its
    parent's times count(node) / count(parent), the root's being 1), while the best score left is at least
    min_prob, up to `budget` nodes. branch=False: only the best path (each level's best child)."""
    total = len(ends)
    parents: list[int] = []
    tokens: list[int] = []
    scores: list[float] = []
    heap: list[tuple[float, int, int, int, np.ndarray]] = []  # (-score, order pushed, parent, token, positions)
    pushed = 0

    def push(parent: int, score: float, at: np.ndarray, count: int) -> None:
        nonlocal pushed
        for token, where in _children(corpus, at):
            heapq.heappush(heap, (-score * len(where) / count, pushed, parent, token, where))
            pushed += 1

    if total:
        push(-1, 1.0, ends, total)
    while heap and len(parents) < budget:
        neg, _, parent, token, where = heapq.heappop(heap)
        if -neg < min_prob:
            break
        parents.append(parent)
        tokens.append(token)
        scores.append(-neg)
        if not branch:
            heap.clear()
        push(len(parents) - 1, -neg, where, len(where))
    return Speculation(tuple(parents), tuple(tokens), tuple(scores), match_len)


def speculate(corpus: np.ndarray, ends: np.ndarray, context: np.ndarray, *, max_depth: int, limit: int,
              spec_factor: float, min_prob: float, branch: bool = True) -> Speculation:
    """Match the context's suffix among `ends` (candidate positions holding its last token), then grow the
    speculation below the match: at most min(limit, spec_factor x match length) nodes."""
    m, at = match(corpus, ends, context, max_depth)
    budget = min(limit, int(spec_factor * m + 1e-9))  # 0.7 x 10 is 7, not 6.99...
    if budget < 1 or not len(at):
        return NOTHING
    return grow(corpus, at, m, budget, min_prob, branch)


def speculate_context(row: np.ndarray, **kw) -> Speculation:
    """`speculate` over the row's own context: earlier occurrences of its last token (the last one itself
    excluded, whose continuation is what is being drafted)."""
    if len(row) < 2:
        return NOTHING
    return speculate(row, np.flatnonzero(row[:-1] == row[-1]), row, **kw)


def prompt_key(prompt) -> str:
    """A prompt's identity in the cache: a digest of its token ids."""
    return hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=12).hexdigest()


class ResponseCache:
    """Earlier responses, as one corpus with each token's positions, keyed by the prompt they answered (one
    response per prompt: a later one replaces it). At most `capacity` responses: the oldest go first. A dropped
    response's tokens are overwritten by separators (no lookup matches them any more) until the corpus is
    compacted, once the dead tokens outnumber the live ones."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.spans: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (start, end) in the corpus
        self._clear()
        self.changed = False  # since the last save

    def _clear(self) -> None:
        self._corpus = np.empty(0, dtype=np.int64)
        self._used = 0
        self._dead = 0
        self._positions: dict[int, list] = {}  # token -> [positions array, count used]

    @property
    def corpus(self) -> np.ndarray:
        return self._corpus[: self._used]

    def __len__(self) -> int:
        return len(self.spans)

    def responses(self) -> list[tuple[str, list[int]]]:
        return [(k, self.corpus[a:b].tolist()) for k, (a, b) in self.spans.items()]

    def add(self, key: str, tokens) -> None:
        """Keep `tokens` as the response to the prompt `key` (replacing an earlier one)."""
        self.drop(key)
        tokens = np.asarray(tokens, dtype=np.int64)
        if self.capacity < 1 or not len(tokens):
            return
        while len(self.spans) >= self.capacity:
            self.drop(next(iter(self.spans)))
        start = self._append(np.concatenate([tokens, [SEP]]))
        self.spans[key] = (start, start + len(tokens))
        self.changed = True

    def drop(self, key: str) -> None:
        """Forget the response to the prompt `key`, if one is held."""
        span = self.spans.pop(key, None)
        if span is None:
            return
        a, b = span
        self._corpus[a:b] = SEP
        self._dead += b - a + 1
        self.changed = True
        if self._dead > self._used - self._dead:
            kept = self.responses()
            self.spans.clear()
            self._clear()
            for k, toks in kept:
                start = self._append(np.asarray(toks + [SEP], dtype=np.int64))
                self.spans[k] = (start, start + len(toks))

    def _append(self, tokens: np.ndarray) -> int:
        start, end = self._used, self._used + len(tokens)
        if end > len(self._corpus):
            grown = np.empty(max(2 * len(self._corpus), end, 1024), dtype=np.int64)
            grown[:start] = self._corpus[:start]
            self._corpus = grown
        self._corpus[start:end] = tokens
        self._used = end
        for t in np.unique(tokens[:-1]).tolist():
            where = np.flatnonzero(tokens == t) + start
            slot = self._positions.setdefault(t, [np.empty(0, dtype=np.int64), 0])
            arr, n = slot
            if n + len(where) > len(arr):
                grown = np.empty(max(2 * len(arr), n + len(where), 16), dtype=np.int64)
                grown[:n] = arr[:n]
                slot[0] = arr = grown
            arr[n : n + len(where)] = where
            slot[1] = n + len(where)
        return start

    def occurrences(self, token: int) -> np.ndarray:
        """Live positions holding `token`."""
        slot = self._positions.get(int(token))
        if slot is None:
            return np.empty(0, dtype=np.int64)
        at = slot[0][: slot[1]]
        return at[self._corpus[at] == token] if self._dead else at

    def speculate(self, row: np.ndarray, **kw) -> Speculation:
        """`speculate` over the cached responses, for a context `row`."""
        if not len(row) or not self.spans:
            return NOTHING
        return speculate(self.corpus, self.occurrences(int(row[-1])), row, **kw)

    # ---- kept across runs ------------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        kept = self.responses()
        lengths = np.array([len(t) for _, t in kept], dtype=np.int64)
        tokens = np.array([x for _, t in kept for x in t], dtype=np.int64)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, keys=np.array([k for k, _ in kept], dtype=str), lengths=lengths, tokens=tokens)
        tmp.replace(path)
        self.changed = False

    def load(self, path: Path) -> None:
        """Add the responses saved at `path` (nothing when there is no such file)."""
        if not path.exists():
            return
        try:
            with np.load(path) as saved:
                keys, lengths, tokens = saved["keys"].tolist(), saved["lengths"], saved["tokens"]
        except (OSError, ValueError, KeyError) as e:
            raise SdbenchError(f"the suffix cache {path} cannot be read ({e}): delete it to start afresh") from None
        starts = np.concatenate([[0], np.cumsum(lengths)])
        for k, a, b in zip(keys, starts[:-1], starts[1:]):
            self.add(k, tokens[a:b])
        self.changed = False
