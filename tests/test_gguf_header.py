"""A GGUF file's header as sdbench reads it, field by field, against the values the `gguf` package's own writer put
in a tiny file: sdbench's reader (`models/loading/gguf_header.py`: the architecture, the alignment, the file type and
every tensor's name, shape, type and stored bytes, past header values of every type), the file's type as llama.cpp
names it, and the config a GGUF file's metadata gives (shapes, vocabulary, rope, heads, context) with the memory
footprint counted from it. Every field has its own value, none the writer's or the library's default, so a swapped
or dropped field fails."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType, quants

from sdbench.models.loading import gguf_header

RNG = np.random.default_rng(7)
EMBED = RNG.standard_normal((5, 32)).astype(np.float32)  # numpy's order: rows, then the inner dimension
Q8 = RNG.standard_normal((4, 64)).astype(np.float32)  # 2 blocks of 32 a row: 2 x 34 bytes
Q4 = RNG.standard_normal((3, 96)).astype(np.float32)  # 3 blocks of 32 a row: 3 x 18 bytes
HALF = RNG.standard_normal((6, 32)).astype(np.float16)
EXPERTS = RNG.standard_normal((2, 3, 32)).astype(np.float32)  # a stack of 2 experts' 3 x 32 matrices: 6 rows
NORM = RNG.standard_normal(32).astype(np.float32)  # one row


def _write(path: Path, pad: int = 0, alignment: int | None = 64, file_type: int | None = LlamaFileType.MOSTLY_Q8_0):
    """A header holding a value of every GGUF type (arrays of strings, of numbers and of arrays too) ahead of the
    alignment and file type, then six tensors of four types; `pad` characters more in one string move where the
    header ends."""
    w = GGUFWriter(str(path), "qwen2")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000)
    w.add_int32("t.i32", -5)
    w.add_float32("t.f32", 0.25)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 1 << 40)
    w.add_int64("t.i64", -(1 << 40))
    w.add_float64("t.f64", 1.5)
    w.add_string("t.str", "x" * (3 + pad))
    w.add_array("t.words", ["a", "bb", "ccc"])
    w.add_array("t.scores", [0.5, 1.5, 2.5, 3.5])
    w.add_array("t.nested", [[1, 2, 3], [4, 5]])
    if alignment is not None:
        w.add_custom_alignment(alignment)
    if file_type is not None:
        w.add_file_type(int(file_type))
    w.add_string("t.after", "the last value")
    w.add_tensor("token_embd.weight", EMBED)
    w.add_tensor("blk.0.attn_q.weight", quants.quantize(Q8, GGMLQuantizationType.Q8_0),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", quants.quantize(Q4, GGMLQuantizationType.Q4_0),
                 raw_dtype=GGMLQuantizationType.Q4_0)
    w.add_tensor("blk.0.attn_v.weight", HALF)
    w.add_tensor("blk.0.ffn_gate_exps.weight", EXPERTS)
    w.add_tensor("output_norm.weight", NORM)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_values_ahead_of_the_fields_read_are_of_every_type(tmp_path):
    """The premise of the reader's test below: the writer put one value of each of GGUF's 13 types, and arrays of
    each kind, before the alignment and the file type (a value skipped at the wrong width misreads those)."""
    from gguf import GGUFValueType

    fields = GGUFReader(str(_write(tmp_path / "a.gguf"))).fields
    keys = list(fields)
    assert keys.index("t.nested") < keys.index("general.alignment") < keys.index("general.file_type")
    types = {fields[k].types[0] for k in keys if k.startswith("t.")}
    assert types == set(GGUFValueType)
    assert fields["t.nested"].types[:2] == [GGUFValueType.ARRAY, GGUFValueType.ARRAY]
    # and among the eight headers below, some end where rounding up to 32 falls short of the data at 64
    short = []
    for pad in range(0, 64, 8):
        read = GGUFReader(str(_write(tmp_path / f"p{pad}.gguf", pad)))
        last = read.tensors[-1].field
        end = last.offset + sum(part.nbytes for part in last.parts)
        assert read.data_offset % 64 == 0 and read.data_offset - end < 64
        short.append(-(-end // 32) * 32 < read.data_offset)
    assert any(short) and not all(short)


@pytest.mark.parametrize("pad", range(0, 64, 8))
def test_each_field_of_the_header_as_the_writer_wrote_it(tmp_path, pad):
    """Architecture qwen2, alignment 64 (the writer's default is 32), file type 7 (Q8_0), and per tensor its name, its
    dimensions innermost first (numpy's reversed), its type and its stored bytes as rows: F32 rows of 32 x 4 bytes,
    Q8_0 rows of 2 blocks of 34 bytes (the `gguf` package's own quantisation of the values written), Q4_0 rows of 3
    blocks of 18, F16 rows of 32 x 2; a stack of 2 x 3 rows is 6 rows, a vector 1. Eight headers, each 8 bytes
    longer than the one before, so that in some of them the data starts at a multiple of 64 that rounding to 32
    would not reach."""
    path = _write(tmp_path / f"h{pad}.gguf", pad)
    gguf_header.forget()
    header = gguf_header.reader(path)
    assert (header.architecture, header.file_type) == ("qwen2", 7)
    got = {t.name: t for t in header.tensors}
    assert list(got) == ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_up.weight", "blk.0.attn_v.weight",
                         "blk.0.ffn_gate_exps.weight", "output_norm.weight"]
    expected = {"token_embd.weight": ((32, 5), GGMLQuantizationType.F32, (5, 128)),
                "blk.0.attn_q.weight": ((64, 4), GGMLQuantizationType.Q8_0, (4, 68)),
                "blk.0.ffn_up.weight": ((96, 3), GGMLQuantizationType.Q4_0, (3, 54)),
                "blk.0.attn_v.weight": ((32, 6), GGMLQuantizationType.F16, (6, 64)),
                "blk.0.ffn_gate_exps.weight": ((32, 3, 2), GGMLQuantizationType.F32, (6, 128)),
                "output_norm.weight": ((32,), GGMLQuantizationType.F32, (1, 128))}
    for name, (dims, kind, rows) in expected.items():
        assert (got[name].shape, got[name].tensor_type, got[name].data.shape) == (dims, kind, rows), name
    assert np.array_equal(got["token_embd.weight"].data.view(np.float32), EMBED)
    assert np.array_equal(got["blk.0.attn_q.weight"].data, quants.quantize(Q8, GGMLQuantizationType.Q8_0))
    assert np.array_equal(got["blk.0.ffn_up.weight"].data, quants.quantize(Q4, GGMLQuantizationType.Q4_0))
    assert np.array_equal(got["blk.0.attn_v.weight"].data.view(np.float16), HALF)
    assert np.array_equal(got["blk.0.ffn_gate_exps.weight"].data.view(np.float32), EXPERTS.reshape(6, 32))
    assert np.array_equal(got["output_norm.weight"].data.view(np.float32), NORM[None])


def test_a_header_without_alignment_or_file_type(tmp_path):
    """No general.alignment: the data at GGUF's default 32; no general.file_type: None, and no type for llama.cpp."""
    from sdbench.servers.llamacpp import file_type

    path = _write(tmp_path / "plain.gguf", alignment=None, file_type=None)
    gguf_header.forget()
    header = gguf_header.reader(path)
    assert header.file_type is None and file_type(path) is None
    assert np.array_equal(header.tensors[-1].data.view(np.float32), NORM[None])


@pytest.mark.parametrize("kind, name", [(LlamaFileType.MOSTLY_Q8_0, "Q8_0"), (LlamaFileType.MOSTLY_Q4_K_M, "Q4_K_M"),
                                        (LlamaFileType.ALL_F32, "F32")])
def test_the_files_type_as_llamacpp_names_it(tmp_path, kind, name):
    from sdbench.servers.llamacpp import file_type

    path = _write(tmp_path / f"{name}.gguf", file_type=kind)
    gguf_header.forget()
    assert file_type(path) == name


def _model_file(path: Path) -> Path:
    """A tiny Llama as a GGUF file of float32 tensors, its hyperparameters each its own value, none a default: 3
    layers, context 384, hidden 48, MLP 80, 6 heads and 2 KV heads (of 48 / 6 = 8), RMS epsilon 2.5e-6, rope base
    12345, vocabulary 37, an untied head."""
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(3)
    w.add_context_length(384)
    w.add_embedding_length(48)
    w.add_feed_forward_length(80)
    w.add_head_count(6)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(2.5e-6)
    w.add_rope_freq_base(12345.0)
    w.add_vocab_size(37)

    def tensor(name: str, *shape: int) -> None:
        w.add_tensor(name, RNG.standard_normal(shape).astype(np.float32))

    tensor("token_embd.weight", 37, 48)
    tensor("output.weight", 37, 48)
    tensor("output_norm.weight", 48)
    for i in range(3):
        for part, rows, cols in (("attn_q", 48, 48), ("attn_k", 16, 48), ("attn_v", 16, 48), ("attn_output", 48, 48),
                                 ("ffn_gate", 80, 48), ("ffn_up", 80, 48), ("ffn_down", 48, 80)):
            tensor(f"blk.{i}.{part}.weight", rows, cols)
        tensor(f"blk.{i}.attn_norm.weight", 48)
        tensor(f"blk.{i}.ffn_norm.weight", 48)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_files_config_and_footprint_by_hand(tmp_path):
    """The config sdbench reads of a GGUF file not yet converted (its metadata alone), each field the value written;
    then what a server of it holds (`footprint.shape`): parameters by hand, embedding and head 37 x 48 each, per
    layer q and o 48 x 48, k and v 16 x 48 (2 KV heads of 8), gate, up and down 48 x 80, two norms of 48, and a final
    norm; KV per position: keys and values, 3 layers x 2 heads x 8, two bytes each."""
    from sdbench.models.loading import loader
    from sdbench.servers.footprint import shape

    path = _model_file(tmp_path / "tiny-llama.gguf")
    config = loader.load_config(str(path))
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.max_position_embeddings, config.hidden_size,
            config.intermediate_size) == (3, 384, 48, 80)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (6, 2, 37)
    assert config.rms_norm_eps == pytest.approx(2.5e-6, rel=1e-6)
    theta = config.rope_parameters["rope_theta"] if getattr(config, "rope_parameters", None) else config.rope_theta
    assert theta == 12345.0
    assert getattr(config, "head_dim", None) in (None, 8) and not config.tie_word_embeddings
    layer = 2 * 48 * 48 + 2 * 16 * 48 + 3 * 48 * 80 + 2 * 48
    found = shape(str(path))
    assert found.params == 2 * 37 * 48 + 3 * layer + 48
    assert (found.table, found.vocab, found.kv_per_position) == (37 * 48, 37, 2 * 3 * 2 * 8 * 2)
