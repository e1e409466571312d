"""Weights in llama.cpp's Q8_0 and Q4_0 blocks: sdbench's quantisation byte for byte against the `gguf` package's
(the reference implementation's Python port), its block products against a float64 product over the weights `gguf`
de-quantises, a model's block copy (MODEL@q8_0, --dtype q4_0) against transformers' forward and `generate` over the
de-quantised weights, every strategy's greedy output equal to plain decoding of the same block copy, and the
refusals. The block products run on every instruction set variant this CPU runs (tests/test_cpukernel.py), the integer
products on each that builds them (512-bit and 256-bit vectors)."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
import torch
from gguf import GGMLQuantizationType, quants as gguf_quants

from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate
from sdbench.models.forward import cpufast, cpukernel, cpupacked, quants
from sdbench.models.forward.runner import ModelRunner
from sdbench.models.loading.variants import quantise_blocks
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.ngram import NGram
from tests.conftest import VOCAB, run_cli, skip_unless_ci, tiny_model
from tests.references import hf_generate, tiny_pair
from tests.test_cpukernel import GROUPED, _ChangedSource, kernel, on_variants  # noqa: F401 (kernel: a fixture)

GGUF = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
KINDS = list(GGUF)


def _weights(out: int = 40, n: int = 96, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n, generator=g) * 0.05
    w[0] = 0.0  # a block of zeros: scale 0
    w[1, :32] = 1.0  # a block whose largest magnitude is shared by every input
    w[2, 5] = -3.0  # a negative extreme (Q4_0 takes its sign)
    w[3, :32] = 1e-9  # a scale below float16's smallest
    return w


@pytest.mark.parametrize("kind", KINDS)
def test_quantising_equals_ggufs_byte_for_byte(kind):
    w = _weights()
    ours = quants.quantise(w, kind)
    ref = gguf_quants.quantize(w.numpy(), GGUF[kind])
    assert ours.dtype == torch.uint8 and ours.shape == ref.shape
    assert np.array_equal(ours.numpy(), ref)
    assert np.array_equal(quants.dequantise(torch.from_numpy(ref), kind).numpy(), gguf_quants.dequantize(ref, GGUF[kind]))


@pytest.mark.parametrize("kind", KINDS)
def test_snapped_weights_are_their_own_blocks(kind):
    w = _weights(seed=1)
    snapped = quants.snap(w, kind)
    assert not torch.equal(snapped, w)
    assert torch.equal(quants.snap(snapped, kind), snapped)  # what a block copy packs is what the library computes with


def _product(x: torch.Tensor, blocks: torch.Tensor, kind: str, bias, grouped: bool) -> torch.Tensor:
    """sdbench's C product over stored blocks (float32 activations) or grouped ones (8-bit activations)."""
    out = blocks.shape[0]
    packed = quants.group(blocks, kind, cpukernel.group_rows()) if grouped else blocks
    y = torch.empty(x.shape[0], out)
    fn = getattr(cpukernel.library(), f"sd_linear_grouped_{kind}" if grouped else f"sd_linear_{kind}")
    fn(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), x.shape[0],
       x.shape[1], out)
    return y


def _case(kind: str, rows: int, bias: bool, out: int = 37, n: int = 160):
    """(x, the stored blocks, bias, W de-quantised by gguf in float64)."""
    w = _weights(out=out, n=n, seed=rows)
    blocks = gguf_quants.quantize(w.numpy(), GGUF[kind])
    plain = torch.from_numpy(gguf_quants.dequantize(blocks, GGUF[kind])).double()
    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, n, generator=g), torch.randn(out, generator=g) if bias else None
    return x, torch.from_numpy(blocks), b, plain


# one read of a block meets 6 rows; 48 a sweep
@on_variants("kind,rows,bias", list(itertools.product(KINDS, [1, 2, 3, 5, 6, 7, 13, 50], [False, True])),
             [(kind, rows, bias) for kind in KINDS for rows, bias in ((1, True), (7, False), (50, True))])
def test_stored_block_products_equal_the_product_over_ggufs_weights(kernel, kind, rows, bias):
    """Float32 activations: the product over the weights gguf de-quantises, to float32's rounding."""
    x, blocks, b, plain = _case(kind, rows, bias)
    ref = x.double() @ plain.T + (0 if b is None else b.double())
    torch.testing.assert_close(_product(x, blocks, kind, b, grouped=False).double(), ref, rtol=1e-5, atol=1e-5)


