"""Every native family against the library's own forward and `generate`, on tiny random configs.

Each family differs from Llama in a few named places (`models/forward/families.py`); these tests build a tiny model of
each (hidden 64, 2 layers, every 1-D weight perturbed so that norms and biases matter, MoE with 4 experts and
top-2), in float32, and check the runner's logits against the model's uncached forward at prefill, at
single-token steps and at a verification after a cached prefix; 32 greedy tokens against `generate` with the
fast path on and off and through the static path; a speculative run equal to plain decoding; and that each
of the family's differences changes the logits (so that the test would fail without it).
"""

from __future__ import annotations

import copy
import dataclasses
import weakref

import pytest
import torch

from sdbench.forward_step import Step
from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate
from sdbench.models.forward import cpufast, families
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.strategies.draft import DraftModel
from tests.conftest import VOCAB, skip_unless_ci
from tests.test_runner_fidelity import library_greedy, perturbed_model, tiny_config

GREEDY = SamplingConfig()
NEW = 32
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=3.0, final_logit_softcapping=8.0,
             sliding_window=512, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=False)

SPECS = {  # model_type -> config arguments beyond `tiny_config`'s (hidden 64, 2 layers, 4 heads, 2 KV heads)
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(MOE, shared_expert_intermediate_size=96, mlp_only_layers=[1]),  # layer 1 dense
    "qwen3_moe": dict(MOE, head_dim=24),
    "starcoder2": dict(use_bias=True, hidden_act="gelu_pytorch_tanh"),
    "gemma2": GEMMA,
    "gemma3_text": dict(GEMMA, attn_logit_softcapping=None, rope_parameters={  # local layers: their own base
        "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=10000.0),
        "sliding_attention": dict(rope_type="default", rope_theta=100.0)}),
    "phi3": dict(max_position_embeddings=8192, original_max_position_embeddings=4096, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
        short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5], long_factor=[1.0, 2, 4, 8, 12, 16])),
    "granite": dict(embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=1.7),
    "olmo2": {},
}
NAMES = list(SPECS)


def family_config(name: str, layers: int = 2, **overrides):
    extra = {**SPECS[name], **overrides}
    if "layer_types" in extra:
        extra["layer_types"] = extra["layer_types"][:layers]
    return tiny_config(name, num_hidden_layers=layers, **extra)


def tiny(name: str, seed: int = 0, layers: int = 2, **overrides):
    """A tiny random model of a family, every 1-D weight (norms, biases) perturbed."""
    return perturbed_model(family_config(name, layers, **overrides), seed)


@pytest.fixture(scope="module", params=NAMES)
def model(request):
    return tiny(request.param)


def _ids(seed: int, rows: int = 2, n: int = 20) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, n), generator=torch.Generator().manual_seed(seed))


def _reference(model, ids: torch.Tensor) -> torch.Tensor:
    with cpufast.plain(model), torch.no_grad():
        return model(ids).logits  # [B, S, V], the library's own uncached forward


@pytest.mark.parametrize("fast", [False, True])
def test_logits_match_the_library_at_prefill_decode_and_verify(model, fast):
    ids = _ids(1)
    ref = _reference(model, ids)
    runner = ModelRunner(model, fast=fast)
    cache = runner.new_cache(2, 40)
    first = runner.prefill(cache, [ids[0, :12].tolist(), ids[1, :9].tolist()], chunk=5)
    torch.testing.assert_close(first, torch.stack([ref[0, 11], ref[1, 8]]), atol=1e-4, rtol=1e-4)
    for t in range(3):  # single-token steps, rows at their own positions
        step = runner.run(cache, Step(torch.stack([ids[0, 12 + t : 13 + t], ids[1, 9 + t : 10 + t]]), [12 + t, 9 + t]))
        torch.testing.assert_close(step[:, 0], torch.stack([ref[0, 12 + t], ref[1, 9 + t]]), atol=1e-4, rtol=1e-4)
    verify = runner.run(cache, Step(torch.stack([ids[0, 15:20], ids[1, 12:17]]), [15, 12]))  # 5 tokens at once
    torch.testing.assert_close(verify, torch.stack([ref[0, 15:20], ref[1, 12:17]]), atol=1e-4, rtol=1e-4)


