"""Multi-turn conversations: which prompts take part in each turn and what each turn's prompt is.

Every turn is decoded by the baseline and by each strategy. A later turn's prompt holds the earlier turns and
the answers to them, and those answers are the baseline's (the first strategy's with --no-baseline), so both
sides of a comparison always decode the very same prompt. Under greedy decoding a lossless strategy gives
the same answers anyway; under sampling the baseline's sampled answer is the one carried forward.
"""

from __future__ import annotations

from sdbench.data import Prompt
from sdbench.data.tasks import encode_prompt

# a reply re-tokenized inside the chat template may take a few more tokens than were generated
ANSWER_SLACK_TOKENS = 8


class Conversations:
    """The prompts of a run, their turns and the answers recorded so far (token ids per prompt and turn)."""

    def __init__(self, prompts: list[Prompt], tokenizer, turns: int | None = None):
        self.prompts, self.tokenizer = prompts, tokenizer
        self.count = [len(p.turns) if turns is None else min(turns, len(p.turns)) for p in prompts]
        self.answers: dict[tuple[int, int], list[int]] = {}

    @property
    def most(self) -> int:
        """The most turns any prompt has in this run."""
        return max(self.count, default=1)

    def members(self, idx: list[int], turn: int) -> list[int]:
        """The prompts of a batch that have turn `turn` (0-based)."""
        return [i for i in idx if self.count[i] > turn]

    def turns_of(self, idx: list[int]) -> int:
        return max(self.count[i] for i in idx)

    def encode(self, i: int, turn: int) -> list[int]:
        said = [self.tokenizer.decode(self.answers[i, t], skip_special_tokens=True).strip() for t in range(turn)]
        return encode_prompt(self.prompts[i], self.tokenizer, said)

    def record(self, members: list[int], turn: int, outputs: list[list[int]]) -> None:
        """The answers to carry into the next turn: one output per member, in order."""
        for i, ids in zip(members, outputs):
            self.answers[i, turn] = list(ids)

    def longest(self, max_new_tokens: int) -> int:
        """An upper bound on any turn's prompt length: the last turn with empty answers, plus room for them."""
        return max(len(encode_prompt(p, self.tokenizer, [""] * (n - 1))) + (n - 1) * (max_new_tokens + ANSWER_SLACK_TOKENS)
                   for p, n in zip(self.prompts, self.count))
