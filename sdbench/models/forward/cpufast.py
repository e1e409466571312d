"""The CPU fast path (float32) at the model level: whether it applies to a model, packing and unpacking a model as a
whole, and the choice of path for it.

The stock product (MKL) runs near memory speed for one row but is several times slower for the 2-9 rows a
draft's catch-up and a verification use; oneDNN's product on its own packed layout is not, and sdbench's own
products (`models/forward/cpukernel.py`, on a layout of blocks of 8 outputs) read the weights faster still at every
width (docs/peers.md gives the measurements). So:

- a model's projections are fused and packed into one layout, the only copy of those weights
  (`models/forward/cpupacked.py`); a model is packed by the first fast forward and unpacked by the first plain one
  (the stock runner, or `plain(model)` around a library call), so both can share one model;
- a vocabulary head tied to the embedding table stays plain, since the lookup needs that table, and is read by
  the product measured fastest for the forward's width (`models/forward/cpuhead.py`; also the plain forward's
  head); an untied head is packed like the rest;
- Llama's RMSNorm runs as one op (`rms_norm`) instead of the module's five (the runner decides from the
  family: Gemma's (1 + w) norm and StarCoder2's LayerNorm stay modules);
- the first packing also copies the weights it does not pack (embeddings, norms) into the process's own
  memory: a model loaded from memory-mapped safetensors then holds no reference into the file, the mapping
  goes, and the process's resident size is the packed weights alone (without this, the embedding alone kept
  the whole file mapped and its pages resident beside the packed copy).

oneDNN's packed tensors are opaque (they cannot be pickled or shared between processes): a process that
receives a model's plain weights builds its own fast path with `enable(model)`.

Where sdbench's own products build, a model is packed into their layout and its head read by them at every
verification width (`choose`): their rows are the same bits whatever the width (`kernels/products.c`), so a
strategy's verification computes exactly what plain decoding does. Elsewhere, whether to pack at all, and into which
layout, is measured per shape (`models/forward/cpuchoice.py`): at some shapes the plain products win. A model whose
weights were snapped onto a quantised grid (`quantised`: a MODEL@q8_0 or @q4_0 copy) packs into those blocks, not
measured: reading them as blocks is what it is for.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from sdbench.models.forward import cpuchoice, cpukernel, cpumeasure, quants
from sdbench.models.forward.cpuhead import HeadProduct
from sdbench.models.forward.cpupacked import KERNEL, ONEDNN, FastLayer, Packed, projection_modules
from sdbench.models.loading.memory import free_bytes

_state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> FastModel; not pickled with it
_chosen: dict = {}  # shape key -> cpuchoice.Choice
BLOCKS_ATTR = "sdbench_blocks"  # a model's own attribute naming its weights' block type: it travels with the model


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


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


def supports(model) -> bool:
    """Float32 plain linear projections everywhere (not, say, an int8-quantised copy), on the CPU."""
    mods = [model.lm_head, *(m for layer in model.model.layers for m in projection_modules(layer))]
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


@contextmanager
def library_forward(model, lend: bool | None = None):
    """The model inside the block for the library's own forward (the probe's reference, `check`'s generate):
    `plain`, except that a model packed in blocks whose float32 copy (4-8 times its blocks: 6 GB for a 1.5B model)
    would take more than half the memory free now lends each fused product its float weights only while that
    product's modules run (`Packed.lend`; each forward then de-quantises them again). `lend`: either way. For a
    forward only: a copy or a pickle needs `plain`."""
    found = _state.get(model)
    blocks = found is not None and found.packed and found.layout in quants.TYPES
    if blocks and lend is None:
        free = free_bytes(torch.device("cpu"))
        lend = free is None or 2 * _float_bytes(found) > free
    if not (blocks and lend):
        with plain(model):
            yield model
        return
    lent = [(p, p.lend()) for p in found._projections() if isinstance(p, Packed)]
    try:
        yield model
    finally:
        for p, hooks in lent:
            p.unlend(hooks)


def _float_bytes(found: FastModel) -> int:
    return sum(4 * p.out_features * p.in_features for p in found._projections() if isinstance(p, Packed))


def quantised(model, kind: str) -> None:
    """Mark a model whose projections and head were snapped onto `kind`'s grid (`models/forward/quants.py`): its fast
    path packs them into those blocks (the mark is an attribute of the model, so that a replica made from it in
    another process, a DSI worker, reads the same blocks)."""
    setattr(model, BLOCKS_ATTR, kind)


def adopt_blocks(model, kind: str, stored: dict) -> FastModel:
    """Mark the model as holding `kind`'s blocks and pack it from them now: `stored` gives each packed projection
    module its blocks (a GGUF file's own, `models/loading/gguf_blocks.py`; its weight is empty); a head tied to
    the embedding table is packed from the table, which holds the same values."""
    quantised(model, kind)
    found = fast_model(model)
    found.use(kind)
    for p in found._projections():
        if isinstance(p, Packed):
            p.adopt([stored[m] for m in p.modules], kind)
        else:
            p.pack(kind)
    found.packed = found.owned = True  # the float tensors were made by the reader: no file mapped
    return found


def packed_bytes(model) -> int:
    """The bytes a packed model holds in its packed layouts (0 where it is not packed): its projections' only copy."""
    found = _state.get(model)
    if found is None or not found.packed:
        return 0
    return sum(p.packed.numel() * p.packed.element_size() for p in found._projections() if isinstance(p, Packed))


def weights_kind(model) -> str | None:
    """The block type a model's weights were snapped onto (None: float weights)."""
    return getattr(model, BLOCKS_ATTR, None)


def weight_bytes(model) -> int:
    """The bytes of a loaded model's parameters, each tensor counted once (tied weights share one); a block copy's
    (MODEL@q8_0) matrices at their blocks' bytes, what its forward reads; a packed model's packed projections too."""
    kind = weights_kind(model)
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            if kind is not None and p.dim() == 2 and quants.fits(p.shape[1]):
                total += p.shape[0] * p.shape[1] // quants.BLOCK * quants.BLOCK_BYTES[kind]
            else:
                total += p.numel() * p.element_size()
    return total + packed_bytes(model)  # a packed model's projections: emptied above, held packed


def block_activations(model) -> str | None:
    """What a block copy's products multiply its blocks with on the fast path: "int8" (8-bit activations and integer
    products, as llama.cpp's, where VNNI builds) or "float32"; None for float weights."""
    if weights_kind(model) is None:
        return None
    return "int8" if cpukernel.available() and cpukernel.grouped() else "float32"


def rms_norm(module, x: torch.Tensor) -> torch.Tensor:
    """A Llama-family RMSNorm in one op (float32 models: the same arithmetic as the module's)."""
    return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)


