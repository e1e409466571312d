import os
from pathlib import Path

import pytest
import torch

from sdbench.forward_step import Step
from sdbench.errors import SdbenchError
from sdbench.models.forward.runner import ModelRunner
from tests.conftest import VOCAB, skip_unless_ci, tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_forward_matches_library_logits(arch):
    model = tiny_model(3, arch=arch)
    runner = ModelRunner(model)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    cache = runner.new_cache(2, 40)
    first = runner.prefill(cache, [ids[0, :15].tolist(), ids[1, :12].tolist()], chunk=4)
    torch.testing.assert_close(first[0], ref[0, 14], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first[1], ref[1, 12 - 1], atol=1e-4, rtol=1e-4)
    # rows continue from different positions in one forward
    more = runner.run(cache, Step(torch.stack([ids[0, 15:20], ids[1, 12:17]]), [15, 12]))
    torch.testing.assert_close(more[0], ref[0, 15:20], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(more[1], ref[1, 12:17], atol=1e-4, rtol=1e-4)


def test_rewind_is_restarting_earlier():
    runner = ModelRunner(tiny_model(4))
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    cache = runner.new_cache(1, 32)
    runner.prefill(cache, [ids[0, :6].tolist()])
    wrong = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(2))
    runner.run(cache, Step(wrong, [6]))  # a rejected draft leaves stale slots 6..9
    again = runner.run(cache, Step(ids[:, 6:12], [6]))
    fresh = runner.new_cache(1, 32)
    runner.prefill(fresh, [ids[0, :6].tolist()])
    torch.testing.assert_close(again, runner.run(fresh, Step(ids[:, 6:12], [6])))


def test_overflow_and_unsupported():
    runner = ModelRunner(tiny_model(5))
    cache = runner.new_cache(1, 4)
    with pytest.raises(RuntimeError, match="overflow"):
        runner.prefill(cache, [[1, 2, 3, 4, 5]])
    model = tiny_model(5)
    model.config.model_type = "gpt2"
    with pytest.raises(SdbenchError, match="does not support"):
        ModelRunner(model, "m")


def _tied(model):
    model.lm_head.weight = model.model.get_input_embeddings().weight
    return model


def _resident() -> int:
    """Resident bytes of this process, after handing freed heap memory back to the system."""
    import ctypes
    import gc
    import os

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# qwen2: biased q/k/v, fused with their biases; qwen3: per-head q/k norms after the fused product;
# tied: the head reads the embedding table in place (one row through oneDNN, more through W @ x^T)
@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False),
                                       ("mistral", False)])
def test_fast_path_matches_stock_forward_at_every_width(arch, tied):
    from sdbench.models.forward import cpufast

    model = tiny_model(6, arch=arch)
    model = _tied(model) if tied else model
    before = _snapshot(model)
    stock = ModelRunner(model)
    fast = ModelRunner(model, fast=True)
    if not fast.fast:
        skip_unless_ci("oneDNN is not available in this torch build")
    assert ModelRunner(model, fast=True).path.fast is fast.path.fast  # made once per model
    ids = torch.randint(0, VOCAB, (3, 60), generator=torch.Generator().manual_seed(4))
    for rows in (1, 3):  # rows x width products: 1..27 rows
        a, b = stock.new_cache(rows, 64), fast.new_cache(rows, 64)
        prompts = [ids[r, : 9 - 4 * (r % 2)].tolist() for r in range(rows)]  # different lengths, chunked
        torch.testing.assert_close(fast.prefill(b, prompts, chunk=4), stock.prefill(a, prompts, chunk=4),
                                   atol=1e-4, rtol=1e-4)
        pos = 9
        for width in range(1, 10):  # decode, a draft's catch-up, verifications up to gamma = 8
            chunk = ids[:rows, pos : pos + width]
            want = stock.run(a, Step(chunk, [pos] * rows))
            assert not fast.path.fast.packed  # the stock forward runs on plain weights
            got = fast.run(b, Step(chunk, [pos] * rows))
            assert fast.path.fast.packed
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            pos += width
    cpufast.disable(model)
    for name, value in model.state_dict().items():  # unpacking gives the weights back exactly
        assert torch.equal(value, before[name]), name


def test_fast_path_keeps_one_copy_of_the_weights():
    """Packed, the modules' own weights are empty and the process holds no more than 1.1x the plain weights."""
    import os

    from sdbench.models.forward import cpufast

    if not os.path.exists("/proc/self/statm"):
        skip_unless_ci("reads the resident size from /proc (Linux, glibc)")

    model = tiny_model(8, hidden=512, layers=4)  # ~80 MB of weights: above allocator noise
    plain = sum(p.numel() * p.element_size() for p in model.parameters())
    if cpufast.enable(tiny_model(0)) is None:  # oneDNN's one-time set-up is not the model's memory
        skip_unless_ci("oneDNN is not available in this torch build")
    rss = _resident()
    cpufast.enable(model)
    grown = _resident() - rss
    assert model.model.layers[0].mlp.down_proj.weight.numel() == 0
    assert model.lm_head.weight.numel() == 0  # untied: packed too
    assert grown <= 0.1 * plain, f"packing added {grown / plain:.0%} of the weights' {plain} bytes"
    with cpufast.plain(model):  # plain inside (a library forward, a copy), packed again after
        assert model.model.layers[0].mlp.down_proj.weight.numel() > 0
    assert cpufast.fast_model(model).packed


