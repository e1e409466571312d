"""Losslessness of the one decode loop: every strategy reproduces plain greedy decoding token for token."""

import pytest
import torch

from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.engine.state import Proposal
from sdbench.strategies.base import Proposer
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.ngram import NGram
from tests.conftest import VOCAB, second_token_chi_square

GREEDY = SamplingConfig()
NEW = 24


class Oracle(Proposer):
    """Proposes the reference continuation, shifted by `offset` (0: always right, 1: always wrong)."""

    name = "oracle"

    def __init__(self, reference, gamma, offset=0):
        super().__init__(gamma)
        self.reference, self.offset = reference, offset

    def propose(self, state):
        tokens = torch.zeros(state.batch, self.gamma, dtype=torch.long)
        for b in range(state.batch):
            done = state.lengths[b] - state.prompt_lengths[b]
            ref = self.reference[b][done : done + self.gamma]
            ref = ref + [0] * (self.gamma - len(ref))
            tokens[b] = (torch.tensor(ref) + self.offset) % VOCAB
        return Proposal(tokens, torch.full((state.batch,), self.gamma))


def reference(target, prompts, eos=()):
    return generate(target, Autoregressive(), prompts, max_new_tokens=NEW, sampling=GREEDY, eos_ids=eos).output_ids


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("gamma", [1, 2, 3, 5, 8])
def test_draft_models_match_greedy(target, small_draft, prompts, batch, gamma):
    ps = prompts[:batch]
    ref = reference(target, ps)
    for draft in (target, small_draft):  # the target itself always agrees; the small random one rarely does
        out = generate(target, DraftModel(draft, gamma), ps, max_new_tokens=NEW, sampling=GREEDY)
        assert out.output_ids == ref
    self_draft = generate(target, DraftModel(target, gamma), ps, max_new_tokens=NEW, sampling=GREEDY)
    assert all(r.accepted == r.drafted for r in self_draft.rows)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_oracle_always_and_never_agree(target, prompts, batch, gamma):
    ps = prompts[:batch]
    ref = reference(target, ps)
    right = generate(target, Oracle(ref, gamma), ps, max_new_tokens=NEW, sampling=GREEDY)
    wrong = generate(target, Oracle(ref, gamma, offset=1), ps, max_new_tokens=NEW, sampling=GREEDY)
    assert right.output_ids == ref and wrong.output_ids == ref
    assert all(r.accepted == 0 and r.steps == NEW - 1 for r in wrong.rows)
    steps = -(-(NEW - 1) // (gamma + 1))  # every step commits gamma + 1 tokens
    assert all(r.steps == steps for r in right.rows)
    assert all(len(o) == NEW for o in right.output_ids)
    assert right.new_tokens == wrong.new_tokens == batch * NEW


@pytest.mark.parametrize("batch", [1, 4])
def test_ngram_matches_greedy(target, prompts, batch):
    # repetitive prompts give the lookup something to find
    ps = [(p * 3)[:20] for p in prompts[:batch]]
    ref = reference(target, ps)
    for gamma in (1, 3, 6):
        out = generate(target, NGram(gamma), ps, max_new_tokens=NEW, sampling=GREEDY)
        assert out.output_ids == ref
    assert sum(r.drafted for r in out.rows) > 0


def test_eos_inside_a_draft(target, small_draft, prompts):
    ref = reference(target, prompts)
    eos = ref[0][9]  # the tenth generated token of row 0 becomes the end-of-sequence token
    stopped = reference(target, prompts, eos=(eos,))
    assert stopped[0] == ref[0][: ref[0].index(eos) + 1]
    for proposer in (Oracle(ref, 6), DraftModel(target, 5), DraftModel(small_draft, 3), NGram(4)):
        out = generate(target, proposer, prompts, max_new_tokens=NEW, sampling=GREEDY, eos_ids=(eos,))
        assert out.output_ids == stopped


def test_counts_are_consistent(target, prompts):
    ref = reference(target, prompts)
    out = generate(target, Oracle(ref, 3), prompts, max_new_tokens=NEW, sampling=GREEDY)
    for row, ids in zip(out.rows, out.output_ids):
        assert row.drafted == 3 * row.steps
        assert row.drafted_per_position == [row.steps] * 3
        assert sum(row.accepted_per_position) == row.accepted
    plain = generate(target, Autoregressive(), prompts, max_new_tokens=NEW, sampling=GREEDY)
    assert all(r.steps == NEW - 1 and r.drafted == 0 for r in plain.rows)


def test_sampling_loop_follows_target_distribution(target, small_draft):
    """End to end under top-p: the second token is distributed as the target's (every position of the first
    verification, and wrong samplers caught, in test_sampling_reference.py)."""
    stat, dof, out = second_token_chi_square(target, DraftModel(small_draft, 3), SamplingConfig(1.0, 0.95))
    from scipy.stats import chi2

    bound = chi2.ppf(1 - 1e-3, dof)  # a correct sampler fails this one time in a thousand
    assert stat < bound, f"chi-square {stat:.1f} with {dof} dof, bound {bound:.1f}"
    assert sum(r.accepted for r in out.rows) > 0 and sum(r.accepted for r in out.rows) < sum(r.drafted for r in out.rows)
