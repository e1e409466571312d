"""Data plumbing behind sdbench.data.tasks: one reader per file format, book text and long-context prompts.

The public interface is sdbench.data.tasks; Prompt lives here so that both layers can build prompts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    id: str  # stable id within the dataset, e.g. "mt-bench/81"
    category: str  # dataset category ("writing", "math", ...); one default category if the dataset has none
    turns: tuple[str, ...]  # user turns (text), asked in order; later ones follow the answers to earlier ones
    input_ids: tuple[int, ...] | None = None  # set when the prompt is token-exact (long-context prompts)
    chat: bool = True  # apply the tokenizer's chat template when encoding
    answer: str | None = None  # retrieval tasks: the text a right answer contains
    depth: float | None = None  # retrieval tasks: where the answer is hidden, 0 = start of the text, 1 = end
    reference: str | None = None  # the data set's own reply to the first turn (text a head can be fitted on)
