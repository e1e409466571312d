"""sdbench's own CPU products (`models/forward/cpukernel.py`, `models/forward/kernels/products.c`) against torch's product, and the
fast path on them against the library's forward and `generate`; the product, layer and block checks run on every
instruction set variant this CPU runs (`cpukernel.VARIANTS`: the `kernel` fixture), each branch of the sources'
#ifs landing where its instructions say."""

from __future__ import annotations

import ctypes
import functools
import itertools
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sdbench.forward_step import Step
from sdbench.engine.tree import Tree, TreeBatch
from sdbench.errors import SdbenchError
from sdbench.models.forward import cpufast, cpukernel, cpulayer, cpumeasure, cpupacked
from sdbench.models.forward.runner import ModelRunner
from tests.conftest import skip_unless_ci, tiny_model
from tests.test_runner_fidelity import library_greedy, perturbed_model, runner_greedy, tiny_config


@pytest.fixture(autouse=True)
def products_built():
    """Skipped where sdbench's products do not build (no C compiler, no AVX2); in CI that fails."""
    if not cpukernel.available():
        skip_unless_ci(f"needs sdbench's CPU products ({cpukernel.why_not()})")


# the variants this CPU runs besides `native`, which each test meets on a few of its cases (native: all of them)
OTHERS = [v for v in cpukernel.VARIANTS if v != "native" and cpukernel.runs_here(v)]
# the output rows per group of the integer products each variant builds, read off quants.c's #ifs (native: the CPU's)
GROUP_ROWS = {"avx512-vnni-256": 8, "avx-vnni": 8, "avx512": 0, "avx2": 0}
GROUPED = [v for v in OTHERS if GROUP_ROWS[v]]


@functools.cache
def variant_builds() -> dict:
    """Every variant but `native`, built once a session, side by side (10-15 s each here): its loaded library where
    this CPU runs it, else the path of what it built; the reason where the build failed."""
    def one(name: str):
        try:
            return cpukernel.build(name) if name in OTHERS else cpukernel.compiled(name)
        except RuntimeError as e:
            return str(e)

    names = [v for v in cpukernel.VARIANTS if v != "native"]
    with ThreadPoolExecutor(len(names)) as pool:
        return dict(zip(names, pool.map(one, names)))


def variant_build(variant: str):
    """`variant_builds()[variant]`; a build that fails fails the test, unless the compiler does not know the
    variant's flags (an older one's: a skip, in CI a failure)."""
    built = variant_builds()[variant]
    if isinstance(built, str):
        if "unrecognized command-line option" in built or "unknown argument" in built:  # gcc's, clang's
            skip_unless_ci(f"the C compiler does not know {variant}'s flags ({built})")
        pytest.fail(f"sdbench's products do not build for {variant}: {built}")
    return built


@pytest.fixture
def kernel(request, monkeypatch):
    """sdbench's products built for the variant `request.param` for the test's duration (native: the library users
    build, whose build this session's other tests use)."""
    if not cpukernel.available():
        skip_unless_ci(f"needs sdbench's CPU products ({cpukernel.why_not()})")
    if request.param != "native":
        monkeypatch.setattr(cpukernel, "_lib", variant_build(request.param))
    return request.param


def on_variants(names: str, every: list, few: list, variants: list | None = None):
    """Parametrize `kernel` and the arguments `names`: each case of `every` on the native build, each of `few` on the
    other variants (`OTHERS`, or `variants`): the C is the same for all, so a few shapes reach each variant's code."""
    cases = [("native", *c) for c in every] + [(v, *c) for v in (OTHERS if variants is None else variants) for c in few]
    return pytest.mark.parametrize(("kernel", *names.split(",")), cases, indirect=["kernel"])


every_variant = pytest.mark.parametrize("kernel", ["native", *OTHERS], indirect=True)


def _native_group_rows(cpu: set) -> int:
    if {"avx512f", "avx512bw", "avx512_vnni"} <= cpu:
        return 16
    return 8 if {"avx512vl", "avx512_vnni"} <= cpu or "avx_vnni" in cpu else 0


