"""sdbench's own CPU products (`models/cpukernel.py`, `models/kernels/products.c`) against torch's product, and the
fast path on them against the library's forward and `generate`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sdbench.errors import SdbenchError
from sdbench.models import cpufast, cpukernel
from sdbench.models.runner import ModelRunner
from tests.conftest import tiny_model

pytestmark = pytest.mark.skipif(not cpukernel.available(), reason=f"no CPU products: {cpukernel.why_not()}")


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(b.abs().max())))


# out: one block, a part block, an odd number of blocks (the wide path's last block alone); n: below a vector, odd,
# past the wide path's input chunk (256); rows: every narrow width, a wide tile and its remainders
@pytest.mark.parametrize("out", [1, 8, 13, 20, 40])
@pytest.mark.parametrize("n", [1, 7, 16, 37, 300])
def test_the_blocked_product_equals_torch_at_every_width(out, n):
    g = torch.Generator().manual_seed(out * 1000 + n)
    w, b = torch.randn(out, n, generator=g), torch.randn(out, generator=g)
    blocked = cpukernel.pack(w)
    assert blocked.numel() == -(-out // 8) * 8 * n
    for rows in [*range(1, 10), 12, 13, 17, 64]:
        x = torch.randn(1, rows, n, generator=g)
        _close(cpukernel.linear(x, blocked, b, out), F.linear(x, w, b))
        _close(cpukernel.linear(x[0], blocked, None, out), F.linear(x[0], w))


@pytest.mark.parametrize("n", [1, 15, 16, 33, 576])
def test_the_in_place_product_equals_torch(n):
    g = torch.Generator().manual_seed(n)
    w, b = torch.randn(29, n, generator=g), torch.randn(29, generator=g)
    for rows in (1, 2, 5, 8, 9, 16, 19):
        x = torch.randn(rows, n, generator=g)
        _close(cpukernel.linear_plain(x, w, b), F.linear(x, w, b))
        _close(cpukernel.linear_plain(x.view(1, rows, n), w, None), F.linear(x, w).view(1, rows, 29))


def test_packing_moves_values_and_unpacking_gives_them_back_exactly():
    w = torch.randn(21, 10)
    blocked = cpukernel.pack(w)
    assert torch.equal(cpukernel.unpack(blocked, 21, 10), w)
    grid = blocked.view(3, 10, 8)  # block, input, output within the block
    assert torch.equal(grid[1, 4], w[8:16, 4]) and torch.equal(grid[2, :, :5], w[16:].T)
    assert not grid[2, :, 5:].any()  # the last block's padding


def test_a_broken_product_is_caught(monkeypatch):
    """The comparison above fails on a product that drops one input (the test can fail)."""
    w, x = torch.randn(8, 16), torch.randn(1, 16)
    wrong = w.clone()
    wrong[:, 3] = 0
    with pytest.raises(AssertionError):
        _close(cpukernel.linear(x, cpukernel.pack(wrong), None, 8), F.linear(x, w))


def test_the_kernel_path_gives_the_librarys_logits_and_weights_back(monkeypatch):
    monkeypatch.setenv(cpufast.FAST_ENV, "kernel")
    model = tiny_model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ids = torch.tensor([[3, 5, 7, 9, 11, 2]])
        want = model(ids).logits
    runner = ModelRunner(model, "tiny", fast=True)
    assert runner.cpu_fast and runner.path.fast.layout == cpufast.KERNEL
    assert "packed (sdbench's products)" in runner.fast_path_note()
    cache = runner.new_cache(1, 16)
    got = runner.prefill(cache, [[3, 5, 7, 9]])
    steps = [runner.forward(cache, ids[:, 4:5], [4]), runner.forward(cache, ids[:, 5:6], [5])]
    _close(got, want[:, 3])
    _close(steps[0][:, -1], want[:, 4])
    _close(steps[1][:, -1], want[:, 5])
    assert runner.path.fast.packed and model.model.layers[0].mlp.down_proj.weight.numel() == 0  # the only copy
    cpufast.disable(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_kernel_override_is_refused_in_one_line_where_it_does_not_build(monkeypatch):
    monkeypatch.setenv(cpufast.FAST_ENV, "kernel")
    monkeypatch.setattr(cpukernel, "_lib", None)
    monkeypatch.setattr(cpukernel, "_why", "no C compiler (cc or gcc; or set CC)")
    with pytest.raises(SdbenchError, match="SDBENCH_CPU_FAST=kernel: sdbench's CPU products are not available here "
                                           r"\(no C compiler"):
        cpufast.choose(tiny_model(0))


def test_without_a_compiler_the_products_say_why(monkeypatch, tmp_path):
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(cpukernel, "_lib", None)
    monkeypatch.setattr(cpukernel, "_why", None)
    assert not cpukernel.available()
    assert "does not run" in cpukernel.why_not()
