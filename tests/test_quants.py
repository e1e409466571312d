"""Weights in llama.cpp's Q8_0 and Q4_0 blocks: sdbench's quantisation byte for byte against the `gguf` package's
(the reference implementation's Python port), its block products against a float64 product over the weights `gguf`
de-quantises, a model's block copy (MODEL@q8_0, --dtype q4_0) against transformers' forward and `generate` over the
de-quantised weights, every strategy's greedy output equal to plain decoding of the same block copy, and the
refusals."""

from __future__ import annotations

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
from tests.conftest import VOCAB, run_cli, tiny_model
from tests.references import hf_generate, tiny_pair
from tests.test_cpukernel import _ChangedSource

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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 50])  # one read of a block meets 6 rows; 48 a sweep
@pytest.mark.parametrize("bias", [False, True])
def test_block_products_equal_the_product_over_ggufs_weights(kind, rows, bias):
    w = _weights(out=37, n=160, seed=rows)
    blocks = gguf_quants.quantize(w.numpy(), GGUF[kind])
    plain = torch.from_numpy(gguf_quants.dequantize(blocks, GGUF[kind])).double()
    g = torch.Generator().manual_seed(rows)
    x, b = torch.randn(rows, 160, generator=g), torch.randn(37, generator=g) if bias else None
    y = cpukernel.linear_blocks(x.view(1, rows, 160), torch.from_numpy(blocks), kind, b)
    ref = x.double() @ plain.T + (0 if b is None else b.double())
    assert y.shape == (1, rows, 37)
    torch.testing.assert_close(y[0].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("kind", "old", "new"), [
    ("q4_0", "k < 2 ? _mm_and_si128(v, m)", "k >= 2 ? _mm_and_si128(v, m)"),  # the nibbles' halves swapped
    ("q8_0", "a##r = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * n + j), a##r);",
     "a##r = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + j), a##r);"),  # every row read as the first
])
def test_a_wrong_block_product_is_caught(monkeypatch, tmp_path, kind, old, new):
    """The product check fails on quants.c built with one mistake (the test can fail)."""
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(cpukernel, "resources", _ChangedSource(old, new, "quants.c"))
    monkeypatch.setattr(cpukernel, "_lib", None)
    monkeypatch.setattr(cpukernel, "_why", None)
    assert cpukernel.available(), cpukernel.why_not()
    with pytest.raises(AssertionError):
        test_block_products_equal_the_product_over_ggufs_weights(kind, 3, False)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    rand = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 5)]
    return rand + [(rand[0] * 3)[:20]]  # repetitive: prompt lookup finds drafts


def _decoded(runner, proposer, prompt) -> list[int]:
    return generate(runner, proposer, [prompt], max_new_tokens=20, sampling=SamplingConfig()).output_ids[0]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # Qwen2: q/k/v biases
def test_a_block_copy_decodes_as_generate_over_its_weights(kind, arch):
    """The copy reads its projections and head as blocks; transformers' `generate` over the same model (its
    weights de-quantised in place) is the reference for plain decoding, a draft's (a Q4_0 copy of a smaller model)
    and prompt lookup; the float model it was copied from is untouched."""
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
def test_every_strategy_on_a_block_copy_is_lossless_from_the_cli(folder, tmp_path, capsys, strategy):
    """`--dtype q8_0` decodes every model of the run as its Q8_0 copy, a draft naming @q4_0 as that; each
    strategy's output equals plain decoding of the same copy, and the rows record it."""
    extra = [a.format(f=folder) for a in DRAFTS.get(strategy, [])]
    code, out, err = run_cli(capsys, "run", "--target", folder, "--dtype", "q8_0", "--strategy", strategy, *extra,
                             "--dataset", "gsm8k", "--limit", "2", "--max-new-tokens", "12", "--device", "cpu",
                             "--out", str(tmp_path))
    assert code == 0, err + out
    df = pd.concat(pd.read_parquet(p) for p in tmp_path.glob("*.parquet"))
    assert (df["target"] == f"{folder}@q8_0").all() and (df["dtype"] == "q8_0").all()
    assert df["lossless"].all() and len(df) == 4
    if strategy in DRAFTS:
        assert df.loc[df["role"] == "strategy", "draft"].str.startswith(f"{folder}@q4_0").all()


@pytest.mark.parametrize(("argv", "says"), [
    (["run", "--dtype", "q5_0"], "--dtype q5_0: use one of float32, bfloat16, float16, q8_0, q4_0"),
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
    from sdbench.models.loading.memory import weight_bytes

    model = tiny_model(2)  # vocabulary VOCAB, hidden 64, MLP 128, 2 layers, 4 heads of 16 (2 for keys and values)
    matrices = 2 * VOCAB * 64 + 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64)  # untied head and table
    norms = 4 * (64 + 2 * 2 * 64)
    assert weight_bytes(model) == 4 * matrices + norms
    for kind, block in (("q8_0", 34), ("q4_0", 18)):
        assert weight_bytes(quantise_blocks(model, kind, copy_first=True)) == matrices // 32 * block + norms
