"""Result rows on disk: one explicit Parquet schema, written part by part so an interrupt loses nothing finished.

A run ``R`` lives in ``<out>/R.parquet`` (merged) plus ``<out>/R.parts/part-NNNNN.parquet`` (not yet merged).
Every part is written to a temporary name, fsync'd and renamed, so a part on disk is always whole.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import secrets
import shutil
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Iterable, Protocol

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from sdbench.engine.metrics import RowMetrics, speedup
from sdbench.errors import SdbenchError

_F, _I, _S = pa.float64(), pa.int64(), pa.string()

# Columns are only ever appended: older files are read with the missing ones as null.
SCHEMA = pa.schema([
    ("run_id", _S),
    ("timestamp", _S),  # ISO 8601 with offset
    ("role", _S),  # "baseline" | "strategy"
    ("strategy", _S),
    ("params", _S),  # JSON of the strategy's parameters
    ("target", _S),
    ("draft", _S),  # "" when the strategy has no draft model
    ("dataset", _S),
    ("category", _S),
    ("prompt_id", _S),
    ("repeat", _I),
    ("batch_id", _I),  # rows decoded in one batch share it
    ("batch_size", _I),
    ("prompt_tokens", _I),
    ("new_tokens", _I),
    ("wall_s", _F),  # the batch's decode wall time, repeated on each of its rows
    ("tokens_per_s", _F),
    ("batch_tokens_per_s", _F),
    ("speedup", _F),  # vs the baseline row of the same prompt & repeat; 1.0 for baseline; NaN without one
    ("steps", _I),
    ("drafted", _I),
    ("accepted", _I),
    ("mean_accepted_len", _F),  # bonus token included: 1.0 = plain decoding
    ("acceptance_rate", _F),
    ("accepted_per_position", pa.list_(_I)),
    ("drafted_per_position", pa.list_(_I)),
    ("ttft_s", _F),
    ("tpot_s", _F),
    ("draft_s", _F),  # the batch's proposing time over the steps this row was active; max over rows = batch's
    ("verify_s", _F),  # the same for target verification
    ("setup_s", _F),  # the batch's proposer setup (a draft's own prefill, a cache compression), also in draft_s
    ("peak_mem_bytes", _I),
    ("mem_kind", _S),  # see sdbench.env.peak_memory
    ("lossless", pa.bool_()),  # output ids == baseline's under greedy; null when sampling or no baseline
    ("temperature", _F),
    ("top_p", _F),
    ("seed", _I),
    ("gamma", _I),
    ("predicted_speedup", _F),
    ("device", _S),
    ("dtype", _S),
    ("torch_version", _S),
    ("transformers_version", _S),
    ("sdbench_version", _S),
    ("git_commit", _S),
    ("hardware", _S),
    ("cpu", _S),
    ("gpu", _S),
    ("output_ids", pa.list_(pa.int32())),
    ("strategy_stats", _S),  # JSON: the proposer's own per-row figures (Proposer.row_stats)
    ("fast", pa.bool_()),  # the runner's fast path was on (CPU: packed projections)
    ("max_new_tokens", _I),  # the token budget per prompt (--max-new-tokens)
    ("divergence", _S),  # lossless false: "tie" (the target's top logits within rounding where the outputs
    # first differ) or "real"; null otherwise (see sdbench.commands.divergence)
    ("divergence_gap", _F),  # the target's logit gap there: top logit minus the lower of the two chosen tokens'
    ("turn", _I),  # 1-based turn of a multi-turn conversation; null in files from before turns (read as 1)
    ("depth", _F),  # retrieval tasks: where the answer was hidden, 0 = start of the text, 1 = end
    ("found", pa.bool_()),  # retrieval tasks: the output holds the answer; null for other tasks
    ("runner", _S),  # the target's runner: "native" (sdbench's forward) or "generic" (the library's forward)
    ("probe", _S),  # the fidelity probe (models/probing/probe.py): "passed", "fallback" (a native runner failed it and
    # the generic one passed) or "skipped" (--no-probe); null in files from before the probe
    ("probe_gap", _F),  # the probe's largest gap over the run's models, relative to the logits' scale
    ("probe_reused", pa.bool_()),  # the gap is a kept verdict of an earlier probe of the same weights, dtype,
    # device, forward path and code over at least this run's context (models/probing/probe_cache.py); null: not probed
    ("weights", _S),  # "random" when the row's target or draft is MODEL@random, else "real"; null (real) before it
    # served under load (`run --request-rate/--concurrency`): one row per request; null for batch runs.
    # Latencies as engine/metrics.py defines them (vLLM benchmark_serving's names); times in s from serving's start
    ("request_rate", _F),  # requests/s of the Poisson arrivals; inf: all at once
    ("concurrency", _I),  # requests in flight at most (the running batch's slots; also in batch_size)
    ("arrival_s", _F),  # when the request arrived
    ("scheduled_s", _F),  # when it took a slot (its prefill began)
    ("token_s", pa.list_(_F)),  # when each chunk of its tokens was committed (the first: its first token)
    ("chunk_tokens", pa.list_(_I)),  # tokens in each chunk
    ("ttft_ms", _F),
    ("tpot_ms", _F),
    ("itl_ms", pa.list_(_F)),
    ("e2el_ms", _F),
    ("queue_ms", _F),
    ("prefill_ms", _F),
    ("duration_s", _F),  # the role's whole serving time at this load point (first arrival to last token)
    ("slo", _S),  # the --slo bounds, e.g. "ttft:500ms,tpot:50ms"; null without
    ("slo_met", pa.bool_()),  # the request kept every bound; null without --slo
    ("prompt_len", _I),  # --prompt-len: the token-exact prompts' length; null for prompts of their own lengths
    ("schedule_entry", _S),  # the tuned schedule's entry this run applied (sdbench/schedule.py), e.g. "batch 4"
    ("sweep", _S),  # the `sdbench sweep` this row's run is a point of (its id); null outside a sweep
    # token trees and acceptance by depth and sibling rank, as engine/metrics.py defines them; null before them
    ("tree_steps", _I),  # steps that verified a tree (0 for a chain)
    ("tree_nodes", _I),  # nodes those steps drafted (mean tree size: tree_nodes / tree_steps)
    ("sibling_accepts", _I),  # committed nodes that were not their parent's first child
    ("verified_width", _I),  # tokens per row of the verifying forwards, summed (mean width: / steps)
    ("tried_per_depth_rank", pa.list_(pa.list_(_I))),  # [d][r]: steps that tried the rank-r child at depth d + 1
    ("accepted_per_depth_rank", pa.list_(pa.list_(_I))),  # [d][r]: of those, the steps that accepted it
    ("engine", _S),  # `run --engine`: the engine whose server decoded the row (llama.cpp, vllm); null: sdbench's loop
])
COLUMNS: tuple[str, ...] = tuple(SCHEMA.names)
ENV_COLUMNS = ("device", "dtype", "torch_version", "transformers_version", "sdbench_version",
               "git_commit", "hardware", "cpu", "gpu")
KEY = ("role", "prompt_id", "repeat", "turn")
_MERGED = b"sdbench.merged_parts"
_PART = re.compile(r"^part-(\d+)\.parquet$")
UNFINISHED = "its process stopped before the run's end (killed, or still running)"
# Nullable pandas dtypes keep ints ints (and lossless a true three-valued bool) when values are missing.
_PANDAS_TYPES = {_I: pd.Int64Dtype(), pa.int32(): pd.Int32Dtype(), pa.bool_(): pd.BooleanDtype()}


def new_run_id(strategy: str, now: datetime | None = None) -> str:
    """e.g. 20261122-153012-draft-ab12: sortable by time, readable, unique enough per output folder."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    slug = re.sub(r"[^a-z0-9]+", "-", strategy.lower()).strip("-") or "run"
    return f"{stamp}-{slug}-{secrets.token_hex(2)}"