@pytest.mark.parametrize("variant", list(cpukernel.VARIANTS))
def test_each_variant_takes_the_branch_its_instructions_select(variant):
    """Each variant builds, and its quants.c takes the branch its instructions select: 512-bit integer products (16
    output rows a group), 256-bit ones (8) or none (0). One this CPU cannot run is built and asked only that (a
    function with no vector instruction in it)."""
    built = cpukernel.library() if variant == "native" else variant_build(variant)
    rows = ctypes.CDLL(str(built)).sd_grouped() if isinstance(built, Path) else built.group_rows
    assert rows == (_native_group_rows(cpukernel._cpu_flags()) if variant == "native" else GROUP_ROWS[variant])


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(b.abs().max())))


# out: one block, a part block, an odd number of blocks (the wide path's last block alone); n: below a vector, odd,
# past the wide path's input chunk (256); rows: every narrow width, a wide tile and its remainders
@on_variants("out,n", list(itertools.product([1, 8, 13, 20, 40], [1, 7, 16, 37, 300])), [(13, 7), (40, 300)])
def test_the_blocked_product_equals_torch_at_every_width(kernel, out, n):
    g = torch.Generator().manual_seed(out * 1000 + n)
    w, b = torch.randn(out, n, generator=g), torch.randn(out, generator=g)
    blocked = cpukernel.pack(w)
    assert blocked.numel() == -(-out // 8) * 8 * n
    for rows in [*range(1, 10), 12, 13, 17, 64]:
        x = torch.randn(1, rows, n, generator=g)
        _close(cpukernel.linear(x, blocked, b, out), F.linear(x, w, b))
        _close(cpukernel.linear(x[0], blocked, None, out), F.linear(x[0], w))


@on_variants("n", [(1,), (15,), (16,), (33,), (576,)], [(15,), (576,)])
def test_the_in_place_product_equals_torch(kernel, n):
    g = torch.Generator().manual_seed(n)
    w, b = torch.randn(29, n, generator=g), torch.randn(29, generator=g)
    for rows in (1, 2, 5, 8, 9, 16, 19):
        x = torch.randn(rows, n, generator=g)
        _close(cpukernel.linear_plain(x, w, b), F.linear(x, w, b))
        _close(cpukernel.linear_plain(x.view(1, rows, n), w, None), F.linear(x, w).view(1, rows, 29))


@every_variant
def test_packing_moves_values_and_unpacking_gives_them_back_exactly(kernel):
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
    monkeypatch.setenv(cpumeasure.FAST_ENV, "kernel")
    model = tiny_model(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ids = torch.tensor([[3, 5, 7, 9, 11, 2]])
        want = model(ids).logits
    runner = ModelRunner(model, "tiny", fast=True)
    assert runner.cpu_fast and runner.path.fast.layout == cpupacked.KERNEL
    assert "packed (sdbench's products)" in runner.fast_path_note()
    cache = runner.new_cache(1, 16)
    got = runner.prefill(cache, [[3, 5, 7, 9]])
    steps = [runner.run(cache, Step(ids[:, 4:5], [4])), runner.run(cache, Step(ids[:, 5:6], [5]))]
    _close(got, want[:, 3])
    _close(steps[0][:, -1], want[:, 4])
    _close(steps[1][:, -1], want[:, 5])
    assert runner.path.fast.packed and model.model.layers[0].mlp.down_proj.weight.numel() == 0  # the only copy
    cpufast.disable(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_kernel_override_is_refused_in_one_line_where_it_does_not_build(monkeypatch):
    monkeypatch.setenv(cpumeasure.FAST_ENV, "kernel")
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


# --- the fused decoder layer (`models/forward/cpulayer.py`) ---------------------------------------------------------------


# (head size, dimensions rotated): real models' head sizes (64, 80, 96, 128), two not a multiple of 8 (`dot`'s
# scalar tail: 36, 68), every dimension rotated and partial rotations (Phi-2's 32 of 80, a half, a third)
HEADS = [(8, 8), (8, 4), (36, 36), (36, 12), (64, 64), (64, 32), (68, 68), (80, 80), (80, 32), (96, 96), (128, 128)]


def _attend_checked(D: int, rotated: int, group: int, start: int, scale: float | None = None) -> None:
    """`cpukernel.attend` for 3 tokens per row of 2 rows at slot `start` of a 64-slot cache, 2 KV heads of `group`
    query heads each, against the library's rotation (`apply_rotary_pos_emb` on the first `rotated` dimensions), the
    cache written by slicing and torch's SDPA with GQA."""
    g = torch.Generator().manual_seed(1000 * D + 10 * rotated + group + start)
    B, T, Hk, cap, scale = 2, 3, 2, 64, scale or D**-0.5
    Hq = Hk * group
    qkv = torch.randn(B, T, (Hq + 2 * Hk) * D, generator=g)
    cos, sin = torch.randn(1, T, rotated, generator=g), torch.randn(1, T, rotated, generator=g)  # the library's
    keys, values = torch.randn(B, Hk, cap, D, generator=g), torch.randn(B, Hk, cap, D, generator=g)
    want_k, want_v = keys.clone(), values.clone()
    q, k, v = qkv.view(B, T, Hq + 2 * Hk, D).transpose(1, 2).split([Hq, Hk, Hk], dim=1)
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rotated], k[..., :rotated], cos, sin)
    q, k = torch.cat((q_rot, q[..., rotated:]), -1), torch.cat((k_rot, k[..., rotated:]), -1)
    want_k[:, :, start:start + T], want_v[:, :, start:start + T] = k, v
    mask = torch.arange(start + T)[None, :] <= (start + torch.arange(T))[:, None]  # causal from slot `start`
    want = F.scaled_dot_product_attention(q, want_k[:, :, :start + T], want_v[:, :, :start + T], attn_mask=mask,
                                          scale=scale, enable_gqa=True).transpose(1, 2).reshape(B, T, Hq * D)
    half = rotated // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), -1)  # sdbench's tables hold sin' (`rotary.rope`)
    tables = cpulayer.tables({None: (cos[:, None], signed[:, None])}, B)[None]  # as the fused layer hands them over
    got = cpukernel.attend(qkv, *tables, keys, values, start, Hq, scale)
    _close(got, want)
    _close(keys, want_k)
    assert torch.equal(values, want_v)


# keys in the cache after the step's 3: 5 (scores one at a time), 8 (one block of 8 keys, the first two queries
# seeing part of it), 21 (two blocks, then one at a time), 63 (the values in passes of 8 KiB: 32 rows at head size 64)
@on_variants("D,rotated,group,start", [(*h, g, s) for h in HEADS for g in (1, 2, 4, 8) for s in (2, 5, 18, 60)],
             [(36, 12, 2, 18), (64, 64, 4, 60), (80, 80, 1, 5)])  # group: query heads per KV head
def test_attend_equals_rotation_cache_writes_and_sdpa(kernel, D, rotated, group, start):
    _attend_checked(D, rotated, group, start)


@on_variants("D", [(36,), (64,), (128,)], [(36,)])
def test_attention_weights_across_the_range_of_exp(kernel, D):
    """Scores spread over hundreds (scale 8: most of a query's weights e^-87 or less, counted as 0) still give SDPA's
    output: the weights' e^x taken eight at a time is checked where it flushes to 0 as well as near 1."""
    _attend_checked(D, D, 2, 18, 8.0)


class _ChangedSource:
    """`importlib.resources` as `cpukernel` reads its sources, handing back one of them with one change (or, with
    `more`, several: (old, new) pairs)."""

    def __init__(self, old: str, new: str, name: str = "products.c", more: tuple = ()):
        self.real = resources.files("sdbench.models.forward")
        text = self.real.joinpath("kernels", name).read_text()
        for before, after in ((old, new), *more):
            assert text.count(before) == 1, before  # the change still names one place
            text = text.replace(before, after)
        self.name, self.source = name, text.encode()

    def files(self, package: str):
        return self

    def joinpath(self, *parts: str):
        return self if parts[-1] == self.name else self.real.joinpath(*parts)

    def read_bytes(self) -> bytes:
        return self.source


# a query against 8 keys side by side (the last keys of a step too, padded to 8)
@pytest.mark.parametrize("tail", ["t[j] += q[d] * k[j * D + d];"])
def test_a_dot_product_without_its_scalar_tail_is_caught(monkeypatch, tmp_path, tail):
    """The attention check fails on layer.c built with a score dropping the dimensions past the last multiple of 8
    (the test can fail), at the head sizes that have them, and only there."""
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(cpukernel, "resources", _ChangedSource(tail, "", "layer.c"))
    monkeypatch.setattr(cpukernel, "_lib", None)
    monkeypatch.setattr(cpukernel, "_why", None)
    assert cpukernel.available(), cpukernel.why_not()
    for D in (36, 68):
        with pytest.raises(AssertionError):
            _attend_checked(D, D, 2, 18)
    _attend_checked(64, 64, 2, 18)


@every_variant
def test_the_norm_and_the_activation_equal_torchs(kernel):
    g = torch.Generator().manual_seed(0)
    x, w, gu = torch.randn(3, 37, generator=g), torch.randn(37, generator=g), torch.randn(2, 1, 26, generator=g)
    _close(cpukernel.rms_norm(x, w, 1e-5), F.rms_norm(x, (37,), w, 1e-5))
    _close(cpukernel.silu_mul(gu), F.silu(gu[..., :13]) * gu[..., 13:])


@every_variant
def test_the_activation_across_the_range_of_exp(kernel):
    """silu(g) for g from -120 to 120 (e^-g from e^120, past float32, to e^-120, below its smallest normal), 8
    a vector and a part vector last, within 4e-7 of silu in float64 (torch's float32 silu: 1.6e-7) or under 1e-30."""
    g = torch.linspace(-120, 120, 240_005)
    got = cpukernel.silu_mul(torch.cat([g, torch.ones_like(g)])[None])[0]
    torch.testing.assert_close(got.double(), F.silu(g.double()), rtol=4e-7, atol=1e-30)


@pytest.fixture
def fused_calls(monkeypatch):
    monkeypatch.setenv(cpumeasure.FAST_ENV, "kernel")
    calls = []
    real = cpulayer.layer
    monkeypatch.setattr(cpulayer, "layer", lambda *a: calls.append(a[1]) or real(*a))
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # Qwen2: q/k/v biases
def test_the_fused_layers_decode_as_generate(fused_calls, arch):
    model = perturbed_model(tiny_config(arch, num_attention_heads=4, num_key_value_heads=2))
    runner = ModelRunner(model, "tiny", fast=True)
    for prompt in ([3, 9, 4, 1, 7], [5] * 11):
        assert runner_greedy(runner, prompt, 12) == library_greedy(model, prompt, 12)
    assert fused_calls.count(0) >= 2 * 11  # every decode step's first layer, fused


def test_a_broken_fused_layer_is_caught(fused_calls, monkeypatch):
    """The check above fails when the fused attention ignores its scale (the test can fail)."""
    real = cpukernel.attend
    monkeypatch.setattr(cpukernel, "attend", lambda *a: real(*a[:7], 3.0, *a[8:]))  # (..., scale, tree)
    model = perturbed_model(tiny_config("llama"))
    runner = ModelRunner(model, "tiny", fast=True)
    assert runner_greedy(runner, [3, 9, 4, 1, 7], 12) != library_greedy(model, [3, 9, 4, 1, 7], 12)


def test_the_fused_layers_are_not_taken_where_they_do_not_compute_the_layer(fused_calls):
    qwen3 = ModelRunner(perturbed_model(tiny_config("qwen3")), "q3", fast=True)  # q/k norms
    windowed = ModelRunner(perturbed_model(tiny_config("mistral", sliding_window=4)), "m", fast=True)
    llama = ModelRunner(perturbed_model(tiny_config("llama")), "l", fast=True)
    for runner in (qwen3, windowed):
        cache = runner.new_cache(1, 32)
        runner.prefill(cache, [[3, 5, 7]])
        runner.run(cache, Step(torch.tensor([[4]]), [3]))
    sparse = llama.new_sparse_cache(1, 2, torch.tensor([4]), 4)
    llama.prefill(sparse, [[3, 5, 7, 9, 11, 2]])
    llama.run(sparse, Step(torch.tensor([[4]]), [6]))
    assert fused_calls == []
    tree = TreeBatch.of([Tree.from_vllm("[(0,), (1,)]").with_root()])  # two siblings: the fused layer reads the tree
    llama.run(llama.new_cache(1, 32), Step(torch.tensor([[4, 6, 8]]), [0], tree=tree))
    assert fused_calls == [0, 1]  # tests/test_tree_forward.py checks its logits, and a tree attended as a chain
    cache = llama.new_cache(1, 32)
    llama.prefill(cache, [[3, 5, 7]])
    llama.run(cache, Step(torch.tensor([[4, 6]]), [3]))
    assert fused_calls == [0, 1] * 3  # a short prefill and a 2-token step, both layers


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # runs, builds nothing
    monkeypatch.setattr(cpukernel, "_lib", None)
    monkeypatch.setattr(cpukernel, "_why", None)
    assert not cpukernel.available()
    assert cpukernel.why_not() == "false failed to build products.c, layer.c, quants.c: no message"
    assert not list(tmp_path.rglob("products-*"))  # neither the copy of the sources nor a part-built library left
