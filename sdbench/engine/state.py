"""What every part of decoding shares: the committed tokens of a batch, the commit rule, and a proposal.

Nothing here imports a model, a cache or a strategy: the loop, the strategies, the drafters, the levels of a
polybasic chain and DSI's ledger all build on these three definitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sdbench.config import SamplingConfig
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


@dataclass
class Proposal:
    """Drafted tokens for a verifier."""

    tokens: torch.Tensor  # [B, G] long: drafted tokens, host or device (entries past lengths[b] are padding)
    lengths: torch.Tensor  # [B] long on the host: real drafted tokens per row, 0..G
    probs: torch.Tensor | None = None  # [B, G, V] draft distribution p; None = deterministic (one-hot) draft

    @classmethod
    def empty(cls, batch: int) -> "Proposal":
        """Nothing drafted: a verification of the committed tokens alone (a plain step)."""
        return cls(torch.zeros(batch, 0, dtype=torch.long), torch.zeros(batch, dtype=torch.long))

    @property
    def width(self) -> int:
        return int(self.lengths.max()) if len(self.lengths) else 0

    def fit(self, limits: list[int]) -> "Proposal":
        """At most limits[b] tokens in row b, and no column of padding only (nothing past the longest row is
        verified); drafts stay where the drafter made them (a model's on its device: no wait here)."""
        lengths = torch.minimum(self.lengths.cpu(), torch.tensor(limits, dtype=torch.long))
        width = int(lengths.max()) if len(lengths) else 0
        tokens, probs = self.tokens, self.probs
        if width < tokens.shape[1]:
            tokens = tokens[:, :width]
            probs = probs[:, :width] if probs is not None else None
        return Proposal(tokens, lengths, probs)


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