def _needs_grouped():
    if not cpukernel.available():
        skip_unless_ci(f"needs sdbench's CPU products ({cpukernel.why_not()})")
    if not cpukernel.grouped():
        skip_unless_ci(f"this CPU has no VNNI (or {cpukernel.ACTIVATIONS_ENV}=float32): the integer products do not "
                       "build")


# 6 rows a pass over a group-block, 48 a sweep; part groups of 8 and 16 outputs
@on_variants("kind,rows,out,bias", [(kind, rows, *ob) for kind in KINDS for rows in [1, 2, 5, 6, 7, 13, 50, 97]
                                    for ob in ((37, True), (64, False), (5, True))],
             [(kind, 1, 37, True) for kind in KINDS] + [(kind, 7, 5, True) for kind in KINDS]
             + [(kind, 50, 64, False) for kind in KINDS], GROUPED)
def test_grouped_block_products_equal_ggufs_arithmetic(kernel, kind, rows, out, bias):
    """8-bit activations, as llama.cpp's CPU products: each row of x quantised as gguf quantises a Q8_0 tensor,
    the product of the two de-quantised in float64 (the integer sums are exact, so only float32's rounding of the
    scaled sums is left)."""
    _needs_grouped()
    x, blocks, b, plain = _case(kind, rows, bias, out=out)
    xq = torch.from_numpy(gguf_quants.dequantize(gguf_quants.quantize(x.numpy(), GGUF["q8_0"]), GGUF["q8_0"]))
    ref = xq.double() @ plain.T + (0 if b is None else b.double())
    torch.testing.assert_close(_product(x, blocks, kind, b, grouped=True).double(), ref, rtol=2e-6, atol=2e-5)
    assert not torch.allclose(x.double() @ plain.T, xq.double() @ plain.T, rtol=1e-6, atol=1e-6)  # quantised indeed


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [8, 16])  # AVX2's vectors, AVX-512's
def test_grouping_by_hand_and_back(kind, rows):
    """A group-block is the rows' float16 scales, then 4 inputs of each row at a time (Q8_0 as q + 128, Q4_0's
    bytes as stored); a last part group is padded with zero blocks; `ungroup` gives the blocks back."""
    out = rows + 3
    w = _weights(out=out, n=64, seed=3)
    blocks = quants.quantise(w, kind)
    grouped = quants.group(blocks, kind, rows)
    nb, size = 2, quants.BLOCK_BYTES[kind]
    stride = 2 * rows + rows * (size - 2)  # one group-block
    assert grouped.numel() == 2 * nb * stride  # two groups
    for g, j, b in ((0, 3, 1), (1, 2, 0), (0, rows - 1, 0)):
        row, gb = rows * g + j, grouped[(g * nb + b) * stride:(g * nb + b + 1) * stride]
        stored = blocks[row, b * size:(b + 1) * size]
        assert torch.equal(gb[2 * j:2 * j + 2], stored[:2])  # its scale
        for k in range((size - 2) // 4):
            at = 2 * rows + 4 * rows * k + 4 * j
            want = stored[2 + 4 * k:6 + 4 * k]
            if kind == "q8_0":
                want = (want.view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
            assert torch.equal(gb[at:at + 4], want), (g, j, b, k)
    assert not grouped[nb * stride + 2 * 3:][:2].any()  # group 1, row 3 (past the last real row): a zero scale
    assert torch.equal(quants.ungroup(grouped, kind, out, 64, rows), blocks)


@pytest.mark.parametrize(("kind", "old", "new", "grouped"), [
    ("q4_0", "k < 2 ? _mm_and_si128(v, m)", "k >= 2 ? _mm_and_si128(v, m)", False),  # the nibbles' halves swapped
    ("q8_0", "const float *xr = x + r * n + i;", "const float *xr = x + i;", False),  # every row read as the first
    ("q8_0", "VI(set1_epi32)(-OFF * xr->sum)", "VI(set1_epi32)(0)", True),  # the unsigned offset left in
    ("q4_0", "w[k + 4] = VAND(VI(srli_epi16)(v, 4), m);", "w[k + 4] = VAND(v, m);", True),
])
def test_a_wrong_block_product_is_caught(monkeypatch, tmp_path, kind, old, new, grouped):
    """The product checks fail on quants.c built with one mistake (the tests can fail)."""
    if grouped:
        _needs_grouped()
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(cpukernel, "resources", _ChangedSource(old, new, "quants.c"))
    monkeypatch.setattr(cpukernel, "_lib", None)
    monkeypatch.setattr(cpukernel, "_why", None)
    assert cpukernel.available(), cpukernel.why_not()
    with pytest.raises(AssertionError):
        if grouped:
            test_grouped_block_products_equal_ggufs_arithmetic("native", kind, 3, 37, False)
        else:
            test_stored_block_products_equal_the_product_over_ggufs_weights("native", kind, 3, False)


@pytest.fixture
def float_activations(monkeypatch, tmp_path):
    """sdbench's products built with float32 activations (the exact product over the de-quantised weights)."""
    monkeypatch.setenv(cpukernel.ACTIVATIONS_ENV, "float32")
    monkeypatch.setattr(cpukernel, "_lib", None)
    monkeypatch.setattr(cpukernel, "_why", None)
    if not cpukernel.available():
        skip_unless_ci(f"needs sdbench's CPU products ({cpukernel.why_not()})")
    assert not cpukernel.grouped()
    yield
    monkeypatch.setattr(cpukernel, "_lib", None)  # the next test builds (or finds) the default again
    monkeypatch.setattr(cpukernel, "_why", None)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    rand = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 5)]
    return rand + [(rand[0] * 3)[:20]]  # repetitive: prompt lookup finds drafts


