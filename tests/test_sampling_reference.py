"""Speculative sampling end to end against the target's exact distribution, position by position.

A tiny model with an 8-token vocabulary makes every marginal computable exactly: the distribution of output
token k is the sum over all k-token prefixes of P(prefix) q(. | prompt + prefix), from transformers' own forward
(softmax of logits / T). Many copies of one prompt are decoded for γ + 2 tokens in one batch: token 0 from the
prefill, tokens 1..γ+1 decided by the first verification (accepted drafts, the correction after a rejection, or
the bonus). Each position's counts are compared with its exact marginal by a chi-square test whose bound is the
chi-square quantile at a false-alarm rate of ALPHA per position (a correct sampler fails one run with
probability at most (γ + 2) · ALPHA = 0.5 %). The same check, run with deliberately wrong samplers, must fail.

At a temperature other than 1 and top-p below 1, the target's distribution is the library's own: its forward,
then transformers' TemperatureLogitsWarper and TopPLogitsWarper, as `generate(do_sample=True)` applies them.
Those tests decode six tokens with a lookahead short enough that tokens 4 and 5 are decided by a later
verification than the first, for `draft`, `ngram`, a polybasic chain and MagicDec.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chi2
from transformers import (LlamaConfig, LlamaForCausalLM, LogitsProcessorList, TemperatureLogitsWarper,
                          TopPLogitsWarper)

from sdbench.config import SamplingConfig
from sdbench.engine import sampling
from sdbench.engine.loop import generate
from sdbench.engine.sampling import Verdict, sample
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.magicdec import MagicDec
from sdbench.strategies.ngram import NGram
from sdbench.strategies.polybasic import Polybasic
from tests.references import perturbed

V = 8
GAMMA = 3
N = 3000
ALPHA = 1e-3
TEMPERATURE = 1.0
PROMPT = [1, 5, 2, 6, 1, 5]


def _model(seed: int, layers: int):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.08,
                      max_position_embeddings=64, tie_word_embeddings=False)
    return perturbed(LlamaForCausalLM(cfg).eval(), seed + 100)


@pytest.fixture(scope="module")
def pair():
    return _model(0, 2), _model(1, 1)


def library_probs(model, ctx: torch.Tensor, temperature: float = TEMPERATURE, top_p: float = 1.0) -> torch.Tensor:
    """[P, V] the next token's distribution after each context [P, S]: the library's forward, then its own
    warpers (temperature, then nucleus), as its sampling `generate` applies them; float64."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)])
    with torch.no_grad():
        scores = torch.cat([model(part).logits[:, -1] for part in ctx.split(4096)])
    return warpers(ctx, scores).double().softmax(-1)


def exact_marginals(model, prompt: list[int], positions: int, temperature: float = TEMPERATURE,
                    top_p: float = 1.0) -> list[torch.Tensor]:
    """[V] distribution of each output token 0..positions-1 under the target (float64)."""
    out, joint, prefixes = [], torch.ones(1, dtype=torch.float64), [()]
    for _ in range(positions):
        ctx = torch.tensor([prompt + list(p) for p in prefixes])
        q = library_probs(model, ctx, temperature, top_p)  # [P, V]
        out.append(joint @ q)
        joint = (joint[:, None] * q).flatten()  # prefixes extended by one token, in product order
        prefixes = [p + (t,) for p in prefixes for t in range(V)]
    return out


def chi_square(counts: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, float]:
    """(statistic, bound at ALPHA); bins expected below 5 are pooled into one."""
    expected = expected_p * counts.sum()
    big = expected >= 5
    stat = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
    bins = int(big.sum())
    if (~big).any():
        rest = float(expected[~big].sum())
        stat += (float(counts[~big].sum()) - rest) ** 2 / max(rest, 1e-9)
        bins += 1
    return stat, float(chi2.ppf(1 - ALPHA, bins - 1))


def position_checks(target, proposer, seed: int = 0):
    """[(position, statistic, bound)] for output tokens 0..γ+1, and the BatchResult."""
    cfg = SamplingConfig(TEMPERATURE, 1.0, seed)
    g = torch.Generator().manual_seed(seed)
    out = generate(ModelRunner(target), proposer, [PROMPT] * N, max_new_tokens=GAMMA + 2, sampling=cfg, generator=g)
    tokens = torch.tensor(out.output_ids)  # [N, γ+2]
    checks = []
    for k, exact in enumerate(exact_marginals(target, PROMPT, GAMMA + 2)):
        stat, bound = chi_square(torch.bincount(tokens[:, k], minlength=V).double(), exact)
        checks.append((k, stat, bound))
    return checks, out


@pytest.mark.parametrize("kind", ["draft model", "n-gram"])
def test_every_position_of_the_first_verification_follows_the_target(pair, kind):
    target, draft = pair
    proposer = DraftModel(ModelRunner(draft), GAMMA) if kind == "draft model" else NGram(GAMMA)
    checks, out = position_checks(target, proposer)
    assert all(stat < bound for _, stat, bound in checks), checks
    accepted, drafted = sum(r.accepted for r in out.rows), sum(r.drafted for r in out.rows)
    assert min(accepted, drafted - accepted) > 300  # both acceptance and rejection (the residual) exercised


