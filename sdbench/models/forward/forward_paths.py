"""The forward path a runner takes, chosen once at its construction: eager (the modules' own products),
CPU-packed (fused projections in a packed layout, `models/forward/cpupacked.py`), CPU-compiled (the packed products in
static-shape steps compiled whole, `models/forward/cpucompile.py`) or CUDA graphs (static shapes replayed,
`models/forward/graphs.py`). One interface, read by the runner's layer loop:

  ready()        puts the weights in the layout this path's forward reads (packed, or the library's), before
                 a forward or a timed section; a model shared by runners of both kinds is moved between the two
  layer(i)       layer i's fused projections (cpupacked.FastLayer), or None for the modules' own
  head(h)        the vocabulary projection, [..., H] -> [..., V]
  norm(m, x)     a norm module applied (one op for Llama's RMSNorm when packed)

Only the runner (models/forward/runner.py) holds a path; nothing outside models/ changes the weights' layout.
"""

from __future__ import annotations

import torch

from sdbench.models.forward import cpufast, cpuhead, cpupacked

EAGER, CPU_PACKED, CPU_COMPILED, CUDA_GRAPHS = "eager", "cpu-packed", "cpu-compiled", "cuda-graphs"


class Eager:
    """The modules' own products. With the fast path asked for on a CPU where packing measured slower, the head
    is still read by the product measured fastest per width (cpuhead.HeadProduct, in place)."""

    kind = EAGER
    graphs = False  # static steps are captured as CUDA graphs
    compiled = False  # static steps run compiled (`models/forward/cpucompile.py`)
    static = False  # decode and verification steps take the static-shape forward (`models/forward/graphs.py`)

    def __init__(self, model, cpu_head: bool = False):
        self.model = model
        self.head = cpuhead.HeadProduct(model.lm_head) if cpu_head else model.lm_head

    def ready(self) -> None:
        cpufast.disable(self.model)  # a model another runner packed goes back to the library's layout

    def layer(self, i: int):
        return None

    def norm(self, module, x: torch.Tensor) -> torch.Tensor:
        return module(x)


class CpuPacked(Eager):
    """Fused q/k/v and gate/up products packed for sdbench's products or oneDNN's (`cpupacked.LAYOUT_NAMES`; the
    model's only copy of those weights while packed) and one-op RMSNorm for the families that use Llama's."""

    kind = CPU_PACKED

    def __init__(self, model, one_op_norms: bool, layout: str = cpupacked.ONEDNN):
        super().__init__(model)
        self.fast = cpufast.fast_model(model)
        self.fast.use(layout)
        self.head = self.fast.head
        self.one_op_norms = one_op_norms

    def ready(self) -> None:
        self.fast.pack()

    def layer(self, i: int):
        return self.fast.layers[i]

    def norm(self, module, x: torch.Tensor) -> torch.Tensor:
        return cpufast.rms_norm(module, x) if self.one_op_norms else module(x)


class CpuCompiled(CpuPacked):
    """The packed products inside static-shape decode and verification steps that are compiled whole (norms,
    rotation, attention and the cache writes fused into a few kernels between the products, no Python between
    them); `SDBENCH_CPU_FAST=compiled`."""

    kind = CPU_COMPILED
    compiled = True
    static = True


class CudaGraphs(Eager):
    """Eager products inside static-shape forwards captured as CUDA graphs (the runner's static path)."""

    kind = CUDA_GRAPHS
    graphs = True
    static = True


def choose(model, fast: bool, device: torch.device, rms_norm: bool) -> Eager:
    """The path for a runner: off without `fast`; CUDA graphs on a GPU; on a CPU, packed where a short
    measurement at this model's shape finds packing faster (`cpufast.choose`), else eager with the head's
    fastest product. rms_norm: the family's norm is Llama's (one op when packed; not Gemma's 1 + w)."""
    if not fast:
        return Eager(model)
    if device.type == "cuda":
        return CudaGraphs(model)
    cpu = device.type == "cpu" and cpufast.available() and cpufast.supports(model)
    choice = cpufast.choose(model) if cpu else None
    if choice is not None and choice.packed:
        return CpuPacked(model, rms_norm, choice.layout)
    return Eager(model, cpu_head=cpu)


def compiled(path: CpuPacked) -> CpuCompiled:
    """The compiled form of a CPU-packed path (the runner takes it where `cpucompile.wanted()`)."""
    return CpuCompiled(path.model, path.one_op_norms, path.fast.layout)
