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
from sdbench.data.records import book_pool, prompt_pool
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
    if prompt_len is None:
        return
    if spec.kind == "prompts":
        books = ", ".join(e.name for e in task_registry if e.meta.get("kind") == "book")
        raise SdbenchError(f"--prompt-len needs a book dataset ({books}); '{spec.name}' is a set of prompts")
    if prompt_len < 1:
        raise SdbenchError(f"--prompt-len must be at least 1, got {prompt_len}")
    if tokenizer is None:
        raise SdbenchError("--prompt-len needs the target's tokenizer to cut prompts to an exact token count")


def _load(spec: TaskSpec) -> tuple[Resolved, Sequence[Prompt] | Sequence[Book]]:
    """The resolved source and its prompt pool or books. A hub source that fails mid-way is dropped and the
    task resolved again, so it falls back (to a stand-in, for PG-19) instead of failing the run."""
    res = resolve(spec.name)
    read = (lambda r: book_pool(r, spec.max_books)) if spec.kind == "book" else prompt_pool
    try:
        data = read(res)
    except SdbenchError as err:
        if res.source.kind != "hub":
            raise
        log.warning("%s", err)
        res = resolve(spec.name)  # the failed hub dataset is now skipped
        data = read(res)
    if res.stand_in:
        _warn_stand_in(spec.name, res.label)
    return res, data


def check_dataset(name: str, fields: dict | None = None, depths: tuple[float, ...] = (),
                  prompt_len: int | None = None) -> None:
    """Fails (one line) on a data set that cannot be used as asked: an unknown task, a bad prompt file, prompt
    file fields given for a task, depths given for a task without them. Cheap: a run calls it before loading
    models."""
    retrieval = ", ".join(e.name for e in task_registry if e.meta.get("kind") == "retrieval")
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


def load_prompts(task: str, *, limit: int | None = None, seed: int = 0, prompt_len: int | None = None,
                 tokenizer=None, fields: dict | None = None, depths: tuple[float, ...] = ()) -> list[Prompt]:
    """The prompts of a task or a prompt file: all of them in dataset order (limit None), or `limit` picked by
    `seed`.

    Book tasks give `limit` passages (DEFAULT_LIMIT when None): plain-text excerpts, or with prompt_len
    token-exact prompts of exactly prompt_len tokens (input_ids set, chat off); retrieval tasks give such
    prompts with an answer hidden at `depths` (spread evenly when empty)."""
    check_dataset(task, fields, depths, prompt_len)
    if task not in task_registry:
        if prompt_len is not None:
            raise SdbenchError("--prompt-len needs a book dataset; a prompt file is a set of prompts")
        return _select(load_prompt_file(task, fields), limit, seed)
    spec = task_registry.get(task)
    _check_args(spec, limit, prompt_len, tokenizer)
    res, data = _load(task_registry.get(spec.haystack) if spec.haystack else spec)
    if spec.kind == "prompts":
        return _select(data, limit, seed)
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
    set, so a task that would fall back reports False and names what runs would use instead."""
    spec = task_registry.get(task)
    try:
        res = resolve(spec.name)
    except SdbenchError as err:
        return False, str(err)
    if res.stand_in:
        envs = [f"${s.ref}" for s in spec.sources if s.kind == "local"]
        where = f"set {' or '.join(envs)} or reach the hub" if envs else "reach the hub"
        return False, f"real {spec.name} not found ({where}); runs use {res.label}"
    return True, res.how


def dataset_label(task: str, prompt_len: int | None = None) -> str:
    """The honest name of the data actually used, e.g. "pg19" or "kjv-bible (PG-19 stand-in)". prompt_len is
    accepted so callers can pass a run's settings as they are; the label depends only on the source."""
    if task not in task_registry and is_prompt_file(task):
        return Path(task).name
    spec = task_registry.get(task)
    try:
        return resolve(spec.name).label
    except SdbenchError:
        return spec.record_label  # nothing to load: the label of what was asked for
