"""A user's own prompt file (`--dataset PATH`): .jsonl, .json (an array of records) or .csv.

The MT-Bench / Spec-Bench question format (`question_id`, `category`, `turns`) is read as such; other files
have their columns named with --prompt-field / --category-field / --id-field or guessed. Every problem is
one line naming the file, the line and what is wrong.
"""

from __future__ import annotations

import csv
import functools
import io
import json
from pathlib import Path
from typing import Iterator

from sdbench.data import Prompt
from sdbench.errors import SdbenchError

SUFFIXES = (".jsonl", ".json", ".csv")
PROMPT_GUESSES = ("turns", "prompt", "text", "question", "instruction")
CATEGORY_GUESSES = ("category",)
ID_GUESSES = ("question_id", "id", "prompt_id", "task_id")
REPLY_GUESSES = ("reply", "response", "completion", "output")  # a reply of the file's own: `train-head` reads it
FIELD_OPTIONS = {"prompt": "--prompt-field", "category": "--category-field", "id": "--id-field"}
DEFAULT_CATEGORY = "general"
FORMATS = (  # (name, what it holds): `sdbench list datasets` and the README show these
    ("FILE.jsonl", "one JSON object per line; MT-Bench/Spec-Bench `question_id, category, turns` or any fields"),
    ("FILE.json", "a JSON array of such objects"),
    ("FILE.csv", "a header row, then one prompt per row; a column each for prompt, category, id"),
)

Record = tuple[int, dict]  # (line where the record starts, its fields)


def is_prompt_file(name: str) -> bool:
    """Whether --dataset names a file rather than a registered task."""
    return Path(name).suffix.lower() in SUFFIXES or "/" in name or Path(name).is_file()


def _read_text(path: Path) -> str:
    if path.suffix.lower() not in SUFFIXES:
        raise SdbenchError(f"{path}: unknown prompt file type '{path.suffix}'; use {', '.join(SUFFIXES)}")
    try:
        return path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise SdbenchError(f"{path}: no such prompt file") from None
    except UnicodeDecodeError as err:
        raise SdbenchError(f"{path}: not UTF-8 text (byte {err.start})") from None
    except OSError as err:
        raise SdbenchError(f"{path}: cannot read it ({err.strerror})") from None


def _jsonl(path: Path, text: str) -> Iterator[Record]:
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as err:
            raise SdbenchError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from None


def _json(path: Path, text: str) -> Iterator[Record]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise SdbenchError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(data, list):
        raise SdbenchError(f"{path}:1: expected a JSON array of records, got a {type(data).__name__}")
    # element positions, for line numbers: decode the array again element by element
    decoder, skip, pos = json.JSONDecoder(), json.decoder.WHITESPACE.match, text.index("[") + 1
    for record in data:
        pos = skip(text, pos).end()
        yield text.count("\n", 0, pos) + 1, record
        pos = skip(text, decoder.raw_decode(text, pos)[1]).end() + 1  # past the comma


def _csv(path: Path, text: str) -> Iterator[Record]:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        reader.fieldnames  # reads the header row
        start = reader.line_num + 1
        for row in reader:
            if None in row:
                raise SdbenchError(f"{path}:{start}: {len(row[None])} more value(s) than the header has columns")
            yield start, {k: v for k, v in row.items() if v is not None}
            start = reader.line_num + 1
    except csv.Error as err:
        raise SdbenchError(f"{path}:{reader.line_num}: not valid CSV ({err})") from None


READERS = {".jsonl": _jsonl, ".json": _json, ".csv": _csv}


def _pick(fields: dict, first: dict, key: str, guesses: tuple[str, ...]) -> str | None:
    """The record field for a prompt field: the one the user named, else the first guess the record has."""
    if fields.get(key):
        return fields[key]
    return next((g for g in guesses if g in first), None)


def _turns(path: Path, line: int, value, name: str) -> tuple[str, ...]:
    turns = [value] if isinstance(value, str) else value
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise SdbenchError(f"{path}:{line}: field '{name}' must be a string or a list of strings")
    if not turns or not turns[0].strip():
        raise SdbenchError(f"{path}:{line}: field '{name}' is empty")
    return tuple(turns)


def _field(path: Path, line: int, record: dict, name: str, option: str):
    if name not in record or record[name] in (None, ""):
        has = ", ".join(record) or "none"
        raise SdbenchError(f"{path}:{line}: no value for field '{name}' (fields: {has}; set {option})")
    return record[name]


def _prompts(path: Path, records: list[Record], fields: dict) -> list[Prompt]:
    for line, record in records:
        if not isinstance(record, dict):
            raise SdbenchError(f"{path}:{line}: expected a JSON object, got {type(record).__name__}")
    first_line, first = records[0]
    text_f = _pick(fields, first, "prompt", PROMPT_GUESSES)
    if text_f is None:
        raise SdbenchError(f"{path}:{first_line}: no prompt field (looked for {', '.join(PROMPT_GUESSES)}; "
                           f"name one with --prompt-field)")
    cat_f, id_f = _pick(fields, first, "category", CATEGORY_GUESSES), _pick(fields, first, "id", ID_GUESSES)
    reply_f = next((g for g in REPLY_GUESSES if g in first), None)
    prompts, seen = [], {}
    for line, record in records:
        turns = _turns(path, line, _field(path, line, record, text_f, FIELD_OPTIONS["prompt"]), text_f)
        category = str(_field(path, line, record, cat_f, FIELD_OPTIONS["category"])) if cat_f else DEFAULT_CATEGORY
        rid = str(_field(path, line, record, id_f, FIELD_OPTIONS["id"])) if id_f else str(line)
        if rid in seen:
            raise SdbenchError(f"{path}:{line}: id '{rid}' repeats the record on line {seen[rid]}")
        seen[rid] = line
        reply = record.get(reply_f) if reply_f else None
        prompts.append(Prompt(id=f"{path.stem}/{rid}", category=category, turns=turns,
                              reference=reply if isinstance(reply, str) and reply.strip() else None))
    return prompts


@functools.lru_cache(maxsize=8)
def _load(path: str, fields: tuple[tuple[str, str], ...], stamp: tuple) -> tuple[Prompt, ...]:
    file = Path(path)
    text = _read_text(file)
    records = list(READERS[file.suffix.lower()](file, text))
    if not records:
        raise SdbenchError(f"{file}: holds no prompts")
    return tuple(_prompts(file, records, dict(fields)))


def load_prompt_file(path: str, fields: dict | None = None) -> list[Prompt]:
    """Every prompt of the file, in file order. fields: prompt / category / id -> the record's field name."""
    unknown = sorted(set(fields or {}) - set(FIELD_OPTIONS))
    if unknown:
        raise SdbenchError(f"unknown prompt-file field(s) {', '.join(unknown)}; known: {', '.join(FIELD_OPTIONS)}")
    try:
        stat = Path(path).stat()
        stamp: tuple = (stat.st_size, stat.st_mtime_ns)
    except OSError:
        stamp = ()
    return list(_load(path, tuple(sorted((k, v) for k, v in (fields or {}).items() if v)), stamp))