def env_fields(env: dict) -> dict:
    """The part of sdbench.env.environment() that is stored on every row."""
    return {k: env[k] for k in ENV_COLUMNS if k in env}


def rows_to_table(rows: list[dict]) -> pa.Table:
    """Rows as a table of exactly SCHEMA. Missing keys become null; unknown keys are a bug."""
    unknown = sorted({k for row in rows for k in row} - set(COLUMNS))
    if unknown:
        hints = {k: difflib.get_close_matches(k, COLUMNS, n=1) for k in unknown}
        said = ", ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for k, h in hints.items())
        raise ValueError(f"unknown result column(s): {said}")
    arrays = []
    for field in SCHEMA:
        try:
            arrays.append(pa.array([row.get(field.name) for row in rows], type=field.type))
        except (pa.ArrowException, OverflowError, TypeError) as e:
            raise ValueError(f"result column {field.name!r} wants {field.type}: {e}") from e
    return pa.Table.from_arrays(arrays, schema=SCHEMA)


# ---- building a row: the one place a result row is assembled ------------------------------------------------


@dataclass(frozen=True)
class RunFields:
    """What every row of a run (or of one load point of it) records alike."""

    target: str
    dataset: str
    batch_size: int  # under load: the load point's slots
    temperature: float
    top_p: float
    seed: int
    fast: bool
    max_new_tokens: int
    prompt_len: int | None
    schedule_entry: str | None
    runner: str | None
    probe: str | None
    probe_gap: float | None
    probe_reused: bool | None = None
    sweep: str | None = None
    request_rate: float | None = None  # under load
    concurrency: int | None = None  # under load
    slo: str | None = None  # under load, with --slo
    engine: str | None = None  # `run --engine`: the engine whose server decodes every role; None: sdbench's loop


