"""What engines' servers will hold in memory, from the models' configs alone, before any server starts: the one check
that every server a command starts fits beside sdbench's own models, refused in one line where they do not (the
kernel's out-of-memory killer would end the run with no line and no results). Each engine's adapter says what one
server holds (`Engine.footprint`): memory its processes hold alone, and files it maps and reads from as it decodes
(llama.cpp's GGUF), which the page cache holds once however many servers map them. Calibrated on this project's CPU
machine (2026-11-29, PSS summed over a server's processes after one request): llama.cpp's server of
Qwen2.5-Coder-1.5B at Q4_0 1.70 GiB (its file 0.94), with the 0.5B drafting 2.27, at F32 6.71 (file 5.75); vLLM's of
SmolLM2-135M at float32 4.55, of the 1.5B as GPTQ 7.25, each with a 2 GiB KV cache (its processes' own torch and
Python about 2 GiB)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from sdbench.errors import SdbenchError
from sdbench.models.loading import loader
from sdbench.models.loading.memory import GIB, HEADROOM, free_bytes
from sdbench.models.loading.shapes import parameter_count

# bits a weight takes at each type: llama.cpp's blocks (Q8_0: 32 int8 and a float16 scale; Q4_0: 32 nibbles and one),
# its K-quant mixes as llama-quantize writes them (their larger types for some tensors included)
BITS = {"float32": 32, "bfloat16": 16, "float16": 16, "q8_0": 8.5, "q4_0": 4.5, "q3_k_m": 3.9, "q4_k_s": 4.6,
        "q4_k_m": 4.9, "q5_k_s": 5.5, "q5_k_m": 5.7, "q6_k": 6.6}
PROMPT_ROOM = 2048  # positions a prompt is counted at before the prompts are read (a server's KV cache is small beside
# its weights)


@dataclass
class Footprint:
    """One server's memory: `own` bytes its processes hold alone, and `files` it maps (a key per file: bytes), held
    once by the page cache however many servers map them."""

    own: int = 0
    files: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Shape:
    """What a model's memory follows from: its parameters, its vocabulary table's, and its KV bytes per position."""

    params: int
    table: int  # vocabulary × hidden: one table (an untied head is another)
    vocab: int
    kv_per_position: int  # keys and values of every layer for one position, at two bytes an element

    def weights(self, kind: str) -> int:
        return int(self.params * BITS[kind] / 8)


@functools.lru_cache(maxsize=64)
def shape(model: str) -> Shape | None:
    """The model's Shape from its config alone (MODEL@q4_0: MODEL's), or None where no config is at hand without a
    download; read once per model (every role of every engine asks, and a GGUF's config is parsed from its file)."""
    try:
        config = loader.load_config(model)
    except SdbenchError:
        return None
    params = parameter_count(config, cached=True)
    if not params:
        return None
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_position = 2 * config.num_hidden_layers * kv_heads * head_dim * 2
    return Shape(params, config.vocab_size * config.hidden_size, config.vocab_size, per_position)


def total(prints: list[Footprint]) -> int:
    """Bytes of every server together: each one's own, and each mapped file once."""
    files: dict[str, int] = {}
    for p in prints:
        files.update(p.files)
    return sum(p.own for p in prints) + sum(files.values())


def check_servers_fit(planned: list[tuple[str, list[Footprint | None]]], fewer: str, beside: int = 0,
                      free: int | None = None) -> None:
    """Refuse in one line, before any server starts, servers that together with `beside` (bytes of sdbench's own
    models the command loads) take more than HEADROOM of the memory free now. planned: (engine name, one footprint
    per server, None where it is not known); fewer: how the user starts fewer servers; free: the memory free (read
    from the machine when None)."""
    free = free_bytes_cpu() if free is None else free
    known = [(name, [p for p in prints if p is not None]) for name, prints in planned]
    need = total([p for _, prints in known for p in prints])
    if free is None or need + beside <= HEADROOM * free:
        return
    each = ", ".join(f"{name} {len(prints)} server{'s' * (len(prints) != 1)} about {total(prints) / GIB:.1f} GiB"
                     for name, prints in known if prints)
    own = f" beside sdbench's own models' {beside / GIB:.1f} GiB" if beside else ""
    raise SdbenchError(f"the engines' servers would hold about {need / GIB:.1f} GiB ({each}){own} and "
                       f"{free / GIB:.1f} GiB are free: {fewer}; no server was started")


def free_bytes_cpu() -> int | None:
    import torch

    return free_bytes(torch.device("cpu"))
