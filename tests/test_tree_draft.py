"""The draft model grows a token tree (`--strategy draft --set tree_topk=K tree_nodes=N`, or `tree_shape=...`;
`tree_dynamic=true`: EAGLE-2's dynamic tree, tested on its own in test_tree_dynamic.py; `tree_sample=true`:
SpecInfer's sampled children).

Against transformers itself: every node's token must be the draft model's own ranked choice after the node's
path (the library's uncached forward), in the first round and in the next one, whose context runs over the
slots the tree wrote.
Through the one loop, greedy decoding must give exactly the library's greedy `generate` for a batch of prompts
of different lengths (llama and qwen3 targets; native and generic runners as drafts, a noisy copy of the target
that disagrees often), with second siblings really accepted; `tree_topk=1` is the chain, token for token and
count for count. Under sampling, every output position must follow the target's exact marginal, and the same
check must fail when the top-k children are verified as if they had been drawn from the draft (p = the draft's
distribution instead of one-hot). So must a dynamic tree's, and a tree whose children are drawn from the draft
(with replacement, verified with the draft's p by the residual rule), each child's p the draft's distribution at
its parent; the same check must fail when a rejected sampled child does not update the residual. (Verifying
sampled children as deterministic ones, p dropped, is no such mistake: accepting a token with q(x) and removing
it from q is lossless for any children chosen without the target, only less often accepted.) Away from T = 1,
top-p = 1 (test_tree_loop.py POINTS, the library's warpers), top-k, dynamic and sampled children's trees follow
the target's marginals there too, a sampled child's p is the draft's warped distribution, and sampled children
verified with the draft's plain softmax as their p fail the check. Impossible
settings are refused in one line, a static-shape draft and sampled children under greedy decoding before the
draft's prefill.
"""

from __future__ import annotations

import copy

import pytest
import torch

from sdbench.config import SamplingConfig
from sdbench.drafting import model as drafting
from sdbench.drafting.dynamic import DynamicTree
from sdbench.drafting.model import ModelDrafter
from sdbench.engine import sampling as acceptance
from sdbench.engine.loop import generate
from sdbench.engine.state import DecodeState, Proposal
from sdbench.engine.tree import Tree, child_picks
from sdbench.errors import SdbenchError
from sdbench.models.forward import cpufast
from sdbench.models.forward.generic import GenericRunner
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies.draft import DraftModel, DraftStrategy
from sdbench.strategies.polybasic import PolybasicStrategy
from tests.references import hf_generate
from tests.test_runner_fidelity import perturbed_model, tiny_config
from tests.test_sampling_reference import library_probs
from tests.test_tree_loop import (POINTS, S_PROMPT, V, _small, assert_target_marginals_through_branches,
                                  assert_tree_decodes_as_the_chain, sampled_checks, sampling_model, target_marginals,
                                  warped_checks)

NEW = 30
GREEDY = SamplingConfig()
SHAPE = Tree.from_vllm("[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]")  # 7 nodes, 3 levels


def _noisy(model, scale: float, seed: int = 7):
    """A copy of the model with every weight moved by N(0, scale^2): a draft that shares the vocabulary and
    agrees with the target often, but not always."""
    g = torch.Generator().manual_seed(seed)
    noisy = copy.deepcopy(model)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return noisy


TARGETS = {
    "llama": lambda: _small(),  # 8 tokens
    "qwen3": lambda: perturbed_model(tiny_config("qwen3", head_dim=16)),  # 96 tokens
}
NOISE = {"llama": 0.12, "qwen3": 0.04}  # enough for the draft to miss often, second choices winning
_made: dict = {}


def _pair(family: str):
    if family not in _made:
        target = TARGETS[family]()
        _made[family] = target, _noisy(target, NOISE[family])
    return _made[family]


def _runner(model, kind: str):
    return ModelRunner(model) if kind == "native" else GenericRunner(model)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (12, 7, 16)]


def _library(model, rows: list[list[int]]) -> torch.Tensor:
    """[len(rows), V] the library's logits after each token list (its uncached forward, one call each)."""
    with cpufast.plain(model), torch.no_grad():
        return torch.stack([model(torch.tensor([r])).logits[0, -1].float() for r in rows])


# ---- the drafter: each node the draft's own ranked token after its path ----------------------------------------

