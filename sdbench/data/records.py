"""A task's records as prompts or books: each record mapped to a Prompt through the task's fields and
templates, a big data set's seeded sample built once and cached as a small JSON file, and the prompts or books
loaded kept per source for the process. data/sources.py finds and reads the records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any, Sequence

from sdbench.data import Prompt
from sdbench.data.books import Book, assemble_books
from sdbench.data.sources import Resolved, read_records
from sdbench.data.specs import TaskSpec
from sdbench.errors import SdbenchError
from sdbench.paths import cache_dir

SUBSET_CACHE_VERSION = 2  # bump when the cached subset's layout or selection rule changes


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
    for index, record in enumerate(read_records(res)):
        try:
            prompt = _to_prompt(spec, fields, record, index)
        except KeyError as err:
            raise SdbenchError(f"{res.location}: record {index} has no field {err} (task {spec.name})") from None
        if prompt is not None and prompt.id not in seen:  # ShareGPT repeats some ids: keep the first
            seen.add(prompt.id)
            prompts.append(prompt)
    return prompts


def refuse_placeholders(res: Resolved, prompts: Sequence[Prompt]) -> None:
    """One line when a task declares a placeholder and any turn is one (text the copy does not hold): a run over
    them would measure the placeholder, not the data set."""
    spec = res.spec
    held = [p for p in prompts if spec.placeholder and any(t.startswith(spec.placeholder) for t in p.turns)]
    if held:
        where = f"{res.location} ({res.source.config})" if res.source.kind == "hub" else res.location
        raise SdbenchError(f"task '{spec.name}': {len(held)} of {len(prompts)} prompts in {where} are placeholders, "
                           f"not prompts (the first: {held[0].id}, {held[0].category}), so nothing was run: "
                           f"{spec.prepare or spec.missing}")


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


# Loaded data per (task, source, location, config): the key changes when the environment points elsewhere, and
# a hub source's config (one location, a split per length bucket) is part of it.
_POOLS: dict[tuple[str, int, str, str | None], tuple[Prompt, ...]] = {}
_BOOKS: dict[tuple[str, int, str], tuple[Book, ...]] = {}


def prompt_pool(res: Resolved) -> tuple[Prompt, ...]:
    """A prompt task's prompts from that source (a subset task's cached sample), loaded once per process."""
    key = (res.spec.name, res.index, res.location, res.source.config)
    if key not in _POOLS:
        _POOLS[key] = tuple(_subset(res) if res.spec.subset else _map_records(res))
    return _POOLS[key]


def book_pool(res: Resolved, max_books: int | None) -> tuple[Book, ...]:
    """A book task's books from that source (from at most max_books records), assembled once per process."""
    key = (res.spec.name, res.index, res.location)
    if key not in _BOOKS:
        fields = {**res.spec.fields, **res.source.fields}
        _BOOKS[key] = tuple(assemble_books(read_records(res, max_books), fields, res.spec.strip, res.spec.name))
    return _BOOKS[key]
