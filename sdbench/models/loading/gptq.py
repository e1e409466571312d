"""A model's Q4_0 copy written as a GPTQ checkpoint, for an engine that serves 4-bit weights in that format (vLLM's
CPU build: its W4A16 products read GPTQ's symmetric 4-bit type with any even group size).

Q4_0 and GPTQ's symmetric 4-bit type with groups of 32 inputs hold the same numbers: a Q4_0 block is a float16 scale
d and 32 four-bit q, w = d (q - 8); GPTQ keeps, per group of 32 inputs of an output, a float16 scale and four-bit q
with the same w = scale (q - 8). So each decoder projection's blocks (`models/forward/quants.py`, the bytes sdbench's
own `--dtype q4_0` reads) are re-packed, not re-quantised: `qweight` [n / 8, out] int32, input i of output o in bits
4 (i % 8) of qweight[i // 8, o]; `scales` [n / 32, out] float16, each block's d; `qzeros` [n / 32, out / 8] int32,
the zero 8 stored as 7 in every four bits (GPTQ's first format keeps zero - 1); `g_idx` [n] int32 = i // 32. The
embedding table and an untied vocabulary head hold their Q4_0 values as floats (sdbench's copy snaps them too), norms
and biases as they are. The engine computes at its own activation type (bfloat16 or float16), so only the
projections' weights are exactly sdbench's.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import torch

from sdbench.errors import SdbenchError
from sdbench.models.forward import quants
from sdbench.models.loading.gguf_cache import COMPLETE, atomic_dir, is_complete
from sdbench.paths import cache_dir

KIND = "q4_0"
GROUP = quants.BLOCK  # inputs per group: a Q4_0 block
ZEROS = 0x77777777  # eight zeros of 8, each stored as 7
_PROJECTION = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")
_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def quantization_config() -> dict:
    """The config.json entry that names the format."""
    return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True, "desc_act": False,
            "lm_head": False, "checkpoint_format": "gptq"}


def pack(blocks: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """Q4_0 blocks [out, n / 32 * 18] (uint8, as stored) as GPTQ's qweight, scales, qzeros and g_idx."""
    out = blocks.shape[0]
    b = blocks.reshape(out, n // GROUP, quants.BLOCK_BYTES[KIND])
    scales = b[..., :2].contiguous().view(torch.float16).reshape(out, -1)  # [out, groups]
    packed = b[..., 2:]
    q = torch.cat([packed & 15, packed >> 4], dim=-1).reshape(out, n).to(torch.int64)  # input j low, j + 16 high
    shifts = (4 * torch.arange(8, dtype=torch.int64))[None, :, None]
    words = (q.t().reshape(n // 8, 8, out) << shifts).sum(dim=1)  # [n / 8, out] unsigned 32-bit values
    qweight = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return {"qweight": qweight, "scales": scales.t().contiguous(),
            "qzeros": torch.full((n // GROUP, out // 8), ZEROS, dtype=torch.int32),
            "g_idx": (torch.arange(n, dtype=torch.int32) // GROUP)}


def unpack(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [out, n] a symmetric GPTQ layer holds (the inverse of `pack`, for checks)."""
    words = qweight.to(torch.int64) & 0xFFFFFFFF  # [n / 8, out]
    q = torch.stack([(words >> (4 * j)) & 15 for j in range(8)], dim=1).reshape(-1, words.shape[1])  # [n, out]
    return ((q.to(torch.float32) - 8) * scales.to(torch.float32).repeat_interleave(GROUP, dim=0)).t().contiguous()


def convert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A float state dict as the GPTQ checkpoint's: every decoder projection whose sizes take whole groups re-packed
    from its Q4_0 blocks, the embedding table and the head snapped onto Q4_0's grid, the rest as it is."""
    got = {}
    for name, t in tensors.items():
        out_in = tuple(t.shape)
        if _PROJECTION.match(name) and len(out_in) == 2 and out_in[1] % GROUP == 0 and out_in[0] % 32 == 0:
            for part, value in pack(quants.quantise(t.to(torch.float32), KIND), out_in[1]).items():
                got[name.removesuffix("weight") + part] = value
        elif name in _TABLES and t.shape[-1] % GROUP == 0:
            got[name] = quants.snap(t.to(torch.float32), KIND)
        else:
            got[name] = t
    if not any(name.endswith(".qweight") for name in got):
        raise SdbenchError("no decoder projection named model.layers.N.*_proj.weight with whole groups of 32 inputs: "
                           "a layout sdbench's Q4_0 copy and GPTQ's do not share here")
    return got


def _key(folder: Path) -> str:
    """The folder's place and its weights' sizes and times: another folder of the same name gets a copy of its own."""
    digest = hashlib.sha256(str(folder.resolve()).encode())
    for f in sorted(folder.glob("*.safetensors")):
        st = f.stat()
        digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def gptq_folder(folder: Path) -> Path:
    """The GPTQ checkpoint of the safetensors model in `folder` (a config, its tokenizer, weights), made once in
    sdbench's cache."""
    out = cache_dir("engines", "gptq") / f"{folder.name}-{_key(folder)}-{KIND}-g{GROUP}"
    if is_complete(out):
        return out
    from safetensors.torch import load_file, save_file

    with atomic_dir(out) as tmp:
        tensors = {}
        for f in sorted(folder.glob("*.safetensors")):
            tensors.update(load_file(f))
        save_file({k: v.contiguous() for k, v in convert(tensors).items()}, tmp / "model.safetensors",
                  metadata={"format": "pt"})
        for f in folder.iterdir():  # the tokenizer and generation config
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", COMPLETE) \
                    and not f.name.endswith(".index.json"):
                shutil.copy2(f, tmp / f.name)
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = quantization_config()
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / COMPLETE).write_text(json.dumps({"from": str(folder), "type": KIND, "group_size": GROUP}))
    return out
