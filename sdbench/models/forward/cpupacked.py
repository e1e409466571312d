"""The CPU fast path's packed products (float32): a decoder layer's projections fused, and each fused product packed
into one layout, one copy of the weights.

- q/k/v are fused into one product and gate/up into another (7 products per layer become 4; Phi-3's are
  fused already, StarCoder2's plain MLP packs its two products, a mixture of experts stays the library's
  own module): `FastLayer`;
- a fused projection (`Packed`) is packed into one of the layouts (`LAYOUT_NAMES`: sdbench's blocks of 8 outputs,
  `models/forward/cpukernel.py`, oneDNN's, or llama.cpp's Q8_0/Q4_0 blocks for a model whose weights were snapped
  onto that grid, `models/forward/quants.py`), which then is the only copy: the modules' own weights are emptied
  while packed, and `unpack` gives them back exactly (a reorder moves values, it does not round them; snapped
  weights quantise back to themselves);
- inside a compiled step (`models/forward/cpucompile.py`) a packed product runs as the custom op `packed_linear`,
  which names its `Packed` by handle.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from sdbench.models.forward import cpukernel, quants

ONEDNN, KERNEL = "onednn", "kernel"  # the packed layouts: oneDNN's, and sdbench's blocks of 8 (`cpukernel`)
LAYOUT_NAMES = {ONEDNN: "packed (oneDNN)", KERNEL: "packed (sdbench's products)",
                **{kind: f"{kind.upper()} blocks (sdbench's products)" for kind in quants.TYPES}}
PACK_HINT = 5  # rows oneDNN's packed layout is tuned for: a verification of gamma = 4 (also best at 1-9 rows)
_EMPTY = torch.empty(0)  # what a packed module's own weight holds


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
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
        self.packed = pack_weight(plain, layout)
        self.layout = layout
        self._empty()

    def _empty(self) -> None:
        for m in self.modules:
            m.weight.data = _EMPTY

    def adopt(self, blocks: list[torch.Tensor], kind: str) -> None:
        """Packed from the modules' stored blocks (each [out, n / 32 * bytes], a GGUF file's own), not from their
        weights (empty: the blocks are the only copy)."""
        self.packed = cpukernel.pack_stored(blocks[0] if len(blocks) == 1 else torch.cat(blocks), kind)
        self.layout = kind
        self._empty()

    def _plain(self) -> torch.Tensor:
        """The fused plain weight [out, in], exactly (a new tensor: the packed one stays)."""
        if self.layout == KERNEL:
            return cpukernel.unpack(self.packed, self.out_features, self.in_features)
        if self.layout in quants.TYPES:
            return cpukernel.unpack_blocks(self.packed, self.layout, self.out_features, self.in_features)
        return self.packed.to_dense()

    def unpack(self) -> None:
        _share_rows(self.modules, "weight", self._plain())
        self.packed = self.layout = None

    def lend(self) -> list:
        """While packed, forward hooks by which the modules hold their plain weights only while they run: made when
        the first is called, emptied after the last (q, k and v: one de-quantisation, dropped after v); the hooks'
        handles, to remove (`cpufast.library_forward`)."""
        waiting: set = set()

        def before(module, args) -> None:
            if not waiting:
                _share_rows(self.modules, "weight", self._plain())
                waiting.update(map(id, self.modules))

        def after(module, args, output) -> None:
            waiting.discard(id(module))
            if not waiting:
                self._empty()

        return [h for m in self.modules for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]

    def unlend(self, hooks: list) -> None:
        for h in hooks:
            h.remove()
        self._empty()  # a forward stopped between the first module and the last

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return packed_product(x, self.packed, self.bias, self.out_features, self.layout)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle, self.out_features)
        return self.product(x)


def pack_weight(plain: torch.Tensor, layout: str) -> torch.Tensor:
    """A contiguous [out, in] weight in a packed layout: sdbench's blocks of 8 outputs, quantised blocks, or
    oneDNN's."""
    if layout == KERNEL:
        return cpukernel.pack(plain)
    if layout in quants.TYPES:
        return cpukernel.pack_blocks(plain, layout)
    return torch.ops.mkldnn._reorder_linear_weight(plain, PACK_HINT)


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                   layout: str) -> torch.Tensor:
    """x W^T + b, W packed in `layout` (`pack_weight`)."""
    if layout == KERNEL:
        return cpukernel.linear(x, packed, bias, out_features)
    if layout in quants.TYPES:
        return cpukernel.linear_blocks(x, packed, layout, bias, out_features)
    return onednn_linear(x, packed, bias)


def mlp_parts(mlp):
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


def projection_modules(layer) -> list:
    """The linear modules of a decoder layer that the fast path packs."""
    parts = mlp_parts(layer.mlp)
    groups = _attention_parts(layer.self_attn) + (parts[0] if parts else [])
    return [m for group in groups for m in group]


class FastLayer:
    """A decoder layer's projections: qkv, o, and the MLP's (gate_up and down, or up and down; none for one
    the fast path leaves to the library)."""

    def __init__(self, layer):
        qkv, o = _attention_parts(layer.self_attn)
        self.qkv, self.o = Packed(qkv), Packed(o)
        parts = mlp_parts(layer.mlp)
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