def choose(model) -> cpuchoice.Choice:
    """Whether the fast path packs this model, and how: the override when set; else sdbench's own products where
    they build (width-invariant: a verification's rows equal their tokens decoded alone, bit for bit); else
    measured once per shape."""
    mode = cpumeasure.fast_mode()
    if weights_kind(model) is not None:
        return cpuchoice.Choice(mode != "plain", "quantised", layout=weights_kind(model))
    if mode != "measure":
        return cpuchoice.overridden(mode)
    if cpukernel.available():  # the products whose rows are the same bits at every width: exact verification
        return cpuchoice.Choice(True, cpuchoice.INVARIANT, layout=KERNEL)
    key = (model.config.to_json_string(use_diff=False), model.lm_head.weight is model.get_input_embeddings().weight,
           torch.get_num_threads(), cpukernel.available())
    if key not in _chosen:
        digest = cpuchoice.kept_digest(key)
        kept = cpuchoice.kept_choices().get(digest)
        if kept is not None:
            _chosen[key] = cpuchoice.Choice(kept["packed"], "measured", kept["ratio"], kept["measured"],
                                            layout=kept.get("layout", ONEDNN))
        else:
            with plain(model):  # the plain weights to time and to pack a copy of
                plain_s, *packed_s = cpuchoice.timed_paths(fast_model(model))
            best = min(range(len(packed_s)), key=packed_s.__getitem__)  # timed in measured_layouts()' order
            _chosen[key] = cpuchoice.Choice(packed_s[best] < plain_s, "measured", plain_s / packed_s[best],
                                            layout=cpuchoice.measured_layouts()[best])
            cpuchoice.keep_choice(digest, _chosen[key])
    return _chosen[key]
