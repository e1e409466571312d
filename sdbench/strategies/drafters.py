"""Draft candidates for the adaptive strategies: a draft model or prompt lookup, asked for any gamma per round.

A model drafter wraps `DraftModel` (its cache and `CachedPrefix` bookkeeping). It starts lazily, on the
first round it is chosen, and a drafter left idle for some rounds simply feeds the committed tokens it has
not seen on its next use (the drafting loop's catch-up handles any number of them), so its cache stays in
step whether or not it was chosen.
"""

from __future__ import annotations

from sdbench.strategies.base import Proposal
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.ngram import DRAFT_NAME, NGram

STEADY_CATCH_UP = 2  # a round feeding more unseen tokens than this is not a typical drafting cost


class ModelDrafter:
    """A draft model with its own KV cache."""

    def __init__(self, runner):
        self.name = runner.name or "model"
        self.model = DraftModel(runner, 1)
        self.started = False

    def begin(self, state) -> None:
        self.started = False  # prefilled on first use: a candidate never chosen costs nothing

    def propose(self, state, gamma: int) -> tuple[Proposal | None, bool]:
        """(proposal, steady): steady is False when the round also paid for a prefill or a long catch-up."""
        if not self.started:
            self.model.begin(state)
            self.started = True
            steady = False
        else:
            steady = self.model.unseen(state) <= STEADY_CATCH_UP
        return self.model.propose(state, gamma), steady

    def observe(self, state, accepted, proposal) -> None:
        self.model.observe(state, accepted, proposal)

    def end(self) -> None:
        self.model.end()


class NGramDrafter:
    """Prompt lookup; the proposal is trimmed to the longest match so that the target verifies no padding."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.name = DRAFT_NAME
        self.lookup = NGram(1, max_ngram, min_ngram)

    def begin(self, state) -> None:
        pass

    def propose(self, state, gamma: int) -> tuple[Proposal | None, bool]:
        proposal = self.lookup.propose(state, gamma)
        width = int(proposal.lengths.max())
        return (Proposal(proposal.tokens[:, :width], proposal.lengths) if width else None), True

    def observe(self, state, accepted, proposal) -> None:
        pass

    def end(self) -> None:
        pass


def make_drafters(drafts: list, max_ngram: int, min_ngram: int) -> list:
    """One drafter per --draft entry (a runner, or the name 'ngram'); prompt lookup when there are none."""
    made = []
    for d in drafts or [DRAFT_NAME]:
        made.append(NGramDrafter(max_ngram, min_ngram) if isinstance(d, str) else ModelDrafter(d))
    return made
