"""sdbench's output against transformers' own generation, token for token: plain decoding against `generate`,
`draft` against assisted generation (`assistant_model=`, the same γ), `ngram` against prompt lookup
(`prompt_lookup_num_tokens=`), and a batch of prompts decoded together against each prompt's `generate`.

transformers is the reference: every comparison is of token ids, never of re-tokenised text. Tiny random models
of every family the runner serves, with every 1-D weight perturbed; SmolLM2-135M (slow) on real MT-Bench prompts
with the fast path on."""

from __future__ import annotations

import pytest
import torch

from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.ngram import NGram
from tests.conftest import VOCAB, skip_unless_ci
from tests.references import hf_assisted, hf_generate, hf_lookup, tiny_pair

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
NEW = 24
GAMMA = 3


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    rand = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 12, 4)]
    return rand + [(rand[0] * 3)[:18]]  # a repetitive one gives prompt lookup matches to draft from


def _ours(runner, proposer, prompts, eos=()) -> list[list[int]]:
    return generate(runner, proposer, prompts, max_new_tokens=NEW, sampling=SamplingConfig(), eos_ids=eos).output_ids


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    target, draft = tiny_pair(request.param)
    prompts = _prompts()
    plain = [hf_generate(target, p, NEW) for p in prompts]
    # an end-of-sequence token that greedy decoding meets mid-output: both sides must stop at it
    eos = [plain[1][9]]
    return target, draft, prompts, plain, eos


def test_tiny_models_are_not_degenerate(family):
    *_, plain, _ = family
    assert all(len(set(out)) > 4 for out in plain)  # the perturbed models do not collapse onto one token


def test_plain_decoding_equals_generate(family):
    target, _, prompts, plain, eos = family
    runner = ModelRunner(target)
    assert _ours(runner, Autoregressive(), prompts[:1]) == plain[:1]
    for p, ref in zip(prompts, plain):
        assert _ours(runner, Autoregressive(), [p]) == [ref]
    stopped = [hf_generate(target, p, NEW, eos) for p in prompts]
    assert stopped[1] == plain[1][: plain[1].index(eos[0]) + 1]
    assert [_ours(runner, Autoregressive(), [p], eos)[0] for p in prompts] == stopped


def test_draft_equals_assisted_generation(family):
    target, draft, prompts, plain, eos = family
    runner, d_runner = ModelRunner(target), ModelRunner(draft)
    for p in prompts:
        ref = hf_assisted(target, draft, p, NEW, GAMMA)
        assert _ours(runner, DraftModel(d_runner, GAMMA), [p]) == [ref]
        stopped = hf_assisted(target, draft, p, NEW, GAMMA, eos)
        assert _ours(runner, DraftModel(d_runner, GAMMA), [p], eos) == [stopped]
    # the target drafting for itself: every draft accepted, on both sides
    assert _ours(runner, DraftModel(runner, GAMMA), prompts[:1]) == [hf_assisted(target, target, prompts[0], NEW, GAMMA)]


def test_ngram_equals_prompt_lookup(family):
    target, _, prompts, _, eos = family
    runner = ModelRunner(target)
    drafted = 0
    for p in prompts:
        ref = hf_lookup(target, p, NEW, GAMMA)
        out = generate(runner, NGram(GAMMA), [p], max_new_tokens=NEW, sampling=SamplingConfig())
        assert out.output_ids == [ref]
        drafted += out.rows[0].drafted
        assert _ours(runner, NGram(GAMMA), [p], eos) == [hf_lookup(target, p, NEW, GAMMA, eos)]
    assert drafted > 0  # the lookup did propose, so verification of drafts was exercised


def test_batched_run_equals_each_prompts_generate(family):
    target, draft, prompts, plain, eos = family
    runner, d_runner = ModelRunner(target), ModelRunner(draft)
    # rows of different lengths in one batch, each stopping where its own generate stops
    assert _ours(runner, DraftModel(d_runner, GAMMA), prompts) == plain
    assert _ours(runner, NGram(GAMMA), prompts, eos) == [hf_generate(target, p, NEW, eos) for p in prompts]


def test_the_cpu_fast_path_equals_generate(family):
    """The fast path's own kernels (fused, packed projections; one-op RMSNorm) on weights whose norms and biases
    matter, against transformers on the plain model."""
    import copy

    target, draft, prompts, plain, eos = family
    runner = ModelRunner(copy.deepcopy(target), fast=True)  # packing empties the copy's own weights
    if not runner.cpu_fast:
        skip_unless_ci("oneDNN is not available in this torch build")
    d_runner = ModelRunner(copy.deepcopy(draft), fast=True)
    assert [_ours(runner, Autoregressive(), [p])[0] for p in prompts] == plain
    assert _ours(runner, DraftModel(d_runner, GAMMA), prompts) == plain
    assert [_ours(runner, NGram(GAMMA), [p], eos)[0] for p in prompts] == [hf_lookup(target, p, NEW, GAMMA, eos)
                                                                          for p in prompts]


# --- the real model ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from sdbench.data.tasks import encode_prompt, load_prompts
    from sdbench.models.loading import embedded
    from sdbench.models.loading.aliases import model_registry
    from sdbench.models.loading.loader import eos_token_ids, load_model

    spec = model_registry.get("smollm2-135m")
    if embedded.missing_packages(spec):
        skip_unless_ci(f"needs `{spec.install_command()}`")
    loaded = load_model("smollm2-135m")
    prompts = [encode_prompt(p, loaded.tokenizer) for p in load_prompts("mt-bench", limit=2, seed=0)]
    return loaded, prompts, eos_token_ids(loaded)


@pytest.mark.slow
def test_smollm2_plain_draft_ngram_and_batch_equal_transformers(smollm2):
    from sdbench.models.forward import cpufast

    loaded, prompts, eos = smollm2
    model, new = loaded.model, 32
    with cpufast.plain(model):  # transformers runs on the plain weights
        plain = [hf_generate(model, p, new, eos) for p in prompts]
        assisted = [hf_assisted(model, model, p, new, 4, eos) for p in prompts]
        lookup = [hf_lookup(model, p, new, 4, eos) for p in prompts]
    runner = ModelRunner(model, "smollm2-135m", fast=True)  # the fast path where this build has it

    def ours(proposer, ps):
        return generate(runner, proposer, ps, max_new_tokens=new, sampling=SamplingConfig(), eos_ids=eos).output_ids

    assert [ours(Autoregressive(), [p])[0] for p in prompts] == plain
    assert [ours(DraftModel(runner, 4), [p])[0] for p in prompts] == assisted
    assert [ours(NGram(4), [p])[0] for p in prompts] == lookup
    assert ours(DraftModel(runner, 4), prompts) == plain
