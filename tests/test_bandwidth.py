"""The roofline's bandwidth: the best of several streaming reads (analysis/bandwidth.py)."""

from __future__ import annotations

import math

import pytest
import torch

from sdbench.analysis.bandwidth import COLUMNS, best_read, measure_bandwidth, read_kernels


class FakeClock:
    """Seconds that advance only when a fake kernel says how long its read took."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def kernel(self, seconds: list[float]):
        """A kernel whose successive calls take these seconds (the first call is the untimed warm-up)."""
        it = iter(seconds)

        def read(x):
            self.t += next(it)
        return read


def test_the_fastest_pass_of_the_fastest_kernel_is_the_bandwidth():
    clock = FakeClock()
    x = torch.zeros(1000)  # 4000 bytes
    kernels = {"slow": clock.kernel([9.0, 4.0, 4.0, 4.0]),
               "fast but noisy": clock.kernel([9.0, 3.0, 1.0, 5.0]),  # its best pass counts, not its mean
               "middle": clock.kernel([9.0, 2.0, 2.0, 2.0])}
    bw = best_read(x, kernels, passes=3, clock=clock)
    assert bw.kernel == "fast but noisy" and bw.bytes_per_s == 4000.0
    assert bw.rates == {"slow": 1000.0, "fast but noisy": 4000.0, "middle": 2000.0}


def test_a_kernel_this_build_lacks_is_skipped():
    clock = FakeClock()

    def missing(x):
        raise RuntimeError("no such op")
    bw = best_read(torch.zeros(10), {"missing": missing, "ok": clock.kernel([1.0, 2.0])}, passes=1, clock=clock)
    assert bw.kernel == "ok" and set(bw.rates) == {"ok"}
    with pytest.raises(RuntimeError, match="no read kernel"):
        best_read(torch.zeros(10), {"missing": missing}, clock=clock)


def test_every_kernel_reads_the_whole_buffer():
    """Each kernel's result depends on every element (a kernel that read half would count double bandwidth)."""
    n = COLUMNS * torch.get_num_threads() * 3
    for name, read in read_kernels(torch.device("cpu")).items():
        x = torch.zeros(n)
        base = read(x)
        x[-1] = 1.0
        assert not torch.equal(torch.as_tensor(read(x)), torch.as_tensor(base)), name


def test_measured_on_this_machine_is_a_positive_finite_rate():
    bw = measure_bandwidth(torch.device("cpu"), mib=16)
    assert math.isfinite(bw.bytes_per_s) and bw.bytes_per_s > 0
    assert bw.kernel in bw.rates and bw.bytes_per_s == max(bw.rates.values())
    assert "GB/s" in bw.describe()