def _decoded(runner, proposer, prompt) -> list[int]:
    return generate(runner, proposer, [prompt], max_new_tokens=20, sampling=SamplingConfig()).output_ids[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # Qwen2: q/k/v biases
def test_a_block_copy_decodes_as_generate_over_its_weights(kind, arch, float_activations):
    """With float32 activations the copy computes its de-quantised weights' model: transformers' `generate` over
    the same model (its weights de-quantised in place) is the reference for plain decoding, a draft's (a Q4_0
    copy of a smaller model) and prompt lookup; the float model it was copied from is untouched."""
    target, draft = tiny_pair(arch)
    before = target.lm_head.weight.clone()
    q_target = quantise_blocks(target, kind, copy_first=True)
    q_draft = quantise_blocks(draft, "q4_0", copy_first=False)
    assert torch.equal(target.lm_head.weight, before) and cpufast.weights_kind(target) is None
    runner, d_runner = ModelRunner(q_target, fast=True), ModelRunner(q_draft, fast=True)
    assert runner.path.fast.layout == kind and d_runner.path.fast.layout == "q4_0"
    for prompt in _prompts():
        got = _decoded(runner, Autoregressive(), prompt)
        assert not runner.model.model.layers[0].self_attn.q_proj.weight.numel()  # packed: the blocks are the only copy
        with cpufast.plain(q_target):
            want = hf_generate(q_target, prompt, 20)
        assert got == want
        assert _decoded(runner, DraftModel(d_runner, 3), prompt) == want
        assert _decoded(runner, NGram(3), prompt) == want
    assert isinstance(runner.path.fast.layers[0].qkv, cpupacked.Packed)
    assert runner.path.fast.layers[0].qkv.packed.dtype == torch.uint8


@pytest.mark.parametrize("kind", KINDS)
def test_8_bit_activations_are_lossless_and_near_the_float_model(kind):
    """Where the integer products build, the copy quantises its activations (as llama.cpp does): every strategy
    equals its own plain decoding, and its logits are within the probe's block tolerance of the library's forward
    over the de-quantised weights, but not within float32's (the test sees which arithmetic ran)."""
    from sdbench.forward_step import Step
    from sdbench.models.probing.probe import BLOCK_TOLERANCE, TOLERANCE

    _needs_grouped()
    target, draft = tiny_pair("llama")
    q_target, q_draft = quantise_blocks(target, kind, copy_first=False), quantise_blocks(draft, "q4_0", False)
    runner, d_runner = ModelRunner(q_target, fast=True), ModelRunner(q_draft, fast=True)
    assert cpufast.block_activations(q_target) == "int8"
    for prompt in _prompts():
        plain = _decoded(runner, Autoregressive(), prompt)
        assert _decoded(runner, DraftModel(d_runner, 3), prompt) == plain
        assert _decoded(runner, NGram(3), prompt) == plain
    ids = torch.tensor([_prompts()[0]])
    cache = runner.new_cache(1, 64)
    ours = runner.run(cache, Step(ids, [0]))[0]
    with cpufast.plain(q_target), torch.inference_mode():
        theirs = q_target(ids).logits[0]
    gap = ((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1)).item()
    assert TOLERANCE[torch.float32] < gap < BLOCK_TOLERANCE


def test_the_snapped_weights_are_what_a_copy_holds():
    """Every projection, the head and the embeddings of a copy hold values its blocks give back exactly."""
    model = quantise_blocks(tiny_model(3), "q8_0", copy_first=True)
    with cpufast.plain(model):
        weights = [model.lm_head.weight, model.model.embed_tokens.weight,
                   *(m.weight for layer in model.model.layers for m in cpupacked.projection_modules(layer))]
        for w in weights:
            assert torch.equal(quants.snap(w, "q8_0"), w)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.references import tiny_text_model_dir

    return str(tiny_text_model_dir(tmp_path_factory.mktemp("quant") / "tiny"))


STRATEGIES = ["ngram", "draft", "lookahead", "magicdec", "adaptive", "adaptive-fsm", "suffix", "polybasic", "dsi"]
DRAFTS = {"draft": ["--draft", "{f}@q4_0"], "polybasic": ["--draft", "{f}@q4_0", "--draft", "ngram"],
          "dsi": ["--draft", "{f}@q4_0"]}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_on_a_block_copy_is_lossless_from_the_cli(folder, tmp_path, capsys, strategy,
                                                                  float_activations):
    """`--dtype q8_0` decodes every model of the run as its Q8_0 copy, a draft naming @q4_0 as that; each
    strategy's output equals plain decoding of the same copy, and the rows record it. Float32 activations: the
    probe holds the copy to float32's tolerance, so it runs on the native runner (8-bit activations move this tiny
    model's peaked logits past the block tolerance, and it would fall back to the library's forward)."""
    extra = [a.format(f=folder) for a in DRAFTS.get(strategy, [])]
    code, out, err = run_cli(capsys, "run", "--target", folder, "--dtype", "q8_0", "--strategy", strategy, *extra,
                             "--dataset", "gsm8k", "--limit", "2", "--max-new-tokens", "12", "--device", "cpu",
                             "--out", str(tmp_path))
    assert code == 0, err + out
    df = pd.concat(pd.read_parquet(p) for p in tmp_path.glob("*.parquet"))
    assert (df["target"] == f"{folder}@q8_0").all() and (df["dtype"] == "q8_0").all()
    assert df["lossless"].all() and len(df) == 4 and (df["runner"] == "native").all()
    if strategy in DRAFTS:
        assert df.loc[df["role"] == "strategy", "draft"].str.startswith(f"{folder}@q4_0").all()


@pytest.mark.parametrize(("argv", "says"), [
    (["run", "--dtype", "q5_0"], "--dtype q5_0: use one of float32, bfloat16, float16, q8_0, q4_0 (or, through "
                                 "--engine llama.cpp, q4_k_m"),
    (["run", "--dtype", "q4_k_m"], "--dtype q4_k_m: llama.cpp's K-quant mix, which sdbench's own runner does not read"),
    (["bench", "--dtype", "q4_k_m"], "bench --dtype q4_k_m: llama.cpp's K-quant mix; add --engine llama.cpp"),
    (["run", "--target", "smollm2-135m@q3_k"], "unknown variant '@q3_k'"),
    (["train-head", "--target", "smollm2-135m", "--kind", "eagle3", "--dtype", "q8_0", "--out", "x"],
     "train-head --dtype q8_0: a head is fitted on the target's float weights"),
])
def test_bad_block_settings_get_one_line(capsys, argv, says):
    code, out, err = run_cli(capsys, *argv)
    assert code != 0 and says in err and "Traceback" not in err + out
    assert len(err.strip().splitlines()) == 1


def test_a_model_whose_rows_are_not_whole_blocks_is_refused():
    model = tiny_model(0, hidden=48, heads=4, kv=2)  # rows of 48 inputs: one and a half blocks
    with pytest.raises(Exception, match="rows of 48 inputs, and the block types quantise whole blocks of 32"):
        quantise_blocks(model, "q4_0", copy_first=True)


def test_the_block_type_travels_with_the_model():
    """A replica made in another process (a DSI worker receives the model pickled) reads the same blocks."""
    import pickle

    model = quantise_blocks(tiny_model(4), "q4_0", copy_first=True)
    copy = pickle.loads(pickle.dumps(model))
    assert cpufast.weights_kind(copy) == "q4_0"
    assert ModelRunner(copy, fast=True).path.fast.layout == "q4_0"


def test_a_block_copy_counts_its_blocks_bytes():
    """What the roofline divides by: a block copy's matrices at 34 (Q8_0) or 18 (Q4_0) bytes per 32 weights, its
    1-D weights (norms) at float32's 4 bytes, the tied head once."""
    from sdbench.models.forward.cpufast import weight_bytes

    model = tiny_model(2)  # vocabulary VOCAB, hidden 64, MLP 128, 2 layers, 4 heads of 16 (2 for keys and values)
    matrices = 2 * VOCAB * 64 + 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64)  # untied head and table
    norms = 4 * (64 + 2 * 2 * 64)
    assert weight_bytes(model) == 4 * matrices + norms
    for kind, block in (("q8_0", 34), ("q4_0", 18)):
        assert weight_bytes(quantise_blocks(model, kind, copy_first=True)) == matrices // 32 * block + norms


