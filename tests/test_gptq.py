"""A Q4_0 copy as a GPTQ checkpoint (vLLM's 4-bit weights on a CPU): each projection's numbers read back by GPTQ's
own packing rule, by hand, equal the `gguf` package's de-quantisation of the same Q4_0 bytes; the folder is what an
engine loads; vLLM is asked for the GPTQ copy at q4_0 and refuses Q8_0 in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants as gguf_quants

from sdbench.errors import SdbenchError
from sdbench.models.forward import quants
from sdbench.models.loading import gptq
from sdbench.servers.engines import EngineRole
from sdbench.servers.vllm import Vllm
from tests.references import tiny_model_dir


def by_gptq_rule(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, g_idx: torch.Tensor) -> np.ndarray:
    """w[o, i] = scale[g_idx[i], o] * (q - (zero + 1)), q the four bits 4 (i % 8) of qweight[i // 8, o] and zero the
    four bits 4 (o % 8) of qzeros[g_idx[i], o // 8] (GPTQ's first format stores zero - 1), one element at a time."""
    n, out = qweight.shape[0] * 8, qweight.shape[1]
    w = np.zeros((out, n), dtype=np.float32)
    for o in range(out):
        for i in range(n):
            q = (int(qweight[i // 8, o]) & 0xFFFFFFFF) >> (4 * (i % 8)) & 15
            g = int(g_idx[i])
            zero = ((int(qzeros[g, o // 8]) & 0xFFFFFFFF) >> (4 * (o % 8)) & 15) + 1
            w[o, i] = float(scales[g, o]) * (q - zero)
    return w


def test_a_projection_re_packed_holds_the_numbers_its_q4_0_bytes_hold():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    blocks = quants.quantise(w, "q4_0")
    got = gptq.pack(blocks, 64)
    assert got["qweight"].dtype == torch.int32 and got["qweight"].shape == (8, 32)
    assert got["scales"].dtype == torch.float16 and got["scales"].shape == (2, 32)
    assert got["qzeros"].shape == (2, 4) and got["g_idx"].tolist() == [i // 32 for i in range(64)]
    reference = gguf_quants.dequantize(blocks.numpy(), GGMLQuantizationType.Q4_0)  # the gguf package's reading
    assert np.array_equal(by_gptq_rule(**got), reference)
    assert torch.equal(gptq.unpack(got["qweight"], got["scales"]), torch.from_numpy(reference))


def test_the_state_dict_keeps_what_is_not_a_projection_and_snaps_the_tables():
    g = torch.Generator().manual_seed(1)
    tensors = {"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 32, generator=g),
               "model.layers.0.self_attn.q_proj.bias": torch.randn(64, generator=g),
               "model.layers.0.mlp.down_proj.weight": torch.randn(32, 48, generator=g),  # 48 inputs: no whole groups
               "model.layers.0.input_layernorm.weight": torch.randn(32, generator=g),
               "model.embed_tokens.weight": torch.randn(10, 32, generator=g)}
    got = gptq.convert(tensors)
    assert set(got) == {"model.layers.0.self_attn.q_proj." + p for p in ("qweight", "scales", "qzeros", "g_idx", "bias")} \
        | {"model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight"}
    for kept in ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert torch.equal(got[kept], tensors[kept])
    with pytest.raises(SdbenchError, match="no decoder projection"):
        gptq.convert({"transformer.h.0.attn.c_attn.weight": torch.randn(64, 32, generator=g)})
    table = tensors["model.embed_tokens.weight"]
    assert torch.equal(got["model.embed_tokens.weight"], quants.snap(table, "q4_0"))
    snapped = quants.snap(tensors["model.layers.0.self_attn.q_proj.weight"], "q4_0")
    assert torch.equal(gptq.unpack(got["model.layers.0.self_attn.q_proj.qweight"],
                                   got["model.layers.0.self_attn.q_proj.scales"]), snapped)


def test_the_folder_is_a_loadable_gptq_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    folder = tiny_model_dir(tmp_path / "tiny")
    out = gptq.gptq_folder(folder)
    assert gptq.gptq_folder(folder) == out  # made once
    other = tiny_model_dir(tmp_path / "elsewhere" / "tiny", seed=1)  # the same name, other weights: its own copy
    assert gptq.gptq_folder(other) != out
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                                             "desc_act": False, "lm_head": False, "checkpoint_format": "gptq"}
    assert (out / "tokenizer.json").is_file() and not list(out.glob(".*.tmp"))
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved = load_file(out / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(folder)
    for name, p in model.state_dict().items():
        if name.endswith("_proj.weight") and p.shape[1] % 32 == 0:
            stem = name.removesuffix("weight")
            assert torch.equal(gptq.unpack(saved[stem + "qweight"], saved[stem + "scales"]), quants.snap(p, "q4_0"))


def test_vllm_serves_q4_0_as_the_gptq_copy_at_bfloat16_and_refuses_q8_0(tmp_path, monkeypatch):
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    folder = str(tiny_model_dir(tmp_path / "tiny"))
    eng = Vllm()
    argv = eng.command(folder, EngineRole("draft", 3, folder), "q4_0", 64, 2)
    served = argv[argv.index("--model") + 1]
    assert served == str(gptq.gptq_folder(tmp_path / "tiny")) and argv[argv.index("--dtype") + 1] == "bfloat16"
    assert json.loads(argv[argv.index("--speculative-config") + 1])["model"] == served
    assert eng.label(EngineRole("autoregressive"), eng.served_dtype(folder, "q4_0")) == \
        "vllm plain decoding (q4_0 as GPTQ, bfloat16)"
    plain = eng.command(folder, EngineRole("autoregressive"), "float32", 64, 2)
    assert plain[plain.index("--model") + 1] == folder and plain[plain.index("--dtype") + 1] == "float32"
    with pytest.raises(SdbenchError, match="no q8_0 here"):
        eng.command(folder, EngineRole("autoregressive"), "q8_0", 64, 2)


VLLM_READS = """
import sys
import torch
from safetensors.torch import load_file
from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
from vllm.scalar_type import scalar_types

kind = scalar_types.uint4b8  # what its GPTQ config maps 4 bits, symmetric, to
saved, expected = load_file(sys.argv[1]), load_file(sys.argv[2])
for stem, w in expected.items():
    q = unpack_quantized_values_into_int32(saved[stem + "qweight"], kind, 0)  # [n, out], input-packed
    groups = saved[stem + "g_idx"].long()
    got = (q.float() - kind.bias) * saved[stem + "scales"].float()[groups]
    assert torch.equal(got.t(), w), stem
print(len(expected))
"""


def test_vllms_own_unpacking_reads_the_q4_0_numbers(tmp_path, monkeypatch, vllm):
    """vLLM's own reading of the checkpoint (its unpacking and its 4-bit symmetric type's bias, in its environment)
    gives every projection's Q4_0 numbers exactly."""
    import subprocess

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    folder = tiny_model_dir(tmp_path / "tiny")
    out = gptq.gptq_folder(folder)
    expected = {name.removesuffix("weight"): quants.snap(p, "q4_0")
                for name, p in AutoModelForCausalLM.from_pretrained(folder).state_dict().items()
                if name.endswith("_proj.weight") and p.shape[1] % 32 == 0}
    save_file(expected, tmp_path / "expected.safetensors")
    script = tmp_path / "reads.py"
    script.write_text(VLLM_READS)
    done = subprocess.run([str(Vllm().executable()), str(script), str(out / "model.safetensors"),
                           str(tmp_path / "expected.safetensors")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == len(expected) > 0
