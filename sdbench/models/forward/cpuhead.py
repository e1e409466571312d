"""The CPU fast path's vocabulary head: read in place over its plain weight, by sdbench's own product at every
verification width where it builds (width-invariant), else by the product measured fastest for the forward's width.

The head is read in place (tied to the embedding table, which the lookup needs, or the plain weight of a model the
fast path leaves unpacked), and no one product is fastest for it at every width: the library's is near memory speed
for one row and slower for 2-9, oneDNN's on the plain layout is the reverse at 2 rows, W x^T sits between;
sdbench's own (`cpukernel.linear_plain`, where it builds) reads it in one stream per output row (docs/peers.md gives
the measurements). `head_ways` times each at HEAD_WIDTHS once per shape and thread count; `HeadProduct` reads the
head by the way chosen for the nearest width. A model whose weights are snapped onto a quantised grid reads its head
from a quantised copy instead (the plain table stays for the embedding lookup).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from sdbench.models.forward import cpukernel, cpumeasure, quants
from sdbench.models.forward.cpupacked import KERNEL, ONEDNN, PACK_HINT, onednn_linear

HEAD_WIDTHS = (1, 2, PACK_HINT, 8)  # the widths measured; a product of r <= 2 * 8 rows takes the nearest one's way
VERIFY_ROWS = 256  # rows read by sdbench's product where it is the head's one way (the largest fused tree)
HEAD_WAYS = {
    "library": lambda x, w, b: F.linear(x, w, b),
    "onednn": lambda x, w, b: onednn_linear(x, w, b),
    "transposed": lambda x, w, b: _transposed(x, w, b),
    KERNEL: lambda x, w, b: cpukernel.linear_plain(x, w, b),
}
_head_ways: dict = {}  # (V, H, bias, threads) -> {width: way}


def _transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = (weight @ x.reshape(-1, x.shape[-1]).T).T.contiguous()
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])


def _nearest_width(rows: int) -> int | None:
    if rows > 2 * HEAD_WIDTHS[-1]:
        return None  # a prefill: compute-bound, the library's product
    return min(HEAD_WIDTHS, key=lambda w: (abs(w - rows), w))


class HeadProduct:
    """The vocabulary head over its plain weight (never packed): by sdbench's product at every width up to
    VERIFY_ROWS where that is its one way (`head_ways`: width-invariant), else by the way measured fastest for the
    forward's number of rows."""

    def __init__(self, lm_head: torch.nn.Linear):
        self.lm_head = lm_head
        self.ways = head_ways(lm_head.weight, lm_head.bias)
        self.invariant = set(self.ways.values()) == {KERNEL}  # one product at every width up to VERIFY_ROWS
        self.blocks = self.kind = None  # the quantised copy, in a quantised layout

    def pack(self, layout: str = ONEDNN) -> None:
        if layout in quants.TYPES and self.blocks is None:
            self.blocks, self.kind = cpukernel.pack_blocks(self.lm_head.weight, layout), layout

    def unpack(self) -> None:
        self.blocks = self.kind = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [..., H] -> [..., V]
        if self.blocks is not None:
            return cpukernel.linear_blocks(x, self.blocks, self.kind, self.lm_head.bias, self.lm_head.out_features)
        rows = x.numel() // x.shape[-1]
        if self.invariant and rows <= VERIFY_ROWS:
            return cpukernel.linear_plain(x, self.lm_head.weight, self.lm_head.bias)
        way = self.ways.get(_nearest_width(rows), "library")
        return HEAD_WAYS[way](x, self.lm_head.weight, self.lm_head.bias)


def head_ways(weight: torch.Tensor, bias: torch.Tensor | None) -> dict:
    """{width: way} for a [V, H] head: sdbench's product at every width where it builds (width-invariant, as the
    fast path's layers: `cpufast.choose`; also the override `kernel`); else measured once per shape and thread
    count (the override `packed` keeps the fixed choice the fast path made before measuring: oneDNN for one row,
    W x^T for more; `plain` the library's)."""
    mode = os.environ.get(cpumeasure.FAST_ENV, "measure").strip().lower() or "measure"
    if mode == "packed":
        return {w: "onednn" if w == 1 else "transposed" for w in HEAD_WIDTHS}
    if mode in (KERNEL, "measure") and cpukernel.available():
        return dict.fromkeys(HEAD_WIDTHS, KERNEL)
    if mode == "plain" or not weight.numel():  # (an untied head emptied while packed: nothing to time)
        return dict.fromkeys(HEAD_WIDTHS, "library")
    key = (*weight.shape, bias is not None, torch.get_num_threads())
    if key not in _head_ways:
        rows = cpumeasure.streamed_rows(weight)
        w, b = weight.detach()[:rows], None if bias is None else bias.detach()[:rows]
        ways = {}
        candidates = {name: fn for name, fn in HEAD_WAYS.items() if name != KERNEL or cpukernel.available()}
        for width in HEAD_WIDTHS:
            x = torch.randn(1, width, weight.shape[1], dtype=weight.dtype)
            # best of 5: best of 2 can pick a way that is not the fastest (docs/peers.md)
            times = {name: cpumeasure.timed(lambda: fn(x, w, b), reps=5) for name, fn in candidates.items()}
            ways[width] = min(times, key=times.get)
        _head_ways[key] = ways
    return _head_ways[key]
