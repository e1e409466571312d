"""The CPU fast path's fused decoder layer: a Llama-style layer's step over a few tokens in five calls into sdbench's
own kernels (`models/forward/cpukernel.py`) and its four products, where the library's layer takes ~30 small torch ops.

On a small model the products are not all of a CPU decode step: the norms, rotation, cache writes, attention,
activation and the Python between them take a large share of it (docs/peers.md "Where a CPU decode step's time
goes" has the measurements). Here each layer is

    x = rms_norm(h); o = attend(qkv(x)); h = h + o_proj(o); x = rms_norm(h); h = h + down(silu(gate) * up)

with `attend` rotating the new keys into the dense cache and attending causally over it in one call.

It is taken per forward where it computes what the layer loop computes: the packed path on sdbench's products (float32
or quantised blocks), a
family with Llama's layer (RMSNorm before attention and MLP, no q/k norms, no soft-capping, no residual scale, a
SiLU-gated MLP, fused q/k/v), no sliding window, a dense cache (not a sparse or scoring one) at one start position
for every row, a chain of at most FUSED_TOKENS tokens or a token tree of at most TREE_TOKENS nodes, eagerly. Any
other forward runs the loop. A tree's node gets the bits its token gets decoded alone (`kernels/layer.c`), so a
tree's verification is as exact as a chain's.
"""

from __future__ import annotations

import torch

from sdbench.kv.cache import DenseKVCache, StepIndex, TreeStep
from sdbench.models.forward import cpukernel, cpupacked, forward_paths, quants
from sdbench.models.forward.cpuhead import VERIFY_ROWS, HeadProduct

FUSED_TOKENS = 16  # the widest forward (tokens per row) taken: decoding, a draft's catch-up, verifications
TREE_TOKENS = 256  # the largest token tree taken (nodes per row, the root included): lookahead's branches too
INVARIANT_ROWS = VERIFY_ROWS  # the most rows (batch x tokens) a width-invariant step reads the head over
SILU = ("SiLU", "SiLUActivation")  # torch's module, and the library's own (`transformers.activations`)


def _layer_fits(runner, i: int) -> bool:
    attn_in, attn_out, mlp_in, mlp_out = runner._norms[i]
    fast = runner.path.fast.layers[i]
    width = (runner.n_heads + 2 * runner.n_kv_heads) * runner.head_dim
    return (attn_out is None and mlp_out is None
            and all(hasattr(m, "variance_epsilon") and m.weight is not None for m in (attn_in, mlp_in))
            and fast.gated and type(fast.act).__name__ in SILU and fast.qkv.out_features == width)


def fits(runner) -> bool:
    """Whether the runner's layers can run fused at all: its path and family (the runner asks once, when made)."""
    path, fam = runner.path, runner.family
    return (type(path) is forward_paths.CpuPacked and path.one_op_norms
            and path.fast.layout in (cpupacked.KERNEL, *quants.TYPES)
            and fam.qk_norm is None and fam.attn_softcap is None and fam.residual_scale is None
            and all(w is None for w in runner.windows) and runner.dtype == torch.float32
            and all(_layer_fits(runner, i) for i in range(len(runner.layers))))


def invariant(runner) -> bool:
    """Whether the runner's fused steps are width-invariant whole: its layers fused over sdbench's products and its
    head one of sdbench's products at every verification width (a block copy's, the packed one, or the plain
    head's where that is its one way: `cpuhead.HeadProduct`)."""
    if not runner.fused_layers:
        return False
    head = runner.path.head
    return runner.path.fast.layout in quants.TYPES or not isinstance(head, HeadProduct) or head.invariant


def wanted(cache, step) -> bool:
    """Whether a forward of a runner that `fits` runs fused: a chain, or a tree placed on the host, over a dense
    cache the layers can take."""
    chain = type(step) is StepIndex and step.T <= FUSED_TOKENS
    tree = type(step) is TreeStep and step.start is not None and step.T <= TREE_TOKENS
    return ((chain or tree) and step.uniform and type(cache) is DenseKVCache and step.kv_len <= cache.capacity
            and cache.k[0].is_contiguous())


def ancestors(step: StepIndex) -> torch.Tensor | None:
    """A tree step's ancestors as `cpukernel.attend` reads them ([B, T, T] uint8), None for a chain: made once per
    forward, shared by every layer."""
    return step.ancestors.to(torch.uint8).contiguous() if type(step) is TreeStep else None


def tables(cos_sin: dict, batch: int) -> dict:
    """The forward's rotary tables as `cpukernel.attend` reads them, [B, 1, T, Dr] each in its own memory: made
    once per forward, shared by every layer of a type."""
    return {t: tuple(x.expand(batch, *x.shape[1:]).contiguous() for x in pair) for t, pair in cos_sin.items()}


def layer(runner, i: int, h: torch.Tensor, cache: DenseKVCache, step: StepIndex, cos: torch.Tensor,
          sin: torch.Tensor, tree: torch.Tensor | None = None) -> torch.Tensor:
    """Layer i's step: hidden states [B, T, H] in, out; cos/sin from `tables`, tree from `ancestors`."""
    attn_in, _, mlp_in, _ = runner._norms[i]
    fast = runner.path.fast.layers[i]
    x = cpukernel.rms_norm(h, attn_in.weight, attn_in.variance_epsilon)
    o = cpukernel.attend(fast.qkv(x), cos, sin, cache.k[i], cache.v[i], step.start[0], runner.n_heads, runner._scale,
                         tree)
    h = h + fast.o(o)
    x = cpukernel.rms_norm(h, mlp_in.weight, mlp_in.variance_epsilon)
    return h + fast.down(cpukernel.silu_mul(fast.up(x)))
