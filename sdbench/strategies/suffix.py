"""Suffix decoding: speculate what followed the context's longest matching suffix, in the row's own context and in
the responses the run has already given, as a tree whose size follows the match (drafting/suffix.py)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from sdbench.drafting.suffix import NOTHING, ResponseCache, Speculation, prompt_key, speculate_context
from sdbench.engine.state import DecodeState, Proposal
from sdbench.engine.tree import Tree
from sdbench.errors import SdbenchError
from sdbench.paths import cache_dir
from sdbench.strategies.base import Proposer
from sdbench.strategies.spec import BuildContext, Option, Strategy, need_gamma, register


def cache_file(target: str) -> Path:
    """Where `persist=1` keeps the responses of the runs with this target (a file per target: token ids mean
    nothing to another tokenizer)."""
    return cache_dir("suffix") / (re.sub(r"[^A-Za-z0-9._-]+", "_", target).strip("_") + ".npz")


class Suffix(Proposer):
    """Per row and round, the speculation with the higher score of two: one grown over the row's own context, one
    over the cache of earlier responses; a tree (tree=True) or its best path. A row's response joins the cache
    when the row finishes; a prompt that starts again first loses its own cached response (a repeat, or the
    warm-up's, would otherwise be drafted from its own answer)."""

    name = "suffix"
    rows_join = True

    def __init__(self, gamma: int, max_depth: int = 24, max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 max_cached: int = 10000, tree: bool = False, persist: bool = False, store: Path | None = None):
        super().__init__(gamma)
        self.max_depth, self.max_spec_factor, self.min_token_prob = max_depth, max_spec_factor, min_token_prob
        self.max_cached, self.tree, self.persist = max_cached, tree, persist
        self.cache = ResponseCache(max_cached)
        self.store = store if persist else None
        if self.store is not None:
            self.cache.load(self.store)
        self._keys: list[str] = []  # per row, its prompt's key
        self._kept: list[bool] = []  # per row, whether its response went to the cache
        self._from_cache: list[int] = []  # per row, rounds drafted from the cache

    @property
    def proposes_trees(self) -> bool:
        return self.tree

    def begin(self, state: DecodeState) -> None:
        self._keys, self._kept, self._from_cache = [""] * state.batch, [False] * state.batch, [0] * state.batch
        self._start(state, range(state.batch))

    def begin_rows(self, state: DecodeState, rows: list[int]) -> None:
        self._start(state, rows)

    def _start(self, state: DecodeState, rows) -> None:
        for b in rows:
            self._keys[b] = prompt_key(state.tokens[b, : state.prompt_lengths[b]].numpy())
            self._kept[b], self._from_cache[b] = False, 0
            self.cache.drop(self._keys[b])
        self._keep_finished(state)

    def warmed_up(self) -> None:
        """The warm-up's responses are not the run's: forget them (in the kept file too)."""
        for key in [k for k in self._keys if k]:
            self.cache.drop(key)
        self.end()

    def speculation(self, row: np.ndarray, limit: int) -> tuple[Speculation, bool]:
        """The better of the two speculations for a context `row` (ties: the row's own), and whether it came
        from the cache."""
        kw = dict(max_depth=self.max_depth, limit=limit, spec_factor=self.max_spec_factor,
                  min_prob=self.min_token_prob, branch=self.tree)
        own = speculate_context(row, **kw)
        cached = self.cache.speculate(row, **kw) if len(self.cache) else NOTHING
        return (cached, True) if cached.score > own.score else (own, False)

    def propose(self, state: DecodeState) -> Proposal:
        made = []
        for b, k in enumerate(state.lookahead(self.gamma)):
            spec, cached = self.speculation(state.row(b).numpy(), k) if k > 0 else (NOTHING, False)
            self._from_cache[b] += cached and bool(spec.tokens)
            made.append(spec)
        trees = Proposal.of_trees([(Tree(s.parents), s.tokens) for s in made])
        if all(s.is_chain for s in made):  # one branch everywhere: the chain's fast path
            return Proposal(trees.tokens, trees.lengths)
        return trees

    def observe(self, state: DecodeState, proposal: Proposal | None, rnd) -> None:
        self._keep_finished(state)

    def _keep_finished(self, state: DecodeState) -> None:
        for b in range(state.batch):
            if state.done[b] and not self._kept[b] and self._keys[b]:
                self.cache.add(self._keys[b], state.generated(b))
                self._kept[b] = True

    def end(self) -> None:
        if self.store is not None and self.cache.changed:
            self.cache.save(self.store)

    def params(self) -> dict:
        return {"gamma": self.gamma, "max_depth": self.max_depth, "max_spec_factor": self.max_spec_factor,
                "min_token_prob": self.min_token_prob, "max_cached": self.max_cached, "tree": self.tree,
                "persist": self.persist}

    def notes(self, context_tokens: int) -> list[str]:
        if self.store is None:
            return []
        return [f"suffix: drafting also from {len(self.cache)} response(s) of earlier runs kept in {self.store}"]

    def row_stats(self, b: int) -> dict:
        return {"cache_drafts": self._from_cache[b]} if b < len(self._from_cache) else {}


def check_suffix(gamma: int, options: dict) -> None:
    """The settings' rules, one line each."""
    need_gamma("suffix", gamma)
    if options["max_depth"] < 1:
        raise SdbenchError(f"suffix needs --set max_depth >= 1 (the longest suffix matched; got "
                           f"{options['max_depth']})")
    if not options["max_spec_factor"] > 0:
        raise SdbenchError(f"suffix needs --set max_spec_factor > 0 (nodes per matched token; got "
                           f"{options['max_spec_factor']})")
    if not 0 <= options["min_token_prob"] <= 1:
        raise SdbenchError(f"suffix needs --set min_token_prob between 0 and 1 (got {options['min_token_prob']})")
    if options["max_cached"] < 0:
        raise SdbenchError(f"suffix needs --set max_cached >= 0 responses (0: no cache; got "
                           f"{options['max_cached']})")
    if options["persist"] and options["max_cached"] < 1:
        raise SdbenchError("suffix --set persist=1 keeps the cache of responses, and max_cached=0 keeps none")


@register
class SuffixStrategy(Strategy):
    name = "suffix"
    help = ("suffix decoding: a tree of what followed the longest suffix match in the context and in earlier "
            "responses, sized by the match (no model)")
    aliases = ("suffix-decoding",)
    options = (
        Option("max_depth", 24, "longest context suffix (tokens) matched"),
        Option("max_spec_factor", 1.0, "nodes speculated per matched token (capped by --gamma)", float),
        Option("min_token_prob", 0.1, "a node is kept while its path's empirical probability is at least this",
               float),
        Option("max_cached", 10000, "earlier responses kept to draft from, oldest dropped first (0: none)"),
        Option("tree", False, "speculate the tree (a runner that verifies trees); off: its best path", bool),
        Option("persist", False, "keep the responses across runs, in a file per target under the cache dir",
               bool),
    )
    proposer = Suffix

    @classmethod
    def validate(cls, gamma: int, options: dict, drafts: tuple[str, ...], sampling) -> None:
        check_suffix(gamma, options)

    @classmethod
    def build(cls, ctx: BuildContext) -> Proposer:
        store = cache_file(ctx.target.name) if ctx.options["persist"] else None
        return Suffix(ctx.gamma, **ctx.options, store=store)

    @classmethod
    def search_space(cls, trial, space) -> tuple[int, dict]:
        return trial.suggest_int("gamma", 1, 16), {
            "max_spec_factor": trial.suggest_float("max_spec_factor", 0.5, 4.0, log=True),
            "min_token_prob": trial.suggest_float("min_token_prob", 0.02, 0.5, log=True)}
