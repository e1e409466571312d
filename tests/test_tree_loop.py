"""Token trees through the one decode loop, against transformers itself.

The n-gram drafter's trees (`--strategy ngram --set tree=K`) on a tiny model with an 8-token vocabulary, whose
contexts repeat so that lookups find several continuations: greedy decoding must give exactly the library's
greedy `generate`, on the native and the generic runner, for a batch whose rows verify trees of different
sizes, with branches really used (accepted nodes at depth >= 2, accepted nodes that were not their parent's
first child); with an EOS, and with requests joining a running batch (serving under load). Breaking the tree's path on purpose (the cache not kept to the accepted path, or the nodes
verified under the chain's mask) must change the tokens. Under sampling, every output position must follow
the target's exact marginal (the library's forward, summed over every prefix; test_sampling_reference.py), at
T = 1 and over the grid T in {0.6, 1.3} x top-p in {0.8, 1} (the library's own temperature and top-p warpers),
and the same check must catch nodes verified under the chain's mask, and a tree verifier whose target
distribution ignores the temperature or top-p (at every point of the grid). Runs and caches that cannot verify
trees are refused before anything is decoded.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, LogitsProcessorList, TemperatureLogitsWarper,
                          TopPLogitsWarper)

from sdbench.config import SamplingConfig
from sdbench.drafting.ngram import lookup, lookup_branches, trie
from sdbench.engine import sampling as acceptance
from sdbench.engine import step
from sdbench.engine.loop import generate, serve
from sdbench.engine.metrics import row_metrics
from sdbench.engine.scheduler import Request, Scheduler
from sdbench.engine.state import Proposal
from sdbench.engine.tree import Tree
from sdbench.errors import SdbenchError
from sdbench.kv.cache import DenseKVCache
from sdbench.models.forward import cpufast
from sdbench.models.forward.generic import GenericCache, GenericRunner
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies.ngram import NGram, NGramStrategy
from tests.references import hf_generate, perturbed
from tests.test_families import tiny
from tests.test_sampling_reference import chi_square, exact_marginals

V = 8
NEW = 40
GREEDY = SamplingConfig()


def _small(seed: int = 0):
    """A tiny llama with an 8-token vocabulary (peaked logits: greedy choices far from ties)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                      max_position_embeddings=256, tie_word_embeddings=False)
    return perturbed(LlamaForCausalLM(cfg).eval(), seed + 100)


@pytest.fixture(scope="module")
def small():
    return _small()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in (12, 7, 16)]


