"""The base of every strategy's typed per-row stats: what `Proposer.row_stats` returns (as `to_dict()`) and the
results keep, as JSON, in the `strategy_stats` column; readers parse it back with `from_dict`.

Each strategy declares its own dataclass beside itself (strategies/adaptive.py, strategies/polybasic.py with
strategies/chain_levels.py, dsi/orchestrator.py). `from_dict` is tolerant both ways, since results outlive the
code that wrote them: a field an older file lacks keeps its default, and a key no field names is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import ClassVar, TypeVar

R = TypeVar("R", bound="StatsRecord")


@dataclass(frozen=True)
class StatsRecord:
    """Fields map one to one onto the JSON keys; every field needs a default (what a file without it means)."""

    # fields left out of to_dict() while None: keys the writer only adds in some configurations
    OPTIONAL: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict:
        """The JSON-able dict, keys in field order."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in out.items() if v is not None or k not in self.OPTIONAL}

    @classmethod
    def from_dict(cls: type[R], data: Mapping | None) -> R:
        """The record from one row's parsed stats ({} or None: every default)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in names})