def _wrong_nodes(model, proposal: Proposal, ctx: torch.Tensor, lengths: list[int]) -> int:
    """How many nodes are not the library's rank-r token after ctx + the node's parent path (r: its rank)."""
    wrong = 0
    for b, tree in enumerate(proposal.trees):
        row, tokens = ctx[b, : lengths[b]].tolist(), proposal.tokens[b].tolist()
        parents = [tree.parents[i] for i in range(len(tree))]
        logits = _library(model, [row + [tokens[j] for j in (tree.path_to(a) if a >= 0 else ())] for a in parents])
        for i, r in enumerate(tree.rank):
            wrong += tokens[i] != int(logits[i].topk(r + 1).indices[r])
    return wrong


def _grow(ctx: torch.Tensor, lengths: list[int], new: list[list[int]]) -> list[int]:
    for b, t in enumerate(new):
        ctx[b, lengths[b] : lengths[b] + len(t)] = torch.tensor(t)
    return [n + len(t) for n, t in zip(lengths, new)]


@pytest.mark.parametrize("kind", ["native", "generic"])
def test_each_node_is_the_drafts_ranked_token_after_its_path_round_after_round(kind):
    _, model = _pair("llama")
    prompts = _prompts(V)
    state = DecodeState.for_prompts(prompts, 20, 64, sampling=GREEDY)
    drafter = ModelDrafter(_runner(model, kind), tree=SHAPE)
    drafter.begin(state)
    ctx, lengths = state.tokens.clone(), list(state.lengths)
    first = drafter.draft(ctx, lengths, [3] * 3)
    assert first.trees == (SHAPE,) * 3 and first.probs is None
    assert _wrong_nodes(model, first, ctx, lengths) == 0
    # the next context runs over the tree's slots with their own tokens (node 0, then its siblings 1 and 2),
    # which the cache holds at the wrong positions past node 0: they must be fed again
    lengths = _grow(ctx, lengths, [t[:3] for t in first.tokens.tolist()])
    second = drafter.draft(ctx, lengths, [2, 3, 1])  # each row's tree cut to its limit
    assert [t.max_depth for t in second.trees] == [2, 3, 1]
    assert _wrong_nodes(model, second, ctx, lengths) == 0
    # an accepted path that is not the first nodes (node 0, its second child node 4), then a correction
    lengths = _grow(ctx, lengths, [[t[0], t[4], 5] if tree.max_depth >= 2 else [t[0], 5]
                                   for t, tree in zip(second.tokens.tolist(), second.trees)])
    assert _wrong_nodes(model, drafter.draft(ctx, lengths, [3] * 3), ctx, lengths) == 0
    drafter.end()


# ---- greedy through the one loop: the library's own generate ----------------------------------------------------

CASES = {"llama-native": ("llama", "native"), "llama-generic": ("llama", "generic"),
         "qwen3-native": ("qwen3", "native"), "qwen3-generic": ("qwen3", "generic")}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tree_drafts_give_the_librarys_greedy_tokens(case):
    family, kind = CASES[case]
    target, draft = _pair(family)
    prompts = _prompts(target.config.vocab_size)
    ref = [hf_generate(target, p, NEW) for p in prompts]
    proposer = DraftModel(_runner(draft, kind), 4, tree_topk=3, tree_nodes=10)
    assert proposer.proposes_trees and proposer.max_lookahead == 10
    out = generate(ModelRunner(target), proposer, prompts, max_new_tokens=NEW, sampling=GREEDY)
    assert out.output_ids == ref
    rows = out.rows
    assert sum(r.sibling_accepts for r in rows) > 0  # a second (or third) sibling won: the tree is used
    assert sum(sum(r.accepted_per_position[1:]) for r in rows) > 0  # accepted at depth >= 2
    for r in rows:
        assert r.tree_steps == r.steps and r.tree_nodes == r.drafted


def test_a_static_shape_decodes_as_the_library_does():
    target, draft = _pair("llama")
    prompts = _prompts(V)
    proposer = DraftModel(ModelRunner(draft), 3, tree_shape="[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]")
    out = generate(ModelRunner(target), proposer, prompts, max_new_tokens=NEW, sampling=GREEDY)
    assert out.output_ids == [hf_generate(target, p, NEW) for p in prompts]
    assert sum(r.sibling_accepts for r in out.rows) > 0