def test_bench_holds_8_bit_activations_to_sdbenchs_own_plain_decoding():
    """A block copy with 8-bit activations parts from generate's tokens as llama.cpp's does: bench then says its fast
    plain decoding's agreement with generate without failing, holds its fast systems to sdbench's fast plain decoding
    (lossless, as a run is) and its library-product rows to generate."""
    from sdbench.commands.bench_judge import fail_on_real, hold
    from sdbench.commands.bench_table import OutputDiffers, SystemMeasurement

    generate, ours = [[1, 2, 3]], [[1, 2, 4]]
    results = [SystemMeasurement("transformers generate", False, outputs=generate),
               SystemMeasurement("sdbench autoregressive (no fast path)", False, outputs=generate),
               SystemMeasurement("sdbench autoregressive (fast)", True, outputs=ours),
               SystemMeasurement("sdbench draft (γ=4) (fast)", True, outputs=ours)]
    held = hold(results, generate, [[0]], True, lambda fast: None)
    fail_on_real(held)
    assert held["sdbench autoregressive (fast)"].cell(1) == "0/1"  # said, not failed: 8-bit activations
    assert held["sdbench draft (γ=4) (fast)"].cell(1) == "yes"
    with pytest.raises(OutputDiffers, match="autoregressive \\(fast\\) differs from transformers generate"):
        fail_on_real(hold(results, generate, [[0]], False, lambda fast: None))
    results[3].outputs = [[1, 2, 5]]
    with pytest.raises(OutputDiffers, match="draft .* differs from sdbench's fast plain decoding on prompt 1"):
        fail_on_real(hold(results, generate, [[0]], True, lambda fast: None))
    results[1].outputs = ours
    results[3].outputs = ours
    with pytest.raises(OutputDiffers, match="no fast path\\) differs from transformers generate"):
        fail_on_real(hold(results, generate, [[0]], True, lambda fast: None))


def test_a_dsi_worker_takes_its_callers_activations(monkeypatch):
    """A DSI worker from a fork server started before the setting changed builds its products as its caller does
    (without it, the float32-activations run of DSI above was lossy after an earlier DSI test)."""
    from sdbench.dsi import pools

    monkeypatch.setenv(cpukernel.ACTIVATIONS_ENV, "float32")
    assert pools.arithmetic_env() == {cpukernel.ACTIVATIONS_ENV: "float32"}
    monkeypatch.delenv(cpukernel.ACTIVATIONS_ENV)
    assert pools.arithmetic_env() == {}
