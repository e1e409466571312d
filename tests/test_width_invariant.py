"""Every kernel of the CPU fast path is width-invariant: a row's output is the same bits (torch.equal, not allclose)
whatever the number of rows in the call — a verification's T tokens, a tree's nodes, the rows of a batch, a prefill
— as that row alone gives. Random shapes with tails (outputs not a multiple of the blocks, inputs not of the
unrolling, head sizes not of 8, key counts not of 8), on every instruction set variant this CPU runs; and mutant
builds whose multi-row products sum in another order (still right to float32's rounding) fail the same checks."""

from __future__ import annotations

import pytest
import torch

from sdbench.models.forward import cpukernel, quants
from tests.test_cpukernel import OTHERS, _ChangedSource, kernel, products_built  # noqa: F401 - fixtures

WIDTHS = (1, 2, 3, 5, 8, 16)
MANY = 50  # past the products' sweep of 48 rows: a prefill's chunked path
every_variant = pytest.mark.parametrize("kernel", ["native", *OTHERS], indirect=True)


def differing_rows(product, x: torch.Tensor) -> list[tuple[int, int]]:
    """(width, row) where a row of `product` over the first `width` rows of x differs from that row alone."""
    alone = torch.cat([product(x[r:r + 1]) for r in range(x.shape[0])])
    found = []
    for width in (*WIDTHS, x.shape[0]):
        together = product(x[:width])
        found += [(width, r) for r in range(width) if not torch.equal(together[r], alone[r])]
    return found


def _float32_shapes(g):
    for out, n in ((37, 203), (64, 576), (24, 1030)):
        yield torch.randn(out, n, generator=g), torch.randn(out, generator=g), torch.randn(MANY, n, generator=g)


@every_variant
def test_float32_products_are_width_invariant(kernel):
    g = torch.Generator().manual_seed(1)
    for w, b, x in _float32_shapes(g):
        packed, out = cpukernel.pack(w), w.shape[0]
        assert differing_rows(lambda rows: cpukernel.linear(rows, packed, b, out), x) == []
        assert differing_rows(lambda rows: cpukernel.linear(rows, packed, None, out), x) == []
        assert differing_rows(lambda rows: cpukernel.linear_plain(rows, w, b), x) == []


@every_variant
@pytest.mark.parametrize("kind", quants.TYPES)
def test_block_products_are_width_invariant(kernel, kind):
    """Q8_0 and Q4_0 weights, read as stored against float32 activations or, where VNNI builds, against 8-bit
    activations each row quantised on its own."""
    g = torch.Generator().manual_seed(2)
    for out, n in ((37, 96), (64, 576), (19, 1024)):
        w, b, x = torch.randn(out, n, generator=g), torch.randn(out, generator=g), torch.randn(MANY, n, generator=g)
        packed = cpukernel.pack_blocks(w, kind)
        assert differing_rows(lambda rows: cpukernel.linear_blocks(rows, packed, kind, b, out), x) == []


@every_variant
def test_norm_and_activation_are_width_invariant(kernel):
    g = torch.Generator().manual_seed(3)
    for n in (576, 203):
        x, w = torch.randn(MANY, n, generator=g), torch.randn(n, generator=g)
        assert differing_rows(lambda rows: cpukernel.rms_norm(rows, w, 1e-5), x) == []
        assert differing_rows(lambda rows: cpukernel.silu_mul(rows), torch.randn(MANY, 2 * n, generator=g)) == []


def _attention_case(g, B: int, T: int, D: int, start: int, Hq: int = 4, Hk: int = 2, cap: int = 48):
    qkv = torch.randn(B, T, (Hq + 2 * Hk) * D, generator=g)
    cos, sin = torch.randn(B, 1, T, D, generator=g), torch.randn(B, 1, T, D, generator=g)
    keys, values = torch.randn(B, Hk, cap, D, generator=g), torch.randn(B, Hk, cap, D, generator=g)
    return qkv, cos, sin, keys, values, Hq


