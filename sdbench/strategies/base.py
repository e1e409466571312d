"""What runs a strategy: a proposer. The decode loop asks it for draft tokens and tells it what was committed.

A proposer does two jobs, grouped below: running (begin / propose / observe / end, called by the one loop) and
reporting (params, notes, row_stats: what results record). How one is declared, checked and made is the
strategy's declaration (strategies/spec.py).
"""

from __future__ import annotations

from sdbench.drafting.dynamic import DynamicTree
from sdbench.engine.hidden import TargetStates
from sdbench.engine.state import DecodeState, Proposal
from sdbench.engine.step import Round


class Proposer:
    """Base proposer: proposes nothing, so the loop decodes one target token per step."""

    name = "autoregressive"
    decoder = "sequential"  # the decoder the command runs it with (sdbench/decoders.py): the one loop, or "dsi"
    rows_join = False  # True: requests may join a running batch (serving under load): `begin_rows` is implemented
    hidden_layers: tuple[int, ...] = ()  # the target's hidden states it reads (engine/hidden.py); () : none kept
    proposes_trees = False  # True: its proposals may be token trees (Proposal.trees), refused before a run on
    # a runner or cache that cannot verify them (loop.check_trees)

    def __init__(self, gamma: int = 0):
        self.gamma = gamma

    # ---- running -------------------------------------------------------------------------------------------
    @property
    def max_lookahead(self) -> int:
        """Most tokens ever proposed in one step (sizes the KV caches)."""
        return self.gamma

    def begin(self, state: DecodeState) -> None:
        """Called once after the target's prefill and first token."""

    def begin_rows(self, state: DecodeState, rows: list[int]) -> None:
        """Serving under load: rows `rows` now hold a new request (its prompt and first token) in the middle of a
        generation; forget whatever was kept for the requests they held before (a draft model prefills its own
        cache row). Only called where `rows_join` is set."""
        if not self.rows_join:
            raise NotImplementedError(f"strategy '{self.name}' cannot take rows joining mid-generation")

    def propose(self, state: DecodeState) -> Proposal | None:
        return None

    def see_target(self, states: TargetStates) -> None:
        """Only for a proposer naming `hidden_layers`: the target's states of the tokens just committed to its
        cache (the prompts after the prefill; after each verification, the last committed token and the
        accepted drafts: a tree's accepted path, in order), before `observe`."""

    def observe(self, state: DecodeState, proposal: Proposal | None, rnd: Round) -> None:
        """Called after each verification: the proposal as verified (cut to what each row could commit) and
        the round: per row drafted, accepted and committed drafts, and the round's measured draft and verify
        seconds."""

    def end(self) -> None:
        """Called once the generation is over (also after an error): give back caches for reuse."""

    def warmed_up(self) -> None:
        """The run's warm-up generation is over: forget what it taught that later generations would draft from
        (a cache of earlier responses), so that the measured ones never see the warm-up's answers."""

    # ---- reporting -----------------------------------------------------------------------------------------
    def params(self) -> dict:
        """The settings recorded with every result row."""
        return {"gamma": self.gamma}

    def notes(self, context_tokens: int) -> list[str]:
        """What the user should be told before a run whose contexts reach `context_tokens` (prompt plus new
        tokens): settings that are accepted but do something other than their name suggests."""
        return []

    def row_stats(self, b: int) -> dict:
        """Strategy-specific figures for row b of the generation that just ended (JSON-able), recorded in
        the `strategy_stats` column: e.g. a gamma trajectory, per-level counts, worker busy fractions."""
        return {}


class FixedLookahead(Proposer):
    """A fixed-k use of one drafter: every round asks it for `gamma` tokens per row (never more than a row can
    still commit). Draft-model SD, prompt lookup and MagicDec are this with their own drafter."""

    def __init__(self, drafter, gamma: int):
        super().__init__(gamma)
        self.drafter = drafter

    rows_join = True

    def begin(self, state: DecodeState) -> None:
        self.drafter.begin(state)

    def begin_rows(self, state: DecodeState, rows: list[int]) -> None:
        self.drafter.begin_rows(state, rows)

    def propose(self, state: DecodeState) -> Proposal:
        return self.drafter.draft(state.tokens, state.lengths, state.lookahead(self.gamma))

    def end(self) -> None:
        self.drafter.end()


class TrainedHead(FixedLookahead):
    """A fixed-k use of a trained head's drafter (EAGLE, Medusa): it reads the target's hidden states, which
    the loop gives it after the prefill and each verification. A drafter with a `tree` proposes that token tree
    (cut to each row's limit as a depth); tree_settings: the settings that asked for it, recorded."""

    rows_join = False  # a joining row's prompt states would come from its own prefill: not wired yet

    def __init__(self, drafter, gamma: int, head: str, tree_settings: dict | None = None):
        super().__init__(drafter, gamma)
        self.head = head
        self.hidden_layers = tuple(drafter.layers)
        self.tree = getattr(drafter, "tree", None)
        self.tree_settings = dict(tree_settings or {}) if self.tree is not None else {}

    @property
    def proposes_trees(self) -> bool:
        return self.tree is not None

    @property
    def max_lookahead(self) -> int:
        if self.tree is None:
            return self.gamma
        if isinstance(self.tree, DynamicTree):
            return self.tree.slots  # the head's last forward may feed more expanded nodes than it keeps
        return len(self.tree)

    def see_target(self, states: TargetStates) -> None:
        self.drafter.see(states)

    def params(self) -> dict:
        return {"gamma": self.gamma, "head": self.head, **self.tree_settings}
