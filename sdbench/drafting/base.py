"""The one drafting protocol. A drafter proposes tokens continuing each row of a context; it never verifies.

Implemented for a model (dense or sparse KV cache: drafting/model.py), prompt lookup (drafting/ngram.py), a
retrieval datastore (drafting/retrieval.py) and trained heads (drafting/heads.py: EAGLE, Medusa). Fixed-lookahead
strategies call one drafter every round, the adaptive strategies choose among several, the bottom of a polybasic
chain is one, and DSI's drafter thread drafts through one.
"""

from __future__ import annotations

from typing import Protocol

import torch

from sdbench.engine.state import DecodeState, Proposal


class Drafter(Protocol):
    name: str  # as results name it: the model's name, or "ngram"

    def begin(self, state: DecodeState) -> None:
        """A new generation: state holds the prompts and each row's first token (a model prefills here)."""

    def begin_rows(self, state: DecodeState, rows: list[int]) -> None:
        """Rows `rows` now hold a new prompt and its first token mid-generation (a request joined a running
        batch): forget what was kept for those rows (a model prefills its cache row)."""

    def catch_up(self, ctx: torch.Tensor, lengths: list[int]) -> int:
        """The most context tokens of a row the next `draft` must feed before drafting (0 for a lookup)."""

    def draft(self, ctx: torch.Tensor, lengths: list[int], limits: list[int]) -> Proposal:
        """Up to limits[b] tokens continuing ctx[b, :lengths[b]] per row (0: the row takes no part).

        ctx [B, W] long on the host. Returns a Proposal with lengths[b] <= limits[b]; its tokens may stay on
        the drafter's device (nothing here waits for it)."""

    def end(self) -> None:
        """The generation is over (also after an error): give back caches for reuse."""
