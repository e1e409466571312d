"""llama.cpp's `llama-server`, built from source by `make engine-llama.cpp`: GGUF weights (the shipped file
re-typed by its own `llama-quantize` to the run's dtype, or a model's own @q8_0 / @q4_0, every tensor in that type
as sdbench's block copy has them, so both sides compute on the same values), its native
`/completion` endpoint streaming token ids, and the per-request `draft_n` / `draft_n_accepted` counters. Its
block drafters (`draft-dflash`, `draft-dspark`) load a head folder converted by its own converter (head_gguf.py)."""

from __future__ import annotations

import json
import struct
import subprocess
from pathlib import Path

from sdbench.config import SamplingConfig
from sdbench.engine.counters import MIRROR
from sdbench.errors import SdbenchError
from sdbench.models.loading import gguf_header
from sdbench.models.loading.loader import model_files, safetensors_folder
from sdbench.models.loading.names import BLOCK_TYPES, ENGINE_TYPES, split_variant, with_weights
from sdbench.paths import cache_dir
from sdbench.servers.client import EngineReplyError, post_json
from sdbench.servers.engines import Engine, EngineRole, Reply, engines_dir, token_gaps
from sdbench.servers.footprint import Footprint, shape
from sdbench.servers.head_gguf import head_gguf, model_gguf, refusal

# sdbench's --dtype (or a model's own block type) -> llama-quantize's type name: the float types, the block types
# sdbench's own runner reads too, and the K-quant mixes llama.cpp alone runs
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0",
              **{t: t.upper() for t in ENGINE_TYPES}}
NGRAM_SIZE = 3  # the lookup n-gram, as sdbench's ngram's longest suffix
# the checkpoints sdbench reads an MTP module from (`models/heads/mtp_native.py`) whose MTP layers llama.cpp's converter
# keeps and its draft-mtp runs: GLM-4.5's (DeepSeek-V3's and MiMo-7B's it drops)
MTP_ARCHITECTURES = ("Glm4MoeForCausalLM",)
UBATCH = 512  # its server's default micro-batch: its logits and compute buffers are sized for it
BASE_BYTES = 64 << 20  # the server's own code and buffers beside the models'


