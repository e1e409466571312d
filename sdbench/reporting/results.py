"""Reading result rows back: every row from .parquet files, .parts folders and folders of runs as one
DataFrame (schema.SCHEMA's columns, partial runs' rows saying why in `unfinished`), and a row's strategy stats.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Iterable

import pandas as pd
import pyarrow as pa

from sdbench.errors import SdbenchError
from sdbench.reporting.schema import KEY, conform
from sdbench.reporting.writer import part_files, pending_parts, read_table, run_sources, unfinished_path

UNFINISHED = "its process stopped before the run's end (killed, or still running)"
# Nullable pandas dtypes keep ints ints (and lossless a true three-valued bool) when values are missing.
_PANDAS_TYPES = {pa.int64(): pd.Int64Dtype(), pa.int32(): pd.Int32Dtype(), pa.bool_(): pd.BooleanDtype()}


def unfinished_reason(source: Path) -> str | None:
    """Why the run a results file belongs to is partial, or None when it ran to its end: its marker's reason,
    or, for parts with no merged file (the marker predates), that its process stopped before the end."""
    parts = source.parent.name.endswith(".parts")
    final = source.parent.with_suffix(".parquet") if parts else source
    marker = unfinished_path(final)
    if marker.is_file():
        return marker.read_text().strip() or UNFINISHED
    return UNFINISHED if parts and not final.is_file() else None


def _sdbench_table(path: Path) -> pa.Table:
    """A results file's rows; rows without sdbench's key columns are refused, not read as empty ones."""
    table = read_table(path)
    missing = [c for c in ("run_id", *KEY) if c not in table.column_names and c != "turn"]  # turn: newer
    if missing and table.num_rows:
        raise SdbenchError(f"{path} is not an sdbench results file (no column {', '.join(missing)})")
    return table


def parse_stats(text) -> dict:
    """One row's `strategy_stats` (the proposer's JSON row stats) as a dict; {} where a row has none."""
    return json.loads(text) if isinstance(text, str) and text else {}


def read_results(paths: Iterable[str | Path] | str | Path) -> pd.DataFrame:
    """All rows from .parquet files, .parts folders and folders of runs, as one DataFrame; a path that does not
    exist but holds a wildcard ('fleet/*/current', quoted in the shell) stands for every path it matches."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise SdbenchError("no results paths given")
    sources: dict[Path, None] = {}  # ordered set: a file named twice is read once
    for raw in (p for given in paths for p in _matches(str(given))):
        sources.update(dict.fromkeys(p.resolve() for p in _expand(raw)))
    tables = [t for t in (_with_unfinished(conform(_sdbench_table(p)), unfinished_reason(p)) for p in sources)
              if t.num_rows]
    if not tables:
        raise SdbenchError(f"no result rows in {', '.join(str(p) for p in paths)}")
    table = pa.concat_tables(tables, promote_options="default")
    return table.to_pandas(types_mapper=_PANDAS_TYPES.get)


def _with_unfinished(table: pa.Table, reason: str | None) -> pa.Table:
    """A partial run's rows carry why in the column `unfinished` (read only: never written to a results file)."""
    if reason is None:
        return table
    return table.append_column("unfinished", pa.array([reason] * table.num_rows, pa.string()))


def _matches(given: str) -> list[Path]:
    """A path as given, or, when none exists by that name and it holds a wildcard, the paths it matches."""
    if Path(given).exists() or not glob.has_magic(given):
        return [Path(given)]
    found = sorted(Path(p) for p in glob.glob(given, recursive=True))
    if not found:
        raise SdbenchError(f"no results path matches {given}")
    return found


def _expand(path: Path) -> list[Path]:
    if not path.exists():
        raise SdbenchError(f"results path not found: {path}")
    if path.is_dir() and path.name.endswith(".parts"):
        return pending_parts(path.with_name(path.name[: -len(".parts")] + ".parquet"), path)
    if path.is_dir():
        found = []
        for final in sorted(p for p in path.glob("*.parquet") if p.is_file()):
            found += run_sources(final, final.with_suffix(".parts"))
        for parts in sorted(p for p in path.glob("*.parts") if p.is_dir()):
            if not parts.with_suffix(".parquet").is_file():
                found += part_files(parts)
        if not found:
            raise SdbenchError(f"no .parquet results in folder {path}")
        return found
    if path.suffix != ".parquet":
        raise SdbenchError(f"not a results file (.parquet) or folder: {path}")
    return [path]
