"""Whether the CPU fast path packs a model at its shape, and into which layout: the choice, measured or overridden,
and what is kept of it.

Where sdbench's own products build, a model is packed into them without measuring (INVARIANT: their rows are the
same bits at every width, which exact verification needs). Elsewhere, since at some shapes the plain products win,
the choice is measured per shape on the products the two paths differ
in (`timed_paths`: plain, and packed in each layout that builds here, at WIDTHS), once per machine: it is kept in
the cache (`choices.json`) by shape, threads, CPU and torch, so that runs on one machine take the same path (where
the two are close, a measurement per run would flip between them, and with it every figure that depends on the
forward path, the fidelity probe's kept verdicts included). Delete the file to measure again. `SDBENCH_CPU_FAST`
sets the choice instead (`overridden`). `cpufast.choose` makes the choice for a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sdbench.env import cpu_name
from sdbench.errors import SdbenchError
from sdbench.models.forward import cpukernel, cpumeasure
from sdbench.models.forward.cpuhead import HeadProduct
from sdbench.models.forward.cpumeasure import FAST_ENV
from sdbench.models.forward.cpupacked import KERNEL, LAYOUT_NAMES, ONEDNN, PACK_HINT, pack_weight, packed_product
from sdbench.paths import cache_dir

KEPT_VERSION = 2  # choices kept before sdbench's own products were among the measured ones are measured again
WIDTHS = (1, 2, PACK_HINT)  # decoding, a draft's catch-up, a verification of gamma = 4
INVARIANT = "width-invariant"  # how a model is packed where sdbench's products build: into them, not measured


@dataclass(frozen=True)
class Choice:
    packed: bool
    how: str  # "measured", "override", INVARIANT (sdbench's products) or "quantised" (the weights are blocks: read so)
    ratio: float | None = None  # plain time / packed time, layers and head, summed over WIDTHS (> 1: packing wins)
    measured: str = ""  # when, where the measurement was kept from an earlier run on this machine ("": now)
    compiled: bool = False  # steps compiled too (`models/forward/cpucompile.py`; an override only)
    layout: str = ONEDNN  # the packed layout (LAYOUT_NAMES), where packed

    def describe(self) -> str:
        path = LAYOUT_NAMES[self.layout] + (", steps compiled," if self.compiled else "") if self.packed else "plain"
        if self.how == "quantised":
            how = "the model's weights" if self.packed else f"the de-quantised weights, set by {FAST_ENV}"
            return f"CPU fast path: {path} forward ({how})"
        if self.how == INVARIANT:
            return (f"CPU fast path: {path} forward (width-invariant: a verification's rows are the bits of their "
                    "tokens decoded alone)")
        if self.ratio is None:
            return f"CPU fast path: {path} forward, set by {FAST_ENV}"
        when = f" on {self.measured} (kept: {choices_file()})" if self.measured else ""
        missing = f"; sdbench's products: {cpukernel.why_not()}" if cpukernel.why_not() else ""
        return (f"CPU fast path: {path} forward, measured at this shape{when} (packed products {self.ratio:.2f}x "
                f"the speed of plain ones at widths {', '.join(map(str, WIDTHS))}{missing})")


def _override_layout(mode: str) -> str:
    """The layout an override packs into: `kernel` sdbench's products (refused in one line where they do not
    build), `packed` oneDNN's, `compiled` sdbench's where they build, else oneDNN's."""
    if mode == KERNEL and not cpukernel.available():
        raise SdbenchError(f"{FAST_ENV}={KERNEL}: sdbench's CPU products are not available here "
                           f"({cpukernel.why_not()}); use {FAST_ENV}=packed")
    return KERNEL if mode == KERNEL or (mode == "compiled" and cpukernel.available()) else ONEDNN