@dataclass(frozen=True)
class Place:
    """Where a row sits: its prompt, the repeat, the batch (or load point) and the turn."""

    category: str
    prompt_id: str
    repeat: int
    batch_id: int
    turn: int = 1
    depth: float | None = None  # retrieval tasks: where the answer was hidden


class Described(Protocol):
    """What a row records of the configuration that decoded it (commands/roles.py Role)."""

    name: str  # the `role` column
    strategy: str
    drafts: tuple[str, ...]

    def params(self) -> dict: ...


@dataclass(frozen=True)
class Judged:
    """What a row's figures are judged against: the baseline's row of the same prompt, and the cost model."""

    baseline: RowMetrics | None  # None: no baseline ran (or the request was not served by it)
    greedy: bool  # outputs are compared token for token only under greedy decoding
    predicted_speedup: float = math.nan
    found: bool | None = None  # retrieval tasks: the output holds the answer


def result_row(run: RunFields, role: Described, place: Place, m: RowMetrics, judged: Judged,
               memory: tuple[int | None, str], weights: str) -> dict:
    """One result row, every column named here (SCHEMA). memory: (peak bytes, kind) as sdbench.env.peak_memory;
    weights: "random" when the row's target or a draft is MODEL@random, else "real"."""
    params = role.params()
    row = {**asdict(run), **asdict(place), "role": role.name, "strategy": role.strategy,
           "params": json.dumps(params, sort_keys=True), "draft": ",".join(role.drafts), "gamma": params.get("gamma"),
           "output_ids": list(m.output_ids), "prompt_tokens": m.prompt_tokens, "new_tokens": m.new_tokens,
           "steps": m.steps, "drafted": m.drafted, "accepted": m.accepted, "mean_accepted_len": m.mean_accepted_len,
           "acceptance_rate": m.acceptance_rate, "accepted_per_position": list(m.accepted_per_position),
           "drafted_per_position": list(m.drafted_per_position), "draft_s": m.draft_s, "verify_s": m.verify_s,
           "wall_s": m.wall_s, "tokens_per_s": m.tokens_per_s, "batch_tokens_per_s": m.batch_tokens_per_s,
           "ttft_s": m.ttft_s, "tpot_s": m.tpot_s, "setup_s": m.setup_s,
           "strategy_stats": json.dumps(m.strategy_stats, sort_keys=True), "peak_mem_bytes": memory[0],
           "mem_kind": memory[1], "weights": weights, "predicted_speedup": judged.predicted_speedup,
           "found": judged.found, "tree_steps": m.tree_steps, "tree_nodes": m.tree_nodes,
           "sibling_accepts": m.sibling_accepts, "verified_width": m.verified_width,
           "tried_per_depth_rank": [list(r) for r in m.tried_per_depth_rank],
           "accepted_per_depth_rank": [list(r) for r in m.accepted_per_depth_rank]}
    if m.served is not None:
        row.update(asdict(m.served))
    if judged.baseline is not None:
        row["speedup"] = speedup(m.tokens_per_s, judged.baseline.tokens_per_s)
        if judged.greedy:
            row["lossless"] = m.output_ids == judged.baseline.output_ids
    return row


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
        used = _merged_parts(self.final_path) | {p.name for p in _part_files(self.parts_dir)}
        return 1 + max((int(_PART.match(name).group(1)) for name in used if _PART.match(name)), default=0)

    def done_keys(self) -> set[tuple[str, str, int, int]]:
        """(role, prompt_id, repeat, turn) already recorded, in the merged file or in parts."""
        keys = set()
        for path in run_sources(self.final_path, self.parts_dir):
            table = conform(_read_table(path))
            role, prompt, repeat, turn = (table.column(c).to_pylist() for c in KEY)
            keys.update(zip(role, prompt, repeat, (1 if t is None else t for t in turn)))
        return keys

    def finalize(self) -> Path | None:
        """Merge pending parts (and the existing final file) into <run_id>.parquet; None if no rows ever."""
        pending = _pending_parts(self.final_path, self.parts_dir)
        if pending:
            sources = ([self.final_path] if self.final_path.exists() else []) + pending
            table = pa.concat_tables([conform(_read_table(p)) for p in sources], promote_options="default")
            merged = _merged_parts(self.final_path) | {p.name for p in pending}
            # Recording merged part names makes a crash between rename and cleanup harmless.
            _write_atomic(table, self.final_path, {_MERGED: json.dumps(sorted(merged)).encode()})
        if self.parts_dir.exists():
            shutil.rmtree(self.parts_dir, ignore_errors=True)
        return self.final_path if self.final_path.exists() else None


