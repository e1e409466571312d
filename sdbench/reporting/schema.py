"""The result rows' one explicit Parquet schema: its columns (only ever appended), rows checked into a table of
exactly that schema, and tables from older or newer files conformed to it.
"""

from __future__ import annotations

import difflib

import pyarrow as pa

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
    ("verify_s", _F),  # the same for the target's verifying forwards
    ("accept_s", _F),  # the same for the verdicts, their sampling and commits
    ("observe_s", _F),  # the same for the proposer's bookkeeping after each verdict
    ("loop_s", _F),  # the same for the decode loop's own work between rounds
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
    # the machine while the row's batch was decoded by its role (sdbench/busy.py); null where not readable
    ("busy_others", _F),  # share of the cores' time other processes used (0-1; a busy loop on 2 cores: 0.5)
    ("cpu_steal", _F),  # share of the cores' time the hypervisor gave to other guests
    ("width_invariant", pa.bool_()),  # every target step past the prefill computed each row as that token decoded
    # alone (sdbench's fused CPU steps): held to plain decoding with no tolerance; false: the path's products depend
    # on the step's width (cuBLAS, oneDNN, the library's forward), a difference is judged for a tie; null: not known
])
COLUMNS: tuple[str, ...] = tuple(SCHEMA.names)
ENV_COLUMNS = ("device", "dtype", "torch_version", "transformers_version", "sdbench_version",
               "git_commit", "hardware", "cpu", "gpu")
KEY = ("role", "prompt_id", "repeat", "turn")


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
                               f"expected {field.type}: {first_line(e)}") from e
    extras = [name for name in table.column_names if name not in COLUMNS]
    return pa.Table.from_arrays(arrays + [table.column(n) for n in extras], names=list(COLUMNS) + extras)


def first_line(error: BaseException) -> str:
    """An error's first line, as the messages about results files quote it."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

