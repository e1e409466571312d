"""One reader per format. Each returns the records of a file (or a `datasets` source) as a list of dicts.

Readers are cached per location, so a task loaded twice in one process is parsed once.
"""

from __future__ import annotations

import functools
import gzip
import json
import logging
import os
import sqlite3
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

from sdbench.data.speed_bench import read_prepared
from sdbench.errors import SdbenchError

log = logging.getLogger(__name__)


def one_line(err: BaseException) -> str:
    """An exception as one line: library messages often span several."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"

HUB_PROBE_TIMEOUT_S = 3.0


def _jsonl_lines(lines: Iterator[str], where: str) -> list[dict]:
    records = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise SdbenchError(f"{where}:{number}: not a JSON line ({err.msg})") from None
    return records


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return _jsonl_lines(fh, str(path))


def read_jsonl_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return _jsonl_lines(fh, str(path))


def read_json(path: Path) -> list[dict]:
    """A top-level JSON array, read element by element.

    Element-wise decoding keeps every complete record of a file that was cut off mid-way (the embedded
    ShareGPT file is), where json.load would reject the whole file.
    """
    text = Path(path).read_text(encoding="utf-8")
    decoder, skip = json.JSONDecoder(), json.decoder.WHITESPACE.match
    pos = skip(text, 0).end()
    if text[pos : pos + 1] != "[":
        raise SdbenchError(f"{path}: expected a JSON array of records")
    records, pos = [], pos + 1
    while True:
        pos = skip(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            log.info("%s is cut off after %d complete records; using those", path, len(records))
            break
        records.append(record)
        pos = skip(text, pos).end()
        if text[pos : pos + 1] == ",":
            pos += 1
    return records


def read_sqlite(path: Path, query: str) -> list[dict]:
    # read-only URI: the file lives inside an installed package and must never be touched
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        conn.row_factory = sqlite3.Row
        return [dict(row) for row in conn.execute(query)]
    except sqlite3.Error as err:
        raise SdbenchError(f"{path}: query failed ({one_line(err)})") from None
    finally:
        conn.close()


FILE_READERS: dict[str, Callable[..., list[dict]]] = {
    "jsonl": read_jsonl,
    "jsonl.gz": read_jsonl_gz,
    "json": read_json,
    "sqlite": read_sqlite,
    "speed-bench": read_prepared,  # a split as SPEED-Bench's preparation writes it (parquet or JSON lines)
}


def read_file(fmt: str, path: str, query: str | None = None, cached: bool = True) -> tuple[dict, ...]:
    """Records of one file; cached unless asked not to (a big file read once for a cached sample should
    not stay in memory), so callers must not mutate them."""
    return _read_file_cached(fmt, path, query) if cached else _read_file(fmt, path, query)


@functools.lru_cache(maxsize=8)
def _read_file_cached(fmt: str, path: str, query: str | None) -> tuple[dict, ...]:
    return _read_file(fmt, path, query)


def _read_file(fmt: str, path: str, query: str | None) -> tuple[dict, ...]:
    if fmt not in FILE_READERS:
        raise SdbenchError(f"unknown task format '{fmt}'; known: {', '.join(FILE_READERS)}, datasets")
    if fmt == "sqlite":
        if not query:
            raise SdbenchError(f"{path}: a sqlite source needs a `query`")
        return tuple(read_sqlite(Path(path), query))
    return tuple(FILE_READERS[fmt](Path(path)))


# --- sources read through the `datasets` library (imported only here: it is slow to import) ---------------


def hub_offline() -> bool:
    """True when the user told the HF libraries to stay offline."""
    flags = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(f, "").strip().lower() in ("1", "true", "yes", "on") for f in flags)


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


# Hub datasets that failed to load in this process: later lookups skip them, so the source that is
# actually used (and the label recorded for it) is the same for every call after a failure.
_HUB_FAILED: set[str] = set()


@functools.lru_cache(maxsize=16)
def _hub_answers(endpoint: str, repo: str) -> bool:
    """One short request for the dataset's hub page, so an unreachable hub costs seconds, not the
    libraries' long retries. Only a 2xx counts: sandboxes and proxies answer errors for any address."""
    try:
        with urllib.request.urlopen(f"{endpoint}/api/datasets/{repo}", timeout=HUB_PROBE_TIMEOUT_S) as reply:
            return 200 <= reply.status < 300
    except (OSError, ValueError):  # URLError and HTTPError are OSErrors
        return False


def hub_usable(repo: str) -> bool:
    return not hub_offline() and repo not in _HUB_FAILED and _hub_answers(hub_endpoint(), repo)


def _datasets():
    try:
        import datasets  # slow to import, and only a hub source needs it
    except ImportError:
        raise SdbenchError("reading this source needs `datasets`: run `pip install datasets`") from None
    return datasets


def _local_dataset(path: Path, split: str):
    """A save_to_disk folder, a folder of data files, or one data file."""
    datasets = _datasets()
    if path.is_dir() and any((path / f).exists() for f in ("dataset_dict.json", "state.json")):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise SdbenchError(f"{path}: no '{split}' split (has {', '.join(loaded)})")
            return loaded[split]
        return loaded
    if path.is_dir():
        return datasets.load_dataset(str(path), split=split)
    builders = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow", ".csv": "csv"}
    builder = builders.get(path.suffix.lower())
    if builder is None:
        raise SdbenchError(f"{path}: expected a dataset folder or a {'/'.join(builders)} file")
    return datasets.load_dataset(builder, data_files=str(path), split="train")


def read_local_dataset(path: str, split: str, max_records: int | None = None) -> list[dict]:
    try:
        ds = _local_dataset(Path(path), split)
        n = len(ds) if max_records is None else min(len(ds), max_records)
        return [ds[i] for i in range(n)]
    except SdbenchError:
        raise
    except Exception as err:  # datasets raises many kinds; the user needs one line either way
        raise SdbenchError(f"could not read the dataset at {path}: {one_line(err)}") from None


def read_hub(repo: str, split: str, config: str | None = None, data_files: str | None = None,
             revision: str | None = None, max_records: int | None = None) -> list[dict]:
    """Stream a hub dataset (never downloads more than the records taken)."""
    datasets = _datasets()
    try:
        stream = datasets.load_dataset(repo, config, split=split, data_files=data_files, revision=revision,
                                       streaming=True)
        records = []
        for record in stream:
            records.append(dict(record))
            if max_records is not None and len(records) >= max_records:
                break
        return records
    except Exception as err:  # network, auth and format errors all end the same way for the user
        _HUB_FAILED.add(repo)
        raise SdbenchError(f"could not stream {repo} ({split}) from the hub: {one_line(err)}") from None
