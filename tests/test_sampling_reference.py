"""Speculative sampling end to end against the target's exact distribution, position by position.

A tiny model with an 8-token vocabulary makes every marginal computable exactly: the distribution of output
token k is the sum over all k-token prefixes of P(prefix) q(. | prompt + prefix), from transformers' own forward
(softmax of logits / T). Many copies of one prompt are decoded for γ + 2 tokens in one batch: token 0 from the
prefill, tokens 1..γ+1 decided by the first verification (accepted drafts, the correction after a rejection, or
the bonus). Each position's counts are compared with its exact marginal by a chi-square test whose bound is the
chi-square quantile at a false-alarm rate of ALPHA per position (a correct sampler fails one run with
probability at most (γ + 2) · ALPHA = 0.5 %). The same check, run with deliberately wrong samplers, must fail.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chi2
from transformers import LlamaConfig, LlamaForCausalLM

from sdbench.config import SamplingConfig
from sdbench.engine import sampling
from sdbench.engine.loop import generate
from sdbench.engine.sampling import Verdict, sample
from sdbench.models.runner import ModelRunner
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.ngram import NGram
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


def exact_marginals(model, prompt: list[int], positions: int) -> list[torch.Tensor]:
    """[V] distribution of each output token 0..positions-1 under the target (float64)."""
    out, joint, prefixes = [], torch.ones(1, dtype=torch.float64), [()]
    for _ in range(positions):
        ctx = torch.tensor([prompt + list(p) for p in prefixes])
        with torch.no_grad():
            q = (model(ctx).logits[:, -1].double() / TEMPERATURE).softmax(-1)  # [P, V]
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
