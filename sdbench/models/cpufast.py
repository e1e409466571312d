"""The CPU fast path (float32): fewer, larger matrix products, and packed GEMMs for verification widths.

Measured on the 2-core AVX2 machine this project runs on (SmolLM2-135M, one forward at context 100):
- q/k/v fused into one product and gate/up into another: 7 products per layer become 4 (the separate
  weights become views of the fused ones, so no memory is added);
- `F.rms_norm` instead of the module's five-op norm;
- stock GEMM is near memory speed for 1-3 rows but jumps at 4-5 rows (a 5-row forward cost ~1.6x a 1-row
  one); MKL's packed GEMM (weights re-laid once for the kernel) keeps 5 rows close to 1 row. Packing is used
  only from PACK_MIN_ROWS rows, where it wins; below, the stock product is as fast and packed is slower.
  Packed copies double the weights' memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK_MIN_ROWS = 4  # rows (batch x tokens) from which a packed product beats the stock one
PACK_HINT = 5  # row count the packed layout is tuned for: a verification of gamma = 4


def _mkl() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def _onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def available() -> bool:
    return _mkl() or _onednn()


def _absent() -> None:
    return None


class Projection:
    """y = x W^T + b with the stock product for few rows and a packed one from PACK_MIN_ROWS rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias
        self.mkl = _mkl()
        if self.mkl:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_HINT)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT)

    def __deepcopy__(self, memo):  # a copied model (e.g. an int8 variant) does not carry the fast path along
        return None

    def __reduce__(self):  # nor does a model sent to another process (packed weights cannot be shared):
        return _absent, ()  # it arrives without, and a runner there builds its own (DSI workers)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows < PACK_MIN_ROWS:
            return F.linear(x, self.weight, self.bias)
        if self.mkl:
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, rows)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts concatenated along dim 0; without a copy when they already lie back to back in one storage
    (weights fused in another process and shared with this one: DSI workers keep sharing them)."""
    first = parts[0]
    offset, adjacent = first.storage_offset(), True
    for p in parts:
        adjacent &= (p.is_contiguous() and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                     and p.storage_offset() == offset)
        offset += p.numel()
    if not adjacent:
        return torch.cat(parts).contiguous()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _fuse(modules: list[torch.nn.Linear]) -> Projection:
    """One projection over the concatenated weights; the modules' own weights become views into it."""
    weight = _join([m.weight.detach() for m in modules])
    bias = None
    if modules[0].bias is not None:
        bias = _join([m.bias.detach() for m in modules])
    row = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight.data = weight[row : row + n]
        if bias is not None:
            m.bias.data = bias[row : row + n]
        row += n
    return Projection(weight, bias)


class FastLayer:
    """A decoder layer's projections, fused: qkv, o, gate_up (None for a non-gated MLP), down."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = Projection(attn.o_proj.weight.detach(), attn.o_proj.bias)
        self.gated = hasattr(mlp, "gate_proj")
        self.gate_up = _fuse([mlp.gate_proj, mlp.up_proj]) if self.gated else None
        self.down = Projection(mlp.down_proj.weight.detach(), mlp.down_proj.bias) if self.gated else None
        self.act = mlp.act_fn if self.gated else None
        self.intermediate = mlp.gate_proj.weight.shape[0] if self.gated else 0

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return _absent, ()

    def mlp(self, mlp, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return mlp(x)
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(self.act(gate) * up)


def _projections(layer) -> list:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
            *(getattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj") if hasattr(mlp, name))]


def supports(model) -> bool:
    """Float32 plain linear projections everywhere (not, say, an int8-quantised copy)."""
    mods = [model.lm_head, *(m for layer in model.model.layers for m in _projections(layer))]
    return all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 for m in mods)


def fast_layer(layer) -> FastLayer:
    """The layer's fused projections, made once per layer (runners sharing a model share them); rebuilt if
    the layer's weights are no longer the views into them (the weights were replaced)."""
    found = layer.__dict__.get("_sdbench_fast")
    if found is None or layer.self_attn.q_proj.weight.data_ptr() != found.qkv.weight.data_ptr():
        found = layer.__dict__["_sdbench_fast"] = FastLayer(layer)
    return found


def fast_head(lm_head) -> Projection:
    found = lm_head.__dict__.get("_sdbench_fast")
    if found is None or found.weight.data_ptr() != lm_head.weight.data_ptr():
        found = lm_head.__dict__["_sdbench_fast"] = Projection(lm_head.weight.detach(), lm_head.bias)
    return found


def rms_norm(module, x: torch.Tensor) -> torch.Tensor:
    """A Llama-family RMSNorm in one op (float32 models: the same arithmetic as the module's)."""
    return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)