def _wrong(flip_ratio: bool = False, residual_is_q: bool = False, unnormalised: bool = False):
    """A speculative sampler with one deliberate mistake (everything else as the correct rule)."""

    def verify_sampling(draft, n_draft, p, q, generator):
        B, G = draft.shape
        rows = torch.arange(B)
        q_x = q[:, :G].gather(-1, draft[..., None]).squeeze(-1)
        p_x = torch.ones_like(q_x) if p is None else p.gather(-1, draft[..., None]).squeeze(-1)
        u = torch.rand(B, G, generator=generator)
        ok = ((u * q_x < p_x) if flip_ratio else (u * p_x < q_x)) & (torch.arange(G)[None] < n_draft[:, None])
        accepted = ok.long().cumprod(-1).sum(-1)
        q_next = q[rows, accepted]
        at = accepted.clamp(max=max(G - 1, 0))
        if not G:  # nothing drafted (a lookup that found no match): the bonus token alone
            return Verdict(accepted, sample(q_next, generator))
        p_at = torch.zeros_like(q_next).scatter(-1, draft[rows, at][:, None], 1.0) if p is None else p[rows, at]
        residual = q_next if residual_is_q else (q_next - p_at).clamp(min=0.0)
        if unnormalised:  # drawn by inverse CDF from the unnormalised residual: u beyond its mass lands on the last id
            residual = residual.clone()
            residual[:, -1] += 1.0 - residual.sum(-1)
        dist = torch.where((accepted < n_draft)[:, None], residual, q_next)
        return Verdict(accepted, sample(dist, generator))
    return verify_sampling


@pytest.mark.parametrize("mistake", [dict(flip_ratio=True), dict(residual_is_q=True), dict(unnormalised=True)],
                         ids=["acceptance min(1, p/q)", "residual q instead of max(0, q - p)",
                              "residual not renormalised"])
def test_the_same_check_catches_a_wrong_sampler(pair, monkeypatch, mistake):
    target, draft = pair
    monkeypatch.setattr(sampling, "verify_sampling", _wrong(**mistake))
    checks, _ = position_checks(target, DraftModel(ModelRunner(draft), GAMMA))
    assert checks[0][1] < checks[0][2]  # the prefill's token does not go through the verifier
    assert any(stat > bound for _, stat, bound in checks[1:]), checks


# ---- temperature and top-p through the library's own warpers, over several rounds ----------------------------
WARPED = SamplingConfig(0.7, 0.8)
POSITIONS = 6  # tokens 0..5: every proposer below commits at most 3 tokens a round, so 4 and 5 come later
N_WARPED = 4000


@pytest.fixture(scope="module")
def warped_marginals(pair):
    return exact_marginals(pair[0], PROMPT, POSITIONS, WARPED.temperature, WARPED.top_p)


def warped_checks(target, proposer_for, marginals, seed: int = 1):
    """[(position, statistic, bound)] for tokens 0..5 under WARPED, and the BatchResult. proposer_for(runner)
    builds the proposer around the target's runner (MagicDec drafts with the target itself)."""
    runner = ModelRunner(target)
    g = torch.Generator().manual_seed(seed)
    out = generate(runner, proposer_for(runner), [PROMPT] * N_WARPED, max_new_tokens=POSITIONS, sampling=WARPED,
                   generator=g)
    tokens = torch.tensor(out.output_ids)  # [N, 6]
    checks = []
    for k, exact in enumerate(marginals):
        stat, bound = chi_square(torch.bincount(tokens[:, k], minlength=V).double(), exact)
        checks.append((k, stat, bound))
    return checks, out


PROPOSERS = {  # each drafts at most 2 tokens a round (polybasic: a middle block of 1, plus its bonus)
    "draft": lambda draft: lambda runner: DraftModel(ModelRunner(draft), 2),
    "ngram": lambda draft: lambda runner: NGram(2),
    "polybasic": lambda draft: lambda runner: Polybasic([ModelRunner(draft), "ngram"], 1, "1"),
    "magicdec": lambda draft: lambda runner: MagicDec(runner, 2, kv="streamingllm", budget=3, sink=1),
}


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_every_position_follows_the_library_at_temperature_and_top_p(pair, warped_marginals, name):
    """Sampling at T = 0.7, top-p = 0.8: each of the first six tokens follows the target's exact marginal under
    transformers' own warpers, tokens 4 and 5 decided after the first verification."""
    target, draft = pair
    assert sum(float((m == 0).sum()) for m in warped_marginals) > 0  # the nucleus does drop tokens here
    checks, out = warped_checks(target, PROPOSERS[name](draft), warped_marginals)
    assert all(stat < bound for _, stat, bound in checks), checks
    accepted, drafted = sum(r.accepted for r in out.rows), sum(r.drafted for r in out.rows)
    assert min(accepted, drafted - accepted) > 400  # both acceptance and rejection exercised
    assert sum(r.steps for r in out.rows) >= 2 * N_WARPED  # several rounds per row


@pytest.mark.parametrize("mistake", [dict(flip_ratio=True), dict(residual_is_q=True), dict(unnormalised=True)],
                         ids=["one-hot draft accepted whenever q(x) > 0", "one-hot residual q, x not removed",
                              "one-hot residual not renormalised"])
def test_the_same_check_catches_a_wrong_one_hot_sampler(pair, warped_marginals, monkeypatch, mistake):
    """Prompt lookup's draft is the one-hot p = 1[x]: accepted with probability q(x), its residual q without x.
    A wrong rule for it fails the check the correct one passes above."""
    monkeypatch.setattr(sampling, "verify_sampling", _wrong(**mistake))
    checks, _ = warped_checks(pair[0], PROPOSERS["ngram"](pair[1]), warped_marginals)
    assert checks[0][1] < checks[0][2]
    assert any(stat > bound for _, stat, bound in checks[1:]), checks