class Spy(NGram):
    """The n-gram tree proposer, keeping each round's tree sizes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sizes: list[list[int]] = []

    def propose(self, state):
        proposal = super().propose(state)
        self.sizes.append([len(t) for t in proposal.trees])
        return proposal


# ---- the drafter on plain integer arrays ----------------------------------------------------------------------

def test_branches_are_distinct_continuations_merged_into_one_trie():
    seq = torch.tensor([1, 2, 3, 9, 1, 2, 4, 5, 1, 2, 3, 7, 6, 1, 2]).numpy()
    found = lookup_branches(seq, 3, max_n=3, min_n=1, branches=4)
    # "1 2" matched latest first: 3 7 6, then 4 5 1, then 3 9 1 (shares the 3 with the first)
    assert [f.tolist() for f in found] == [[3, 7, 6], [4, 5, 1], [3, 9, 1]]
    assert found[0].tolist() == lookup(seq, 3, 3, 1).tolist()  # the first branch is the chain's draft
    tree, tokens = trie(found)
    assert tree.parents == (-1, 0, 1, -1, 3, 4, 0, 6) and tokens == [3, 7, 6, 4, 5, 1, 9, 1]
    assert [len(b) for b in lookup_branches(seq, 3, 3, 1, branches=1)] == [3]
    # a continuation found again (here by two matches of "5") adds nothing: not a branch
    assert [f.tolist() for f in lookup_branches(torch.tensor([5, 6, 7, 5, 6, 7, 5]).numpy(), 2, 2, 1, 3)] == [[6, 7]]


def test_fit_keeps_the_nodes_within_each_rows_depth():
    tree = Tree((-1, 0, 1, -1, 3, 0))  # depths 1 2 3 1 2 2
    probs = torch.arange(2 * 6 * 3, dtype=torch.float).view(2, 6, 3)
    p = Proposal(torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 0, 0, 0, 0]]), torch.tensor([6, 2]), probs,
                 (tree, Tree((-1, 0))))
    cut = p.fit([2, 5])
    assert cut.trees == (Tree((-1, 0, -1, 2, 0)), Tree((-1, 0)))
    assert cut.tokens[0].tolist() == [10, 11, 13, 14, 15] and cut.tokens[1, :2].tolist() == [20, 21]
    assert cut.lengths.tolist() == [5, 2]
    assert torch.equal(cut.probs[0], probs[0, [0, 1, 3, 4, 5]])
    assert p.fit([3, 3]) is p  # nothing beyond the limits


# ---- greedy: the library's own generate ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["native", "generic"])
def test_greedy_trees_give_the_librarys_greedy_tokens(small, kind):
    prompts = _prompts()
    ref = [hf_generate(small, p, NEW) for p in prompts]
    runner = ModelRunner(small) if kind == "native" else GenericRunner(small)
    spy = Spy(4, tree=4)
    out = generate(runner, spy, prompts, max_new_tokens=NEW, sampling=GREEDY)
    assert out.output_ids == ref
    rows = out.rows
    assert sum(sum(r.accepted_per_position[1:]) for r in rows) > 0  # accepted at depth >= 2
    assert sum(r.sibling_accepts for r in rows) > 0  # a branch other than the first won
    assert any(len({n for n in sizes if n}) > 1 for sizes in spy.sizes)  # rows with different trees, one forward
    for b, r in enumerate(rows):  # counted by the definitions: nodes drafted, one accepted per depth
        assert r.tree_steps == r.steps and r.tree_nodes == r.drafted
        assert r.accepted == sum(r.accepted_per_position) and len(r.drafted_per_position) <= 4
        m = row_metrics(out, b)  # the tree counters reach the result row's columns, not the strategy's stats
        assert (m.tree_steps, m.tree_nodes, m.sibling_accepts, m.verified_width) == \
               (r.tree_steps, r.tree_nodes, r.sibling_accepts, r.verified_width)
        assert m.tried_per_depth_rank == r.tried_per_depth_rank and out.extras[b] == {}
        tried, accepted = r.tried_per_depth_rank, r.accepted_per_depth_rank
        assert tried[0][0] == r.drafted_per_position[0]  # every round that drafted tried the root's first child
        assert sum(accepted[0][1:]) > 0  # and some accepted a later one
        # every committed node was accepted at its depth (the budget never cuts a path here: 40 new tokens, 4 deep)
        assert [sum(a) for a in accepted] == r.accepted_per_position + [0] * (len(accepted) - len(r.accepted_per_position))
        assert r.verified_width >= r.tree_nodes + r.steps  # per step the root, the nodes and any padding
    assert out.new_tokens == sum(len(o) for o in ref)


def test_an_eos_on_an_accepted_path_ends_the_row_as_the_library_does(small):
    prompts = _prompts()
    ref = [hf_generate(small, p, NEW) for p in prompts]
    eos = ref[0][NEW // 2]  # met midway by the first row, anywhere by the others
    stopped = [hf_generate(small, p, NEW, (eos,)) for p in prompts]
    out = generate(ModelRunner(small), NGram(4, tree=4), prompts, max_new_tokens=NEW, sampling=GREEDY,
                   eos_ids=(eos,))
    assert out.output_ids == stopped and len(stopped[0]) < NEW


def test_requests_joining_a_running_batch_keep_their_own_trees(small):
    """Serving under load: rows restart mid-run in slots whose caches earlier trees moved (the same rounds)."""
    prompts = _prompts() + [p[::-1] for p in _prompts()]
    budgets = [9, 20, 6, 14, 11, 7]
    requests = [Request(i, p, 0.0, m) for i, (p, m) in enumerate(zip(prompts, budgets))]
    done = serve(ModelRunner(small), NGram(3, tree=3), Scheduler(requests, 2), sampling=GREEDY)
    assert [r.output_ids for r in done.requests] == [hf_generate(small, p, m) for p, m in zip(prompts, budgets)]
    assert sum(r.stats.sibling_accepts for r in done.requests) > 0


def test_a_one_branch_tree_is_the_chain(small):
    prompts = _prompts()
    chain = generate(ModelRunner(small), NGram(4), prompts, max_new_tokens=NEW, sampling=GREEDY)
    tree = generate(ModelRunner(small), NGram(4, tree=1), prompts, max_new_tokens=NEW, sampling=GREEDY)
    assert_tree_decodes_as_the_chain(chain, tree)


def assert_tree_decodes_as_the_chain(chain, tree) -> None:
    """A one-branch tree's decoding is the chain's: the same tokens and counts, every round a tree of one path."""
    assert tree.output_ids == chain.output_ids
    for c, t in zip(chain.rows, tree.rows):
        assert (t.steps, t.drafted, t.accepted, t.accepted_per_position) == \
               (c.steps, c.drafted, c.accepted, c.accepted_per_position)
        assert t.sibling_accepts == 0 and t.tree_steps == t.steps and c.tree_steps == 0
        # a chain counts its tries by `chain_tries`, a tree by walking it: the same tables
        assert (t.tried_per_depth_rank, t.accepted_per_depth_rank, t.verified_width) == \
               (c.tried_per_depth_rank, c.accepted_per_depth_rank, c.verified_width)
        assert all(len(row) == 1 for row in c.tried_per_depth_rank)  # rank 0 only
    assert chain.extras == [{}] * len(chain.rows)


def _no_keep_path(monkeypatch):
    monkeypatch.setattr(DenseKVCache, "keep_path", lambda self, b, start, nodes: None)
    monkeypatch.setattr(GenericCache, "keep_path", lambda self, b, start, nodes: None)


def _chain_mask(monkeypatch, runner_cls):
    """The nodes verified in one forward as if they were a chain (no tree mask, consecutive positions)."""
    run = runner_cls.run

    def chained(self, cache, step):
        return run(self, cache, replace(step, tree=None))

    monkeypatch.setattr(runner_cls, "run", chained)


BROKEN = {"no-keep-path": lambda mp: _no_keep_path(mp),
          "chain-mask": lambda mp: _chain_mask(mp, ModelRunner)}


@pytest.mark.parametrize("mistake", list(BROKEN))
def test_greedy_catches_a_broken_tree_path(small, monkeypatch, mistake):
    prompts = _prompts()
    ref = [hf_generate(small, p, NEW) for p in prompts]
    BROKEN[mistake](monkeypatch)
    out = generate(ModelRunner(small), NGram(4, tree=4), prompts, max_new_tokens=NEW, sampling=GREEDY)
    assert out.output_ids != ref


# ---- sampling: the target's exact marginals ------------------------------------------------------------------

S_PROMPT = [1, 5, 2, 6, 1, 5, 3, 1, 2, 5, 6, 2, 1]  # each token followed by several others: branches at once
S_NEW = 6
S_N = 3000


# (temperature, top-p) away from T = 1, top-p = 1, where a verifier that took the target's plain softmax would
# pass: the full grid for the n-gram tree below; each other tree drafter's tests take POINTS (both settings
# away from 1, and the temperature alone), one or both
GRID = [(t, p) for t in (0.6, 1.3) for p in (0.8, 1.0)]
POINTS = [(0.6, 0.8), (1.3, 1.0)]
_PREFIX_LOGITS: dict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def _prefix_logits(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per output position k, (every context S_PROMPT + a k-token prefix [V^k, S], the library's next-token
    logits after each [V^k, V]), in exact_marginals' product order; computed once per set of weights."""
    with cpufast.plain(model), torch.no_grad():  # the library's own weights and forward, whatever a runner packed
        key = hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in model.state_dict().values()))
        if key.digest() not in _PREFIX_LOGITS:
            levels, prefixes = [], [()]
            for _ in range(S_NEW):
                ctx = torch.tensor([S_PROMPT + list(p) for p in prefixes])
                levels.append((ctx, torch.cat([model(part).logits[:, -1] for part in ctx.split(4096)])))
                prefixes = [p + (t,) for p in prefixes for t in range(V)]
            _PREFIX_LOGITS[key.digest()] = levels
    return _PREFIX_LOGITS[key.digest()]


