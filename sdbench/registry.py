"""One registry per kind of thing (strategies, tasks, model aliases), with aliases and lazy targets."""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, field
from typing import Any, Generic, Iterator, TypeVar

from sdbench.errors import SdbenchError

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    target: Any  # the object, or "module:attr" resolved on first use
    description: str = ""
    aliases: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict)

    def load(self) -> T:
        if isinstance(self.target, str) and ":" in self.target:
            module, attr = self.target.split(":", 1)
            return getattr(importlib.import_module(module), attr)
        return self.target


class Registry(Generic[T]):
    """Name -> entry, with aliases. Lookup errors are one-line SdbenchErrors with suggestions."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}
        self._alias: dict[str, str] = {}

    def add(self, name: str, target: Any, description: str = "", aliases: tuple[str, ...] = (), **meta) -> Entry[T]:
        key = name.lower()
        if key in self._alias:
            raise ValueError(f"{self.kind} '{name}' registered twice")
        entry = Entry(name=name, target=target, description=description, aliases=tuple(aliases), meta=meta)
        self._entries[key] = entry
        for a in (key, *(x.lower() for x in aliases)):
            if a in self._alias and self._alias[a] != key:
                raise ValueError(f"{self.kind} alias '{a}' registered twice")
            self._alias[a] = key
        return entry

    def remove(self, name: str) -> None:
        """Take an entry and its aliases out (a registration a test made)."""
        key = self.entry(name).name.lower()
        del self._entries[key]
        self._alias = {a: k for a, k in self._alias.items() if k != key}

    def __contains__(self, name: str) -> bool:
        return name.lower() in self._alias

    def entry(self, name: str) -> Entry[T]:
        key = self._alias.get(name.lower())
        if key is None:
            known = sorted(self._entries)
            close = difflib.get_close_matches(name.lower(), list(self._alias), n=1)
            hint = f" (did you mean '{self._alias[close[0]]}'?)" if close else ""
            raise SdbenchError(f"unknown {self.kind} '{name}'{hint}; known: {', '.join(known)}")
        return self._entries[key]

    def get(self, name: str) -> T:
        return self.entry(name).load()

    def __iter__(self) -> Iterator[Entry[T]]:
        return iter(sorted(self._entries.values(), key=lambda e: e.name))

    def names(self) -> list[str]:
        return [e.name for e in self]
