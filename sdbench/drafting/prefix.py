"""Which tokens a draft's KV cache holds keys for: the one bookkeeping every drafting model uses.

A position-indexed cache keeps whatever was last written at each slot. A drafting model (a draft model, a
level of a polybasic chain, the DSI drafter) therefore remembers, per row, the token it wrote at each
position (`seen`) and how far its keys reach (`fed`). Before drafting after a context, it keeps only the
longest prefix on which `seen` agrees with that context: every key kept was computed from exactly those
tokens, whatever the levels above accepted, corrected or rewound in between. Rewinding is then, as for the
target, just starting the next forward earlier.
"""

from __future__ import annotations

import torch


class CachedPrefix:
    """seen [B, capacity] on the host and fed[b]: keys for seen[b, :fed[b]] are in the cache."""

    def __init__(self, batch: int, capacity: int):
        self.seen = torch.zeros(batch, capacity, dtype=torch.long)
        self.fed = [0] * batch
        self._pending: list[tuple[torch.Tensor, list[int]]] = []  # writes whose tokens are not read back yet

    def holds(self, ctx: torch.Tensor, lens: list[int]) -> None:
        """The cache now holds keys for ctx[b, :lens[b]] (after a prefill)."""
        self._pending.clear()
        for b, n in enumerate(lens):
            self.seen[b, :n] = ctx[b, :n]
        self.fed = list(lens)

    def holds_row(self, b: int, row: torch.Tensor, n: int) -> None:
        """Row b of the cache now holds keys for row[:n] alone (a request prefilled into its slot); writes still
        pending for the slot's earlier request are read back first, so that none lands over it later."""
        self._read_back()
        self.seen[b].zero_()
        self.seen[b, :n] = row[:n]
        self.fed[b] = n

    def wrote(self, tokens: torch.Tensor, start: list[int]) -> None:
        """A forward wrote tokens [B, T] from positions start[b] on; padding included, since it is what the
        cache now holds there. Tokens on a device are read back only when `agree` needs them (by then the
        decode loop has waited for the device anyway), so drafting never waits for its own tokens."""
        T = tokens.shape[1]
        self._pending.append((tokens, list(start)))
        for b, s in enumerate(start):
            self.fed[b] = s + T

    def kept(self, b: int, tokens: list[int], start: int) -> None:
        """Row b's cache now holds keys for `tokens` from position start on, and none it can vouch for past
        them (a tree's accepted path moved into place)."""
        self._read_back()
        self.seen[b, start : start + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        self.fed[b] = start + len(tokens)

    def _read_back(self) -> None:
        for tokens, start in self._pending:
            tokens = tokens.cpu()
            for b, s in enumerate(start):
                self.seen[b, s : s + tokens.shape[1]] = tokens[b]
        self._pending.clear()

    def agree(self, ctx: torch.Tensor, lens: list[int]) -> None:
        """Keep the cached prefix that agrees with each row's context ctx[b, :lens[b]], and never the context's
        last token (the next forward must feed it to get the logits after it)."""
        self._read_back()
        for b, n in enumerate(lens):
            keep = min(self.fed[b], n - 1)
            differ = (self.seen[b, :keep] != ctx[b, :keep]).nonzero()
            self.fed[b] = int(differ[0]) if len(differ) else keep

    def unseen(self, ctx: torch.Tensor, lens: list[int], block: torch.Tensor | None = None):
        """What the next forward feeds after `agree`: per row the context from fed[b] on, then block [B, G]
        when given. Returns (tokens [B, W], start positions, todo[b] = context tokens fed for row b)."""
        G = 0 if block is None else block.shape[1]
        todo = [n - f for n, f in zip(lens, self.fed)]
        tokens = torch.zeros(len(lens), max(todo) + G, dtype=torch.long)
        block = block.cpu() if G else block
        for b, (f, n) in enumerate(zip(self.fed, lens)):
            tokens[b, : n - f] = ctx[b, f:n]
            if G:
                tokens[b, n - f : n - f + G] = block[b]
        return tokens, list(self.fed), todo