def target_marginals(model, temperature: float = 1.0, top_p: float = 1.0) -> list[torch.Tensor]:
    """exact_marginals(model, S_PROMPT, S_NEW, temperature, top_p) (test_sampling_reference.py): [V] per output
    position, the sum over every prefix of P(prefix) q(. | prompt + prefix), q the library's forward then its own
    temperature and top-p warpers; the forwards shared by every setting (a grid costs one set of them)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)])
    out, joint = [], torch.ones(1, dtype=torch.float64)
    for ctx, scores in _prefix_logits(model):
        q = warpers(ctx, scores.clone()).double().softmax(-1)  # [V^k, V]
        out.append(joint @ q)
        joint = (joint[:, None] * q).flatten()
    return out


def sampling_model():
    """A tiny model for sampling, its distributions flat enough that many siblings are accepted."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3,
                      max_position_embeddings=64, tie_word_embeddings=False)
    return perturbed(LlamaForCausalLM(cfg).eval(), 100)


@pytest.fixture(scope="module")
def sampled():
    """sampling_model(), and the exact marginals of its first S_NEW output tokens after S_PROMPT (T = 1)."""
    model = sampling_model()
    return model, target_marginals(model)


def sampled_checks(target, proposer, marginals, seed: int = 0, point: tuple[float, float] = (1.0, 1.0)):
    """S_N continuations of S_PROMPT, S_NEW tokens each, sampled through the one loop with `proposer` at
    point = (temperature, top-p): per position k, (k, chi-square of its token counts against the exact
    marginal, the bound), and the result."""
    cfg = SamplingConfig(*point, seed)
    out = generate(target, proposer, [S_PROMPT] * S_N, max_new_tokens=S_NEW, sampling=cfg,
                   generator=torch.Generator().manual_seed(seed))
    tokens = torch.tensor(out.output_ids)  # [N, S_NEW]
    checks = [(k, *chi_square(torch.bincount(tokens[:, k], minlength=V).double(), exact))
              for k, exact in enumerate(marginals)]
    return checks, out


