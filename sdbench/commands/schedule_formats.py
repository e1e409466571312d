"""The forms `sdbench schedule export` writes, each what its engine loads as it is: one registry, each entry a
renderer of (strategy, schedule, draft name -> id the engine loads) to text.

A schedule (sdbench/schedule.py) holds a strategy's settings per batch-size bucket, the entry of the largest tuned
size at or below the running batch applying, the smallest below every tuned size. The engines take that same rule
in their own words: vLLM's `num_speculative_tokens_per_batch_size` as inclusive ranges starting at 1 (the last K
carried on to its largest batch), TensorRT-LLM's `draft_len_schedule` as thresholds starting at 1 (its batch-1
draft length the longest), SGLang and llama.cpp one draft length per server (`--batch B` exports the bucket of a
server sized for B). The engines vary only the number of drafted tokens with the batch: a schedule whose buckets
differ in any other setting (the n-gram's length, the draft) has no engine form, and says so in one line.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import replace

import yaml

from sdbench.errors import SdbenchError
from sdbench.registry import Registry
from sdbench.schedule import Entry, Schedule

schedule_formats: Registry = Registry("schedule format")
schedule_formats.add("vllm", "sdbench.commands.schedule_formats:as_vllm",
                     "vLLM's --speculative-config JSON, its drafted tokens per batch size as "
                     "num_speculative_tokens_per_batch_size")
schedule_formats.add("trtllm", "sdbench.commands.schedule_formats:as_trtllm",
                     "TensorRT-LLM's --extra_llm_api_options YAML: speculative_config with its draft_len_schedule",
                     aliases=("tensorrt-llm",))
schedule_formats.add("sglang", "sdbench.commands.schedule_formats:as_sglang",
                     "SGLang's server arguments (one draft length per server: give --batch where it varies)")
schedule_formats.add("llama.cpp", "sdbench.commands.schedule_formats:as_llamacpp",
                     "llama-server's flags (one draft length per server: give --batch where it varies)")
schedule_formats.add("json", "sdbench.commands.schedule_formats:as_json",
                     "sdbench's own schedule, every setting per bucket")

VLLM_METHODS = {"ngram": "ngram", "draft": "draft_model"}  # sdbench strategy -> vLLM's speculative method
TRTLLM_TYPES = {"ngram": "NGram", "draft": "Draft_Target"}  # -> TensorRT-LLM's decoding_type
SGLANG_ALGORITHMS = {"ngram": "NGRAM", "draft": "STANDALONE"}  # -> SGLang's --speculative-algorithm
LLAMACPP_STRATEGIES = ("draft", "ngram")  # llama-server's draft-simple and ngram-simple


def render(fmt: str, strategy: str, schedule: Schedule, hub_id=lambda name: name, batch: int | None = None) -> str:
    """The schedule (or, with `batch`, the one entry a server sized for that batch runs) in format `fmt`."""
    form = schedule_formats.entry(fmt)
    if batch is not None:
        if batch < 1:
            raise SdbenchError(f"--batch {batch}: expected a whole number of at least 1")
        if schedule.by_context:
            raise SdbenchError("--batch exports one bucket of a schedule tuned per batch size only; this one is "
                               "tuned per context length too: export it as json")
        schedule = Schedule((replace(schedule.lookup(batch, None), batch=batch),))
    return form.load()(strategy, schedule, hub_id, batch)


def as_json(strategy: str, schedule: Schedule, hub_id, batch: int | None) -> str:
    return json.dumps({"strategy": strategy, **schedule.spec()}, indent=2)


def buckets(engine: str, strategy: str, schedule: Schedule, known) -> tuple[list[Entry], Entry]:
    """The entries by batch size, and the one whose settings (all but gamma) every speculating bucket shares;
    one line where the engine has no form for them."""
    from sdbench.engine.tree import tree_text  # torch's import, past the CLI's start

    if strategy not in known:
        raise SdbenchError(f"strategy '{strategy}' has no {engine} form ({', '.join(sorted(known))} have one): "
                           "export it as json")
    if schedule.by_context:
        raise SdbenchError(f"{engine} takes one speculative setting per server, not per context length: "
                           "export this schedule as json")
    entries = sorted(schedule.entries, key=lambda e: e.batch)
    speculating = [e for e in entries if e.gamma > 0]
    if not speculating:
        raise SdbenchError(f"every bucket of this schedule decodes without drafting (gamma 0): run {engine} "
                           "without a speculative setting")
    first = speculating[0]
    for e in speculating:
        tree = tree_text(e.options)
        if tree:
            raise SdbenchError(f"the {e.label} entry grows a token tree ({tree}), which {engine}'s {strategy} "
                               "speculation does not verify (it drafts a chain): export this schedule as json")
        for key in sorted({*first.options, *e.options, "drafts"}):
            mine, theirs = ((x.drafts if key == "drafts" else x.options.get(key)) for x in (first, e))
            if mine != theirs:
                raise SdbenchError(f"{engine} varies only the number of drafted tokens with the batch size, but "
                                   f"this schedule's {key} is {_said(mine)} at {first.label} and {_said(theirs)} at "
                                   f"{e.label}: export it as json, or export one bucket with --batch")
    if strategy == "draft" and len(first.drafts) != 1:
        raise SdbenchError(f"{engine} drafts with one model; the {first.label} entry names "
                           f"{len(first.drafts)}: export it as json")
    return entries, first


def _said(value) -> str:
    return ",".join(value) if isinstance(value, tuple) else str(value)


def _ngram(entry: Entry) -> tuple[int, int]:
    """(longest, shortest) suffix the n-gram drafter matches: the entry's, the strategy's defaults where it leaves
    them (its declared options, applied as a run applies them)."""
    from sdbench.strategies import strategy

    settings = strategy("ngram").settings(dict(entry.options))
    return int(settings["max_ngram"]), int(settings["min_ngram"])


def _one_gamma(engine: str, entries: list[Entry]) -> int:
    gammas = {e.gamma for e in entries}
    if len(gammas) > 1:
        drafted = ", ".join(f"{e.gamma} at {e.label}" for e in entries)
        raise SdbenchError(f"{engine} takes one draft length per server, and this schedule's varies ({drafted}): "
                           "export the bucket of your server's batch size with --batch B")
    return gammas.pop()


def as_vllm(strategy: str, schedule: Schedule, hub_id, batch: int | None) -> str:
    """The `--speculative-config` JSON: the method and its settings, num_speculative_tokens the longest draft, and
    num_speculative_tokens_per_batch_size's inclusive ranges (the first from 1, the last K carried on by vLLM)."""
    entries, shared = buckets("vLLM", strategy, schedule, VLLM_METHODS)
    config = {"method": VLLM_METHODS[strategy], "num_speculative_tokens": max(e.gamma for e in entries)}
    if strategy == "ngram":
        config["prompt_lookup_max"], config["prompt_lookup_min"] = _ngram(shared)
    else:
        config["model"] = hub_id(shared.drafts[0])
    if len(entries) > 1:
        ends = [e.batch - 1 for e in entries[1:]] + [entries[-1].batch]
        starts = [1] + [e.batch for e in entries[1:]]
        config["num_speculative_tokens_per_batch_size"] = [[s, end, e.gamma]
                                                           for s, end, e in zip(starts, ends, entries)]
    return json.dumps(config)