class LlamaCpp(Engine):
    name = "llama.cpp"
    folder = "llama.cpp"
    install = "make engine-llama.cpp"
    own_names = {"autoregressive": "plain", "ngram": "ngram-simple", "draft": "draft-simple", "dflash": "draft-dflash",
                 "dspark": "draft-dspark", "mtp": "draft-mtp"}
    blocks = ("dflash", "dspark")  # strategies run by a head GGUF (a DFlash 2 head runs under dflash)
    # draft-simple runs the target's verification batch through the draft too (its `process`), then one forward
    # per draft: the sampled token's and each draft's but the last
    draft_round = MIRROR
    dtypes = tuple(GGUF_TYPES)
    synthetic = True  # --spec-synth-rates: the drafts accepted at given unconditional per-position rates

    def executable(self) -> Path:
        return engines_dir(self.folder, "build", "bin", "llama-server")

    def refuse(self, role: EngineRole, target: str | None = None) -> str | None:
        if role.strategy == "mtp":
            return mtp_refusal(role.draft or "", target)
        if role.strategy == "eagle":
            return ("llama.cpp runs an EAGLE-3 head only as a GGUF written by its own convert_hf_to_gguf.py "
                    "--target-model-dir; sdbench does not convert heads for it yet")
        if role.strategy in self.blocks:
            why = refusal(role.draft or "")
            if why is not None:
                return why
        return super().refuse(role, target)

    def served_dtype(self, model: str, dtype: str) -> str:
        """The type the server runs `model` at: the block type its name gives (MODEL@q4_0), or a GGUF file of a
        block type at float32 its own (`with_weights`: as sdbench's own runner takes it), else --dtype's."""
        variant = split_variant(with_weights(model, dtype))[1]
        return variant if variant in BLOCK_TYPES else dtype

    def label(self, role: EngineRole, dtype: str) -> str:
        return super().label(role, GGUF_TYPES.get(dtype, dtype))

    def footprint(self, target: str, role: EngineRole, dtype: str, capacity: int) -> Footprint | None:
        """The target's GGUF, mapped (one file however many servers map it); a draft model's weights, which its
        server holds apart (measured: a SmolLM2 server drafting with its own F32 file held 0.58 GiB beside the file,
        plain 0.05); per model its KV cache at F16 and buffers for a micro-batch (the target's about three times a
        micro-batch's logits over the vocabulary: 0.76-0.96 GiB for Qwen2.5-Coder-1.5B's server, its file aside)."""
        out = Footprint(BASE_BYTES)
        for i, model in enumerate(role.loaded(target)):
            found = shape(model)
            if found is None:
                return None
            kind = self.served_dtype(model, dtype)
            if i == 0:
                out.files[f"{split_variant(model)[0]}:{kind}"] = found.weights(kind)
            else:
                out.own += found.weights(kind)
            out.own += found.kv_per_position * capacity + (3 if i == 0 else 1) * 4 * found.vocab * UBATCH
        return out

    def gguf(self, model: str, dtype: str) -> Path:
        """The model's GGUF with its weights re-typed to `dtype`, or to the block type the name gives (MODEL@q4_0),
        made once, in sdbench's cache; a file already of that type as it is (a user's own Q4_K_M file); a folder or a
        hub model converted first by llama.cpp's own converter (`model_gguf`). A block type
        puts every tensor in it (`--pure`: no other type for the head or the embeddings, as sdbench's block copy);
        a K-quant mix is llama-quantize's own mix."""
        model, dtype = split_variant(model)[0], self.served_dtype(model, dtype)
        if dtype not in GGUF_TYPES:
            raise SdbenchError(f"llama.cpp: no GGUF type for --dtype {dtype} (use one of {', '.join(GGUF_TYPES)})")
        kind, where = model_files(model)
        source = Path(where) if kind == "gguf" else model_gguf(target_folder(model), engines_dir(self.folder, "src"))
        if file_type(source) == GGUF_TYPES[dtype]:
            return source
        out = cache_dir("engines", "gguf") / f"{source.stem}-{source.stat().st_size}-{GGUF_TYPES[dtype]}.gguf"
        if not out.is_file():
            quantize = engines_dir(self.folder, "build", "bin", "llama-quantize")
            if not quantize.is_file():
                raise SdbenchError(f"llama.cpp's llama-quantize is missing ({quantize}): run `{self.install}`")
            part = out.with_suffix(".part")
            pure = ["--pure"] if dtype in BLOCK_TYPES else []
            done = subprocess.run([str(quantize), "--allow-requantize", *pure, str(source), str(part),
                                   GGUF_TYPES[dtype]], capture_output=True, text=True)
            if done.returncode != 0:
                part.unlink(missing_ok=True)
                said = (done.stderr or done.stdout).strip().splitlines()
                raise SdbenchError(f"llama-quantize could not re-type {source.name} to {GGUF_TYPES[dtype]}: "
                                   f"{said[-1] if said else done.returncode}")
            part.rename(out)
        return out

    def command(self, target: str, role: EngineRole, dtype: str, capacity: int, threads: int) -> list[str]:
        argv = [str(self.executable()), "-m", str(self.gguf(role.model(target), dtype)), "--host", "127.0.0.1",
                "--port", "{port}", "-c", str(capacity), "-np", "1", "-t", str(threads), "-tb", str(threads),
                "-cram", "0", "--no-webui"]
        if role.strategy == "ngram":
            argv += speculation_flags("ngram", role.gamma)
        elif role.strategy == "draft":
            draft = ["-md", str(self.gguf(role.draft, dtype))]
            argv += [*speculation_flags("draft", role.gamma, draft), "-td", str(threads)]
        elif role.strategy == "mtp":  # the module the target's own GGUF carries (its converter keeps it)
            argv += speculation_flags("mtp", role.gamma)
        elif role.strategy in self.blocks:  # every drafted token verified (draft-dspark's per-slot cut: p-min 0)
            head = ["-md", str(head_gguf(role.draft, target_folder(target), engines_dir(self.folder, "src")))]
            argv += [*speculation_flags(role.strategy, role.gamma, head), "-td", str(threads)]
        if role.synthetic:  # one rate per drafted position, non-increasing (the server checks both)
            from sdbench.reporting.profile import synth_rates  # pandas, past a server's start-up

            argv += ["--spec-synth-rates", synth_rates(role.synthetic)]
        return argv

    def request(self, prompt: list[int], max_new: int, sampling: SamplingConfig | None = None) -> tuple[str, dict]:
        # from token ids, no prompt cache between requests: every request prefills its prompt, as sdbench's own rows
        # do. Greedy is temperature 0; sampled, top-k and min-p are switched off (their defaults are 40 and 0.05),
        # so that its chain is temperature and top-p alone, as sdbench's sampler is
        body = {"prompt": prompt, "n_predict": max_new, "temperature": 0.0, "stream": True, "return_tokens": True,
                "cache_prompt": False, "seed": 0}
        if sampling is not None and not sampling.greedy:
            body.update(temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed, top_k=0,
                        min_p=0.0)
        return "/completion", body

    def reply(self, streamed, url: str, before: dict | None) -> Reply:
        tokens, counts, timings = [], [], {}
        for event in streamed.events:
            got = [int(t) for t in event.get("tokens") or []]
            tokens += got
            counts.append(len(got))
            if event.get("stop"):
                timings = event.get("timings") or {}
        ttft, gaps = token_gaps(streamed.times, counts)
        # absent where the server drafted nothing (plain decoding, or no n-gram found)
        return Reply(tokens, streamed.seconds, ttft, gaps, timings.get("draft_n"), timings.get("draft_n_accepted"))

    def probe(self, url: str, prompt: list[int]) -> tuple[float, int]:
        # the slot keeps the previous request's tokens: with cache_prompt it computes only what follows the common
        # prefix, and its own timings say how long that took
        body = {"prompt": prompt, "n_predict": 1, "temperature": 0.0, "cache_prompt": True, "stream": False}
        timings = post_json(url, "/completion", body).get("timings") or {}
        if "prompt_ms" not in timings or "prompt_n" not in timings:
            raise EngineReplyError(f"{url}/completion: no prompt timings in the reply")
        return float(timings["prompt_ms"]) / 1000.0, int(timings["prompt_n"])


