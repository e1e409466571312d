"""Lookahead decoding (Fu et al. 2024): Jacobi iteration over a window of future positions gathers n-grams, and each
step verifies those that start with the last committed token, in the same target forward (drafting/lookahead.py).

One forward per step holds both branches: the verification branch (the pool's candidates, a token tree verified
as any other) and the lookahead branch (the window, side nodes of the forward: engine/state.py `Side`), whose
target argmax the proposer reads back after the verification (`Round.side_argmax`) to grow the next level.
"""

from __future__ import annotations

from dataclasses import replace

from sdbench.drafting.lookahead import Pool, Window, candidates
from sdbench.engine.state import NO_SIDE, DecodeState, Proposal, Side
from sdbench.errors import SdbenchError
from sdbench.strategies.base import Proposer
from sdbench.strategies.spec import BuildContext, Option, Strategy, register

MAX_NODES = 1024  # window and verification branch in one forward: past this a step is no longer one wide forward


def nodes(window: int, ngram: int, pool: int) -> int:
    """The most nodes one step feeds beside the root: the full window and G untouched (N - 1)-token n-grams."""
    return (window + pool) * (ngram - 1)


class Lookahead(Proposer):
    """Per row a window and a pool (drafting/lookahead.py). gamma: the verification branch's depth, N - 1."""

    name = "lookahead"
    proposes_trees = True
    rows_join = True

    def __init__(self, window: int = 5, ngram: int = 7, pool: int = 7):
        super().__init__(ngram - 1)
        self.window, self.ngram, self.pool = window, ngram, pool
        self._windows: list[Window | None] = []
        self._pools: list[Pool | None] = []
        self._grams: list[int] = []  # per row, n-grams the window gave the pool

    @property
    def max_lookahead(self) -> int:
        return nodes(self.window, self.ngram, self.pool)

    def begin(self, state: DecodeState) -> None:
        self._windows, self._pools, self._grams = [None] * state.batch, [None] * state.batch, [0] * state.batch
        self.begin_rows(state, list(range(state.batch)))

    def begin_rows(self, state: DecodeState, rows: list[int]) -> None:
        """A row starts with level 0 from its context's last tokens and a pool of its context's own n-grams."""
        for b in rows:
            context = state.row(b).tolist()
            self._windows[b] = Window.from_context(context, self.window, self.ngram)
            self._pools[b] = Pool(self.pool)
            self._pools[b].seed(context, self.ngram)
            self._grams[b] = 0

    def propose(self, state: DecodeState) -> Proposal:
        made, side = [], []
        last = state.last_tokens().tolist()
        for b, k in enumerate(state.lookahead(self.gamma)):
            if k > 0:
                made.append(candidates(self._pools[b].get(last[b]), k))
                w = self._windows[b]
                side.append(Side(w.tree, w.tokens))
            else:  # a finished row feeds nothing
                made.append(candidates([], 0))
                side.append(NO_SIDE)
        return replace(Proposal.of_trees(made), side=tuple(side))

    def observe(self, state: DecodeState, proposal: Proposal | None, rnd) -> None:
        for b, guesses in enumerate(rnd.side_argmax or ()):
            if guesses:
                for gram in self._windows[b].advance(guesses):
                    self._pools[b].add(gram)
                    self._grams[b] += 1

    def params(self) -> dict:
        return {"gamma": self.gamma, "window": self.window, "ngram": self.ngram, "pool": self.pool}

    def row_stats(self, b: int) -> dict:
        return {"window_ngrams": self._grams[b]} if b < len(self._grams) else {}


def check_lookahead(options: dict) -> None:
    """The settings' rules, one line each."""
    w, n, g = options["window"], options["ngram"], options["pool"]
    if w < 1:
        raise SdbenchError(f"lookahead needs --set window >= 1 (the Jacobi window's columns; got {w})")
    if n < 2:
        raise SdbenchError(f"lookahead needs --set ngram >= 2 (the n-grams' length, the window's levels + 1; got {n})")
    if g < 1:
        raise SdbenchError(f"lookahead needs --set pool >= 1 (n-grams kept and verified per key token; got {g})")
    if nodes(w, n, g) > MAX_NODES:
        raise SdbenchError(f"lookahead --set window={w} ngram={n} pool={g} feeds up to (window + pool) x (ngram - 1) "
                           f"= {nodes(w, n, g)} nodes to one forward; at most {MAX_NODES}")


@register
class LookaheadStrategy(Strategy):
    name = "lookahead"
    help = ("lookahead decoding: Jacobi iteration gathers n-grams in the verifying forward itself, and those "
            "starting with the last token are verified as a tree (no model)")
    aliases = ("lookahead-decoding", "jacobi")
    options = (
        Option("window", 5, "W: future positions the Jacobi window guesses at once"),
        Option("ngram", 7, "N: the n-grams' length (the window keeps N - 1 levels; verified n-grams are N - 1 "
                           "tokens deep)"),
        Option("pool", 7, "G: n-grams kept per key token, the newest first, and verified per step"),
    )
    tree_options = ("window", "ngram", "pool")
    proposer = Lookahead

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        check_lookahead(options)

    @classmethod
    def build(cls, ctx: BuildContext) -> Proposer:
        return Lookahead(**ctx.options)

    @classmethod
    def side_nodes(cls, params: dict) -> int:
        """The full window: W x (N - 1) nodes."""
        o = {**{x.name: x.default for x in cls.options}, **params}
        return int(o["window"]) * (int(o["ngram"]) - 1)

    @classmethod
    def search_space(cls, trial, space) -> tuple[int, dict]:
        """The window, the n-grams' length and the pool (gamma follows: ngram - 1)."""
        ngram = trial.suggest_int("ngram", 3, 7)
        return ngram - 1, {"window": trial.suggest_int("window", 2, 8), "ngram": ngram,
                           "pool": trial.suggest_int("pool", 2, 8)}
