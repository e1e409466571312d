"""What every part of decoding shares: the committed tokens of a batch, the commit rule, and a proposal.

Nothing here imports a model, a cache or a strategy: the loop, the strategies, the drafters, the levels of a
polybasic chain and DSI's ledger all build on these three definitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sdbench.config import SamplingConfig
from sdbench.engine.tree import Tree
from sdbench.padding import right_pad

CAPACITY_SLACK = 2  # KV slots beyond one step's drafts: the bonus position and one spare


def needed_capacity(prompt_tokens: int, max_new_tokens: int, lookahead: int) -> int:
    """KV slots a generation may write: the longest prompt, the new tokens, one step's drafts, and slack."""
    return prompt_tokens + max_new_tokens + lookahead + CAPACITY_SLACK


def admit(new: list[int], room: int, eos: frozenset[int]) -> tuple[list[int], bool]:
    """The commit rule: of the tokens `new` a verification produced for a row, the ones it commits — at most
    `room` (what is left of its token budget), ending at the first EOS — and whether the row is finished
    (it reached an EOS, or its budget)."""
    new = new[: max(room, 0)]
    for i, t in enumerate(new):
        if t in eos:
            return new[: i + 1], True
    return new, len(new) >= room


@dataclass(frozen=True)
class Side:
    """Nodes a row feeds to the verifying forward beside its drafted tree, never candidates for acceptance:
    verification and the counters never see them, the target's cache drops them (they are on no accepted path),
    and the proposer reads the target's argmax at each of them (`Round.side_argmax`). Lookahead decoding's
    Jacobi window is one."""

    tree: Tree  # parents: -1 for a child of the root (the last committed token), j for side node j
    tokens: tuple[int, ...]  # [S] a token per side node

    def __post_init__(self):
        if len(self.tokens) != len(self.tree):
            raise ValueError(f"side nodes: {len(self.tree)} nodes, {len(self.tokens)} tokens")


NO_SIDE = Side(Tree(()), ())


@dataclass
class Proposal:
    """Drafted tokens for a verifier: a chain per row (the default and the fast path), or a token tree per row
    (`trees`, engine/tree.py): then tokens[b, i] is node i's token, in the tree's order (parents first). A tree
    proposal may also feed side nodes (`side`) to the verifying forward: they follow the row's drafted nodes in
    its block, so the drafted nodes keep their places and verification reads only them."""

    tokens: torch.Tensor  # [B, G] long: drafted tokens (tree: [B, N], one per node), host or device;
    # entries past lengths[b] are padding
    lengths: torch.Tensor  # [B] long on the host: real drafted tokens per row, 0..G (tree: its node count)
    probs: torch.Tensor | None = None  # [B, G, V] draft distribution p (tree: [B, N, V], the one node i was
    # drawn from); None = deterministic (one-hot) drafts
    trees: tuple[Tree, ...] | None = None  # [B] per row the tree of its drafts; None = a chain
    side: tuple[Side, ...] | None = None  # [B] per row its side nodes (only with trees); None = none

    @classmethod
    def empty(cls, batch: int) -> "Proposal":
        """Nothing drafted: a verification of the committed tokens alone (a plain step)."""
        return cls(torch.zeros(batch, 0, dtype=torch.long), torch.zeros(batch, dtype=torch.long))

    @classmethod
    def of_trees(cls, made) -> "Proposal":
        """A tree per row from (tree, its nodes' tokens in the tree's order) pairs, padded to the largest."""
        tokens = torch.zeros(len(made), max((len(t) for t, _ in made), default=0), dtype=torch.long)
        for b, (_, found) in enumerate(made):
            tokens[b, : len(found)] = torch.as_tensor(list(found), dtype=torch.long)
        return cls(tokens, torch.tensor([len(t) for t, _ in made], dtype=torch.long),
                   trees=tuple(t for t, _ in made))

    def block(self, last: torch.Tensor) -> tuple[torch.Tensor, tuple[Tree, ...] | None]:
        """The verifying forward's tokens [B, T] and its trees (None: a chain): per row the last committed token
        (last [B], the root), the drafts, then the side nodes (each row's right after its own drafts, the rest
        padding)."""
        tokens = torch.cat([last[:, None].to(self.tokens.device), self.tokens], 1)
        if self.trees is None:
            return tokens, None
        if self.side is None:
            return tokens, tuple(t.with_root() for t in self.trees)
        trees, rows = [], []
        for b, (t, s) in enumerate(zip(self.trees, self.side)):
            n = len(t)
            parents = t.parents + tuple(a if a < 0 else n + a for a in s.tree.parents)
            trees.append(Tree(parents).with_root())
            rows.append(tokens[b, : n + 1].tolist() + list(s.tokens))
        return right_pad(rows, max(map(len, rows))).to(self.tokens.device), tuple(trees)

    def side_columns(self) -> list[list[int]]:
        """Per row the columns of `block`'s tokens that hold its side nodes, in order."""
        if self.side is None:
            return [[] for _ in range(len(self.lengths))]
        return [list(range(1 + len(t), 1 + len(t) + len(s.tree))) for t, s in zip(self.trees, self.side)]

    @property
    def width(self) -> int:
        return int(self.lengths.max()) if len(self.lengths) else 0

    def fit(self, limits: list[int]) -> "Proposal":
        """At most limits[b] tokens in row b (a tree: its nodes of depth <= limits[b], renumbered), and no column
        of padding only (nothing past the longest row is verified); drafts stay where the drafter made them (a
        model's on its device: no wait here)."""
        if self.trees is not None:
            return self._fit_trees(limits)
        lengths = torch.minimum(self.lengths.cpu(), torch.tensor(limits, dtype=torch.long))
        width = int(lengths.max()) if len(lengths) else 0
        tokens, probs = self.tokens, self.probs
        if width < tokens.shape[1]:
            tokens = tokens[:, :width]
            probs = probs[:, :width] if probs is not None else None
        return Proposal(tokens, lengths, probs)

    def _fit_trees(self, limits: list[int]) -> "Proposal":
        cut = [t.to_depth(k) for t, k in zip(self.trees, limits)]
        if all(len(kept) == len(t) for (_, kept), t in zip(cut, self.trees)) and \
                self.tokens.shape[1] == max((len(t) for t in self.trees), default=0):
            return self  # nothing beyond the limits: the usual case for a drafter that knows them
        # side nodes hang from the root or each other, never from a draft: a cut of the drafts leaves them whole
        width = max((len(kept) for _, kept in cut), default=0)
        index = torch.zeros(len(cut), width, dtype=torch.long)
        for b, (_, kept) in enumerate(cut):
            index[b, : len(kept)] = torch.tensor(kept, dtype=torch.long)
        index = index.to(self.tokens.device)
        tokens = self.tokens.gather(1, index)
        probs = None if self.probs is None else self.probs.gather(
            1, index.to(self.probs.device)[..., None].expand(-1, -1, self.probs.shape[-1]))
        return Proposal(tokens, torch.tensor([len(kept) for _, kept in cut], dtype=torch.long), probs,
                        tuple(t for t, _ in cut), self.side)