def speculation_flags(strategy: str, gamma: int, draft: list[str] = (), ngram: int = NGRAM_SIZE) -> list[str]:
    """llama-server's flags for `strategy`'s speculation of `gamma` tokens (its --spec-type: `LlamaCpp.own_names`),
    every drafted token verified: n-gram with a lookup of `ngram` tokens, or a drafter (`draft`: the flags that load
    it: a draft model, a block head; none for the target's own MTP module). bench's servers run them, `schedule
    export --format llama.cpp` writes them."""
    kind = LlamaCpp.own_names[strategy]
    if strategy == "ngram":
        return ["--spec-type", kind, "--spec-ngram-simple-size-n", str(ngram), "--spec-ngram-simple-size-m",
                str(gamma), "--spec-draft-n-max", str(gamma)]
    return ["--spec-type", kind, *draft, "--spec-draft-n-max", str(gamma), "--spec-draft-n-min", "0",
            "--spec-draft-p-min", "0"]


def draft_flags(name: str) -> list[str]:
    """The flags that load draft `name` as it is: its GGUF file (-md), or its hub repository (--hf-repo-draft)."""
    kind, where = model_files(name)
    if kind == "folder":
        raise SdbenchError(f"llama.cpp loads GGUF files, and draft '{name}' is a safetensors folder: convert it "
                           "with llama.cpp's convert_hf_to_gguf.py and name the file, or export as json")
    return ["-md" if kind == "gguf" else "--hf-repo-draft", where]


def mtp_refusal(head: str, target: str | None) -> str | None:
    """Why llama.cpp's draft-mtp cannot draft with `head` for `target`, or None: it runs the MTP module a target's
    own checkpoint ships (--head naming the target's folder), of a family whose layers its converter keeps."""
    same = target is not None and Path(head).expanduser().resolve() == Path(target).expanduser().resolve()
    if not same or not (Path(head) / "config.json").is_file():
        return ("llama.cpp's draft-mtp drafts with the MTP module of the target's own checkpoint: give --head the "
                f"target's folder itself (got {head!r})")
    kinds = json.loads((Path(head) / "config.json").read_text()).get("architectures") or []
    if not set(kinds) & set(MTP_ARCHITECTURES):
        return (f"llama.cpp's converter keeps the MTP layers of {', '.join(MTP_ARCHITECTURES)} checkpoints among "
                f"those sdbench reads, and {head} is {', '.join(kinds) or 'of no named architecture'}")
    return None


def file_type(path: Path) -> str | None:
    """A GGUF file's own type as llama-quantize names it (`general.file_type`: Q4_K_M, Q8_0, F32...), or None where
    the file does not say (or is not one)."""
    try:
        from gguf import LlamaFileType

        found = gguf_header.reader(Path(path)).file_type
        if found is None:
            return None
        return LlamaFileType(found).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (ValueError, OSError, KeyError, IndexError, struct.error):
        return None


def target_folder(target: str) -> Path:
    """The target's folder of config and tokenizer, which llama.cpp's converter reads a head's vocabulary from: a
    GGUF's de-quantised copy, a local folder, or a hub model's snapshot."""
    target = split_variant(target)[0]  # a block copy's folder is its model's
    kind, where = model_files(target)
    if kind == "hub":
        from sdbench.models.loading.hub import snapshot  # huggingface_hub: slow to import; only a hub target

        return Path(snapshot(where))
    return Path(safetensors_folder(target))
