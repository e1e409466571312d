"""Task declarations: tasks/<name>.yaml read into `TaskSpec`s (where a data set's records come from, and how
they map to prompts) and the `task_registry` that holds them. Turning a task into prompts is data/tasks.py.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sdbench.errors import SdbenchError
from sdbench.paths import tasks_dir
from sdbench.registry import Entry, Registry

KINDS = ("prompts", "book", "retrieval")


@dataclass(frozen=True)
class Source:
    """One place a task's records can come from."""

    kind: str  # "local" (env var names a path) | "package" (file inside an installed wheel) | "hub"
    ref: str  # the env var, the pip package, or the hub dataset id
    format: str  # jsonl | jsonl.gz | json | sqlite | datasets
    module: str = ""  # package: the import name, to locate its folder
    path: str = ""  # package: the file inside that folder
    install: str = ""  # package: the exact command that installs it
    query: str | None = None  # sqlite: the rows to read, in reading order
    split: str = "train"
    config: str | None = None
    revision: str | None = None  # hub: a branch such as refs/convert/parquet
    data_files: str | None = None
    fields: dict = field(default_factory=dict)  # overrides the task's field map for this source
    files: tuple[str, ...] = ()  # local: the file to read in the folder named, the first that exists ({config})


@dataclass(frozen=True)
class TaskSpec:
    name: str
    description: str
    kind: str  # "prompts": a set of user requests; "book": long running text; "retrieval": built from a book
    sources: tuple[Source, ...]
    fields: dict  # record field per prompt field (id, category, turns | text | conversation, reference, ...)
    aliases: tuple[str, ...] = ()
    label: str = ""  # the name recorded with results; the task name when empty
    default_category: str = "general"
    id_prefix: str | None = None  # "<name>/" when None
    template: str | None = None  # wraps the first turn: "... {text} ..."
    reference_template: str | None = None  # wraps the data set's own reply: "... {text} ... {reference} ..."
    subset: dict | None = None  # size, seed, max_chars: sample and cache a big file once
    count: int | None = None  # documented size of the data set, for the tests
    excerpt_chars: int = 2000  # book passages when no prompt_len is given
    max_books: int | None = None  # book sources: read at most this many records
    strip: str | None = None  # book text: regex of markup to remove
    fallback: str | None = None  # task to use when no source is available
    fallback_label: str = ""
    haystack: str | None = None  # retrieval tasks: the book task whose text hides the answer
    missing: str = ""  # one line on how to get the data when no source is available (else `prepare`)
    placeholder: str | None = None  # a turn starting with this is a stand-in for text the copy does not hold
    prepare: str = ""  # one line on how to make a copy without placeholders
    lengths: tuple[str, ...] = ()  # input-length buckets ("1k", ...) --prompt-len picks; sources' {length}

    @classmethod
    def from_yaml(cls, path: Path) -> "TaskSpec":
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            raise SdbenchError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
        if not isinstance(raw, dict) or "name" not in raw:
            raise SdbenchError(f"{path}: a task file needs at least `name`, `kind` and `sources`")
        raw = dict(raw)
        sources = tuple(_source(path, s, raw.get("format", "")) for s in raw.pop("sources", None) or ())
        raw.pop("format", None)
        raw["aliases"] = tuple(raw.get("aliases") or ())
        raw["lengths"] = tuple(str(n) for n in raw.get("lengths") or ())
        raw.setdefault("description", "")
        raw.setdefault("fields", {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SdbenchError(f"{path}: unknown key(s) {', '.join(unknown)}")
        spec = cls(sources=sources, **raw)
        if spec.kind not in KINDS:
            raise SdbenchError(f"{path}: kind must be one of {', '.join(KINDS)}, not '{spec.kind}'")
        if not spec.sources and not spec.fallback and not spec.haystack:
            raise SdbenchError(f"{path}: no sources, no fallback and no haystack")
        if not all(re.fullmatch(r"[1-9]\d*k", n) for n in spec.lengths):
            raise SdbenchError(f"{path}: lengths are thousands of tokens such as 1k or 32k, not {list(spec.lengths)}")
        return spec

    def length_named(self, prompt_len: int) -> str:
        """The length bucket --prompt-len picks: "8k" for 8000 or 8192 (data sets count a thousand either way)."""
        for name in self.lengths:
            if prompt_len in (int(name[:-1]) * 1000, int(name[:-1]) * 1024):
                return name
        last = self.lengths[-1]
        raise SdbenchError(f"--prompt-len {prompt_len}: task '{self.name}' has input lengths of "
                           f"{', '.join(self.lengths)} tokens only (--prompt-len {last}, {int(last[:-1]) * 1024} or "
                           f"{int(last[:-1]) * 1000} picks {last})")

    def at_length(self, name: str) -> "TaskSpec":
        """The task narrowed to one length bucket: each source's config for it, its label naming it."""
        sources = tuple(dataclasses.replace(s, config=s.config.format(length=name) if s.config else s.config)
                        for s in self.sources)
        return dataclasses.replace(self, sources=sources, label=f"{self.record_label}-{name}", lengths=())

    @property
    def record_label(self) -> str:
        return self.label or self.name


def _source(path: Path, raw: Any, default_format: str) -> Source:
    kinds = [k for k in ("local", "package", "hub") if isinstance(raw, dict) and k in raw]
    if len(kinds) != 1:
        raise SdbenchError(f"{path}: each source needs exactly one of local, package, hub")
    kind = kinds[0]
    raw = dict(raw)
    ref = str(raw.pop(kind))
    fmt = "datasets" if kind == "hub" else raw.pop("format", default_format)
    raw["files"] = tuple(raw.get("files") or ())
    if kind == "package":
        raw.setdefault("install", f"pip install {ref}")
        if "module" not in raw or "path" not in raw:
            raise SdbenchError(f"{path}: package source '{ref}' needs `module` and `path`")
    try:
        return Source(kind=kind, ref=ref, format=fmt, **raw)
    except TypeError as err:
        raise SdbenchError(f"{path}: bad source '{ref}' ({err})") from None


class TaskRegistry(Registry[TaskSpec]):
    """The task registry, filled from tasks/*.yaml on first use (so importing sdbench stays cheap and a
    broken task file fails the command that needs tasks, not every command)."""

    def __init__(self, folder: Path | None = None):
        super().__init__("task")
        self._folder = folder
        self._filled = False

    def _fill(self) -> None:
        if self._filled:
            return
        folder = self._folder or tasks_dir()
        specs = [TaskSpec.from_yaml(p) for p in sorted(folder.glob("*.yaml"))]
        for spec in specs:
            self.add(spec.name, spec, spec.description, spec.aliases, kind=spec.kind)
        self._filled = True

    def entry(self, name: str) -> Entry[TaskSpec]:
        self._fill()
        return super().entry(name)

    def __contains__(self, name: str) -> bool:
        self._fill()
        return super().__contains__(name)

    def __iter__(self):
        self._fill()
        return super().__iter__()


task_registry = TaskRegistry()