def test_topk_one_is_the_chain():
    target, draft = _pair("llama")
    prompts = _prompts(V)
    chain = generate(ModelRunner(target), DraftModel(ModelRunner(draft), 4), prompts, max_new_tokens=NEW,
                     sampling=GREEDY)
    tree = generate(ModelRunner(target), DraftModel(ModelRunner(draft), 4, tree_topk=1), prompts,
                    max_new_tokens=NEW, sampling=GREEDY)
    assert_tree_decodes_as_the_chain(chain, tree)


# ---- sampling: the target's exact marginals --------------------------------------------------------------------

@pytest.fixture(scope="module")
def sampled():
    """The tree-loop tests' flat tiny model, a noisy copy of it as the draft, and the target's exact marginals
    of its first S_NEW output tokens after S_PROMPT."""
    model = sampling_model()
    return model, _noisy(model, 0.12), target_marginals(model)


def _sampled_checks(target, draft, marginals, seed: int = 0, **tree):
    tree = tree or {"tree_topk": 3}
    return sampled_checks(ModelRunner(target), DraftModel(ModelRunner(draft), 2, **tree), marginals, seed)


def test_sampled_tree_drafts_follow_the_targets_marginals(sampled):
    assert_target_marginals_through_branches(*_sampled_checks(*sampled))


def test_the_same_check_catches_top_k_children_verified_as_if_drawn_from_the_draft(sampled, monkeypatch):
    """p = the draft's distribution at the parent for each child: the rule for i.i.d.-sampled children (accept
    with min(1, q/p)) applied to children that were not sampled."""
    made: dict[str, torch.Tensor] = {}
    children, draft = drafting.top_children, ModelDrafter.draft

    def with_p(tokens, shape, logits, nodes):
        children(tokens, shape, logits, nodes)
        if nodes == (-1,):  # a new tree
            made["p"] = torch.zeros(*tokens.shape, logits.shape[-1])
        for m, a in enumerate(nodes):
            made["p"][:, list(shape.children_of(a))] = logits[:, m].softmax(-1)[:, None]

    def proposing_p(self, ctx, lengths, limits):
        k = max(limits, default=0)
        full = draft(self, ctx, lengths, [k] * len(limits))  # uncut, so that p lines up with the nodes
        if k:
            full = Proposal(full.tokens, full.lengths, made["p"][:, : full.tokens.shape[1]], full.trees)
        return full.fit(limits)

    monkeypatch.setattr(drafting, "top_children", with_p)
    monkeypatch.setattr(ModelDrafter, "draft", proposing_p)
    checks, _ = _sampled_checks(*sampled)
    assert any(stat > bound for _, stat, bound in checks), checks


def test_sampled_dynamic_trees_follow_the_targets_marginals(sampled):
    assert_target_marginals_through_branches(*_sampled_checks(*sampled, tree_topk=3, tree_nodes=5,
                                                              tree_dynamic=True))


SAMPLED_CHILDREN = {"tree_topk": 3, "tree_sample": True}


@pytest.mark.parametrize("point", [(1.0, 1.0)] + POINTS, ids=lambda p: f"T={p[0]},top_p={p[1]}")
def test_a_sampled_childs_p_is_the_drafts_distribution_at_its_parent(sampled, point):
    """p: the library's forward of the draft after the node's parent, through the library's own temperature and
    top-p warpers."""
    _, draft = sampled[:2]
    sampling = SamplingConfig(*point, 0)
    state = DecodeState.for_prompts([S_PROMPT] * 2, 8, 64, sampling=sampling,
                                    generator=torch.Generator().manual_seed(0))
    drafter = ModelDrafter(ModelRunner(draft), tree=Tree.topk_depth(3, 2, 6), sample_children=True)
    drafter.begin(state)
    proposal = drafter.draft(state.tokens, state.lengths, [2, 2])
    drafter.end()
    tree = proposal.trees[0]
    for b in range(2):
        tokens = proposal.tokens[b].tolist()
        for i, a in enumerate(tree.parents):
            path = S_PROMPT + [tokens[j] for j in (tree.path_to(a) if a >= 0 else ())]
            with cpufast.plain(draft):
                expected = library_probs(draft, torch.tensor([path]), *point)[0].float()
            assert torch.allclose(proposal.probs[b, i], expected, atol=1e-5)


