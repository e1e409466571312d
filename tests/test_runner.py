import pytest
import torch

from sdbench.errors import SdbenchError
from sdbench.models.runner import ModelRunner
from tests.conftest import VOCAB, tiny_model


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
    more = runner.forward(cache, torch.stack([ids[0, 15:20], ids[1, 12:17]]), [15, 12])
    torch.testing.assert_close(more[0], ref[0, 15:20], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(more[1], ref[1, 12:17], atol=1e-4, rtol=1e-4)


def test_rewind_is_restarting_earlier():
    runner = ModelRunner(tiny_model(4))
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    cache = runner.new_cache(1, 32)
    runner.prefill(cache, [ids[0, :6].tolist()])
    wrong = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(2))
    runner.forward(cache, wrong, [6])  # a rejected draft leaves stale slots 6..9
    again = runner.forward(cache, ids[:, 6:12], [6])
    fresh = runner.new_cache(1, 32)
    runner.prefill(fresh, [ids[0, :6].tolist()])
    torch.testing.assert_close(again, runner.forward(fresh, ids[:, 6:12], [6]))


def test_overflow_and_unsupported():
    runner = ModelRunner(tiny_model(5))
    cache = runner.new_cache(1, 4)
    with pytest.raises(RuntimeError, match="overflow"):
        runner.prefill(cache, [[1, 2, 3, 4, 5]])
    model = tiny_model(5)
    model.config.model_type = "gpt2"
    with pytest.raises(SdbenchError, match="does not support"):
        ModelRunner(model, "m")


# qwen2: biased q/k/v, fused with their biases; qwen3: per-head q/k norms after the fused product
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_fast_path_matches_stock_forward(arch):
    from sdbench.models.cpufast import PACK_MIN_ROWS

    model = tiny_model(6, arch=arch)
    stock = ModelRunner(model)
    fast = ModelRunner(model, fast=True)
    if not fast.fast:
        pytest.skip("neither MKL nor oneDNN is available in this torch build")
    layer, fused = model.model.layers[0], fast._fast_layers[0]
    # the separate weights became views of the fused ones: no copy, and the stock forward reads the same
    assert layer.self_attn.k_proj.weight.data_ptr() == fused.qkv.weight[layer.self_attn.q_proj.weight.shape[0]:].data_ptr()
    assert ModelRunner(model, fast=True)._fast_layers[0] is fused  # made once per model
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(4))
    a, b = stock.new_cache(2, 32), fast.new_cache(2, 32)
    torch.testing.assert_close(fast.prefill(b, ids[:, :9].tolist()), stock.prefill(a, ids[:, :9].tolist()),
                               atol=1e-4, rtol=1e-4)
    for width in (1, PACK_MIN_ROWS // 2, 5):  # 2, 4 and 10 rows: stock and packed products
        torch.testing.assert_close(fast.forward(b, ids[:, 9 : 9 + width], [9, 9]),
                                   stock.forward(a, ids[:, 9 : 9 + width], [9, 9]), atol=1e-4, rtol=1e-4)


def test_fast_path_is_lossless_and_only_for_cpu_float32(prompts):
    from sdbench.config import SamplingConfig
    from sdbench.decode import generate
    from sdbench.strategies.autoregressive import Autoregressive
    from sdbench.strategies.draft import DraftModel

    fast = ModelRunner(tiny_model(0), fast=True)
    ref = generate(fast, Autoregressive(), prompts, max_new_tokens=16, sampling=SamplingConfig()).output_ids
    out = generate(fast, DraftModel(fast, 4), prompts, max_new_tokens=16, sampling=SamplingConfig()).output_ids
    assert out == ref
    assert not ModelRunner(tiny_model(0).to(torch.bfloat16), fast=True).fast


def test_fast_path_on_copies_and_quantised_models():
    import copy

    from sdbench.models.variants import quantise_int8

    model = tiny_model(7)
    fast = ModelRunner(model, fast=True)
    if not fast.fast:
        pytest.skip("neither MKL nor oneDNN is available in this torch build")
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
