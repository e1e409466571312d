"""Weights in llama.cpp's quantised block formats (Q8_0, Q4_0), as GGUF files store them: quantising a float32
weight, de-quantising it, and snapping a weight onto a type's grid.

A [out, n] weight (n a multiple of BLOCK) becomes `out` rows of n / BLOCK blocks, each a float16 scale d and BLOCK
quantised inputs, as uint8 [out, n / BLOCK * block bytes]:
- Q8_0: d = max|w| / 127, q = round(w / d) (half away from zero) as int8; w' = d q;
- Q4_0: d = m / -8 where m is the input of largest magnitude (with its sign), q = min(15, trunc(w / d + 8.5)) in
  four bits, input j of a block in the low half of byte j and input j + 16 in the high half; w' = d (q - 8).
The scale is computed in float32 and stored in float16, and w' uses the stored one: the rounding ggml's reference
quantisation does (the `gguf` package's `quants` module is the independent check, byte for byte, in the tests).

Where sdbench's integer products build (VNNI: `models/forward/kernels/quants.c`), the blocks are regrouped by 8 output
rows, or 16 where the vectors are AVX-512's (`group`): a group-block is the rows' float16 scales, then their quants
interleaved 4 inputs at a time (Q8_0 as unsigned bytes q + 128), so that one vector holds 4 inputs of every row.
`ungroup` gives the stored blocks back exactly.

A weight snapped onto a type's grid (`snap`: de-quantised after quantising) quantises back to the same bytes, so
a model whose weights were snapped is its quantised copy exactly: the library's forward over the snapped float32
weights is the reference sdbench's products over the blocks (`models/forward/kernels/quants.c`) are checked against.
"""

from __future__ import annotations

import torch

from sdbench.models.loading.names import BLOCK_TYPES as TYPES

BLOCK = 32  # inputs per block
BLOCK_BYTES = dict(zip(TYPES, (2 + BLOCK, 2 + BLOCK // 2)))  # q8_0, q4_0


def fits(n: int) -> bool:
    """Whether a product over n inputs can be quantised (whole blocks)."""
    return n % BLOCK == 0


def _scales(d: torch.Tensor) -> torch.Tensor:
    """float32 scales [rows, 1] as the stored float16 bytes [rows, 2]."""
    return d.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def quantise(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """A float32 [out, n] weight as uint8 [out, n / BLOCK * BLOCK_BYTES[kind]] blocks."""
    out, n = weight.shape
    if not fits(n):
        raise ValueError(f"{kind} quantises whole blocks of {BLOCK} inputs, and the weight has {n}")
    blocks = weight.detach().to(torch.float32).reshape(-1, BLOCK)
    if kind == "q8_0":
        d = blocks.abs().amax(dim=1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        v = blocks * inv
        q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).to(torch.int8).view(torch.uint8)
    elif kind == "q4_0":
        m = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))
        d = m / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc(blocks * inv + 8.5).clamp(0, 15).to(torch.uint8)
        q = q[:, : BLOCK // 2] | (q[:, BLOCK // 2 :] << 4)
    else:
        raise ValueError(f"unknown block type {kind!r} (known: {', '.join(TYPES)})")
    return torch.cat([_scales(d), q], dim=1).reshape(out, -1).contiguous()


def dequantise(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """uint8 [out, n / BLOCK * BLOCK_BYTES[kind]] blocks as the float32 [out, n] weight they hold."""
    out = blocks.shape[0]
    b = blocks.reshape(-1, BLOCK_BYTES[kind])
    d = b[:, :2].contiguous().view(torch.float16).to(torch.float32)
    if kind == "q8_0":
        q = b[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    else:
        packed = b[:, 2:]
        q = torch.cat([packed & 15, packed >> 4], dim=1).to(torch.float32) - 8
    return (d * q).reshape(out, -1)


def snap(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """The float32 weight a quantised copy of `weight` holds (de-quantised after quantising)."""
    return dequantise(quantise(weight, kind), kind)


def _grouped_shape(blocks: torch.Tensor, kind: str, rows: int) -> torch.Tensor:
    """The stored blocks [out, nb * bytes] padded with zero blocks to whole groups, as [groups, rows, nb, bytes]."""
    out = blocks.shape[0]
    padded = torch.zeros(-(-out // rows) * rows, blocks.shape[1], dtype=torch.uint8)
    padded[:out] = blocks
    return padded.view(-1, rows, blocks.shape[1] // BLOCK_BYTES[kind], BLOCK_BYTES[kind])


def group(blocks: torch.Tensor, kind: str, rows: int) -> torch.Tensor:
    """Stored blocks [out, nb * BLOCK_BYTES] regrouped by `rows` output rows: [groups * nb * group bytes] uint8."""
    b = _grouped_shape(blocks, kind, rows)
    groups, _, nb, _ = b.shape
    scales = b[..., :2].permute(0, 2, 1, 3).reshape(groups, nb, 2 * rows)
    q = b[..., 2:]
    if kind == "q8_0":
        q = (q.view(torch.int8).to(torch.int16) + 128).to(torch.uint8)  # unsigned: what VNNI multiplies
    quads = q.reshape(groups, rows, nb, -1, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, -1)
    return torch.cat([scales, quads], dim=2).reshape(-1).contiguous()


def ungroup(grouped: torch.Tensor, kind: str, out: int, n: int, rows: int) -> torch.Tensor:
    """The stored blocks [out, n / BLOCK * BLOCK_BYTES] back from `group`'s layout."""
    nb, width = n // BLOCK, BLOCK_BYTES[kind] - 2
    g = grouped.view(-1, nb, rows * BLOCK_BYTES[kind])
    groups = g.shape[0]
    scales = g[..., : 2 * rows].reshape(groups, nb, rows, 2).permute(0, 2, 1, 3)
    q = g[..., 2 * rows :].reshape(groups, nb, width // 4, rows, 4).permute(0, 3, 1, 2, 4).reshape(groups, rows, nb,
                                                                                                     width)
    if kind == "q8_0":
        q = (q.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
    return torch.cat([scales, q], dim=3).reshape(groups * rows, -1)[:out].contiguous()
