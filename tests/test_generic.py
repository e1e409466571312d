"""The generic runner (the library's own forward and cache) against the library itself, on tiny random GPT-2,
GPT-NeoX, OPT and Falcon models: logits, greedy tokens against `generate`, and every strategy that needs no
native runner lossless on it."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import (FalconConfig, FalconForCausalLM, GPT2Config, GPT2LMHeadModel, GPTNeoXConfig,
                          GPTNeoXForCausalLM, OPTConfig, OPTForCausalLM)

from sdbench.forward_step import Step
from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate
from sdbench.errors import SdbenchError
from sdbench.models.forward.generic import GenericRunner
from sdbench.models.probing.probe import probe
from sdbench.strategies import BuildContext, build_proposer
from sdbench.strategies.autoregressive import Autoregressive
from tests.conftest import VOCAB

GREEDY = SamplingConfig()
FAMILIES = ("gpt2", "gpt_neox", "opt", "falcon", "falcon-alibi")


def perturbed(model, seed: int):
    """The model with every 1-D weight (biases, norms) moved off its init, so that a runner skipping one
    shows; eval mode."""
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def tiny_generic(family: str, seed: int = 0, layers: int = 2, hidden: int = 64):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=512,
                                           initializer_range=0.2, **common))
    elif family == "gpt_neox":
        model = GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                                                 intermediate_size=2 * hidden, max_position_embeddings=512,
                                                 rotary_pct=0.5, initializer_range=0.2, **common))
    elif family == "opt":
        model = OPTForCausalLM(OPTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                                         ffn_dim=2 * hidden, max_position_embeddings=512, word_embed_proj_dim=hidden,
                                         init_std=0.2, **common))
    else:  # falcon: grouped kv heads and parallel attention; falcon-alibi: multi-query with ALiBi positions
        alibi = family == "falcon-alibi"
        model = FalconForCausalLM(FalconConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                                               new_decoder_architecture=not alibi, num_kv_heads=2, alibi=alibi,
                                               multi_query=alibi, parallel_attn=not alibi, bias=alibi,
                                               max_position_embeddings=512, initializer_range=0.2, **common))
    return perturbed(model, seed)


@functools.cache
def runner_of(family: str, seed: int = 0, layers: int = 2) -> GenericRunner:
    return GenericRunner(tiny_generic(family, seed, layers), family)


@pytest.fixture(scope="module", params=FAMILIES)
def generic(request):
    return runner_of(request.param)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 4)]


def test_logits_match_the_library_per_row_position_with_rewinds(generic):
    """Rows at different positions in one batch, a rejected draft rewound, logits kept only at `at`."""
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = generic.model(ids).logits  # [2, 40, V]: the library's uncached forward
    cache = generic.new_cache(2, 64)
    first = generic.prefill(cache, [ids[0, :20].tolist(), ids[1, :25].tolist()])
    torch.testing.assert_close(first, torch.stack([ref[0, 19], ref[1, 24]]), atol=1e-4, rtol=0)
    step = generic.run(cache, Step(torch.stack([ids[0, 20:21], ids[1, 25:26]]), [20, 25]))
    torch.testing.assert_close(step, torch.stack([ref[0, 20:21], ref[1, 25:26]]), atol=1e-4, rtol=0)
    generic.run(cache, Step(torch.randint(0, VOCAB, (2, 5)), [21, 26]))  # drafts the verifier rejects
    wide = generic.run(cache, Step(torch.stack([ids[0, 21:26], ids[1, 26:31]]), [21, 26]))
    torch.testing.assert_close(wide, torch.stack([ref[0, 21:26], ref[1, 26:31]]), atol=1e-4, rtol=0)
    at = generic.run(cache, Step(torch.stack([ids[0, 26:30], ids[1, 31:35]]), [26, 31], at=torch.tensor([[0, 3], [1, 2]])))
    torch.testing.assert_close(at, torch.stack([ref[0, [26, 29]], ref[1, [32, 33]]]), atol=1e-4, rtol=0)
    last = generic.run(cache, Step(torch.stack([ids[0, 30:31], ids[1, 35:36]]), [30, 35], at=torch.tensor([0, 0])))
    torch.testing.assert_close(last, torch.stack([ref[0, 30], ref[1, 35]]), atol=1e-4, rtol=0)  # at [B]: [B, V]
    with pytest.raises(RuntimeError, match="cannot start at"):  # a hole in a row's positions is a bug
        generic.run(cache, Step(ids[:, :1], [38, 38]))


def test_the_probe_passes_on_the_generic_runner(generic):
    result = probe(generic, 300)
    assert result.passed and result.runner == "generic" and set(result.gaps) == {"prefill", "step", "verify"}
    assert result.gap < 1e-5


def test_32_greedy_tokens_match_generate(generic, prompts):
    for prompt in prompts:
        ours = generate(generic, Autoregressive(), [prompt], max_new_tokens=32, sampling=GREEDY).output_ids[0]
        ids = torch.tensor([prompt])
        with torch.no_grad():
            theirs = generic.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                            max_new_tokens=32, min_new_tokens=32, pad_token_id=0)
        assert ours == theirs[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES[:4])
@pytest.mark.parametrize("strategy, options", [("draft", {}), ("ngram", {}), ("polybasic", {"mu": "4"}),
                                               ("adaptive", {})])
def test_strategies_are_lossless_on_generic_runners(family, prompts, strategy, options):
    generic, small = runner_of(family), runner_of(family, seed=1, layers=1)
    drafts = {"draft": [small], "ngram": [], "polybasic": [small, "ngram"], "adaptive": [small, "ngram"]}[strategy]
    plain = generate(generic, Autoregressive(), prompts, max_new_tokens=10, sampling=GREEDY).output_ids
    # a small random draft that rarely agrees, and the target itself, which always does
    for chosen in ((drafts, [generic, *drafts[1:]]) if drafts else ([],)):
        proposer = build_proposer(strategy, BuildContext(generic, chosen, 3, dict(options)))
        out = generate(generic, proposer, prompts, max_new_tokens=10, sampling=GREEDY)
        assert out.output_ids == plain, (strategy, chosen)


def test_dsi_workers_run_the_generic_runner(prompts):
    from sdbench.decoders import decoder_for
    from sdbench.dsi import pools as pool_module
    from sdbench.dsi.pools import discard_pool

    target, draft = runner_of("gpt2"), runner_of("gpt2", seed=1, layers=1)
    plain = generate(target, Autoregressive(), prompts[:2], max_new_tokens=10, sampling=GREEDY).output_ids
    try:
        proposer = build_proposer("dsi", BuildContext(target, [draft], 3, {"workers": 2, "threads": 1}))
        decode = decoder_for(proposer)
        assert decode(target, proposer, prompts[:2], max_new_tokens=10, sampling=GREEDY).output_ids == plain
        assert [key[-2] for key in pool_module._pools if key[1] == id(target.model)] == ["generic"]
    finally:
        for key, pool in list(pool_module._pools.items()):
            if key[1] == id(target.model):
                discard_pool(pool)


def test_sparse_caches_are_refused_in_one_line(generic, prompts):
    proposer = build_proposer("magicdec", BuildContext(generic, [], 2, {"budget": 8, "sink": 2}))
    with pytest.raises(SdbenchError, match="generic runner .* need the native runner") as refused:
        generate(generic, proposer, prompts, max_new_tokens=4, sampling=GREEDY)
    assert "\n" not in str(refused.value)


def test_bench_measures_the_generic_runner_beside_the_native_one():
    """`sdbench bench` on a model both runners compute: a generic-runner row after the native ones, with the
    same greedy output as generate."""
    from types import SimpleNamespace

    from sdbench.commands.bench import GENERIC_ROW, _systems
    from sdbench.models.forward.runner import ModelRunner
    from tests.conftest import tiny_model

    model = perturbed(tiny_model(0), 0)
    loaded = SimpleNamespace(model=model)
    native = ModelRunner(model, "tiny")
    systems = _systems(loaded, loaded, native, native, native, 8, [95], 64, 2, GenericRunner(model, "tiny"))
    names = [name for name, _, _ in systems]
    assert names.index(GENERIC_ROW) == names.index("sdbench autoregressive") + 1
    prompt = [5, 17, 42, 8, 3]
    outputs = {name: fn(prompt, None) for name, fn, _ in systems}
    assert len(set(map(tuple, outputs.values()))) == 1 and outputs[GENERIC_ROW]


def test_a_model_with_a_recurrent_state_is_refused_in_one_line():
    from transformers import MambaConfig, MambaForCausalLM

    model = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, state_size=4))
    with pytest.raises(SdbenchError, match="^model 'tiny-mamba' keeps a recurrent state") as refused:
        GenericRunner(model, "tiny-mamba")
    assert "\n" not in str(refused.value)