class DecodeState:
    """The committed sequences of a batch. tokens [B, capacity] on the host; row b is tokens[b, :lengths[b]]
    and may grow up to limits[b] (its prompt plus its token budget)."""

    def __init__(self, tokens: torch.Tensor, lengths: list[int], limits: list[int], *, eos_ids=(),
                 sampling: SamplingConfig, generator: torch.Generator | None = None,
                 device: torch.device | str = "cpu", target_cache: Any = None):
        """tokens [B, capacity] long on the host, used in place (a chain's levels share one buffer)."""
        self.tokens = tokens
        self.batch, self.capacity = tokens.shape
        self.prompt_lengths = list(lengths)
        self.lengths = list(lengths)
        self.limits = [min(n, self.capacity) for n in limits]
        self.done = [n >= lim for n, lim in zip(self.lengths, self.limits)]
        self.eos = frozenset(eos_ids)
        self.sampling = sampling
        self.generator = generator
        self.device = torch.device(device)  # the verifier's device
        self.target_cache = target_cache  # the verifier's KV cache (self-speculation compresses its prefill)

    @classmethod
    def for_prompts(cls, prompts: list[list[int]], max_new_tokens: int, capacity: int, **kw) -> "DecodeState":
        """Prompts to decode with a budget of max_new_tokens each, in a buffer of `capacity` positions."""
        lengths = [len(p) for p in prompts]
        return cls(right_pad(prompts, capacity), lengths, [n + max_new_tokens for n in lengths], **kw)

    @classmethod
    def idle(cls, batch: int, capacity: int, **kw) -> "DecodeState":
        """`batch` empty slots for requests to join (serving under load): each holds one placeholder token and is
        done, so that rounds skip it until `restart` gives it a request."""
        return cls(torch.zeros(batch, capacity, dtype=torch.long), [1] * batch, [1] * batch, **kw)

    def restart(self, b: int, prompt: list[int], max_new_tokens: int) -> None:
        """Slot b takes a new request: its prompt, and a budget of max_new_tokens (a request joining a running
        batch; the caller then commits its first token). Nothing of the slot's last request stays readable:
        the buffer row is cleared, and every cache is position-indexed (rewritten from position 0)."""
        self.tokens[b].zero_()
        self.tokens[b, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        self.prompt_lengths[b] = self.lengths[b] = len(prompt)
        self.limits[b] = min(len(prompt) + max_new_tokens, self.capacity)
        self.done[b] = self.lengths[b] >= self.limits[b]

    def row(self, b: int) -> torch.Tensor:
        return self.tokens[b, : self.lengths[b]]

    def last_tokens(self) -> torch.Tensor:  # [B]
        return self.tokens[torch.arange(self.batch), torch.tensor(self.lengths) - 1]

    def room(self, b: int) -> int:
        """Tokens row b can still commit; 0 once done."""
        return 0 if self.done[b] else self.limits[b] - self.lengths[b]

    def lookahead(self, gamma: int) -> list[int]:
        """Per row, the most drafts a round may propose: gamma capped to what the row can still commit (0 for a
        finished row), so that no round drafts past the budget."""
        return [min(gamma, self.room(b)) for b in range(self.batch)]

    def generated(self, b: int) -> list[int]:
        return self.tokens[b, self.prompt_lengths[b] : self.lengths[b]].tolist()

    def commit(self, b: int, new: list[int]) -> int:
        """Append tokens to row b by the commit rule (`admit`); returns how many were kept."""
        new, finished = admit(new, self.limits[b] - self.lengths[b], self.eos)
        n0 = self.lengths[b]
        self.tokens[b, n0 : n0 + len(new)] = torch.tensor(new, dtype=torch.long)
        self.lengths[b] = n0 + len(new)
        self.done[b] = self.done[b] or finished
        return len(new)