def test_fast_path_lets_go_of_memory_mapped_weights(tmp_path):
    """Loaded from safetensors (memory-mapped), a packed model holds no reference into the file: the
    mapping goes, so its pages do not stay resident beside the packed copy."""
    import gc

    from transformers import AutoModelForCausalLM

    from sdbench.models.forward import cpufast

    if not os.path.exists("/proc/self/maps"):
        skip_unless_ci("reads the process's mappings from /proc (Linux)")
    model = _tied(tiny_model(10))  # tied: the embedding table stays plain and also serves as the head
    model.config.tie_word_embeddings = True
    model.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    mapped = lambda: str(tmp_path) in Path("/proc/self/maps").read_text()  # noqa: E731
    assert mapped()
    if cpufast.enable(model) is None:
        skip_unless_ci("oneDNN is not available in this torch build")
    gc.collect()
    assert not mapped()
    assert model.lm_head.weight is model.model.get_input_embeddings().weight  # still tied


def test_fast_path_model_pickles_with_plain_weights():
    """What a DSI worker receives: plain weights, no opaque tensors; the worker packs its own."""
    import pickle

    from sdbench.models.forward import cpufast

    model = tiny_model(9)
    if cpufast.enable(model) is None:
        skip_unless_ci("oneDNN is not available in this torch build")
    with cpufast.plain(model):
        twin = pickle.loads(pickle.dumps(model))
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    assert cpufast.enable(twin) is not None
    a, b = ModelRunner(model).new_cache(1, 16), ModelRunner(twin, fast=True).new_cache(1, 16)
    torch.testing.assert_close(ModelRunner(twin, fast=True).prefill(b, ids.tolist()),
                               ModelRunner(model).prefill(a, ids.tolist()), atol=1e-4, rtol=1e-4)


def test_fast_path_is_lossless_and_only_for_cpu_float32(prompts):
    from sdbench.config import SamplingConfig
    from sdbench.engine.loop import generate
    from sdbench.strategies.autoregressive import Autoregressive
    from sdbench.strategies.draft import DraftModel

    fast = ModelRunner(tiny_model(0), fast=True)
    ref = generate(fast, Autoregressive(), prompts, max_new_tokens=16, sampling=SamplingConfig()).output_ids
    assert ref == generate(ModelRunner(tiny_model(0)), Autoregressive(), prompts, max_new_tokens=16,
                           sampling=SamplingConfig()).output_ids
    for gamma in range(1, 9):  # every verification width, the draft's catch-up included
        out = generate(fast, DraftModel(fast, gamma), prompts, max_new_tokens=16, sampling=SamplingConfig())
        assert out.output_ids == ref
    assert not ModelRunner(tiny_model(0).to(torch.bfloat16), fast=True).fast


def test_fast_path_on_copies_and_quantised_models():
    import copy

    from sdbench.models.loading.variants import quantise_int8

    model = tiny_model(7)
    fast = ModelRunner(model, fast=True)
    if not fast.fast:
        skip_unless_ci("neither MKL nor oneDNN is available in this torch build")
    twin = copy.deepcopy(model)  # the copy does not carry the original's packed weights along
    assert "_sdbench_fast" not in twin.model.layers[0].__dict__ or twin.model.layers[0]._sdbench_fast is None
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)  # a different model: its fast path must use its own weights
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    stock_twin, fast_twin = ModelRunner(twin), ModelRunner(twin, fast=True)
    a, b = stock_twin.new_cache(1, 16), fast_twin.new_cache(1, 16)
    torch.testing.assert_close(fast_twin.prefill(b, ids.tolist()), stock_twin.prefill(a, ids.tolist()),
                               atol=1e-4, rtol=1e-4)
    assert not ModelRunner(quantise_int8(model), fast=True).fast  # int8 projections: no fp32 fast path


def test_every_cache_sets_every_member_of_the_cache_protocol():
    """The runner reads the protocol's members directly (no hasattr): each cache kind must set them all."""
    from sdbench.kv.cache import KVCache
    from sdbench.kv.sparse import ScoringView

    runner = ModelRunner(tiny_model(0), static=True)
    dense = runner.new_cache(1, 16)
    sparse = runner.new_sparse_cache(1, 2, torch.tensor([4]), 2)
    for cache in (dense, sparse, ScoringView(dense)):
        assert KVCache in type(cache).__mro__
        for member in (*KVCache.__annotations__, "update", "queries"):
            assert hasattr(cache, member), f"{type(cache).__name__} lacks {member}"
    assert dense.pool_key == ("dense", 1) and ScoringView(dense).static_kv_len is None
    assert (dense.wants_queries, sparse.wants_queries, ScoringView(dense).wants_queries) == (False, False, True)


def test_right_pad_lays_rows_out_from_column_zero():
    from sdbench.padding import right_pad

    assert right_pad([[1, 2], [3]]).tolist() == [[1, 2], [3, 0]]
    assert right_pad([torch.tensor([4, 5])], 4).tolist() == [[4, 5, 0, 0]]
    assert right_pad([]).shape == (0, 0) and right_pad([[7]]).dtype == torch.long
