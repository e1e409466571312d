"""Tasks are data: each tasks/<name>.yaml declares a data set, where to find it and how its records map to
prompts (data/specs.py reads those files into `task_registry`). This module turns a task into prompts: it checks
the arguments, loads the task's prompts or books (data/sources.py finds the records, data/records.py maps them),
picks prompts by seed, and cuts book text into passages, long-context or passkey prompts; a run's stand-in data
set is labelled as such.
"""

from __future__ import annotations

import functools
import logging
import random
from pathlib import Path
from typing import Sequence

from sdbench.config import DEFAULT_LIMIT
from sdbench.data import Prompt
from sdbench.data.books import Book, as_id_list, excerpt_prompts, long_context_prompts, plain_ids
from sdbench.data.files import is_prompt_file, load_prompt_file
from sdbench.data.passkey import passkey_prompts
from sdbench.data.records import book_pool, prompt_pool, refuse_placeholders
from sdbench.data.sources import Resolved, resolve
from sdbench.data.specs import TaskSpec, task_registry
from sdbench.errors import SdbenchError

__all__ = ["dataset_available", "dataset_label", "encode_prompt", "load_prompts"]

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _warn_stand_in(name: str, label: str) -> None:
    # cached: one warning per process, however often the task is loaded
    log.warning("real %s is not available (no local copy, hub unreachable); using %s", name, label)


def _select(pool: Sequence[Prompt], limit: int | None, seed: int) -> list[Prompt]:
    """Seeded, stratified: categories in a seeded order, prompts in a seeded order within each, taken
    round-robin, so a small limit covers several categories and limit n is a prefix of limit n + 1."""
    if limit is None:
        return list(pool)
    rng = random.Random(seed)
    by_category: dict[str, list[Prompt]] = {}
    for prompt in pool:
        by_category.setdefault(prompt.category, []).append(prompt)
    categories = sorted(by_category)
    rng.shuffle(categories)
    queues = [rng.sample(by_category[c], len(by_category[c])) for c in categories]
    picked: list[Prompt] = []
    for rank in range(max(map(len, queues), default=0)):
        picked.extend(q[rank] for q in queues if rank < len(q))
        if len(picked) >= limit:
            break
    return picked[:limit]


# --- public interface ----------------------------------------------------------------------------------------


def _check_args(spec: TaskSpec, limit: int | None, prompt_len: int | None, tokenizer) -> None:
    if limit is not None and limit < 1:
        raise SdbenchError(f"--limit must be at least 1, got {limit}")
    _check_prompt_len(spec, prompt_len)
    if prompt_len is not None and not spec.lengths and tokenizer is None:
        raise SdbenchError("--prompt-len needs the target's tokenizer to cut prompts to an exact token count")


def _check_prompt_len(spec: TaskSpec, prompt_len: int | None) -> None:
    """--prompt-len cuts book text to a length, or picks a task's length bucket; a task with buckets needs it."""
    if prompt_len is None:
        if spec.lengths:
            raise SdbenchError(f"task '{spec.name}' needs --prompt-len: one of {', '.join(spec.lengths)} (its "
                               "input-length buckets)")
        return
    if prompt_len < 1:
        raise SdbenchError(f"--prompt-len must be at least 1, got {prompt_len}")
    if spec.lengths:
        spec.length_named(prompt_len)  # refuses a length the task does not have
    elif spec.kind == "prompts":
        books = ", ".join(e.name for e in task_registry if e.meta.get("kind") == "book")
        buckets = ", ".join(e.name for e in task_registry if e.load().lengths)
        raise SdbenchError(f"--prompt-len needs a book dataset ({books}) or a data set of input-length buckets "
                           f"({buckets}); '{spec.name}' is a set of prompts")