def overridden(mode: str) -> Choice:
    """The choice an override (`cpumeasure.fast_mode`, any mode but `measure`) sets."""
    layout = _override_layout(mode) if mode != "plain" else ONEDNN
    return Choice(mode != "plain", "override", compiled=mode == "compiled", layout=layout)


def measured_layouts() -> tuple:
    """The packed layouts a measurement times, in order: oneDNN's, and sdbench's where its products build."""
    return (ONEDNN, KERNEL) if cpukernel.available() else (ONEDNN,)


def choices_file() -> Path:
    return cache_dir("cpufast") / "choices.json"


def kept_digest(key: tuple) -> str:
    """The name a choice is kept under: its shape key with the CPU, torch and KEPT_VERSION, hashed."""
    digest = hashlib.sha256(json.dumps([*key, cpu_name(), torch.__version__, KEPT_VERSION]).encode()).hexdigest()
    return digest[:24]


def kept_choices() -> dict:
    try:
        return json.loads(choices_file().read_text())
    except (OSError, ValueError):
        return {}


def keep_choice(digest: str, choice: Choice) -> None:
    """Keep a measured choice for later runs on this machine (whole file replaced at once)."""
    try:
        kept = kept_choices()
        kept[digest] = {"packed": choice.packed, "ratio": choice.ratio, "layout": choice.layout,
                        "measured": time.strftime("%Y-%m-%d %H:%M")}
        path = choices_file()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kept, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache: the next run measures again


def timed_paths(fast) -> tuple:
    """(plain, packed in each of `measured_layouts()`...) seconds of one forward's products (`cpufast.FastModel`),
    summed over WIDTHS: a pass over the first layers that hold STREAM_BYTES (one layer timed again and again would
    sit in a large L3 and time the cache, not the memory a forward streams from), scaled to all layers, plus an
    untied head's (a tied one is the same product on either path)."""
    layers, size = [], 0
    for layer in fast.layers:
        layers.append(layer.projections())
        size += sum(m.weight.numel() * m.weight.element_size() for p in layers[-1] for m in p.modules)
        if size >= cpumeasure.STREAM_BYTES:
            break
    times = _timed_products([p for projections in layers for p in projections])
    scale = len(fast.layers) / len(layers)
    times = [t * scale for t in times]
    if isinstance(fast.head, HeadProduct):
        return tuple(times)
    head = fast.head.modules[0]
    rows = cpumeasure.streamed_rows(head.weight)
    scale = head.weight.shape[0] / rows
    return tuple(t + h * scale for t, h in zip(times, _timed_products([fast.head], rows)))


def _timed_products(products: list, rows: int | None = None) -> list:
    """[plain, packed in each of `measured_layouts()`...] seconds over WIDTHS of y = x W^T for every product in
    turn: its modules' own products one by one, against their fused weight packed (a copy). rows: only the first
    rows of each W."""
    layouts = measured_layouts()
    plain, packed = [], {layout: [] for layout in layouts}
    for p in products:
        weights = [m.weight.detach()[:rows] for m in p.modules]
        fused = (weights[0] if len(weights) == 1 else torch.cat(weights)).contiguous()
        bias = None if p.bias is None or rows is not None else p.bias
        plain.append([(w, m.bias if rows is None else None) for w, m in zip(weights, p.modules)])
        for layout in layouts:
            packed[layout].append((pack_weight(fused, layout), bias, fused.shape[0]))
    times = [0.0] * (1 + len(layouts))
    for width in WIDTHS:
        xs = {n: torch.randn(1, width, n) for n in {pw[0][0].shape[1] for pw in plain}}
        times[0] += cpumeasure.timed(lambda: [F.linear(xs[w.shape[1]], w, b) for pw in plain for w, b in pw], reps=3)
        for k, layout in enumerate(layouts, 1):
            times[k] += cpumeasure.timed(lambda: [packed_product(xs[pw[0][0].shape[1]], w, b, out, layout)
                                                  for pw, (w, b, out) in zip(plain, packed[layout])], reps=3)
    return times
