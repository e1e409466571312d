"""Every strategy of sdbench's runner equals plain decoding token for token through the CPU fast path, at float32,
Q8_0 and Q4_0, on a model made to meet near ties (flat logits, and two tokens whose head rows differ by a millionth):
a verification's rows are the bits of their tokens decoded alone (tests/test_width_invariant.py), so a near tie
falls the same way in both. The tests count the near ties they met; on a mutant build whose products sum rows met
together in another order, some strategy departs from plain decoding on the same model."""

from __future__ import annotations

import pytest
import torch

from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate
from sdbench.forward_step import Step
from sdbench.models.forward import cpukernel
from sdbench.models.forward.runner import ModelRunner
from sdbench.models.loading.variants import quantise_blocks
from sdbench.strategies import BuildContext, build_proposer
from sdbench.strategies.autoregressive import Autoregressive
from tests.conftest import VOCAB, skip_unless_ci
from tests.references import tiny_pair
from tests.test_width_invariant import _mutant, one_chain_source

TOKENS = 120
NEAR = 1e-3  # a near tie: the top two logits within this share of the largest one's magnitude
A, B = 7, 8  # the tokens whose head rows differ by a millionth
CHAINS = {  # name -> (drafts, options): strategies whose verification is a chain of tokens
    "draft": ("draft", {}),
    "ngram": ("ngram", {}),
    "magicdec": (None, {"budget": 24}),
    "suffix": (None, {}),
}
TREES = {  # verifications of a tree (lookahead's side branches are one)
    "draft tree": ("draft", {"tree_topk": 2, "tree_nodes": 10}),
    "lookahead": (None, {}),
}


@pytest.fixture(autouse=True)
def products_built():
    if not cpukernel.available():
        skip_unless_ci(f"needs sdbench's CPU products ({cpukernel.why_not()})")


def tie_pair(kind: str):
    """(target runner, draft runner) through the fast path: the target's logits flattened, and head rows A and B a
    millionth apart (in float32; a block copy rounds them to one value, a tie the argmax always breaks alike)."""
    target, draft = tiny_pair("llama")
    with torch.no_grad():
        head = target.lm_head.weight
        head.mul_(0.1)
        head[A] *= 20
        head[B] = head[A] * (1 + 1e-6 * torch.randn(head.shape[1], generator=torch.Generator().manual_seed(9)))
    if kind != "float32":
        target, draft = quantise_blocks(target, kind, copy_first=False), quantise_blocks(draft, "q4_0", False)
    return ModelRunner(target, fast=True), ModelRunner(draft, fast=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    rand = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 14)]
    return rand + [(rand[0] * 3)[:20]]  # repetitive: the lookups find drafts


def _decoded(runner, proposer, prompt) -> list[int]:
    res = generate(runner, proposer, [prompt], max_new_tokens=TOKENS, sampling=SamplingConfig())
    assert res.width_varied == 0  # every target step past the prefill said width-invariant: judged with no tolerance
    return res.output_ids[0]


def _proposer(name: str, runner, draft):
    drafts, options = {**CHAINS, **TREES}[name]
    listed = [draft] if drafts == "draft" else [drafts] if drafts else []
    return build_proposer(name.split()[0], BuildContext(runner, listed, 4, dict(options)))


def near_ties(runner, prompt: list[int], output: list[int]) -> int:
    """The chosen tokens whose top two logits were within NEAR of each other (one forward over the whole text)."""
    ids = torch.tensor([prompt + output[:-1]])
    cache = runner.new_cache(1, ids.shape[1] + 8)
    logits = runner.run(cache, Step(ids, [0]))[0, len(prompt) - 1:]
    runner.release(cache)
    top = logits.topk(2, dim=-1).values
    return int(((top[:, 0] - top[:, 1]) < NEAR * top[:, 0].abs()).sum())


def departures(kind: str, strategies: dict) -> tuple[dict, int]:
    """{strategy: prompts where its output differs from plain decoding's}, and the near ties plain decoding met."""
    runner, draft = tie_pair(kind)
    found, ties = {}, 0
    for prompt in _prompts():
        plain = _decoded(runner, Autoregressive(), prompt)
        assert len(plain) == TOKENS
        ties += near_ties(runner, prompt, plain)
        for name in strategies:
            if _decoded(runner, _proposer(name, runner, draft), prompt) != plain:
                found[name] = found.get(name, 0) + 1
    return found, ties


@pytest.mark.parametrize("kind", ["float32", "q8_0", "q4_0"])
def test_every_chain_strategy_equals_plain_decoding_through_near_ties(kind):
    found, ties = departures(kind, CHAINS)
    assert found == {}
    assert ties >= 10, ties  # the test met near ties, and every strategy took them as plain decoding did


@pytest.mark.parametrize("kind", ["float32", "q8_0"])
def test_tree_verifications_equal_plain_decoding_through_near_ties(kind):
    found, ties = departures(kind, TREES)
    assert found == {} and ties >= 10


def test_a_mutant_whose_rows_sum_otherwise_together_departs(monkeypatch, tmp_path):
    """The same model and strategies on products that sum rows met together in another order (still right to
    float32's rounding): a near tie then falls otherwise in a verification than in plain decoding."""
    _mutant(monkeypatch, tmp_path, one_chain_source())
    found, _ = departures("float32", CHAINS)
    assert found, "no strategy departed from plain decoding on the mutant"


def test_a_step_that_is_not_width_invariant_is_counted(monkeypatch):
    """The count the judge reads (`BatchResult.width_varied`): every step off the fused path counts, the eager
    runner's, a batch whose rows stand at different positions (torch's attention under a mask), the packed oneDNN
    products; the prefill never does."""
    runner, _ = tie_pair("float32")
    prompts = _prompts()
    one = generate(runner, Autoregressive(), prompts[:1], max_new_tokens=8, sampling=SamplingConfig())
    assert one.width_varied == 0 and runner.width_invariant
    two = generate(runner, Autoregressive(), prompts[:2], max_new_tokens=8, sampling=SamplingConfig())
    assert two.width_varied == 7  # the rows' positions differ: every step after the first token
    eager = ModelRunner(runner.model, fast=False)
    assert not eager.width_invariant
    assert generate(eager, Autoregressive(), prompts[:1], max_new_tokens=8, sampling=SamplingConfig()).width_varied == 7
    monkeypatch.setenv("SDBENCH_CPU_FAST", "packed")
    packed = ModelRunner(tiny_pair("llama")[0], fast=True)
    assert not packed.width_invariant
    assert generate(packed, Autoregressive(), prompts[:1], max_new_tokens=8, sampling=SamplingConfig()).width_varied == 7