def _prompts(seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 12, 4)]


# model -> {prompts: the library's tokens}, computed once for the three modes. Keyed by the model itself, held
# weakly: an id() key can be reused by the next family's model once the fixture frees this one.
_GREEDY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _library_greedy(model, prompts) -> list[list[int]]:
    known = _GREEDY.setdefault(model, {})
    if str(prompts) not in known:
        known[str(prompts)] = [library_greedy(model, p, NEW) for p in prompts]
    return known[str(prompts)]


@pytest.mark.parametrize("mode", ["plain", "fast", "static"])
def test_greedy_tokens_equal_generate(model, mode):
    prompts = _prompts()
    ref = _library_greedy(model, prompts)
    runner = ModelRunner(model, fast=mode == "fast", static=mode == "static")
    out = generate(runner, Autoregressive(), prompts, max_new_tokens=NEW, sampling=GREEDY).output_ids
    assert out == ref


def test_speculative_decoding_equals_plain_decoding(model):
    """Drafting for itself (every draft accepted: the verification path) and by another, smaller model of the
    family (drafts rejected: the rewind path), greedy: the tokens of plain decoding."""
    prompts = _prompts(4)
    target = ModelRunner(model)
    plain = generate(target, Autoregressive(), prompts, max_new_tokens=NEW, sampling=GREEDY)
    itself = generate(target, DraftModel(target, 4), prompts, max_new_tokens=NEW, sampling=GREEDY)
    assert itself.output_ids == plain.output_ids
    assert all(row.steps <= NEW // 5 + 1 for row in itself.rows)  # 5 tokens a step: every draft accepted
    other = ModelRunner(tiny(model.config.model_type, seed=1, layers=1))
    spec = generate(target, DraftModel(other, 4), prompts, max_new_tokens=NEW, sampling=GREEDY)
    assert spec.output_ids == plain.output_ids


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
@pytest.mark.parametrize("draft_kv", ["streamingllm", "snapkv"])
def test_sparse_draft_caches_run_the_families(name, draft_kv):
    """The model drafting for itself over a sparse view of its cache (soft-capped attention under the view's
    mask; fused q/k/v with partial rotary): with a budget covering the context the view is the whole cache,
    so every draft is accepted; with a small one, decoding stays that of plain decoding."""
    target = ModelRunner(tiny(name))
    prompts = [p * 4 for p in _prompts(4)]  # longer than the small budget
    plain = generate(target, Autoregressive(), prompts, max_new_tokens=16, sampling=GREEDY).output_ids
    for budget in (256, 16):
        proposer = DraftModel(target, 3, draft_kv=draft_kv, budget=budget, sink=4, window=4)
        out = generate(target, proposer, prompts, max_new_tokens=16, sampling=GREEDY)
        assert out.output_ids == plain
        assert budget < 256 or all(row.steps <= 16 // 4 + 1 for row in out.rows)


def _differences(name: str) -> list[str]:
    """The family's fields that are not Llama's, but `rms_norm` (whether the fast path may run the norms as
    one op: no maths of its own, and the fast-path logits test fails without it)."""
    fam = families.family(family_config(name))
    return [f.name for f in dataclasses.fields(fam) if getattr(fam, f.name) != f.default and f.name != "rms_norm"]


@pytest.mark.parametrize("name,field", [(n, f) for n in NAMES for f in _differences(n)])
def test_each_difference_of_a_family_matters(name, field, monkeypatch):
    """The runner with one of the family's differences taken back to Llama's is far off the library: these
    configs exercise every difference (a test that passes without the feature proves nothing)."""
    model = tiny(name)
    ids = _ids(2, rows=1, n=12)
    ref = _reference(model, ids)
    real = families.family
    llama = dataclasses.fields(families.Family)
    default = next(f.default for f in llama if f.name == field)
    monkeypatch.setattr("sdbench.models.forward.runner.family", lambda c: dataclasses.replace(real(c), **{field: default}))
    if (name, field) in NAMES_ONLY:  # Llama's module is not there at all: the runner cannot be built without it
        attention = model.model.layers[0].self_attn
        assert not hasattr(attention, NAMES_ONLY[name, field])
        with pytest.raises(AttributeError, match=NAMES_ONLY[name, field]):
            runner = ModelRunner(model)
            runner.run(runner.new_cache(1, 16), Step(ids, [0]))
        return
    if (name, field) == ("olmo2", "norms"):  # post-norms only: Llama's pre-norm, a copy of the family's own
        for layer in model.model.layers:
            layer.input_layernorm = copy.deepcopy(layer.post_attention_layernorm)
    runner = ModelRunner(model)
    got = runner.run(runner.new_cache(1, 16), Step(ids, [0]))
    assert (got - ref).abs().max() > 1e-2


# a difference that only names modules: Llama's name, absent from the family's layers (an exact split of the
# fused projection would compute the same logits, so the name is all there is to check)
NAMES_ONLY = {("phi3", "qkv"): "q_proj"}


def test_fast_path_leaves_experts_and_gemma_norms_to_the_library():
    mixtral = ModelRunner(tiny("mixtral"), fast=True)
    if not mixtral.fast:
        skip_unless_ci("neither MKL nor oneDNN is available in this torch build")
    assert all(layer.up is None for layer in mixtral.path.fast.layers)  # experts: the library's own block
    assert mixtral.path.one_op_norms
    gemma = ModelRunner(tiny("gemma2"), fast=True)
    assert gemma.fast and not gemma.path.one_op_norms  # (1 + w) RMSNorm: not F.rms_norm
    phi = ModelRunner(tiny("phi3"), fast=True)
    assert [len(p.modules) for p in phi.path.layer(0).projections()] == [1, 1, 1, 1]  # fused already


def test_native_list_is_the_families():
    assert set(NAMES) <= set(families.NATIVE)
    assert families.serving(tiny("gemma2").config).runner == "native"


WINDOWED = {  # families with sliding windows -> config arguments making a window of 6 bind
    "gemma2": dict(sliding_window=6),  # local layer 0, global layer 1
    "gemma3_text": dict(sliding_window=6),
    "mixtral": dict(sliding_window=6),
    "starcoder2": dict(sliding_window=6),
    "phi3": dict(sliding_window=6),
    "qwen3_moe": dict(sliding_window=6, use_sliding_window=True),
    "qwen2_moe": dict(sliding_window=6, use_sliding_window=True, max_window_layers=2),  # layer 0 slides
}


@pytest.mark.parametrize("name", list(WINDOWED))
def test_sliding_windows_that_bind(name):
    """Windows far shorter than the sequences: logits past the window at prefill, steps and a verification,
    greedy tokens of every runner kind equal to generate, and a speculative run equal to plain decoding."""
    model = tiny(name, **WINDOWED[name])
    ids = _ids(5, rows=2, n=24)
    ref = _reference(model, ids)
    for runner in (ModelRunner(model), ModelRunner(model, fast=True), ModelRunner(model, static=True)):
        cache = runner.new_cache(2, 40)
        first = runner.prefill(cache, [ids[0, :14].tolist(), ids[1, :10].tolist()], chunk=4)
        torch.testing.assert_close(first, torch.stack([ref[0, 13], ref[1, 9]]), atol=1e-4, rtol=1e-4)
        step = runner.run(cache, Step(torch.stack([ids[0, 14:15], ids[1, 10:11]]), [14, 10]))
        torch.testing.assert_close(step[:, 0], torch.stack([ref[0, 14], ref[1, 10]]), atol=1e-4, rtol=1e-4)
        verify = runner.run(cache, Step(torch.stack([ids[0, 15:20], ids[1, 11:16]]), [15, 11]))
        torch.testing.assert_close(verify, torch.stack([ref[0, 15:20], ref[1, 11:16]]), atol=1e-4, rtol=1e-4)
        prompts = _prompts(6)
        out = generate(runner, Autoregressive(), prompts, max_new_tokens=NEW, sampling=GREEDY).output_ids
        assert out == _library_greedy(model, prompts)
    target = ModelRunner(model)
    spec = generate(target, DraftModel(ModelRunner(tiny(name, seed=1, layers=1, **WINDOWED[name])), 4),
                    _prompts(6), max_new_tokens=NEW, sampling=GREEDY)
    assert spec.output_ids == _library_greedy(model, _prompts(6))