def _load(spec: TaskSpec) -> tuple[Resolved, Sequence[Prompt] | Sequence[Book]]:
    """The resolved source and its prompt pool or books. A hub source that fails mid-way is dropped and the
    task resolved again, so it falls back (to a stand-in, for PG-19) instead of failing the run. Prompts that
    are placeholders are refused, whichever source holds them."""
    res = resolve(spec)
    read = (lambda r: book_pool(r, spec.max_books)) if spec.kind == "book" else prompt_pool
    try:
        data = read(res)
    except SdbenchError as err:
        if res.source.kind != "hub":
            raise
        log.warning("%s", err)
        res = resolve(spec)  # the failed hub dataset is now skipped
        data = read(res)
    if res.stand_in:
        _warn_stand_in(spec.name, res.label)
    if spec.kind == "prompts":
        refuse_placeholders(res, data)
    return res, data


def _named(task: str) -> tuple[str, str | None]:
    """(task, category) of 'TASK@CATEGORY' (that category's prompts only); (task, None) for a task or a file."""
    name, at, category = task.rpartition("@")
    return (name, category) if at and task not in task_registry and name in task_registry else (task, None)


def _prompts(spec: TaskSpec, category: str | None, prompt_len: int | None) -> list[Prompt]:
    """A prompt task's pool: at --prompt-len's bucket for a task of length buckets, of one category if asked."""
    if spec.lengths:
        spec = spec.at_length(spec.length_named(prompt_len))
    pool = _load(spec)[1]
    if category is None:
        return list(pool)
    category = _category(spec, pool, category)
    return [p for p in pool if p.category == category]


def _category(spec: TaskSpec, pool: Sequence[Prompt], asked: str) -> str:
    """The category 'TASK@NAME' asks for: its own name, or the one that begins so (high: high_entropy)."""
    have = sorted({p.category for p in pool})
    matching = [c for c in have if c == asked] or [c for c in have if c.startswith(asked)]
    if len(matching) != 1:
        raise SdbenchError(f"task '{spec.name}' has no category '{asked}'{' alone' if matching else ''}: "
                           f"{', '.join(have)}")
    return matching[0]


def check_dataset(name: str, fields: dict | None = None, depths: tuple[float, ...] = (),
                  prompt_len: int | None = None) -> None:
    """Fails (one line) on a data set that cannot be used as asked: an unknown task or category, a bad prompt
    file, prompt file fields given for a task, depths given for a task without them, a --prompt-len it cannot
    take. Cheap, so a run calls it before loading models; a task that picks a bucket or a category, or declares
    placeholders, is loaded here too (kept for the run), so that missing or unprepared data fails first."""
    retrieval = ", ".join(e.name for e in task_registry if e.meta.get("kind") == "retrieval")
    name, category = _named(name)
    if name not in task_registry and is_prompt_file(name):
        if depths:
            raise SdbenchError(f"--depth applies to retrieval tasks ({retrieval}), not to a prompt file")
        load_prompt_file(name, fields)
        return
    spec = task_registry.get(name)
    if any((fields or {}).values()):
        raise SdbenchError("--prompt-field, --category-field and --id-field apply to --dataset FILE only")
    if depths and spec.kind != "retrieval":
        raise SdbenchError(f"--depth applies to retrieval tasks ({retrieval}), not '{name}'")
    if prompt_len is None and spec.kind == "retrieval":
        raise SdbenchError(f"task '{spec.name}' needs --prompt-len: the length of each prompt in tokens")
    if category is not None and spec.kind != "prompts":
        raise SdbenchError(f"{name}@{category}: a category applies to a set of prompts; '{name}' is a {spec.kind} "
                           "task")
    _check_prompt_len(spec, prompt_len)
    if spec.kind == "prompts" and (spec.placeholder or spec.lengths or category is not None):
        _prompts(spec, category, prompt_len)