def test_sampled_children_follow_the_targets_marginals(sampled):
    checks, out = _sampled_checks(*sampled, **SAMPLED_CHILDREN)
    assert_target_marginals_through_branches(checks, out)


def test_the_same_check_catches_sampled_children_without_the_residual_update(sampled, monkeypatch):
    """After a rejected child the next is tried against the same q: SpecInfer's rule without its residual."""
    monkeypatch.setattr(acceptance, "_residual", lambda q, p, x, inside: q)
    checks, _ = _sampled_checks(*sampled, **SAMPLED_CHILDREN)
    assert any(stat > bound for _, stat, bound in checks), checks


# ---- sampling away from T = 1, top-p = 1 -------------------------------------------------------------------------

WARPED_TREES = {"top-k": {"tree_topk": 3}, "dynamic": {"tree_topk": 3, "tree_nodes": 5, "tree_dynamic": True},
                "sampled children": SAMPLED_CHILDREN}
WARPED_CASES = [("top-k", POINTS[1]), ("dynamic", POINTS[0]), ("sampled children", POINTS[0]),
                ("sampled children", POINTS[1])]


@pytest.mark.parametrize("tree, point", WARPED_CASES, ids=[f"{k} at T={t},top_p={p}" for k, (t, p) in WARPED_CASES])
def test_sampled_tree_drafts_follow_the_targets_marginals_at_temperature_and_top_p(sampled, tree, point):
    """The target's q under the run's settings; a dynamic tree scored by the draft's warped distribution (tokens
    outside its nucleus score -inf); sampled children drawn from it, and verified with it as their p."""
    target, draft, _ = sampled
    proposer = DraftModel(ModelRunner(draft), 2, **WARPED_TREES[tree])
    assert_target_marginals_through_branches(*warped_checks(ModelRunner(target), proposer, target, point))


def test_the_same_check_catches_sampled_children_verified_with_the_drafts_plain_softmax(sampled, monkeypatch):
    """Children drawn at the run's temperature and top-p, verified with min(1, q / p) and max(0, q - p) for p the
    draft's plain softmax at their parent: the p they were not drawn from (the same thing at T = 1, top-p = 1)."""
    children = drafting._sampled_children

    def plain_p(tokens, p, shape, logits, nodes, sampling, generator):
        children(tokens, p, shape, logits, nodes, sampling, generator)
        child, m, _ = child_picks(shape, nodes)
        if child:
            p[:, child] = logits.float().softmax(-1)[:, m].to(p.dtype)

    monkeypatch.setattr(drafting, "_sampled_children", plain_p)
    target, draft, _ = sampled
    checks, _ = warped_checks(ModelRunner(target), DraftModel(ModelRunner(draft), 2, **SAMPLED_CHILDREN), target,
                              POINTS[0])
    assert any(stat > bound for _, stat, bound in checks[1:]), checks


# ---- settings and refusals ---------------------------------------------------------------------------------------

def _options(**given) -> dict:
    return DraftStrategy.settings({k: str(v) for k, v in given.items()})


