"""The memory bandwidth a roofline divides by: the best streaming read this machine delivers.

One reduction over a large buffer undersells a CPU: torch's `sum` accumulates in a cascade that a 2-core
machine cannot run at memory speed, and a decode step reads its weights through matrix-vector products, not
sums. So several multi-threaded read kernels each read the same buffer (larger than any last-level cache), each
a few times, and the fastest pass of the fastest kernel is the bandwidth: a roofline drawn from a slower kernel
would let an engine appear to beat it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sdbench.engine.clock import now

COLUMNS = 4096  # a matrix-vector read views the buffer as [rows, COLUMNS]


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float  # the best pass of the best kernel
    kernel: str  # its name
    rates: dict = field(default_factory=dict)  # kernel -> its best bytes/s

    def best(self, other: "Bandwidth") -> "Bandwidth":
        """The faster of two probes (before and after a run's measurement: a passing slowdown of the machine
        lowers one, not both), each kernel at its best of the two."""
        rates = {k: max(self.rates.get(k, 0.0), other.rates.get(k, 0.0)) for k in {**self.rates, **other.rates}}
        faster = self if self.bytes_per_s >= other.bytes_per_s else other
        return Bandwidth(faster.bytes_per_s, faster.kernel, rates)

    def describe(self) -> str:
        return f"{self.bytes_per_s / 1e9:.1f} GB/s ({self.kernel}, the best of {', '.join(self.rates)})"


def read_kernels(device: torch.device) -> dict[str, Callable[[torch.Tensor], object]]:
    """name -> fn(x): reads every element of the flat float32 buffer x once, on all of the device's threads."""
    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.float32, device=device)

    kernels = {
        "sum": lambda x: x.sum(),
        "sum by thread": lambda x: x.view(torch.get_num_threads(), -1).sum(1),  # one contiguous share per thread
        "amax": lambda x: x.amax(),
        "matrix-vector": lambda x: torch.mv(x.view(-1, COLUMNS), ones(COLUMNS)),
    }
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        kernels["oneDNN product"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            ones(COLUMNS)[None], x.view(-1, COLUMNS), None, "none", [], "")
    return kernels


def best_read(x: torch.Tensor, kernels: dict, passes: int = 3, clock: Callable[[], float] | None = None) -> Bandwidth:
    """Each kernel reads x once untimed, then `passes` times timed; the best pass of each gives its rate, and the
    best rate wins. A kernel that raises is skipped (an op this build lacks). clock: seconds (default: `now`
    on x's device)."""
    clock = clock or (lambda: now(x.device))
    size = x.numel() * x.element_size()
    rates = {}
    for name, read in kernels.items():
        try:
            read(x)
        except (RuntimeError, NotImplementedError):
            continue
        best = math.inf
        for _ in range(passes):
            t0 = clock()
            read(x)
            best = min(best, clock() - t0)
        if best > 0:
            rates[name] = size / best
    if not rates:
        raise RuntimeError("no read kernel ran on this device")
    kernel = max(rates, key=rates.get)
    return Bandwidth(rates[kernel], kernel, rates)


@torch.inference_mode()
def measure_bandwidth(device: torch.device, mib: int = 512) -> Bandwidth:
    """The best streaming read over a buffer of `mib` MiB (about a second on a 2-core CPU)."""
    threads = torch.get_num_threads()
    n = mib * 2**20 // 4 // (COLUMNS * threads) * (COLUMNS * threads)  # whole rows, an equal share per thread
    x = torch.ones(n, dtype=torch.float32, device=device)
    return best_read(x, read_kernels(torch.device(device)))


def with_decodings(probe: Bandwidth, reads: dict[str, float]) -> Bandwidth:
    """The probe's bandwidth, or the fastest plain decoding's read (name -> bytes/s: its weights' bytes times its
    decode tokens/s) where one reads faster: no system decodes above the roofline, and the roofline is the best
    the machine was seen to deliver in the run."""
    best = max(((f"{name}'s decoding", r) for name, r in reads.items() if r == r and r > 0), key=lambda x: x[1],
               default=None)
    if best is None or best[1] <= probe.bytes_per_s:
        return probe
    return Bandwidth(best[1], best[0], {**probe.rates, best[0]: best[1]})
