"""SPEED-Bench (NVIDIA, arXiv 2604.09557) as its preparation writes it. The hub copy (nvidia/SPEED-Bench) leaves
the prompts of third-party sources as placeholders; preparing fetches them. Model-Optimizer's
examples/specdec_bench/prepare_data.py writes each split as <out>/speed/<split>/test.parquet, records with a
`turns` list; NeMo-Skills' speed-bench prepare.py writes <out>/<split>.jsonl, the turns as user `messages`.
Both read here as records with `turns`, the other columns as they are (question_id, category, sub_category,
source, src_id, difficulty, multiturn). Which split a task reads is its yaml's: tasks/speed-bench*.yaml.
"""

from __future__ import annotations

from pathlib import Path

from sdbench.errors import SdbenchError


def read_prepared(path: Path) -> list[dict]:
    """A prepared split's records, each with `turns` (the user's messages, in order)."""
    import pyarrow as pa  # heavy: loaded when a split is read
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    try:
        rows = (pq.read_table(path) if path.suffix == ".parquet" else pj.read_json(path)).to_pylist()
    except (OSError, pa.ArrowException) as err:
        kind = "parquet" if path.suffix == ".parquet" else "JSON lines"
        raise SdbenchError(f"{path}: not a readable {kind} file ({' '.join(str(err).split())})") from None
    return [_with_turns(row, path, number) for number, row in enumerate(rows, 1)]


def _with_turns(row: dict, path: Path, number: int) -> dict:
    if "turns" in row:
        return row
    messages = row.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise SdbenchError(f"{path}: record {number} has neither `turns` nor a list of `messages`")
    rest = {key: value for key, value in row.items() if key != "messages"}
    return {**rest, "turns": [m.get("content") or "" for m in messages if (m.get("role") or "user") == "user"]}
