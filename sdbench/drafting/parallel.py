"""P-EAGLE as a drafter (parallel EAGLE-3; speculators `PEagleDraftModel`, vLLM's parallel drafting): EAGLE-3's
head (models/heads/eagle.py) drafting a whole chain in the one forward that feeds it the committed tokens.

EAGLE's feed (drafting/heads.py) writes the pairs (token p + 1, the target's state of token p) of the tokens the
last verification committed and drafts token N from its output at N - 2. P-EAGLE's feed carries k - 1 more
positions after each row's last pair: the mask token with the head's learned `mask_hidden` as its state, at
positions N - 1 .. N + k - 3 (causal: each sees the context and the positions before it, none of the others'
tokens); the output at N - 2 + j drafts token N + j. So a round's drafting is one head forward whatever k, and
the drafts of one round do not see each other (each is chosen from its own position's logits, as DFlash's are).
The mask positions are not context: the next feed writes from N - 1 on, over them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sdbench.drafting.heads import EagleDrafter
from sdbench.engine.sampling import choose_each
from sdbench.engine.state import DecodeState, Proposal


class ParallelDrafter(EagleDrafter):
    """Drafts up to k tokens per row with one P-EAGLE forward (a chain; no tree)."""

    def __init__(self, head, name: str, layers: tuple[int, ...], mask_token_id: int, mask_hidden: torch.Tensor,
                 gamma: int):
        super().__init__(head, name, layers)
        self.mask_token_id, self.gamma = mask_token_id, gamma
        self.mask_hidden = mask_hidden.reshape(-1)

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        # a row that committed fewer tokens than another still writes the batch's width of slots past its own:
        # at most a round's tokens (gamma + 1) and its mask positions (gamma) more than a chain writes
        self.cache = self.head.new_cache(state.batch, state.capacity + 2 * self.gamma + 1)

    def draft(self, ctx: torch.Tensor, lengths: list[int], limits: list[int]) -> Proposal:
        k = max(limits, default=0)
        if self.pending is None:
            raise RuntimeError("a P-EAGLE head drafts from the target's states, which the loop did not give")
        if k == 0:
            self._feed(ctx)
            return Proposal.empty(len(lengths))
        tokens, probs = choose_each(self._parallel(ctx, k), self.sampling, self.generator)
        return Proposal(tokens, torch.tensor(limits, dtype=torch.long), probs)

    def _parallel(self, ctx: torch.Tensor, k: int) -> torch.Tensor:
        """The pending states fed with the tokens that follow them and k - 1 mask positions after each row's last:
        the logits [B, k, V] at the row's last pair and its mask positions."""
        ts = self.pending
        self.pending = None
        B, T = ts.states.shape[:2]
        start = torch.tensor(ts.start)
        nxt = (start[:, None] + torch.arange(1, T + 1)).clamp(max=ctx.shape[1] - 1)  # past a row's count: padding
        last = (torch.tensor(ts.count) - 1).clamp(min=0)[:, None]  # [B, 1] a row's last pair (done: drafts nothing)
        slot = torch.arange(T + k - 1)[None, :]
        masked = (slot > last) & (slot < last + k)  # [B, T + k - 1]
        tokens = F.pad(ctx.gather(1, nxt), (0, k - 1)).masked_fill(masked, self.mask_token_id)
        states = F.pad(ts.states, (0, 0, 0, k - 1))
        states = torch.where(masked.to(states.device)[..., None], self.mask_hidden.to(states), states)
        logits, _ = self.head.forward(self.cache, tokens, states, ts.start, last + torch.arange(k)[None, :])
        return logits
