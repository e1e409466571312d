"""The CPU fast path (float32): fused projections packed for a faster product, one copy of the weights.

The stock product (MKL) runs near memory speed for one row but is several times slower for the 2-9 rows a
draft's catch-up and a verification use; oneDNN's product on its own packed layout is not, and sdbench's own
products (`models/forward/cpukernel.py`, on a layout of blocks of 8 outputs) read the weights faster still at every width
(docs/peers.md gives the measurements). So:

- q/k/v are fused into one product and gate/up into another (7 products per layer become 4; Phi-3's are
  fused already, StarCoder2's plain MLP packs its two products, a mixture of experts stays the library's
  own module);
- every fused projection is packed once into the chosen layout (`LAYOUT_NAMES`: sdbench's blocked one, or
  oneDNN's), which then is the only copy: the modules' own weights are emptied while packed, and `unpack`
  gives them back exactly (a reorder moves values, it does not round them). A model is packed by the first
  fast forward and unpacked by the first plain one (the stock runner, or `plain(model)` around a library
  call), so both can share one model;
- a vocabulary head tied to the embedding table stays plain, since the lookup needs that table, and is read
  by the product measured fastest for the forward's width (`HeadProduct`; also the plain forward's head: the
  library's, oneDNN's, W x^T or sdbench's in place); an untied head is packed like the rest;
- Llama's RMSNorm runs as one op (`F.rms_norm`) instead of the module's five (the runner decides from the
  family: Gemma's (1 + w) norm and StarCoder2's LayerNorm stay modules);
- the first packing also copies the weights it does not pack (embeddings, norms) into the process's own
  memory: a model loaded from memory-mapped safetensors then holds no reference into the file, the mapping
  goes, and the process's resident size is the packed weights alone (without this, the embedding alone kept
  the whole file mapped and its pages resident beside the packed copy: 2x the weights in RSS).

oneDNN's packed tensors are opaque (they cannot be pickled or shared between processes): a process that
receives a model's plain weights builds its own fast path with `enable(model)`.

Whether to pack at all, and into which layout, is measured per shape (`choose`): at some shapes the plain
products win.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sdbench.env import cpu_name
from sdbench.errors import SdbenchError
from sdbench.models.forward import cpukernel
from sdbench.paths import cache_dir

ONEDNN, KERNEL = "onednn", "kernel"  # the packed layouts: oneDNN's, and sdbench's blocks of 8 (`cpukernel`)
PACK_HINT = 5  # rows oneDNN's packed layout is tuned for: a verification of gamma = 4 (also best at 1-9 rows)
_EMPTY = torch.empty(0)  # what a packed module's own weight holds
_state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> FastModel; not pickled with it


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product; weight: packed, or a plain [out, in] tensor."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _share_rows(modules: list, attr: str, fused: torch.Tensor) -> None:
    """Each module's `attr` becomes its rows of `fused` (a view: no copy)."""
    row = 0
    for m in modules:
        n = m.out_features
        getattr(m, attr).data = fused[row : row + n]
        row += n


_by_handle: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # handle -> Packed, for compiled steps
_handles = itertools.count()


@torch.library.custom_op("sdbench::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """A packed product inside a compiled step (`models/forward/cpucompile.py`): the compiler cannot take an opaque
    oneDNN weight as an input, so the step names its Packed by handle and the product runs as it does eagerly."""
    return _by_handle[handle].product(x)


@packed_linear.register_fake
def _(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class Packed:
    """y = x W^T + b, W the modules' weights stacked by rows; while packed, the only copy of them."""

    def __init__(self, modules: list[torch.nn.Linear]):
        self.modules = modules
        self.packed = None  # the packed weight (`layout`), or None while the modules hold plain weights
        self.layout = None
        self.out_features = sum(m.out_features for m in modules)
        self.in_features = modules[0].in_features
        self.handle = next(_handles)
        _by_handle[self.handle] = self
        self.bias = None
        if modules[0].bias is not None:
            self.bias = torch.cat([m.bias.detach() for m in modules]).contiguous()
            _share_rows(modules, "bias", self.bias)

    def pack(self, layout: str = ONEDNN) -> None:
        weights = [m.weight.detach() for m in self.modules]
        plain = (weights[0] if len(weights) == 1 else torch.cat(weights)).contiguous()
        self.packed = _packed(plain, layout)
        self.layout = layout
        for m in self.modules:
            m.weight.data = _EMPTY

    def unpack(self) -> None:
        if self.layout == KERNEL:
            plain = cpukernel.unpack(self.packed, self.out_features, self.in_features)
        else:
            plain = self.packed.to_dense()
        _share_rows(self.modules, "weight", plain)
        self.packed = self.layout = None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return _product(x, self.packed, self.bias, self.out_features, self.layout)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle, self.out_features)
        return self.product(x)


