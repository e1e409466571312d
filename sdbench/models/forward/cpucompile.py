"""The CPU fast path's compiled steps (`SDBENCH_CPU_FAST=compiled`): decode and verification forwards compiled
whole, around the packed products.

Between its products an eager step runs some twenty small ops per layer (norms, the rotation, the cache writes,
attention, the residual adds), each with Python and dispatch time around it. Compiled, the small ops fuse into a
few generated kernels per layer and the Python between them goes. A runner on this path runs its decode and
verification steps as static-shape forwards (`models/forward/graphs.py`: fixed buffers, attention over the whole pooled
cache under a mask, the new keys scattered to their positions) whose layers torch.compile compiled:

- the products stay the packed ones (sdbench's or oneDNN's), the same calls as eagerly (the compiler cannot
  take a packed weight, so a step names each by handle: `cpupacked.packed_linear`); the vocabulary head runs
  after the compiled layers, by the product measured fastest for its width, as eagerly;
- one compiled step per (batch, width, cache length), each compiled at its first call: 30-45 s on the project's
  2-core CPU at SmolLM2-135M's size, 5-10 s once torch keeps the generated code on disk (nothing compiles ahead:
  a timed section that meets a new width or cache length times its compiling);
- it is an override, not the measured default: on that CPU the products are most of a step, so compiling gained
  1.02x on SmolLM2-135M's decoding and 1.08x on its `ngram` verifications (docs/peers.md, "Where a CPU decode
  step's time goes"), less than the minutes of compiling a first run of each shape would cost;
- a step that fails to compile turns the compiled path off for that runner with a warning: its steps then run
  the same static forward eagerly.
"""

from __future__ import annotations

import warnings

import torch

from sdbench.models.forward import cpumeasure, forward_paths

RECOMPILE_LIMIT = 64  # compiled steps per runner: (batch, width, cache length) each, trees' widths included


def wanted() -> bool:
    """Whether a runner on the packed path compiles its steps (`SDBENCH_CPU_FAST=compiled`)."""
    return cpumeasure.fast_mode() == "compiled"


class CompiledLayers:
    """A runner's layers compiled (`ModelRunner.run_layers`), called by its static forwards."""

    def __init__(self, runner):
        self.runner = runner
        self.fn = torch.compile(runner.run_layers, dynamic=False)

    def __call__(self, forward, taps) -> torch.Tensor | None:
        """The hidden states of a static forward over its filled buffers (`graphs.StaticForward`), or None
        after a failed compilation (the path is then the eager packed one)."""
        runner = self.runner
        runner.path.ready()
        try:
            # inference mode entered here, outside the traced function: entered inside, it fails to compile
            with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return self.fn(forward.cache, forward.tokens, forward.step(), forward.cos_sin, taps)
        except Exception as exc:  # noqa: BLE001 - whatever the compiler raises, the eager step is exact
            runner.path = forward_paths.CpuPacked(runner.model, runner.path.one_op_norms, runner.path.fast.layout)
            warnings.warn(f"{runner.name or 'model'}: compiling a step failed ({str(exc).splitlines()[0]}); "
                          "using the eager packed step", RuntimeWarning, stacklevel=2)
            return None
