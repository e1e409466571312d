"""REST datastores on disk: a corpus in one tokenizer's ids with its suffix array, under the user's cache.

`sdbench datastore build NAME` writes the folder datastores/NAME (tokens.npy, suffixes.npy, datastore.json);
`run --strategy rest --set datastore=NAME` reads it. The JSON records the tokenizer the ids are in (a run with
another tokenizer is refused) and the ids of the prompts whose text it holds (a run on them is told).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from sdbench.drafting.retrieval import SEP, suffix_array
from sdbench.errors import SdbenchError
from sdbench.paths import cache_dir

META = "datastore.json"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class DatastoreMeta:
    """What datastore.json holds."""

    name: str
    target: str  # the model whose tokenizer made the ids, as the user named it
    tokenizer: str  # the tokenizer's name or path
    vocab_hash: str  # of its token -> id map (`vocab_hash`): the ids mean the same only under the same map
    source: str  # what --from named
    documents: int = 0
    tokens: int = 0
    prompt_ids: list[str] = field(default_factory=list)  # the data set prompts whose text it holds
    created: str = ""


@dataclass
class Datastore:
    meta: DatastoreMeta
    tokens: np.ndarray  # [n] int32: the documents' ids, each followed by SEP
    suffixes: np.ndarray  # [n] int64: suffix_array(tokens)


def vocab_hash(tokenizer) -> str:
    """A short hash of a tokenizer's token -> id map and its specials: equal for tokenizers that give the same ids."""
    vocab = sorted(tokenizer.get_vocab().items())
    specials = [getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id")]
    return hashlib.sha256(json.dumps([vocab, specials]).encode()).hexdigest()[:16]


def check_name(name: str) -> None:
    if not NAME_RE.match(name or ""):
        raise SdbenchError(f"datastore name '{name}': use letters, digits, '.', '_' and '-' (starting with a letter "
                           "or digit)")


def folder(name: str) -> Path:
    return cache_dir("datastores") / name


def build_command(name: str, target: str | None = None, source: str = "DATASET|FILE") -> str:
    return f"sdbench datastore build {name} --from {source}" + (f" --target {target}" if target else "")


def exists(name: str) -> bool:
    return (folder(name) / META).is_file()


def index(documents: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The concatenated documents (each followed by SEP) and their suffix array."""
    tokens = np.fromiter((t for doc in documents for t in (*doc, SEP)), dtype=np.int32)
    return tokens, suffix_array(tokens)


def save(meta: DatastoreMeta, tokens: np.ndarray, suffixes: np.ndarray) -> Path:
    """Write the datastore, replacing one of the same name only once the new one is complete."""
    check_name(meta.name)
    final = folder(meta.name)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    np.save(tmp / "tokens.npy", tokens)
    np.save(tmp / "suffixes.npy", suffixes)
    (tmp / META).write_text(json.dumps(asdict(meta), indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def read_meta(name: str) -> DatastoreMeta | None:
    try:
        data = json.loads((folder(name) / META).read_text())
        return DatastoreMeta(**{k: v for k, v in data.items() if k in DatastoreMeta.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return None


def need(name: str, target: str | None = None) -> DatastoreMeta:
    """The datastore's record, or the one line saying how to build it."""
    check_name(name)
    meta = read_meta(name)
    if meta is None:
        raise SdbenchError(f"--set datastore={name}: no such datastore; build it with `{build_command(name, target)}`")
    return meta


def load(name: str, tokenizer=None, target: str = "") -> Datastore:
    """The datastore `name`, refused (one line) when `tokenizer` (the target's) is not the one it was built with."""
    meta = need(name, target or None)
    if tokenizer is not None and vocab_hash(tokenizer) != meta.vocab_hash:
        raise SdbenchError(f"--set datastore={name} holds token ids of {meta.target}'s tokenizer, not of "
                           f"{target or 'the target'}'s; build one for it with "
                           f"`{build_command('NEW_NAME', target or None, meta.source)}`")
    try:
        tokens = np.load(folder(name) / "tokens.npy")
        suffixes = np.load(folder(name) / "suffixes.npy")
    except (OSError, ValueError) as err:
        raise SdbenchError(f"--set datastore={name}: unreadable ({err}); build it again with "
                           f"`{build_command(name, meta.target, meta.source)}`") from None
    if len(tokens) != len(suffixes):
        raise SdbenchError(f"--set datastore={name}: its files disagree; build it again with "
                           f"`{build_command(name, meta.target, meta.source)}`")
    return Datastore(meta, tokens, suffixes)


def known() -> list[DatastoreMeta]:
    """Every datastore in the cache, by name."""
    base = cache_dir("datastores")
    return [m for m in (read_meta(p.name) for p in sorted(base.iterdir()) if p.is_dir()) if m is not None]


def held_note(name: str, prompt_ids: list[str]) -> str | None:
    """One line when a run evaluates prompts whose text the datastore holds (None otherwise)."""
    meta = read_meta(name) if name else None
    if meta is None:
        return None
    held = set(meta.prompt_ids)
    both = [i for i in prompt_ids if i in held]
    if not both:
        return None
    return (f"--set datastore={name} holds the text of {len(both)} of these {len(prompt_ids)} prompts (e.g. "
            f"{both[0]}): its acceptance on them overstates what unseen prompts get; build one from another data set")
