import math

import pytest
import torch

from sdbench.config import SamplingConfig
from sdbench.engine.sampling import probs_from_logits, verify_greedy, verify_sampling


def test_greedy_accepts_matching_prefix():
    V = 5
    best = torch.tensor([[1, 2, 3, 4]])  # target argmax at positions 0..3
    logits = torch.nn.functional.one_hot(best, V).float()
    v = verify_greedy(torch.tensor([[1, 2, 0]]), torch.tensor([3]), logits)
    assert v.accepted.tolist() == [2] and v.next_token.tolist() == [3]
    v = verify_greedy(torch.tensor([[1, 2, 3]]), torch.tensor([3]), logits)
    assert v.accepted.tolist() == [3] and v.next_token.tolist() == [4]  # bonus token
    v = verify_greedy(torch.tensor([[1, 2, 3]]), torch.tensor([1]), logits)  # only one real draft
    assert v.accepted.tolist() == [1] and v.next_token.tolist() == [2]


def test_handcrafted_sampling_cases():
    q = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    p_same = q[:, :1].clone()
    v = verify_sampling(torch.tensor([[1]]), torch.tensor([1]), p_same, q, torch.Generator().manual_seed(0))
    assert v.accepted.tolist() == [1] and v.next_token.tolist() == [2]
    p_wrong = torch.tensor([[[1.0, 0.0, 0.0]]])  # draft puts all mass where the target has none
    v = verify_sampling(torch.tensor([[0]]), torch.tensor([1]), p_wrong, q, torch.Generator().manual_seed(0))
    assert v.accepted.tolist() == [0] and v.next_token.tolist() == [1]


def test_top_p_keeps_nucleus():
    probs = probs_from_logits(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), SamplingConfig(1.0, 0.7))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = probs_from_logits(torch.log(torch.tensor([[0.9, 0.1]])), SamplingConfig(1.0, 0.5))
    assert probs.tolist() == [[1.0, 0.0]]


def _chi_square(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    expected = expected_p * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token the target gives zero probability"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()), int(keep.sum()) - 1


Q0 = torch.tensor([0.30, 0.05, 0.25, 0.0, 0.15, 0.25])
P0 = torch.tensor([0.05, 0.40, 0.10, 0.20, 0.05, 0.20])


def _first_committed(p0, q0, deterministic_draft: bool, n: int = 40000, seed: int = 123, swapped: bool = False):
    """One drafted token per trial (from p0, or the fixed token 1), verified by sdbench against q0: the committed
    first token of each trial [n] (the accepted draft or the replacement), and the verdicts. swapped: sdbench is
    handed q0 as the draft's distribution and p0 as the target's."""
    g = torch.Generator().manual_seed(seed)
    V = len(q0)
    q = torch.stack([q0, torch.full((V,), 1 / V)])[None].expand(n, 2, V)
    if deterministic_draft:
        draft, p = torch.full((n, 1), 1), None
    else:
        p = p0[None, None].expand(n, 1, V)
        draft = torch.multinomial(p0, n, replacement=True, generator=g)[:, None]
    if swapped:
        p, q = q[:, :1], torch.cat([p, q[:, 1:]], 1)
    v = verify_sampling(draft, torch.ones(n, dtype=torch.long), p, q, g)
    return torch.where(v.accepted > 0, draft[:, 0], v.next_token), v


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_committed_tokens_follow_target_distribution(deterministic_draft):
    """Each committed token (first position: accepted draft or replacement) is distributed as q."""
    first, v = _first_committed(P0, Q0, deterministic_draft)
    stat, dof = _chi_square(torch.bincount(first, minlength=6).float(), Q0)
    assert stat < 25.0, f"chi-square {stat:.1f} with {dof} dof"  # p < 0.001 critical value for 4-5 dof is ~18-20.5
    # acceptance rate is sum min(p, q) for a sampled draft, q(x) for a fixed one
    expect = torch.minimum(P0, Q0).sum() if not deterministic_draft else Q0[1]
    assert math.isclose(v.accepted.float().mean().item(), expect.item(), abs_tol=0.01)


def test_chi_square_detects_a_wrong_sampler():
    """The check above can fail: sdbench's sampler handed p and q the wrong way round (the draft's distribution
    as the target's: the anchors disagree on which letter is which) commits tokens the target never gives, and
    the rest far from q."""
    first, _ = _first_committed(P0, Q0, deterministic_draft=False, swapped=True)
    counts = torch.bincount(first, minlength=6).float()
    with pytest.raises(AssertionError, match="sampled a token the target gives zero probability"):
        _chi_square(counts, Q0)
    stat, _ = _chi_square(counts[Q0 > 0], Q0[Q0 > 0] / Q0.sum())
    assert stat > 1000


def test_bonus_and_second_position_distribution():
    """With an always-accepted draft, the bonus token follows q at the next position."""
    g = torch.Generator().manual_seed(9)
    N, V = 30000, 4
    q1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    q = torch.stack([torch.tensor([0.0, 1.0, 0.0, 0.0]), q1])[None].expand(N, 2, V)
    v = verify_sampling(torch.ones(N, 1, dtype=torch.long), torch.ones(N, dtype=torch.long), None, q, g)
    assert v.accepted.eq(1).all()
    stat, _ = _chi_square(torch.bincount(v.next_token, minlength=V).float(), q1)
    assert stat < 20.0


@pytest.mark.parametrize("draft_width", [6, 10])
def test_a_draft_with_another_vocabulary_width_keeps_the_target_distribution(draft_width):
    """Draft and target sharing a tokenizer may pad their vocabulary rows to different widths. One drafted
    token per trial from the draft's own p (its padded rows carry mass when it is wider); the committed first
    token must follow q over the target's 8 rows (chi-square at a 1e-4 false-alarm rate), and a draft of a
    row the target does not have is never accepted."""
    from scipy.stats import chi2

    from sdbench.engine.sampling import verify_sampling

    g = torch.Generator().manual_seed(3)
    q = torch.softmax(torch.randn(8, generator=g) * 1.5, -1)
    p = torch.softmax(torch.randn(draft_width, generator=g) * 1.5, -1)
    n = 20000
    draft = torch.multinomial(p.expand(n, -1), 1, replacement=True, generator=g)  # [n, 1]
    verdict = verify_sampling(draft, torch.ones(n, dtype=torch.long), p.expand(n, 1, -1),
                              q.expand(n, 2, -1).contiguous(), g)
    first = torch.where(verdict.accepted == 1, draft[:, 0], verdict.next_token)
    assert int(first.max()) < 8 and not bool(((draft[:, 0] >= 8) & (verdict.accepted == 1)).any())
    counts = torch.bincount(first, minlength=8).double()
    expected = q.double() * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < chi2.ppf(1 - 1e-4, df=7)
