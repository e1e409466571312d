"""A GGUF file of Q8_0 or Q4_0 blocks read as it is (`models/loading/gguf_blocks.py`), against the library's own
reading of the same file: tiny Llama (q/k rows permuted in the file, as llama.cpp's converter writes them) and Qwen2
(biases) models written with the `gguf` package's writer and quantiser; the library loads each file through its
GGUF loader (de-quantising every tensor), and sdbench's model must hold exactly those weights (unpacked), its packed
blocks must be the file's bytes, and its greedy decoding must equal the library's `generate` over the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, get_tensor_name_map, MODEL_ARCH_NAMES, quants as gguf_quants

from sdbench.errors import SdbenchError
from sdbench.models.forward import cpufast, cpukernel, quants
from sdbench.models.loading import gguf_blocks, gguf_header, loader, names, variants
from sdbench.models.forward.runner import ModelRunner
from tests.references import hf_generate, perturbed
from tests.conftest import tiny_model
from tests.test_cpukernel import products_built  # noqa: F401 (autouse: no products, a skip; in CI a failure)
from tests.test_quants import float_activations  # noqa: F401 (a fixture)

GGUF_TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "f16": GGMLQuantizationType.F16}


def _llama_permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes Llama's q and k in (its rotation pairs adjacent rows)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model, kind: str, tied: bool = False, odd: str | None = None,
               experts: bool = False) -> Path:
    """`model` as a GGUF file whose matrices are `kind` (the norms and biases float32); `odd`: one matrix written
    as F16 instead; `experts`: a stack of two experts' matrices besides. Tied: no output matrix (the head is the
    embedding table)."""
    cfg = model.config
    arch = cfg.model_type
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") else cfg.rope_theta)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_array("sdbench.test.words", [f"w{i}" for i in range(40)])  # arrays of strings and of numbers, as a
    writer.add_array("sdbench.test.scores", [0.5] * 40)  # tokenizer's: the header's reader skips them
    table = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), cfg.num_hidden_layers)
    for hf, value in model.state_dict().items():
        if tied and hf == "lm_head.weight":
            continue
        base, suffix = hf.rsplit(".", 1)
        name = f"{table.get_name(base)}.{suffix}"
        w = value.detach().float().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = _llama_permuted(w, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        if w.ndim == 1:
            writer.add_tensor(name, w)
        else:
            t = GGUF_TYPES["f16" if name == odd else kind]
            writer.add_tensor(name, gguf_quants.quantize(w, t), raw_dtype=t)
    if experts:
        stack = np.random.default_rng(0).standard_normal((2, 2 * cfg.hidden_size, cfg.hidden_size)).astype(np.float32)
        writer.add_tensor("blk.0.ffn_gate_exps.weight", gguf_quants.quantize(stack, GGUF_TYPES[kind]),
                          raw_dtype=GGUF_TYPES[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _library_model(path: Path):
    """The library's own reading of the file: its GGUF loader, every tensor de-quantised."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _model(arch: str, tied: bool):
    model = perturbed(tiny_model(3, arch=arch), 103)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
        model.config.tie_word_embeddings = True
    return model


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", False)])
def test_a_block_file_is_read_as_the_library_reads_it(tmp_path, kind, arch, tied, float_activations):
    path = write_gguf(tmp_path / f"tiny-{kind}.gguf", _model(arch, tied), kind, tied)
    assert names.own_block_type(str(path)) == kind
    # the model alone (the file has no tokenizer), packed as variants.own_blocks packs it
    model, stored = gguf_blocks.read(path, kind, str(path))
    fast = cpufast.adopt_blocks(model, kind, stored)
    reference = _library_model(path)
    layer = model.model.layers[1]
    assert not layer.self_attn.q_proj.weight.numel() and fast.packed  # the blocks are the only copy
    file = {t.name: t for t in gguf_header.reader(path).tensors}
    q = fast.layers[1].qkv
    ours = quants.ungroup(q.packed, kind, q.out_features, q.in_features, cpukernel.group_rows()) \
        if cpukernel.grouped() else q.packed
    head_rows = reference.model.layers[1].self_attn.q_proj.weight.shape[0]
    assert torch.equal(ours[:head_rows], quants.quantise(reference.model.layers[1].self_attn.q_proj.weight, kind))
    assert np.array_equal(ours[head_rows:][-reference.model.layers[1].self_attn.v_proj.weight.shape[0]:].numpy(),
                          file["blk.1.attn_v.weight"].data)  # v: the file's bytes, as stored
    with cpufast.plain(model):
        theirs = reference.state_dict()
        for hf, value in model.state_dict().items():
            assert torch.equal(value, theirs[hf]), hf
    runner = ModelRunner(model, fast=True)
    assert runner.path.fast.layout == kind
    from sdbench.config import SamplingConfig
    from sdbench.engine.loop import generate
    from sdbench.strategies.autoregressive import Autoregressive

    for prompt in ([5, 9, 13, 2, 7], [11] * 6):
        got = generate(runner, Autoregressive(), [prompt], max_new_tokens=12, sampling=SamplingConfig()).output_ids[0]
        assert got == hf_generate(reference, prompt, 12)