def unfinished_path(final_path: Path) -> Path:
    return final_path.with_suffix(".unfinished")


def unfinished_reason(source: Path) -> str | None:
    """Why the run a results file belongs to is partial, or None when it ran to its end: its marker's reason,
    or, for parts with no merged file (the marker predates), that its process stopped before the end."""
    parts = source.parent.name.endswith(".parts")
    final = source.parent.with_suffix(".parquet") if parts else source
    marker = unfinished_path(final)
    if marker.is_file():
        return marker.read_text().strip() or UNFINISHED
    return UNFINISHED if parts and not final.is_file() else None


def run_sources(final_path: Path, parts_dir: Path) -> list[Path]:
    """The files holding one run's rows: the merged file plus parts not merged into it yet."""
    head = [final_path] if final_path.is_file() else []
    return head + _pending_parts(final_path, parts_dir)


def _part_files(parts_dir: Path) -> list[Path]:
    if not parts_dir.is_dir():
        return []
    parts = [p for p in parts_dir.iterdir() if _PART.match(p.name) and p.is_file()]
    return sorted(parts, key=lambda p: int(_PART.match(p.name).group(1)))


def _pending_parts(final_path: Path, parts_dir: Path) -> list[Path]:
    merged = _merged_parts(final_path)
    return [p for p in _part_files(parts_dir) if p.name not in merged]


def _merged_parts(final_path: Path) -> set[str]:
    if not final_path.is_file():
        return set()
    try:
        meta = pq.read_schema(final_path).metadata or {}
    except (pa.ArrowException, OSError) as e:
        raise SdbenchError(f"cannot read results file {final_path}: {_first_line(e)}") from e
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


def _read_table(path: Path, columns: list[str] | None = None) -> pa.Table:
    try:
        return pq.ParquetFile(path).read(columns=columns)
    except (pa.ArrowException, OSError, KeyError) as e:
        raise SdbenchError(f"cannot read results file {path}: {_first_line(e)}") from e


def _sdbench_table(path: Path) -> pa.Table:
    """A results file's rows; rows without sdbench's key columns are refused, not read as empty ones."""
    table = _read_table(path)
    missing = [c for c in ("run_id", *KEY) if c not in table.column_names and c != "turn"]  # turn: newer
    if missing and table.num_rows:
        raise SdbenchError(f"{path} is not an sdbench results file (no column {', '.join(missing)})")
    return table


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def conform(table: pa.Table) -> pa.Table:
    """SCHEMA's columns in order (missing ones null), then any newer columns this version doesn't know."""
    arrays = []
    for field in SCHEMA:
        if field.name not in table.column_names:
            arrays.append(pa.nulls(table.num_rows, field.type))
            continue
        column = table.column(field.name)
        try:
            arrays.append(column if column.type == field.type else column.cast(field.type))
        except pa.ArrowException as e:
            raise SdbenchError(f"results column {field.name!r} has type {column.type}, "
                               f"expected {field.type}: {_first_line(e)}") from e
    extras = [name for name in table.column_names if name not in COLUMNS]
    return pa.Table.from_arrays(arrays + [table.column(n) for n in extras], names=list(COLUMNS) + extras)


def parse_stats(text) -> dict:
    """One row's `strategy_stats` (the proposer's JSON row stats) as a dict; {} where a row has none."""
    return json.loads(text) if isinstance(text, str) and text else {}


def read_results(paths: Iterable[str | Path] | str | Path) -> pd.DataFrame:
    """All rows from .parquet files, .parts folders and folders of runs, as one DataFrame."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not paths:
        raise SdbenchError("no results paths given")
    sources: dict[Path, None] = {}  # ordered set: a file named twice is read once
    for raw in paths:
        sources.update(dict.fromkeys(p.resolve() for p in _expand(Path(raw))))
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


def _expand(path: Path) -> list[Path]:
    if not path.exists():
        raise SdbenchError(f"results path not found: {path}")
    if path.is_dir() and path.name.endswith(".parts"):
        return _pending_parts(path.with_name(path.name[: -len(".parts")] + ".parquet"), path)
    if path.is_dir():
        found = []
        for final in sorted(p for p in path.glob("*.parquet") if p.is_file()):
            found += run_sources(final, final.with_suffix(".parts"))
        for parts in sorted(p for p in path.glob("*.parts") if p.is_dir()):
            if not parts.with_suffix(".parquet").is_file():
                found += _part_files(parts)
        if not found:
            raise SdbenchError(f"no .parquet results in folder {path}")
        return found
    if path.suffix != ".parquet":
        raise SdbenchError(f"not a results file (.parquet) or folder: {path}")
    return [path]