def as_trtllm(strategy: str, schedule: Schedule, hub_id, batch: int | None) -> str:
    """The YAML `trtllm-serve --extra_llm_api_options` reads: speculative_config, max_draft_len the batch-1 draft
    length, draft_len_schedule {threshold: draft length} from 1 (TensorRT-LLM requires both)."""
    entries, shared = buckets("TensorRT-LLM", strategy, schedule, TRTLLM_TYPES)
    longest = entries[0].gamma
    if longest < 1 or any(e.gamma > longest for e in entries):
        raise SdbenchError(f"TensorRT-LLM drafts the most tokens at batch 1 (draft_len_schedule[1] = "
                           f"max_draft_len > 0), and this schedule drafts {entries[0].gamma} at "
                           f"{entries[0].label} but {max(e.gamma for e in entries)} later: export it as vllm or json")
    config = {"decoding_type": TRTLLM_TYPES[strategy], "max_draft_len": longest}
    if strategy == "ngram":
        config["max_matching_ngram_size"] = _ngram(shared)[0]
    else:
        config["speculative_model"] = hub_id(shared.drafts[0])
    if len(entries) > 1:
        config["draft_len_schedule"] = {(1 if i == 0 else e.batch): e.gamma for i, e in enumerate(entries)}
    return yaml.safe_dump({"speculative_config": config}, sort_keys=False).rstrip()


def as_sglang(strategy: str, schedule: Schedule, hub_id, batch: int | None) -> str:
    """`python -m sglang.launch_server`'s speculative arguments for a chain of gamma drafted tokens (its
    num-draft-tokens counts the verified token too; its n-gram tree held to one branch)."""
    entries, shared = buckets("SGLang", strategy, schedule, SGLANG_ALGORITHMS)
    gamma = _one_gamma("SGLang", entries)
    argv = ["--speculative-algorithm", SGLANG_ALGORITHMS[strategy], "--speculative-num-draft-tokens", str(gamma + 1)]
    if strategy == "ngram":
        longest, shortest = _ngram(shared)
        argv += ["--speculative-ngram-max-match-window-size", str(longest),
                 "--speculative-ngram-min-match-window-size", str(shortest), "--speculative-ngram-max-bfs-breadth", "1",
                 "--speculative-ngram-min-bfs-breadth", "1"]
    else:
        argv += ["--speculative-draft-model-path", hub_id(shared.drafts[0]), "--speculative-num-steps", str(gamma),
                 "--speculative-eagle-topk", "1"]
    return _server_line(argv, batch, "--max-running-requests")


def as_llamacpp(strategy: str, schedule: Schedule, hub_id, batch: int | None) -> str:
    """llama-server's speculative flags, as sdbench's own llama.cpp runs pass them (servers/llamacpp.py); the
    draft as its GGUF file or hub repository (not the hub id the other engines load)."""
    from sdbench.servers.llamacpp import draft_flags, speculation_flags

    entries, shared = buckets("llama.cpp", strategy, schedule, LLAMACPP_STRATEGIES)
    gamma = _one_gamma("llama.cpp", entries)
    if strategy == "ngram":
        flags = speculation_flags(strategy, gamma, ngram=_ngram(shared)[0])
    else:
        flags = speculation_flags(strategy, gamma, draft_flags(shared.drafts[0]))
    return _server_line(flags, batch, "-np")


def _server_line(argv: list[str], batch: int | None, slots: str) -> str:
    """The arguments as one shell line; a one-bucket export (--batch B) sizes the server for B requests."""
    if batch is not None:
        argv = [slots, str(batch), *argv]
    return shlex.join(argv)