def assert_target_marginals_through_branches(checks, out) -> None:
    """Every position follows the target's marginal, and the trees' branches were really used to get there."""
    assert all(stat < bound for _, stat, bound in checks), checks
    assert sum(r.sibling_accepts for r in out.rows) > S_N // 10  # second (or later) siblings accepted
    assert sum(sum(r.accepted_per_position[1:]) for r in out.rows) > 0  # and nodes below the first level


def _sampled_checks(model, marginals, seed: int = 0):
    return sampled_checks(ModelRunner(model), NGram(2, tree=4), marginals, seed)


def test_sampled_trees_follow_the_targets_marginals(sampled):
    assert_target_marginals_through_branches(*_sampled_checks(*sampled))


def test_the_same_check_catches_nodes_verified_without_the_tree_mask(sampled, monkeypatch):
    """(A cache not kept to the accepted path misplaces a token two or more back, which this tiny model's
    marginals hardly feel: greedy decoding catches that one, test_greedy_catches_a_broken_tree_path.)"""
    _chain_mask(monkeypatch, ModelRunner)
    checks, _ = _sampled_checks(*sampled)
    assert any(stat > bound for _, stat, bound in checks), checks


def warped_checks(target, proposer, model, point: tuple[float, float], seed: int = 0):
    """sampled_checks at point = (temperature, top-p), against the exact marginals there of `model` (the target's
    weights)."""
    return sampled_checks(target, proposer, target_marginals(model, *point), seed, point)


def test_the_marginals_are_the_librarys_at_every_setting(sampled):
    """The shared forwards give exact_marginals' own figures (checked over the first three positions, where
    exact_marginals is cheap), and the grid's settings really move them: top-p 0.8 drops tokens, and the
    temperature moves the marginals off the plain softmax's."""
    model, plain = sampled
    for t, p in GRID + [(1.0, 1.0)]:
        warped = target_marginals(model, t, p)
        with cpufast.plain(model):  # the library's own forward, whatever an earlier test's runner packed
            exact = exact_marginals(model, S_PROMPT, 3, t, p)
        for got, want in zip(warped, exact):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        assert all(float(m.sum()) == pytest.approx(1.0) for m in warped)
        assert sum(int((m == 0).sum()) for m in warped) > 0 if p < 1 else all((m > 0).all() for m in warped)
        if t != 1.0:
            assert max(float((w - m).abs().max()) for w, m in zip(warped, plain)) > 0.03


@pytest.mark.parametrize("point", GRID, ids=[f"T={t},top_p={p}" for t, p in GRID])
def test_sampled_trees_follow_the_targets_marginals_at_temperature_and_top_p(sampled, point):
    model, _ = sampled
    assert_target_marginals_through_branches(*warped_checks(ModelRunner(model), NGram(2, tree=4), model, point))


