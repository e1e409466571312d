"""Passkey retrieval (the long-context task of Landmark Attention, RULER's simplest needle): a number hidden at
a chosen depth of book text, the question at the end, the whole prompt exactly --prompt-len tokens. Whether
the answer holds the number is recorded per row, so a sparse-KV draft's long-context cost and the target's
retrieval can be read from one run.
"""

from __future__ import annotations

import random

from sdbench.data import Prompt
from sdbench.data.books import Book, long_context_prompts, plain_ids, special_prefix
from sdbench.errors import SdbenchError

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the important information there.\n\n")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"
SENTENCE_SEARCH = 64  # tokens either side of the depth where the needle may move to follow a full stop (at most 5 %)


def spread_depths(count: int, depths: tuple[float, ...] = ()) -> list[float]:
    """The depth of each prompt: the given ones in turn, else evenly from the start (0) to the end (1)."""
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise SdbenchError(f"--depth {d}: a depth is a fraction of the text, from 0 (start) to 1 (end)")
    if depths:
        return [depths[i % len(depths)] for i in range(count)]
    return [0.5] if count == 1 else [i / (count - 1) for i in range(count)]


def _sentence_end(hay: list[int], at: int, tokenizer) -> int:
    """The split point nearest `at` that follows a full stop, so the needle reads as a sentence of its own."""
    if at <= 0 or at >= len(hay):
        return at
    for step in range(min(SENTENCE_SEARCH, len(hay) // 20)):
        for k in (at - step, at + step):
            if 0 < k < len(hay) and tokenizer.decode([hay[k - 1]]).rstrip().endswith("."):
                return k
    return at


def passkey_prompts(books: list[Book], source: str, limit: int, seed: int, prompt_len: int, tokenizer,
                    depths: tuple[float, ...] = ()) -> list[Prompt]:
    """`limit` prompts of exactly prompt_len tokens: BOS (as the tokenizer adds it), the instruction, book text
    with the needle at its depth, and the question, which the answer completes."""
    rng = random.Random(seed)
    keys = [str(rng.randrange(10_000, 100_000)) for _ in range(limit)]
    needles = [plain_ids(tokenizer, NEEDLE.format(key=k)) for k in keys]
    intro, question = plain_ids(tokenizer, INTRO), plain_ids(tokenizer, QUESTION)
    prefix = special_prefix(tokenizer)
    shortest = min(map(len, needles))
    fixed = len(intro) + len(question) + shortest
    if prompt_len - fixed - len(prefix) < 2 * max(map(len, needles)):
        raise SdbenchError(f"--prompt-len {prompt_len} is too short for a passkey prompt (its fixed text alone "
                           f"is {fixed + len(prefix)} tokens); use at least {4 * (fixed + len(prefix))}")
    hays = long_context_prompts(books, source, limit, seed, prompt_len - fixed, tokenizer)
    prompts = []
    for hay, key, needle, depth in zip(hays, keys, needles, spread_depths(limit, depths)):
        text = list(hay.input_ids[len(prefix):])
        text = text[: len(text) - (len(needle) - shortest)]  # a longer needle takes the text's last tokens
        at = _sentence_end(text, round(depth * len(text)), tokenizer)
        ids = prefix + intro + text[:at] + needle + text[at:] + question
        assert len(ids) == prompt_len, (len(ids), prompt_len)
        rest = hay.id.split("/", 1)[1]
        prompts.append(Prompt(id=f"passkey/{rest}/depth-{depth:.2f}", category=f"depth {depth:.0%}",
                              turns=(tokenizer.decode(ids[len(prefix):]),), input_ids=tuple(ids), chat=False,
                              answer=key, depth=depth))
    return prompts


def answer_found(prompt: Prompt, output_ids: list[int], tokenizer) -> bool | None:
    """Whether a retrieval prompt's answer appears in the output; None for prompts without one."""
    if prompt.answer is None:
        return None
    return prompt.answer in tokenizer.decode(output_ids, skip_special_tokens=True)
