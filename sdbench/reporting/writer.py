"""A run's result rows on disk, written part by part so an interrupt loses nothing finished.

A run ``R`` lives in ``<out>/R.parquet`` (merged) plus ``<out>/R.parts/part-NNNNN.parquet`` (not yet merged).
Every part is written to a temporary name, fsync'd and renamed, so a part on disk is always whole.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from datetime import datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sdbench.errors import SdbenchError
from sdbench.reporting.schema import KEY, conform, env_fields, first_line, rows_to_table

_MERGED = b"sdbench.merged_parts"
_PART = re.compile(r"^part-(\d+)\.parquet$")


def new_run_id(strategy: str, now: datetime | None = None) -> str:
    """e.g. 20261122-153012-draft-ab12: sortable by time, readable, unique enough per output folder."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    slug = re.sub(r"[^a-z0-9]+", "-", strategy.lower()).strip("-") or "run"
    return f"{stamp}-{slug}-{secrets.token_hex(2)}"


class RunWriter:
    """Appends result rows durably, one part file per call; finalize() merges them into <run_id>.parquet.

    As a context manager it finalizes on normal exit and on Ctrl-C (then re-raises). On any other error
    the parts stay where they are: they are already durable, readable, and picked up by --resume.
    """

    def __init__(self, out_dir: str | Path, run_id: str, env: dict | None = None):
        self.out_dir = Path(out_dir)
        self.run_id = run_id
        self.final_path = self.out_dir / f"{run_id}.parquet"
        self.parts_dir = self.out_dir / f"{run_id}.parts"
        self._defaults = {"run_id": run_id, **env_fields(env or {})}
        self._last_part: int | None = None

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None or issubclass(exc_type, KeyboardInterrupt):
            self.finalize()
        return False

    def exists(self) -> bool:
        return self.final_path.exists() or self.parts_dir.exists()

    def mark_unfinished(self, reason: str = "") -> None:
        """Leave <run_id>.unfinished beside the rows until mark_finished(): a run stopped before its end (killed,
        interrupted, a tune trial pruned or failed) reads as partial, with the reason written here."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        unfinished_path(self.final_path).write_text(reason)

    def mark_finished(self) -> None:
        unfinished_path(self.final_path).unlink(missing_ok=True)

    def append(self, rows: list[dict]) -> Path | None:
        """Write rows now, as one part. run_id, timestamp and env columns are filled where missing."""
        if not rows:
            return None
        stamp = datetime.now().astimezone().isoformat(timespec="seconds")
        table = rows_to_table([{**self._defaults, "timestamp": stamp, **row} for row in rows])
        if not self.parts_dir.exists():
            self.parts_dir.mkdir(parents=True)
            _fsync_dir(self.out_dir)
        self._last_part = self._next_part_number()
        path = self.parts_dir / f"part-{self._last_part:05d}.parquet"
        _write_atomic(table, path)
        return path

    def _next_part_number(self) -> int:
        if self._last_part is not None:
            return self._last_part + 1
        # Numbers are never reused within a run, so a merged part name can't shadow a new one.
        used = _merged_parts(self.final_path) | {p.name for p in part_files(self.parts_dir)}
        return 1 + max((int(_PART.match(name).group(1)) for name in used if _PART.match(name)), default=0)

    def done_keys(self) -> set[tuple[str, str, int, int]]:
        """(role, prompt_id, repeat, turn) already recorded, in the merged file or in parts."""
        keys = set()
        for path in run_sources(self.final_path, self.parts_dir):
            table = conform(read_table(path))
            role, prompt, repeat, turn = (table.column(c).to_pylist() for c in KEY)
            keys.update(zip(role, prompt, repeat, (1 if t is None else t for t in turn)))
        return keys

    def finalize(self) -> Path | None:
        """Merge pending parts (and the existing final file) into <run_id>.parquet; None if no rows ever."""
        pending = pending_parts(self.final_path, self.parts_dir)
        if pending:
            sources = ([self.final_path] if self.final_path.exists() else []) + pending
            table = pa.concat_tables([conform(read_table(p)) for p in sources], promote_options="default")
            merged = _merged_parts(self.final_path) | {p.name for p in pending}
            # Recording merged part names makes a crash between rename and cleanup harmless.
            _write_atomic(table, self.final_path, {_MERGED: json.dumps(sorted(merged)).encode()})
        if self.parts_dir.exists():
            shutil.rmtree(self.parts_dir, ignore_errors=True)
        return self.final_path if self.final_path.exists() else None


def unfinished_path(final_path: Path) -> Path:
    return final_path.with_suffix(".unfinished")


def run_sources(final_path: Path, parts_dir: Path) -> list[Path]:
    """The files holding one run's rows: the merged file plus parts not merged into it yet."""
    head = [final_path] if final_path.is_file() else []
    return head + pending_parts(final_path, parts_dir)


def part_files(parts_dir: Path) -> list[Path]:
    """A parts folder's part files in the order they were written."""
    if not parts_dir.is_dir():
        return []
    parts = [p for p in parts_dir.iterdir() if _PART.match(p.name) and p.is_file()]
    return sorted(parts, key=lambda p: int(_PART.match(p.name).group(1)))


def pending_parts(final_path: Path, parts_dir: Path) -> list[Path]:
    """The parts not merged into the run's merged file yet."""
    merged = _merged_parts(final_path)
    return [p for p in part_files(parts_dir) if p.name not in merged]


def _merged_parts(final_path: Path) -> set[str]:
    if not final_path.is_file():
        return set()
    try:
        meta = pq.read_schema(final_path).metadata or {}
    except (pa.ArrowException, OSError) as e:
        raise SdbenchError(f"cannot read results file {final_path}: {first_line(e)}") from e
    return set(json.loads(meta[_MERGED])) if _MERGED in meta else set()


def _write_atomic(table: pa.Table, path: Path, metadata: dict | None = None) -> None:
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        pq.write_table(table, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    """Make a rename durable; not every platform can open a directory, and that is fine."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_table(path: Path, columns: list[str] | None = None) -> pa.Table:
    """A results file's table as it is on disk; a file Parquet cannot read is the user's error."""
    try:
        return pq.ParquetFile(path).read(columns=columns)
    except (pa.ArrowException, OSError, KeyError) as e:
        raise SdbenchError(f"cannot read results file {path}: {first_line(e)}") from e
