"""Book text: records assembled into running prose, cut into passages or token-exact long-context prompts."""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any, Sequence

from sdbench.data import Prompt
from sdbench.errors import SdbenchError

# English prose runs ~4-5 characters per token for BPE vocabularies; 6 leaves a margin so that one
# tokenizer call is usually enough. The span doubles when it still falls short.
CHARS_PER_TOKEN = 6
_SPACE = re.compile(r"\s+")

Book = tuple[str, str]  # (title, text)


def assemble_books(records: Sequence[Mapping], fields: Mapping[str, Any], strip: str | None, name: str) -> list[Book]:
    """Records -> books. Consecutive records with the same `title` form one book (no title field: one book
    named after the source); a new `heading` value is written as a heading line, a new `paragraph` value
    starts a paragraph, and `strip` (a regex) removes markup such as verse numbers."""
    title_f, heading_f, para_f, text_f = (fields.get(k) for k in ("title", "heading", "paragraph", "text"))
    pattern = re.compile(strip) if strip else None
    books: list[tuple[str, list[str]]] = []
    heading = para = None
    for record in records:
        title = str(record[title_f]) if title_f else name
        if not books or books[-1][0] != title:
            books.append((title, []))
            heading = para = None
        parts = books[-1][1]
        text = str(record[text_f] or "")
        if pattern:
            text = pattern.sub(" ", text)  # a space, not nothing: the markup may sit between two words
        if heading_f and record[heading_f] != heading:
            heading = record[heading_f]
            parts.append(("\n\n" if parts else "") + f"{heading}\n\n")
        elif para_f and record[para_f] != para:
            parts.append("\n\n" if parts else "")
        elif parts:
            parts.append(" ")
        para = record[para_f] if para_f else None
        parts.append(text.strip())
    return [(title, "".join(parts)) for title, parts in books if parts]


# --- token helpers ----------------------------------------------------------------------------------------


def as_id_list(out: Any) -> list[int]:
    """Token ids from whatever a tokenizer returned: a list, a batch of one, a tensor, or a dict /
    BatchEncoding (transformers 5 `apply_chat_template` returns one by default)."""
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    out = list(out)
    if out and isinstance(out[0], (list, tuple)):
        if len(out) != 1:
            raise ValueError(f"expected one sequence of token ids, got a batch of {len(out)}")
        out = list(out[0])
    return [int(t) for t in out]


def plain_ids(tokenizer, text: str, special: bool = False) -> list[int]:
    # verbose=False: long spans exceed model_max_length on purpose; the length warning would only alarm
    return as_id_list(tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"])


def special_prefix(tokenizer) -> list[int]:
    """The special tokens a plain encoding puts before the text (a BOS, for Llama-style tokenizers)."""
    bare, full = plain_ids(tokenizer, "a"), plain_ids(tokenizer, "a", special=True)
    for k in range(len(full) - len(bare) + 1):
        if full[k : k + len(bare)] == bare:
            return full[:k]
    return []


# --- passages ---------------------------------------------------------------------------------------------


def _word_start(text: str, pos: int) -> int:
    """The start of the first whole word at or after pos, so a passage never opens mid-word."""
    if pos <= 0:
        return 0
    m = _SPACE.search(text, pos - 1)
    return m.end() if m else pos


def _prompt_id(source: str, title: str, offset: int, unit: str) -> str:
    if title == source:  # one-book source (the KJV): the offset alone places the passage
        return f"{source}/off-{offset}/{unit}"
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:40] or "book"
    return f"{source}/{slug}/off-{offset}/{unit}"


def token_span(text: str, n: int, tokenizer, rng: random.Random) -> tuple[list[int], int] | None:
    """n token ids of text from a seeded word start, tokenizing only a span a little longer than needed
    (tokenizing a whole 4 MB book takes seconds). None when the whole text is shorter than n tokens."""
    if n > len(text.encode("utf-8")):
        return None  # no tokenizer makes more tokens than bytes: skip tokenizing a book that cannot fit
    chars = n * CHARS_PER_TOKEN + 64
    offset = _word_start(text, rng.randrange(len(text) - chars)) if len(text) > chars else 0
    while True:
        end = offset + chars
        ids = plain_ids(tokenizer, text[offset:end])
        # more than n unless the span reached the end: the n-th token must not be a word cut by the span
        if len(ids) > n or (len(ids) == n and end >= len(text)):
            return ids[:n], offset
        if offset == 0 and end >= len(text):
            return None
        chars *= 2
        if offset + chars > len(text):
            offset = _word_start(text, max(0, len(text) - chars))


def long_context_prompts(books: list[Book], source: str, limit: int, seed: int, prompt_len: int,
                         tokenizer) -> list[Prompt]:
    """`limit` prompts of exactly prompt_len tokens (the tokenizer's own BOS included, as a plain encoding
    would add it), round-robin over the books in a seeded order."""
    prefix = special_prefix(tokenizer)
    body = prompt_len - len(prefix)
    if body < 1:
        raise SdbenchError(f"--prompt-len {prompt_len} leaves no room for text after {len(prefix)} special token(s)")
    rng = random.Random(seed)
    order = rng.sample(range(len(books)), len(books))
    prompts: list[Prompt] = []
    turn = 0
    while len(prompts) < limit:
        if not order:
            raise SdbenchError(f"no book in {source} is {prompt_len} tokens long; use a smaller --prompt-len")
        index = order[turn % len(order)]
        title, text = books[index]
        span = token_span(text, body, tokenizer, rng)
        if span is None:
            order.remove(index)  # too short for this length; the others keep their turns
            continue
        ids, offset = span
        prompts.append(Prompt(id=_prompt_id(source, title, offset, f"len-{prompt_len}"), category="long-context",
                              turns=(tokenizer.decode(ids),), input_ids=tuple(prefix + ids), chat=False))
        turn += 1
    return prompts


def excerpt_prompts(books: list[Book], source: str, limit: int, seed: int, chars: int) -> list[Prompt]:
    """Plain-text passages of about `chars` characters, cut at word boundaries (no tokenizer needed)."""
    rng = random.Random(seed)
    order = rng.sample(range(len(books)), len(books))
    prompts = []
    for i in range(limit):
        title, text = books[order[i % len(order)]]
        start = _word_start(text, rng.randrange(max(1, len(text) - chars)))
        cut = text.rfind(" ", start, start + chars)
        end = cut if cut > start and start + chars < len(text) else start + chars
        prompts.append(Prompt(id=_prompt_id(source, title, start, f"chars-{end - start}"), category="book",
                              turns=(text[start:end],), chat=False))
    return prompts