def _attend(qkv, cos, sin, keys, values, start, Hq):
    return cpukernel.attend(qkv.contiguous(), cos.contiguous(), sin.contiguous(), keys, values, start, Hq, 0.125)


@every_variant
def test_attention_is_width_invariant(kernel):
    """A step of T tokens at positions start.. gives each query the bits it gets decoded alone at its position (the
    keys before it written by the steps before), and each row of a batch the bits it gets alone; positions on and
    off the blocks of 8 keys, head sizes on and off the vectors of 8."""
    g = torch.Generator().manual_seed(4)
    for D, start in ((64, 13), (36, 8), (64, 0), (40, 23)):
        for B in (1, 2, 3):
            for T in WIDTHS:
                qkv, cos, sin, keys, values, Hq = _attention_case(g, B, T, D, start)
                k_all, v_all = keys.clone(), values.clone()
                together = _attend(qkv, cos, sin, k_all, v_all, start, Hq)
                k_one, v_one = keys.clone(), values.clone()
                for t in range(T):
                    alone = _attend(qkv[:, t:t + 1], cos[:, :, t:t + 1], sin[:, :, t:t + 1], k_one, v_one, start + t,
                                    Hq)
                    assert torch.equal(together[:, t], alone[:, 0]), (D, start, B, T, t)
                assert torch.equal(k_all, k_one) and torch.equal(v_all, v_one)
                for b in range(B):
                    row = _attend(qkv[b:b + 1], cos[b:b + 1], sin[b:b + 1], keys[b:b + 1].clone(),
                                  values[b:b + 1].clone(), start, Hq)
                    assert torch.equal(together[b:b + 1], row), (D, start, B, T, b)


def _tree(g, T: int) -> tuple[list[int], torch.Tensor]:
    """A random token tree of T nodes (node 0 the root, each node's parent before it): parents, ancestors [T, T]."""
    parents = [-1] + [int(torch.randint(0, t, (1,), generator=g)) for t in range(1, T)]
    anc = torch.zeros(T, T, dtype=torch.uint8)
    for t in range(T):
        u = t
        while u >= 0:
            anc[t, u], u = 1, parents[u]
    return parents, anc


@every_variant
def test_a_token_trees_nodes_get_their_paths_bits(kernel):
    """Each node of a tree step gets the bits its path gives decoded one token at a time (its ancestors then itself
    at slots start, start + 1, ...: plain decoding of that path), whatever the tree around it; batch rows too."""
    g = torch.Generator().manual_seed(5)
    for D, start, T, B in ((64, 13, 9, 2), (36, 8, 12, 1), (40, 0, 6, 3), (64, 21, 30, 1)):
        qkv, cos, sin, keys, values, Hq = _attention_case(g, B, T, D, start, cap=64)
        trees = [_tree(g, T) for _ in range(B)]
        tree = torch.stack([anc for _, anc in trees]).contiguous()
        got = cpukernel.attend(qkv, cos, sin, keys.clone(), values.clone(), start, Hq, 0.125, tree)
        for b, (parents, anc) in enumerate(trees):
            for t in range(T):
                path = [u for u in range(T) if anc[t, u]]
                k_one, v_one = keys[b:b + 1].clone(), values[b:b + 1].clone()
                for depth, u in enumerate(path):
                    alone = _attend(qkv[b:b + 1, u:u + 1], cos[b:b + 1, :, u:u + 1], sin[b:b + 1, :, u:u + 1],
                                    k_one, v_one, start + depth, Hq)
                assert torch.equal(got[b, t], alone[0, 0]), (D, start, T, b, t)