def _packed(plain: torch.Tensor, layout: str) -> torch.Tensor:
    """A contiguous [out, in] weight in a packed layout: sdbench's blocks of 8 outputs, or oneDNN's."""
    if layout == KERNEL:
        return cpukernel.pack(plain)
    return torch.ops.mkldnn._reorder_linear_weight(plain, PACK_HINT)


def _product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
             layout: str) -> torch.Tensor:
    """x W^T + b, W packed in `layout` (`_packed`)."""
    if layout == KERNEL:
        return cpukernel.linear(x, packed, bias, out_features)
    return _linear(x, packed, bias)


# --- the vocabulary head's product, chosen per width -------------------------------------------------------------
# The head is read in place (tied to the embedding table, or the plain weight of a model the fast path leaves
# unpacked), and no one product is fastest for it at every width: the library's is near memory speed for one row
# and up to 2x slower for 2-9, oneDNN's on the plain layout is the reverse at 2 rows, W x^T sits between;
# sdbench's own (`cpukernel.linear_plain`, where it builds) reads it in one stream per output row.

HEAD_WIDTHS = (1, 2, PACK_HINT, 8)  # the widths measured; a product of r <= 2 * 8 rows takes the nearest one's way
HEAD_WAYS = {
    "library": lambda x, w, b: F.linear(x, w, b),
    "onednn": lambda x, w, b: _linear(x, w, b),
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
    """The vocabulary head over its plain weight (never packed), by the way measured fastest for the forward's
    number of rows (`head_ways`)."""

    def __init__(self, lm_head: torch.nn.Linear):
        self.lm_head = lm_head
        self.ways = head_ways(lm_head.weight, lm_head.bias)

    def pack(self, layout: str = ONEDNN) -> None:
        pass

    def unpack(self) -> None:
        pass

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [..., H] -> [..., V]
        way = self.ways.get(_nearest_width(x.numel() // x.shape[-1]), "library")
        return HEAD_WAYS[way](x, self.lm_head.weight, self.lm_head.bias)


def head_ways(weight: torch.Tensor, bias: torch.Tensor | None) -> dict:
    """{width: way} for a [V, H] head, measured once per shape and thread count (the override `packed` keeps the
    fixed choice the fast path made before measuring: oneDNN for one row, W x^T for more; `kernel` sdbench's
    product at every width; `plain` the library's). sdbench's product is among those measured where it builds."""
    mode = os.environ.get(FAST_ENV, "measure").strip().lower()
    if mode == "packed":
        return {w: "onednn" if w == 1 else "transposed" for w in HEAD_WIDTHS}
    if mode == KERNEL and cpukernel.available():
        return dict.fromkeys(HEAD_WIDTHS, KERNEL)
    if mode == "plain" or not weight.numel():  # (an untied head emptied while packed: nothing to time)
        return dict.fromkeys(HEAD_WIDTHS, "library")
    key = (*weight.shape, bias is not None, torch.get_num_threads())
    if key not in _head_ways:
        rows = _streamed_rows(weight)
        w, b = weight.detach()[:rows], None if bias is None else bias.detach()[:rows]
        ways = {}
        candidates = {name: fn for name, fn in HEAD_WAYS.items() if name != KERNEL or cpukernel.available()}
        for width in HEAD_WIDTHS:
            x = torch.randn(1, width, weight.shape[1], dtype=weight.dtype)
            # best of 5: best of 2 can pick a way that is not the fastest (docs/peers.md)
            times = {name: _timed(lambda: fn(x, w, b), reps=5) for name, fn in candidates.items()}
            ways[width] = min(times, key=times.get)
        _head_ways[key] = ways
    return _head_ways[key]


def _streamed_rows(weight: torch.Tensor) -> int:
    """Rows of a [V, H] weight to time a product on: _STREAM_BYTES of them (at least 8192), or all."""
    return min(weight.shape[0], max(8192, _STREAM_BYTES // (weight.shape[1] * weight.element_size())))


def _mlp_parts(mlp):
    """(the products to fuse: [up side, down], the activation, gated) of an MLP the fast path packs: gated,
    gate and up fused (Llama: gate_proj, up_proj; Phi-3: gate_up_proj, fused already), or plain (StarCoder2:
    c_fc, c_proj); None for any other (a mixture of experts stays the library's own module)."""
    if hasattr(mlp, "gate_proj"):
        return [[mlp.gate_proj, mlp.up_proj], [mlp.down_proj]], mlp.act_fn, True
    if isinstance(getattr(mlp, "gate_up_proj", None), torch.nn.Linear):  # not an MoE's stacked experts
        return [[mlp.gate_up_proj], [mlp.down_proj]], mlp.activation_fn, True
    if hasattr(mlp, "c_fc"):
        return [[mlp.c_fc], [mlp.c_proj]], mlp.act, False
    return None


def _attention_parts(attn) -> list:
    """The q/k/v products to fuse (one already fused: Phi-3's qkv_proj) and the output's."""
    qkv = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
    return [qkv, [attn.o_proj]]


class FastLayer:
    """A decoder layer's projections: qkv, o, and the MLP's (gate_up and down, or up and down; none for one
    the fast path leaves to the library)."""

    def __init__(self, layer):
        qkv, o = _attention_parts(layer.self_attn)
        self.qkv, self.o = Packed(qkv), Packed(o)
        parts = _mlp_parts(layer.mlp)
        self.up = self.down = self.act = None
        self.gated = False
        if parts is not None:
            (up, down), self.act, self.gated = parts
            self.up, self.down = Packed(up), Packed(down)
        self.intermediate = self.down.modules[0].in_features if self.down else 0

    def projections(self) -> list:
        return [p for p in (self.qkv, self.o, self.up, self.down) if p is not None]

    def mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        if self.up is None:
            return mlp(x)
        if not self.gated:
            return self.down(self.act(self.up(x)))
        gate, up = self.up(x).split(self.intermediate, dim=-1)
        return self.down(self.act(gate) * up)


class FastModel:
    """A model's fast path: its layers' projections and its head, packed or not as a whole, in one layout."""

    def __init__(self, model):
        self.layout = ONEDNN  # the layout `pack` uses (`use`)
        self.layers = [FastLayer(layer) for layer in model.model.layers]
        head, embed = model.lm_head, model.model.get_input_embeddings()
        self.head = HeadProduct(head) if head.weight is embed.weight else Packed([head])
        self.packed = False
        packed = {id(m) for p in self._projections() if isinstance(p, Packed) for m in p.modules}
        rest = {id(p): p for m in model.modules() if id(m) not in packed for p in m.parameters(recurse=False)}
        self.rest = list(rest.values())  # a tied table once
        self.owned = False  # the rest copied out of a memory-mapped file (done once, at the first packing)

    def _projections(self) -> list:
        return [p for layer in self.layers for p in layer.projections()] + [self.head]

    def use(self, layout: str) -> None:
        """Pack into `layout` from now on (a model packed in another is unpacked now, packed again when next used)."""
        if layout != self.layout:
            self.unpack()
            self.layout = layout

    def pack(self) -> None:
        if not self.packed:
            for p in self._projections():
                p.pack(self.layout)
            self.packed = True
        if not self.owned:
            for p in self.rest:  # [V, H] embeddings, [H] norms: a small share of the weights
                p.data = p.data.clone()
            self.owned = True

    def unpack(self) -> None:
        if self.packed:
            for p in self._projections():
                p.unpack()
            self.packed = False


def _projection_modules(layer) -> list:
    parts = _mlp_parts(layer.mlp)
    groups = _attention_parts(layer.self_attn) + (parts[0] if parts else [])
    return [m for group in groups for m in group]


def supports(model) -> bool:
    """Float32 plain linear projections everywhere (not, say, an int8-quantised copy), on the CPU."""
    mods = [model.lm_head, *(m for layer in model.model.layers for m in _projection_modules(layer))]
    return all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
               for m in mods)


def fast_model(model) -> FastModel:
    """The model's fast path, made once per model (runners sharing a model share it), not yet packed."""
    found = _state.get(model)
    if found is None:
        found = _state[model] = FastModel(model)
    return found


def enable(model) -> FastModel | None:
    """Pack the model for the fast path now, in the layout chosen at its shape (None where it does not apply). A
    process that received the plain weights (a DSI worker) calls this to build its own."""
    if not (available() and supports(model)):
        return None
    found = fast_model(model)
    choice = choose(model)
    if choice.packed:
        found.use(choice.layout)
    found.pack()
    return found


def disable(model) -> None:
    """Give the model its plain weights back (exactly), e.g. to share or copy them."""
    found = _state.get(model)
    if found is not None:
        found.unpack()


@contextmanager
def plain(model):
    """The model with plain weights inside the block (a library's own forward, a copy, a pickle), packed
    again after it if it was packed before."""
    found = _state.get(model)
    was = found is not None and found.packed
    disable(model)
    try:
        yield model
    finally:
        if was:
            found.pack()


def rms_norm(module, x: torch.Tensor) -> torch.Tensor:
    """A Llama-family RMSNorm in one op (float32 models: the same arithmetic as the module's)."""
    return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)


# --- whether packing pays at this shape -------------------------------------------------------------------------
# Chosen on the three embedded models' shapes, the packed path lost at Llama-3.2-1B's (0.87x of the plain forward):
# the choice is now measured per shape on the products the two paths differ in, once per machine: it is kept in
# the cache (`choices.json`) by shape, threads, CPU and torch, so that runs on one machine take the same path
# (where the two are close, a measurement per run would flip between them, and with it every figure that
# depends on the forward path, the fidelity probe's kept verdicts included). Delete the file to measure again.

FAST_ENV = "SDBENCH_CPU_FAST"  # measure (default) | kernel | packed | plain | compiled: an override of the measurement
MODES = ("measure", KERNEL, "packed", "plain", "compiled")
KEPT_VERSION = 2  # choices kept before sdbench's own products were among the measured ones are measured again
WIDTHS = (1, 2, PACK_HINT)  # decoding, a draft's catch-up, a verification of gamma = 4
_STREAM_BYTES = 512 * 2**20  # the least weight each path is timed over (more than a large L3 holds)
_chosen: dict = {}  # shape key -> Choice


LAYOUT_NAMES = {ONEDNN: "packed (oneDNN)", KERNEL: "packed (sdbench's products)"}


@dataclass(frozen=True)
class Choice:
    packed: bool
    how: str  # "measured" or "override"
    ratio: float | None = None  # plain time / packed time, layers and head, summed over WIDTHS (> 1: packing wins)
    measured: str = ""  # when, where the measurement was kept from an earlier run on this machine ("": now)
    compiled: bool = False  # steps compiled too (`models/forward/cpucompile.py`; an override only)
    layout: str = ONEDNN  # the packed layout (LAYOUTS), where packed

    def describe(self) -> str:
        path = LAYOUT_NAMES[self.layout] + (", steps compiled," if self.compiled else "") if self.packed else "plain"
        if self.ratio is None:
            return f"CPU fast path: {path} forward, set by {FAST_ENV}"
        when = f" on {self.measured} (kept: {_choices_file()})" if self.measured else ""
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


def fast_mode() -> str:
    """FAST_ENV's value: measure (the default), plain, kernel (sdbench's products), packed (oneDNN's), or compiled
    (packed, steps compiled: `models/forward/cpucompile.py`)."""
    mode = os.environ.get(FAST_ENV, "measure").strip().lower() or "measure"
    if mode not in MODES:
        raise SdbenchError(f"{FAST_ENV}={mode}: use {', '.join(MODES[:-1])} or {MODES[-1]}")
    return mode


def choose(model) -> Choice:
    """Whether the fast path packs this model: the override when set, else measured once per shape."""
    mode = fast_mode()
    if mode != "measure":
        layout = _override_layout(mode) if mode != "plain" else ONEDNN
        return Choice(mode != "plain", "override", compiled=mode == "compiled", layout=layout)
    key = (model.config.to_json_string(use_diff=False), model.lm_head.weight is model.get_input_embeddings().weight,
           torch.get_num_threads(), cpukernel.available())
    if key not in _chosen:
        digest = hashlib.sha256(json.dumps([*key, cpu_name(), torch.__version__, KEPT_VERSION]).encode()).hexdigest()
        digest = digest[:24]
        kept = _kept_choices().get(digest)
        if kept is not None:
            _chosen[key] = Choice(kept["packed"], "measured", kept["ratio"], kept["measured"],
                                  layout=kept.get("layout", ONEDNN))
        else:
            with plain(model):  # the plain weights to time and to pack a copy of
                plain_s, *packed_s = _timed_paths(fast_model(model))
            best = min(range(len(packed_s)), key=packed_s.__getitem__)  # timed in LAYOUTS' order
            _chosen[key] = Choice(packed_s[best] < plain_s, "measured", plain_s / packed_s[best],
                                  layout=_measured_layouts()[best])
            _keep_choice(digest, _chosen[key])
    return _chosen[key]


def _measured_layouts() -> tuple:
    """The packed layouts a measurement times, in order: oneDNN's, and sdbench's where its products build."""
    return (ONEDNN, KERNEL) if cpukernel.available() else (ONEDNN,)


def _choices_file() -> Path:
    return cache_dir("cpufast") / "choices.json"


def _kept_choices() -> dict:
    try:
        return json.loads(_choices_file().read_text())
    except (OSError, ValueError):
        return {}


def _keep_choice(digest: str, choice: Choice) -> None:
    """Keep a measured choice for later runs on this machine (whole file replaced at once)."""
    try:
        kept = _kept_choices()
        kept[digest] = {"packed": choice.packed, "ratio": choice.ratio, "layout": choice.layout,
                        "measured": time.strftime("%Y-%m-%d %H:%M")}
        path = _choices_file()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kept, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache: the next run measures again


def _timed_paths(fast: FastModel) -> tuple:
    """(plain, packed in each of `_measured_layouts()`...) seconds of one forward's products, summed over WIDTHS:
    a pass over the first layers that
    hold _STREAM_BYTES (one layer timed again and again would sit in a large L3 and time the cache, not the
    memory a forward streams from), scaled to all layers, plus an untied head's (a tied one is the same product
    on either path)."""
    layers, size = [], 0
    for layer in fast.layers:
        layers.append(layer.projections())
        size += sum(m.weight.numel() * m.weight.element_size() for p in layers[-1] for m in p.modules)
        if size >= _STREAM_BYTES:
            break
    times = _timed_products([p for projections in layers for p in projections])
    scale = len(fast.layers) / len(layers)
    times = [t * scale for t in times]
    if isinstance(fast.head, HeadProduct):
        return tuple(times)
    head = fast.head.modules[0]
    rows = _streamed_rows(head.weight)
    scale = head.weight.shape[0] / rows
    return tuple(t + h * scale for t, h in zip(times, _timed_products([fast.head], rows)))


def _timed_products(products: list, rows: int | None = None) -> list:
    """[plain, packed in each of `_measured_layouts()`...] seconds over WIDTHS of y = x W^T for every product in
    turn: its modules' own products one by one, against their fused weight packed (a copy). rows: only the first
    rows of each W."""
    layouts = _measured_layouts()
    plain, packed = [], {layout: [] for layout in layouts}
    for p in products:
        weights = [m.weight.detach()[:rows] for m in p.modules]
        fused = (weights[0] if len(weights) == 1 else torch.cat(weights)).contiguous()
        bias = None if p.bias is None or rows is not None else p.bias
        plain.append([(w, m.bias if rows is None else None) for w, m in zip(weights, p.modules)])
        for layout in layouts:
            packed[layout].append((_packed(fused, layout), bias, fused.shape[0]))
    times = [0.0] * (1 + len(layouts))
    for width in WIDTHS:
        xs = {n: torch.randn(1, width, n) for n in {pw[0][0].shape[1] for pw in plain}}
        times[0] += _timed(lambda: [F.linear(xs[w.shape[1]], w, b) for pw in plain for w, b in pw], reps=3)
        for k, layout in enumerate(layouts, 1):
            times[k] += _timed(lambda: [_product(xs[pw[0][0].shape[1]], w, b, out, layout)
                                        for pw, (w, b, out) in zip(plain, packed[layout])], reps=3)
    return times


def _timed(fn, reps: int = 5) -> float:
    """Best of `reps` calls of fn(), in seconds, after one warm-up call: on a shared machine the slowest calls
    measure the other jobs, the fastest the product."""
    with torch.inference_mode():
        fn()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best