def load_prompts(task: str, *, limit: int | None = None, seed: int = 0, prompt_len: int | None = None,
                 tokenizer=None, fields: dict | None = None, depths: tuple[float, ...] = ()) -> list[Prompt]:
    """The prompts of a task or a prompt file: all of them in dataset order (limit None), or `limit` picked by
    `seed`. 'TASK@CATEGORY' keeps that category's prompts only; a task of length buckets reads the one
    prompt_len picks.

    Book tasks give `limit` passages (DEFAULT_LIMIT when None): plain-text excerpts, or with prompt_len
    token-exact prompts of exactly prompt_len tokens (input_ids set, chat off); retrieval tasks give such
    prompts with an answer hidden at `depths` (spread evenly when empty)."""
    check_dataset(task, fields, depths, prompt_len)
    name, category = _named(task)
    if name not in task_registry:
        if prompt_len is not None:
            raise SdbenchError("--prompt-len needs a book dataset; a prompt file is a set of prompts")
        return _select(load_prompt_file(task, fields), limit, seed)
    spec = task_registry.get(name)
    _check_args(spec, limit, prompt_len, tokenizer)
    if spec.kind == "prompts":
        return _select(_prompts(spec, category, prompt_len), limit, seed)
    res, data = _load(task_registry.get(spec.haystack) if spec.haystack else spec)
    books = list(data)
    if not books:
        raise SdbenchError(f"task '{spec.name}': {res.location} holds no book text")
    count = DEFAULT_LIMIT if limit is None else limit
    if spec.kind == "retrieval":
        return passkey_prompts(books, res.spec.name, count, seed, prompt_len, tokenizer, depths)
    if prompt_len is None:
        return excerpt_prompts(books, res.spec.name, count, seed, spec.excerpt_chars)
    return long_context_prompts(books, res.spec.name, count, seed, prompt_len, tokenizer)


def encode_prompt(prompt: Prompt, tokenizer, answers: Sequence[str] = ()) -> list[int]:
    """Token ids to feed the model for the prompt's turn len(answers) + 1, `answers` being the replies to the
    turns before it: the prompt's own ids when token-exact; else the conversation so far through the chat
    template (with the generation prompt) when the prompt is chat and the tokenizer has one; else the plain
    encoding of the turns and answers one paragraph each, special tokens (BOS) included as the tokenizer
    adds them."""
    if prompt.input_ids is not None:
        return list(prompt.input_ids)
    said = [x for turn, answer in zip(prompt.turns, answers) for x in (turn, answer)] + [prompt.turns[len(answers)]]
    if prompt.chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": ("user", "assistant")[k % 2], "content": text} for k, text in enumerate(said)]
        return as_id_list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return plain_ids(tokenizer, "\n\n".join(said), special=True)


def dataset_available(task: str) -> tuple[bool, str]:
    """(usable offline right now?, one line saying from where, or what to do). A stand-in is not the data
    set, so a task that would fall back reports False and names what runs would use instead. A task of length
    buckets is usable when one of them is, and the line names those that are."""
    spec = task_registry.get(task)
    if not spec.lengths:
        return _available(spec)
    found = {name: _available(spec.at_length(name)) for name in spec.lengths}
    usable = [name for name, (ok, _) in found.items() if ok]
    if not usable:
        return found[spec.lengths[0]]
    return True, f"{found[usable[0]][1]}; --prompt-len {', '.join(usable)}"


def _available(spec: TaskSpec) -> tuple[bool, str]:
    try:
        res = resolve(spec)
    except SdbenchError as err:
        return False, str(err)
    if res.stand_in:
        envs = [f"${s.ref}" for s in spec.sources if s.kind == "local"]
        where = f"set {' or '.join(envs)} or reach the hub" if envs else "reach the hub"
        return False, f"real {spec.name} not found ({where}); runs use {res.label}"
    return True, res.how


def dataset_label(task: str, prompt_len: int | None = None) -> str:
    """The honest name of the data actually used, e.g. "pg19", "kjv-bible (PG-19 stand-in)" or, for a length
    bucket's category, "speed-bench-throughput-8k@high_entropy". prompt_len matters only to a task of length
    buckets; otherwise the label depends only on the source."""
    name, category = _named(task)
    if name not in task_registry and is_prompt_file(task):
        return Path(task).name
    spec = task_registry.get(name)
    try:
        if spec.lengths and prompt_len is not None:
            spec = spec.at_length(spec.length_named(prompt_len))
        label = resolve(spec).label
        return label if category is None else f"{label}@{_category(spec, _load(spec)[1], category)}"
    except SdbenchError:  # nothing to load: the label of what was asked for
        return spec.record_label if category is None else f"{spec.record_label}@{category}"