def test_the_options_are_declared_and_the_default_is_the_chain():
    declared = {o.name: o for o in DraftStrategy.options}
    assert all(declared[n].help for n in ("tree_topk", "tree_nodes", "tree_shape", "tree_dynamic", "tree_sample"))
    assert [declared[n].default for n in ("tree_topk", "tree_nodes", "tree_shape", "tree_dynamic", "tree_sample")] \
        == [0, 0, "", False, False]
    assert _options(tree_dynamic="true", tree_sample="no")["tree_dynamic"] is True
    runner = ModelRunner(_pair("llama")[1])
    chain = DraftModel(runner, 4)
    assert chain.tree is None and not chain.proposes_trees and chain.params() == {"gamma": 4}
    assert chain.max_lookahead == 4
    tree = DraftModel(runner, 4, tree_topk=2)
    assert tree.tree == Tree.topk_depth(2, 4, 8) and tree.params() == {"gamma": 4, "tree_topk": 2}
    assert DraftModel(runner, 3, tree_topk=1).tree == Tree.chain(3)
    assert len(DraftModel(runner, 4, tree_topk=3, tree_nodes=5).tree) == 5
    shaped = DraftModel(runner, 2, tree_shape="[(0,), (1,), (0, 0)]")
    assert shaped.tree == Tree((-1, -1, 0)) and shaped.max_lookahead == 3
    DraftStrategy.validate(4, _options(tree_topk=2, tree_nodes=6), ("d",), GREEDY)
    dynamic = DraftModel(runner, 4, tree_topk=3, tree_dynamic=True)
    assert dynamic.tree == DynamicTree(3, 4, 12) and dynamic.proposes_trees and dynamic.max_lookahead == 12
    assert dynamic.params() == {"gamma": 4, "tree_topk": 3, "tree_dynamic": True}
    assert DraftModel(runner, 5, tree_topk=4, tree_nodes=8, tree_dynamic=True).max_lookahead == 16  # 4 x 4 fed
    sampled = DraftModel(runner, 2, tree_topk=2, tree_sample=True)
    assert sampled.tree == Tree.topk_depth(2, 2, 4) and sampled.params()["tree_sample"] is True
    DraftStrategy.validate(2, _options(tree_shape="[(0,), (1,)]", tree_sample=True), ("d",), SamplingConfig(1.0))


@pytest.mark.parametrize("given, match", [
    (dict(tree_nodes=4), "set tree_topk too"),
    (dict(tree_topk=2, tree_shape="[(0,)]"), "set one"),
    (dict(tree_topk=-1), "at least 0"),
    (dict(tree_shape="[(0,), (0, 0), (0, 0, 0)]"), "deeper than --gamma 2"),
    (dict(tree_shape="[(1,)]"), "without a sibling"),
    (dict(tree_shape="oak"), "not a list"),
    (dict(tree_dynamic=True), "set tree_topk too"),
    (dict(tree_dynamic=True, tree_shape="[(0,)]"), "static one: set one"),
    (dict(tree_dynamic=True, tree_topk=2, tree_nodes=-1), "at least 0"),
    (dict(tree_dynamic="maybe"), "expected bool"),
    (dict(tree_sample=True), "set tree_topk or tree_shape too"),
    (dict(tree_sample=True, tree_topk=2, tree_dynamic=True), "no longer draws them from the draft: set one"),
    (dict(tree_sample=True, tree_topk=2), "needs sampling: use --temperature above 0"),
])
def test_impossible_trees_are_refused_in_one_line(given, match):
    with pytest.raises(SdbenchError, match=match) as caught:
        DraftStrategy.validate(2, _options(**given), ("d",), GREEDY)
    assert "\n" not in str(caught.value)


def test_polybasic_takes_no_tree():
    with pytest.raises(SdbenchError, match="'polybasic' grows no token tree .* the strategies that do are draft "):
        PolybasicStrategy.settings({"tree_topk": "2"})


@pytest.mark.parametrize("tree", [dict(tree_topk=8, tree_nodes=65),
                                  dict(tree_topk=8, tree_nodes=65, tree_dynamic=True)])
def test_a_static_shape_draft_beyond_its_widest_graph_is_refused_before_its_prefill(monkeypatch, tree):
    target, draft = _pair("llama")
    static = ModelRunner(draft, static=True)
    monkeypatch.setattr(static, "prefill", lambda *a, **k: pytest.fail("the draft prefilled before the refusal"))
    with pytest.raises(SdbenchError, match="draft model .* a node budget above what a CUDA graph was captured for"):
        generate(ModelRunner(target), DraftModel(static, 8, **tree), _prompts(V), max_new_tokens=4,
                 sampling=GREEDY)


def test_sampled_children_under_greedy_decoding_are_refused_before_the_drafts_prefill(monkeypatch):
    target, draft = _pair("llama")
    runner = ModelRunner(draft)
    monkeypatch.setattr(runner, "prefill", lambda *a, **k: pytest.fail("the draft prefilled before the refusal"))
    with pytest.raises(SdbenchError, match="sampled children need sampling") as caught:
        generate(ModelRunner(target), DraftModel(runner, 2, tree_topk=2, tree_sample=True), _prompts(V),
                 max_new_tokens=4, sampling=GREEDY)
    assert "\n" not in str(caught.value)