@pytest.mark.parametrize("tied", [False, True])
def test_the_librarys_forward_over_blocks_holds_one_products_floats_at_a_time(tmp_path, tied, monkeypatch):
    """The probe's reference (`cpufast.library_forward`) runs the library's forward over the blocks de-quantised one
    fused product at a time where the whole float copy (4-8 times the blocks) would crowd the memory free, with
    exactly the library's logits; the blocks alone are held after it, also after a forward stopped midway; where the
    copy fits it is made whole (one de-quantisation for the whole reference); the probe keys on the file itself."""
    from sdbench.models.probing import probe_cache

    path = write_gguf(tmp_path / "tiny-q4_0.gguf", _model("llama", tied), "q4_0", tied)
    model, stored = gguf_blocks.read(path, "q4_0", str(path))
    fast = cpufast.adopt_blocks(model, "q4_0", stored)
    lent = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and not m.weight.numel()]
    assert len(lent) == 7 * len(model.model.layers) + (not tied)  # every projection (and an untied head): its blocks only
    held = []
    ids = torch.tensor([[5, 9, 13, 2, 7, 11, 3]])
    with cpufast.library_forward(model, lend=True), torch.inference_mode():
        hooks = [m.register_forward_pre_hook(lambda *_: held.append(sum(x.weight.numel() > 0 for x in lent)))
                 for m in lent]  # after the lending hooks: what a product holds while it runs
        ours = model(ids).logits
        for h in hooks:
            h.remove()
    assert torch.equal(ours, _library_model(path)(ids).logits)
    assert len(held) == len(lent) and max(held) == 3 and min(held) >= 1  # q, k and v at most
    assert fast.packed and not any(m.weight.numel() for m in lent)

    def stop(*_):
        raise RuntimeError("stopped")

    with pytest.raises(RuntimeError), cpufast.library_forward(model, lend=True), torch.inference_mode():
        model.model.layers[1].mlp.up_proj.register_forward_pre_hook(stop)  # after gate_up was lent
        model(ids)
    assert not any(m.weight.numel() for m in lent)
    for free, whole in ((1 << 40, True), (1 << 10, False)):  # by the memory free now
        monkeypatch.setattr(cpufast, "free_bytes", lambda device: free)
        with cpufast.library_forward(model):
            assert all(m.weight.numel() for m in lent) == whole
    assert probe_cache.weight_files(model) == [path.resolve()]
    assert probe_cache.weights_fingerprint(model, str(path)).startswith("files:")  # no pass over de-quantised values


def test_which_files_name_their_own_type(tmp_path):
    model = _model("llama", False)
    q4 = write_gguf(tmp_path / "a.gguf", model, "q4_0")
    mixed = write_gguf(tmp_path / "b.gguf", model, "q4_0", odd="blk.0.ffn_down.weight")
    half = write_gguf(tmp_path / "c.gguf", model, "f16")
    stacked = write_gguf(tmp_path / "d.gguf", model, "q4_0", experts=True)
    assert [names.own_block_type(str(p)) for p in (q4, mixed, half, stacked)] == ["q4_0", None, None, None]
    assert names.with_weights(str(q4), "float32") == f"{q4}@q4_0"  # its own blocks
    assert names.with_weights(str(q4), "float32", cpu=False) == str(q4)  # a GPU: de-quantised, as before
    assert names.with_weights(str(q4), "bfloat16") == str(q4)
    assert names.with_weights(str(q4), "q8_0") == f"{q4}@q8_0"  # re-typed from its values
    assert names.with_weights(str(mixed), "float32") == str(mixed)
    assert names.with_weights("smollm2-135m", "float32") == "smollm2-135m"


def test_a_block_file_on_a_gpu_is_one_line(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "a.gguf", _model("llama", False), "q8_0")
    monkeypatch.setattr(loader, "load_own_blocks", lambda name, kind: (loader.LoadedModel(
        name, name, "gguf", _model("llama", False), None), {}))
    with pytest.raises(SdbenchError, match="use --device cpu"):
        variants.own_blocks(str(path), "q8_0", "cuda")


def test_a_file_lacking_a_tensor_is_one_line(tmp_path):
    model = _model("llama", False)
    del model.model.layers[1].post_attention_layernorm.weight  # not written
    model.model.layers[1].post_attention_layernorm.register_parameter("weight", None)
    path = write_gguf(tmp_path / "a.gguf", model, "q4_0")
    with pytest.raises(SdbenchError, match="holds no tensor for model.layers.1.post_attention_layernorm.weight"):
        gguf_blocks.read(path, "q4_0", "tiny")


def test_an_engine_that_cannot_serve_a_files_blocks_is_one_line(tmp_path, capsys):
    """vLLM serves no Q8_0 here: beside sdbench running a Q8_0 file's blocks it would decode other weights, so `bench`
    refuses it before anything loads. A Q4_0 file it serves at its own blocks (as GPTQ), as sdbench runs it."""
    from sdbench.servers.vllm import Vllm
    from tests.conftest import run_cli

    path = write_gguf(tmp_path / "a.gguf", _model("llama", False), "q8_0")
    code, out, err = run_cli(capsys, "bench", "--target", str(path), "--engine", "vllm", "--device", "cpu")
    assert code != 0 and "holds Q8_0 blocks" in err and "vllm does not serve" in err and "Traceback" not in err
    four = write_gguf(tmp_path / "b.gguf", _model("llama", False), "q4_0")
    assert Vllm().served_dtype(str(four), "float32") == "q4_0 as GPTQ, bfloat16"


def test_the_header_is_read_as_ggufs_reader_reads_it(tmp_path):
    """sdbench's own header reader against the `gguf` package's: every tensor's name, shape, type and stored bytes."""
    from gguf import GGUFReader

    path = write_gguf(tmp_path / "a.gguf", _model("qwen2", False), "q8_0", odd="blk.1.attn_v.weight")
    ours, theirs = gguf_header.reader(path), GGUFReader(str(path))
    assert ours.architecture == "qwen2" and len(ours.tensors) == len(theirs.tensors)
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.shape, mine.tensor_type) == (ref.name, tuple(int(d) for d in ref.shape), ref.tensor_type)
        assert np.array_equal(mine.data.reshape(-1), np.ascontiguousarray(ref.data).view(np.uint8).reshape(-1))