# Mutants: rows met together (two or more in a call) summed in another order than a row alone, the product still
# right to float32's rounding. The float32 products: in one chain over the inputs (the order the earlier kernels
# took for five rows or more).
PAIRS = "static const pair_fn pairs[7] = {0, pair_1, pair_2, pair_3, pair_4, pair_5, pair_6};"
ONE_CHAIN = """
static void chained(const float *x, long n, long i0, long i1, const float *pa, const float *pb, float *acc, long R) {
  for (long r = 0; r < R; r++)
    for (long i = i0; i < i1; i++)
      for (long j = 0; j < 8; j++) {
        acc[32 * r + j] += pa[i * 8 + j] * x[r * n + i];
        if (pb) acc[32 * r + 16 + j] += pb[i * 8 + j] * x[r * n + i];
      }
}
#define CHAINED(R) static void chained_##R(const float *x, long n, long i0, long i1, const float *pa, \\
    const float *pb, float *acc) { chained(x, n, i0, i1, pa, pb, acc, R); }
CHAINED(2) CHAINED(3) CHAINED(4) CHAINED(5) CHAINED(6)
static const pair_fn pairs[7] = {0, pair_1, chained_2, chained_3, chained_4, chained_5, chained_6};
"""


# The block products over float32 activations: each weight de-quantised and met in one chain.
BLOCKS_ONE_CHAIN = """
        if (k > 1) {
          for (long q = r; q < r + k; q++) {
            float t = 0.0f;
            for (long i = 0; i < n; i++) {
              const uint8_t *blk = w + o * row_bytes + (i / QK) * block;
              float d = _cvtsh_ss(*(const uint16_t *)blk);
              uint8_t byte = blk[2 + (i % QK) % 16];
              int q4 = (i % QK < 16 ? byte & 15 : byte >> 4) - 8;
              t += d * (block == sizeof(block_q8_0) ? ((const block_q8_0 *)blk)->q[i % QK] : q4) * x[q * n + i];
            }
            y[q * out + o] = t + (b ? b[o] : 0.0f);
          }
          continue;
        }
        fns[k](x + r * n, n, w + o * row_bytes, b ? b[o] : 0.0f, y + r * out + o, out);"""


def one_chain_source() -> _ChangedSource:
    """products.c with rows met together (two or more in a call) summed in one chain."""
    return _ChangedSource(PAIRS, ONE_CHAIN)


def _mutant(monkeypatch, tmp_path, source) -> None:
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(cpukernel, "resources", source)
    monkeypatch.setattr(cpukernel, "_lib", None)
    monkeypatch.setattr(cpukernel, "_why", None)
    assert cpukernel.available(), cpukernel.why_not()


def test_float32_products_summing_rows_together_otherwise_fail_the_check(monkeypatch, tmp_path):
    _mutant(monkeypatch, tmp_path, one_chain_source())
    g = torch.Generator().manual_seed(1)
    w, b, x = next(_float32_shapes(g))
    packed = cpukernel.pack(w)
    found = differing_rows(lambda rows: cpukernel.linear(rows, packed, b, w.shape[0]), x)
    assert {width for width, _ in found} == {2, 3, 5, 8, 16, MANY}


@pytest.mark.parametrize("kind", quants.TYPES)
def test_block_products_summing_rows_together_otherwise_fail_the_check(monkeypatch, tmp_path, kind):
    call = "        fns[k](x + r * n, n, w + o * row_bytes, b ? b[o] : 0.0f, y + r * out + o, out);"
    _mutant(monkeypatch, tmp_path, _ChangedSource(call, BLOCKS_ONE_CHAIN, "quants.c"))
    monkeypatch.setattr(cpukernel, "group_rows", lambda: 0)  # the blocks as stored, against float32 activations
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(37, 96, generator=g), torch.randn(MANY, 96, generator=g)
    packed = cpukernel.pack_blocks(w, kind)
    reference = x @ cpukernel.unpack_blocks(packed, kind, 37, 96).T
    torch.testing.assert_close(cpukernel.linear_blocks(x, packed, kind, None, 37), reference)  # right, but
    found = differing_rows(lambda rows: cpukernel.linear_blocks(rows, packed, kind, None, 37), x)
    assert {width for width, _ in found} == {2, 3, 5, 8, 16, MANY}