def tree_target_ignoring(monkeypatch, temperature: bool = True, top_p: bool = True) -> None:
    """The tree verifier (step.verify_tree, what every tree proposal goes through) with the target's q taken at
    T = 1 and/or top-p = 1 whatever the run's settings: temperature and top_p both True, the plain softmax of
    the logits. The first token (the prefill's) and chain rounds are left right."""

    def verify_tree(trees, draft, draft_probs, target_logits, cfg, generator):
        wrong = replace(cfg, temperature=1.0 if temperature else cfg.temperature, top_p=1.0 if top_p else cfg.top_p)
        return acceptance.verify_tree(trees, draft, draft_probs, target_logits, wrong, generator)

    monkeypatch.setattr(step, "verify_tree", verify_tree)


# per point of the grid, a verifier that drops its settings: at (1.3, 0.8) the flatter temperature and the
# nucleus pull against each other and the plain softmax lands near the target (the chi-square's bound exceeded
# by 2x at most), so top-p alone is dropped there; at (0.6, 0.8) the temperature alone too
IGNORED = {"plain softmax at T=0.6,top_p=0.8": ({}, (0.6, 0.8)),
           "temperature ignored at T=0.6,top_p=0.8": ({"top_p": False}, (0.6, 0.8)),
           "plain softmax at T=0.6,top_p=1": ({}, (0.6, 1.0)),
           "plain softmax at T=1.3,top_p=1": ({}, (1.3, 1.0)),
           "top-p ignored at T=1.3,top_p=0.8": ({"temperature": False}, (1.3, 0.8))}


@pytest.mark.parametrize("ignoring, point", list(IGNORED.values()), ids=list(IGNORED))
def test_the_same_check_catches_a_tree_verifier_that_ignores_the_settings(sampled, monkeypatch, ignoring, point):
    """At each point of the grid a target distribution without the run's temperature or top-p is told apart
    from the target's, after the first token (the prefill's, which is right)."""
    model, _ = sampled
    tree_target_ignoring(monkeypatch, **ignoring)
    checks, out = warped_checks(ModelRunner(model), NGram(2, tree=4), model, point)
    assert sum(r.tree_steps for r in out.rows) > S_N  # the mistake's path was taken
    assert checks[0][1] < checks[0][2]  # the prefill's token does not go through the verifier
    assert any(stat > bound for _, stat, bound in checks[1:]), checks


# ---- refusals, before anything runs -------------------------------------------------------------------------

def test_runs_that_cannot_verify_trees_are_refused_before_they_start(small, monkeypatch):
    calls = []
    static = ModelRunner(small, static=True)
    monkeypatch.setattr(static, "prefill", lambda *a, **k: calls.append(1))
    with pytest.raises(SdbenchError, match="a node budget above what a CUDA graph was captured for"):
        generate(static, NGram(33, tree=2), _prompts(), max_new_tokens=40, sampling=GREEDY)  # 66 nodes, 67 with
        # the root
    assert calls == []  # refused before the prefill
    chain = generate(ModelRunner(small, static=True), NGram(2), _prompts(), max_new_tokens=4, sampling=GREEDY)
    assert chain.output_ids == [hf_generate(small, p, 4) for p in _prompts()]  # the chain still runs there


def test_the_generic_runner_refuses_models_it_cannot_place_before_they_start(monkeypatch):
    generic = GenericRunner(tiny("gemma2", sliding_window=6))
    monkeypatch.setattr(generic, "prefill", lambda *a, **k: pytest.fail("prefilled before the refusal"))
    with pytest.raises(SdbenchError, match="sliding windows"):
        generate(generic, NGram(2, tree=2), [[1, 2, 3]], max_new_tokens=4, sampling=GREEDY)


def test_the_option_is_declared_and_checked():
    option = {o.name: o for o in NGramStrategy.options}["tree"]
    assert option.default == 0 and option.help
    assert NGramStrategy.settings({"tree": "3"}) == {"max_ngram": 3, "min_ngram": 1, "tree": 3}  # --set tree=3
    with pytest.raises(SdbenchError, match="tree=K"):
        NGramStrategy.validate(3, {"max_ngram": 3, "min_ngram": 1, "tree": -1}, (), GREEDY)
    assert NGram(3).params() == {"gamma": 3, "max_ngram": 3, "min_ngram": 1}
    assert NGram(3, tree=4).params()["tree"] == 4 and NGram(3, tree=4).max_lookahead == 12
