"""Trained heads grow token trees (`--strategy eagle|medusa --set tree_topk=K` or `tree_shape=...`).

Every node of every tree drafted in a real generation is checked against the hand references of
tests/head_references.py (the papers' equations over the whole committed sequence, no cache): a node's children
are the head's likeliest tokens at that node, which for EAGLE is the head's chain drafted along the node's path
(its own output fed back), for Medusa head d's ranking at depth d. Rounds after branches other than the first
were accepted check that the loop hands the head the target's states of the accepted path, in order, and that
the head's tree slots never count as its context; the same check fails with the states taken in node order, and
with nodes that see their cousins. Greedy decoding gives transformers' own `generate` (native and generic
runners); `tree_topk=1` is the chain in tokens and counts; under sampling every output position follows the
target's exact marginal through accepted branches, at T = 1 and away from it (T = 0.6, top-p = 0.8 or T = 1.3).
The loop's handoff itself is checked against transformers' hidden states for an n-gram tree proposer that reads
them. Bad settings are refused in one line.

EAGLE-2's dynamic tree over a head (`tree_dynamic=true`): every row's tree in every round of a real generation
must be the one a plain Python rendering of EAGLE-2 (tests/test_tree_dynamic.py `reference`) keeps when scored
by the hand reference's log-probabilities along each path (Medusa's: head d's at depth d), rows with shapes of
their own in one round and shapes changing between rounds; the same check fails with nodes that see their
cousins, and with Medusa's first head scoring every depth. Greedy decoding gives transformers' `generate`
(native and generic runners) with second siblings accepted; under sampling every output position follows the
target's marginal.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from sdbench.config import SamplingConfig
from sdbench.drafting.heads import MedusaDrafter
from sdbench.drafting.dynamic import DynamicTree
from sdbench.engine import loop
from sdbench.engine.hidden import FINAL, eagle3_layers
from sdbench.engine.loop import generate
from sdbench.engine.tree import Tree
from sdbench.errors import SdbenchError
from sdbench.kv.cache import additive
from sdbench.models.forward.generic import GenericRunner
from sdbench.models.heads.eagle import TreeLevel
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies import BuildContext, build_proposer
from sdbench.strategies.eagle import EagleStrategy
from sdbench.strategies.medusa import MedusaStrategy
from sdbench.strategies.ngram import NGram
from tests import head_references as ref
from tests.heads import eagle1_dir, eagle3_dir, medusa_dir, one_thread, small_vocab_target  # noqa: F401
from tests.references import hf_generate
from tests.test_tree_dynamic import reference as eagle2, token_paths
from tests.test_tree_loop import (POINTS, _prompts, _small, assert_target_marginals_through_branches,  # noqa: F401
                                  assert_tree_decodes_as_the_chain, sampled, sampled_checks, warped_checks)

pytestmark = pytest.mark.usefixtures("one_thread")

GAMMA = 3
NEW = 20
PROMPTS = [[5, 6, 7, 1, 2, 4, 3], [1, 2, 3], [3, 3, 1, 0, 7, 7, 7, 1, 2, 6, 4]]
GREEDY = SamplingConfig()
SHAPE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]"  # three levels, uneven branching
KINDS = ["eagle3", "eagle1", "medusa"]


def _cfg(folder) -> dict:
    import json

    cfg = json.loads((folder / "config.json").read_text())
    return cfg.get("transformer_layer_config", cfg)


def _head(kind: str, folder, target):
    """(strategy, head folder, reference: (committed tokens, path tokens, depth) -> the head's logits [V])."""
    if kind == "eagle3":
        folder = eagle3_dir(folder, target, draft_vocab=6, seed=1)
        w, cfg = load_file(str(folder / "model.safetensors")), _cfg(folder)
        layers = eagle3_layers(target.config.num_hidden_layers)
        return "eagle", folder, lambda ctx, path, d: ref.eagle3_logits(target, w, cfg, ctx, path, layers)
    if kind == "eagle1":
        folder = eagle1_dir(folder, target)
        w, cfg = torch.load(folder / "pytorch_model.bin", weights_only=True), _cfg(folder)
        return "eagle", folder, lambda ctx, path, d: ref.eagle1_logits(target, w, cfg, ctx, path)
    folder = medusa_dir(folder, target, heads=GAMMA, layers=2)
    w = load_file(str(folder / "medusa_lm_head.safetensors"))
    return "medusa", folder, lambda ctx, path, d: ref.medusa_logits(target, w, 2, ctx, d)


def _proposer(runner, strategy: str, folder, gamma: int = GAMMA, **tree):
    options = {"head": str(folder), **{k: str(v) for k, v in tree.items()}}
    return build_proposer(strategy, BuildContext(runner, [], gamma, options))


def _run(runner, proposer):
    """(output, [(committed tokens, tree, its tokens)] of every row of every round that drafted a tree)."""
    rounds, propose = [], proposer.propose

    def spy(state):
        p = propose(state)
        for b in range(state.batch):
            if int(p.lengths[b]) and p.trees is not None:
                rounds.append((state.row(b).tolist(), p.trees[b], p.tokens[b, : len(p.trees[b])].tolist()))
        return p

    proposer.propose = spy
    return generate(runner, proposer, PROMPTS, max_new_tokens=NEW, sampling=GREEDY), rounds


def _wrong_nodes(rounds, reference) -> int:
    """Nodes (the root included) whose children are not the reference's likeliest tokens, by rank."""
    wrong = 0
    for ctx, tree, tokens in rounds:
        for node in (-1, *range(len(tree))):
            kids = tree.children_of(node)
            if kids:
                path = [tokens[i] for i in tree.path_to(node)] if node >= 0 else []
                top = reference(ctx, path, len(path)).topk(len(kids)).indices.tolist()
                wrong += top != [tokens[c] for c in kids]
    return wrong


@pytest.fixture(scope="module")
def target():
    return small_vocab_target("llama")


# ---- each node against the hand reference, greedy decoding against the library -----------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_each_node_is_the_heads_ranked_token_along_its_path(tmp_path, target, kind):
    strategy, folder, reference = _head(kind, tmp_path / kind, target)
    out, rounds = _run(ModelRunner(target), _proposer(ModelRunner(target), strategy, folder, tree_shape=SHAPE))
    assert out.output_ids == [hf_generate(target, p, NEW) for p in PROMPTS]  # lossless
    assert len(rounds) > 3 * len(PROMPTS) and 8 in {len(t) for _, t, _ in rounds}
    assert sum(r.sibling_accepts for r in out.rows) > 0  # branches won: later rounds start after them
    assert _wrong_nodes(rounds, reference) == 0


def _states_in_node_order(states, rnd):
    return states


def _nodes_see_cousins(self, dtype, window=None):
    """Every node sees the whole tree's slots, not only its ancestors'."""
    allowed = self.allowed | (torch.arange(self.kv_len)[None, None] >= torch.tensor(self.start)[:, None, None])
    return additive(allowed[:, None], dtype)


@pytest.mark.parametrize("mistake", ["states in node order", "nodes see their cousins"])
def test_the_check_catches_a_broken_head_tree(tmp_path, target, monkeypatch, mistake):
    if mistake == "states in node order":
        monkeypatch.setattr(loop, "_path_states", _states_in_node_order)
    else:
        monkeypatch.setattr(TreeLevel, "causal_mask", _nodes_see_cousins)
    strategy, folder, reference = _head("eagle3", tmp_path / "eagle3", target)
    _, rounds = _run(ModelRunner(target), _proposer(ModelRunner(target), strategy, folder, tree_shape=SHAPE))
    assert _wrong_nodes(rounds, reference) > 0


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_the_generic_runner_verifies_head_trees_losslessly(tmp_path, target, kind):
    strategy, folder, _ = _head(kind, tmp_path / kind, target)
    runner = GenericRunner(target)
    out, _ = _run(runner, _proposer(runner, strategy, folder, tree_topk=2))
    assert out.output_ids == [hf_generate(target, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("kind", KINDS)
def test_topk_one_is_the_chain(tmp_path, target, kind):
    strategy, folder, _ = _head(kind, tmp_path / kind, target)
    chain, _ = _run(ModelRunner(target), _proposer(ModelRunner(target), strategy, folder))
    tree, _ = _run(ModelRunner(target), _proposer(ModelRunner(target), strategy, folder, tree_topk=1))
    assert_tree_decodes_as_the_chain(chain, tree)


# ---- EAGLE-2's dynamic tree over the head ------------------------------------------------------------------------

DYNAMIC = dict(tree_topk=2, tree_nodes=5, tree_dynamic=True)


def _run_dynamic(runner, proposer):
    """(output, per round that drafted, per row that drafted: (committed tokens, depth grown, the row's limit, its
    tree, its tokens)), kept at the drafter (whose limits say how deep the round grew)."""
    rounds, draft = [], proposer.drafter.draft

    def spy(ctx, lengths, limits):
        p = draft(ctx, lengths, limits)
        rows = [(ctx[b, : lengths[b]].tolist(), max(limits), limits[b], tree, p.tokens[b, : len(tree)].tolist())
                for b, tree in enumerate(p.trees or ()) if limits[b]]
        if rows:
            rounds.append(rows)
        return p

    proposer.drafter.draft = spy
    return generate(runner, proposer, PROMPTS, max_new_tokens=NEW, sampling=GREEDY), rounds


def _not_eagle2(rounds, reference) -> int:
    """Trees whose token paths are not those EAGLE-2 keeps when scored by the reference head's log-probabilities
    at temperature 1 (grown as deep as the round's deepest row, then cut to the row's limit)."""
    wrong = 0
    for ctx, depth, limit, tree, tokens in (row for rows in rounds for row in rows):
        def logp_after(path, ctx=ctx):
            return reference(ctx, list(path), len(path)).log_softmax(-1)

        kept = eagle2(logp_after, DYNAMIC["tree_topk"], depth, DYNAMIC["tree_nodes"])
        wrong += token_paths(tree, tokens) != {p for p in kept if len(p) <= limit}
    return wrong


def _shapes(rounds) -> list[set]:
    return [{tree.parents for _, _, _, tree, _ in rows} for rows in rounds]


@pytest.mark.parametrize("kind", KINDS)
def test_dynamic_head_trees_are_what_eagle2_keeps_over_the_heads_scores(tmp_path, target, kind):
    strategy, folder, reference = _head(kind, tmp_path / kind, target)
    proposer = _proposer(ModelRunner(target), strategy, folder, **DYNAMIC)
    assert proposer.tree == DynamicTree(2, GAMMA, 5) and proposer.max_lookahead == 5
    out, rounds = _run_dynamic(ModelRunner(target), proposer)
    assert out.output_ids == [hf_generate(target, p, NEW) for p in PROMPTS]  # lossless
    assert sum(r.sibling_accepts for r in out.rows) > 0  # branches won: later rounds start after them
    assert any(len(shapes) > 1 for shapes in _shapes(rounds))  # rows differ within a round
    assert len(set.union(*_shapes(rounds))) > 2  # and shapes change between rounds
    assert _not_eagle2(rounds, reference) == 0


@pytest.mark.parametrize("mistake", ["nodes see their cousins", "medusa's first head at every depth"])
def test_the_check_catches_a_broken_dynamic_tree(tmp_path, target, monkeypatch, mistake):
    kind = "eagle3"
    if mistake == "nodes see their cousins":
        monkeypatch.setattr(TreeLevel, "causal_mask", _nodes_see_cousins)
    else:
        kind = "medusa"
        monkeypatch.setattr(MedusaDrafter, "_log_probs", lambda self, d, scores=MedusaDrafter._log_probs:
                            scores(self, 0))
    strategy, folder, reference = _head(kind, tmp_path / kind, target)
    _, rounds = _run_dynamic(ModelRunner(target), _proposer(ModelRunner(target), strategy, folder, **DYNAMIC))
    assert _not_eagle2(rounds, reference) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_the_generic_runner_verifies_dynamic_head_trees_losslessly(tmp_path, target, kind):
    strategy, folder, _ = _head(kind, tmp_path / kind, target)
    runner = GenericRunner(target)
    out, rounds = _run_dynamic(runner, _proposer(runner, strategy, folder, **DYNAMIC))
    assert out.output_ids == [hf_generate(target, p, NEW) for p in PROMPTS]
    assert sum(r.sibling_accepts for r in out.rows) > 0 and any(len(s) > 1 for s in _shapes(rounds))


# ---- sampling: the target's exact marginals through the branches ---------------------------------------------

@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("kind", KINDS)
def test_sampled_head_trees_follow_the_targets_marginals(tmp_path, sampled, kind, dynamic):  # noqa: F811
    """Static top-k trees, and dynamic ones scored by the run's sampling distribution; children deterministic
    (p one-hot) in both."""
    model, marginals = sampled
    runner = ModelRunner(model)
    assert_target_marginals_through_branches(*sampled_checks(runner, _sampled_proposer(runner, tmp_path, kind,
                                                                                       dynamic), marginals))


def _sampled_proposer(runner, tmp_path, kind: str, dynamic: bool):
    model = runner.model
    folder = {"eagle3": lambda f: eagle3_dir(f, model, draft_vocab=6, layer_ids=(0, 1, 2)),
              "eagle1": lambda f: eagle1_dir(f, model), "medusa": lambda f: medusa_dir(f, model, heads=2)}[kind]
    return _proposer(runner, "medusa" if kind == "medusa" else "eagle", folder(tmp_path / kind), gamma=2,
                     tree_topk=3, **({"tree_dynamic": True} if dynamic else {}))


# static and dynamic trees each at both points, every kind among them (a dynamic tree scores by the run's warped
# distribution, -inf outside its nucleus)
WARPED = [("eagle3", True, POINTS[0]), ("eagle1", False, POINTS[1]), ("medusa", False, POINTS[0]),
          ("medusa", True, POINTS[1])]


@pytest.mark.parametrize("kind, dynamic, point", WARPED,
                         ids=[f"{k} {'dynamic' if d else 'static'} at T={t},top_p={p}" for k, d, (t, p) in WARPED])
def test_sampled_head_trees_follow_the_targets_marginals_at_temperature_and_top_p(tmp_path, sampled, kind,  # noqa: F811
                                                                                 dynamic, point):
    model, _ = sampled
    runner = ModelRunner(model)
    proposer = _sampled_proposer(runner, tmp_path, kind, dynamic)
    assert_target_marginals_through_branches(*warped_checks(runner, proposer, model, point))


# ---- the loop's handoff: the target's states of the accepted path ---------------------------------------------

class StateSpy(NGram):
    """The n-gram tree proposer, reading the target's states at two layers and keeping every handoff."""

    hidden_layers = (1, FINAL)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def see_target(self, states):
        self.seen.append((states.states.clone(), list(states.start), list(states.count)))


def _handoff_errors(model, out, seen) -> tuple[float, int]:
    """(largest gap between each handed state and the library's state of the committed token at its position,
    states compared)."""
    prompts = _prompts()
    gap, compared = 0.0, 0
    for b, prompt in enumerate(prompts):
        seq = prompt + out.output_ids[b]
        with torch.no_grad():
            hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        expected = torch.cat((hs[1][0], hs[-1][0]), -1)  # [len(seq), 2H] (layer 1's input, the final-norm state)
        for states, start, count in seen:
            for t in range(count[b]):
                gap = max(gap, float((states[b, t] - expected[start[b] + t]).abs().max()))
                compared += 1
    return gap, compared


def test_the_loop_hands_over_the_states_of_the_accepted_path(monkeypatch):
    model = _small()
    spy = StateSpy(4, tree=4)
    out = generate(ModelRunner(model), spy, _prompts(), max_new_tokens=30, sampling=GREEDY)
    assert sum(r.sibling_accepts for r in out.rows) > 0 and sum(sum(r.accepted_per_position[1:]) for r in out.rows)
    gap, compared = _handoff_errors(model, out, spy.seen)
    # every committed token's but the last (a round cut by the budget also hands its last token's)
    assert compared >= sum(len(p) + len(o) - 1 for p, o in zip(_prompts(), out.output_ids)) and gap < 1e-4
    monkeypatch.setattr(loop, "_path_states", _states_in_node_order)
    spy = StateSpy(4, tree=4)
    out = generate(ModelRunner(model), spy, _prompts(), max_new_tokens=30, sampling=GREEDY)
    assert _handoff_errors(model, out, spy.seen)[0] > 1e-2  # the check sees states taken in node order


# ---- settings and refusals -------------------------------------------------------------------------------------

@pytest.mark.parametrize("declared", [EagleStrategy, MedusaStrategy])
def test_the_tree_options_are_declared_and_recorded(tmp_path, target, declared):
    names = {o.name for o in declared.options}
    assert {"tree_topk", "tree_nodes", "tree_shape"} <= names
    assert declared.settings({"head": "h", "tree_topk": "2"})["tree_topk"] == 2
    strategy, folder, _ = _head("eagle1" if declared is EagleStrategy else "medusa", tmp_path / "h", target)
    runner = ModelRunner(target)
    chain = _proposer(runner, strategy, folder)
    assert not chain.proposes_trees and chain.max_lookahead == GAMMA and "tree_topk" not in chain.params()
    tree = _proposer(runner, strategy, folder, tree_topk=2, tree_nodes=5)
    assert tree.proposes_trees and tree.max_lookahead == 5 and tree.tree == Tree.topk_depth(2, GAMMA, 5)
    assert tree.params() == {"gamma": GAMMA, "head": str(folder), "tree_topk": 2, "tree_nodes": 5}
    assert "tree_dynamic" in names and "tree_sample" not in names  # sampled children: the draft model's only
    # EAGLE's expansion's last forward feeds 3 x 2 nodes, more than the 4 it keeps (Medusa's the same bound)
    dynamic = _proposer(runner, strategy, folder, tree_topk=3, tree_nodes=4, tree_dynamic=True)
    assert dynamic.tree == DynamicTree(3, GAMMA, 4) and dynamic.max_lookahead == 6
    assert dynamic.params()["tree_dynamic"] is True


@pytest.mark.parametrize("given, match", [
    (dict(tree_nodes=4), "set tree_topk too"),
    (dict(tree_topk=2, tree_shape="[(0,)]"), "set one"),
    (dict(tree_topk=-1), "at least 0"),
    (dict(tree_shape="[(0,), (0, 0), (0, 0, 0)]"), "deeper than --gamma 2"),
    (dict(tree_shape="oak"), "not a list"),
])
@pytest.mark.parametrize("declared", [EagleStrategy, MedusaStrategy])
def test_impossible_head_trees_are_refused_in_one_line(declared, given, match):
    options = declared.settings({"head": "owner/name", **{k: str(v) for k, v in given.items()}})
    with pytest.raises(SdbenchError, match=match) as caught:
        declared.validate(2, options, (), GREEDY)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("given, match", [
    (dict(tree_dynamic=True), "tree_dynamic expands tree_topk children per node: set tree_topk too"),
    (dict(tree_dynamic=True, tree_shape="[(0,)]"), "tree_dynamic grows a new shape every round, tree_shape is a "
                                                   "static one: set one"),
])
@pytest.mark.parametrize("declared", [EagleStrategy, MedusaStrategy])
def test_impossible_dynamic_head_trees_are_refused_in_one_line(declared, given, match):
    options = declared.settings({"head": "owner/name", **{k: str(v) for k, v in given.items()}})
    with pytest.raises(SdbenchError, match=f"{declared.name}: --set {match}") as caught:
        declared.validate(2, options, (), GREEDY)
    assert "\n" not in str(caught.value)


def test_trees_a_head_cannot_draft_are_refused_when_it_loads(tmp_path, target):
    runner = ModelRunner(target)
    strategy, folder, _ = _head("eagle3", tmp_path / "e3", target)  # a draft vocabulary of 6 tokens
    with pytest.raises(SdbenchError, match="7 children, more than the 6 tokens"):
        _proposer(runner, strategy, folder, gamma=1, tree_topk=7)
    with pytest.raises(SdbenchError, match="7 children, more than the 6 tokens"):
        _proposer(runner, strategy, folder, gamma=2, tree_topk=7, tree_dynamic=True)
    strategy, folder, _ = _head("medusa", tmp_path / "m", target)  # one head per level
    with pytest.raises(SdbenchError, match=f"has {GAMMA} Medusa heads"):
        _proposer(runner, strategy, folder, gamma=GAMMA + 1, tree_topk=2)


def test_a_static_shape_target_verifies_a_heads_tree_and_hands_it_the_paths_states(tmp_path, target):
    strategy, folder, reference = _head("eagle1", tmp_path / "e1", target)
    static = ModelRunner(target, static=True)  # its tree forwards padded to a captured width, states too
    out, rounds = _run(static, _proposer(static, strategy, folder, tree_shape=SHAPE))
    assert out.output_ids == [hf_generate(target, p, NEW) for p in PROMPTS]
    assert sum(r.sibling_accepts for r in out.rows) > 0
    assert _wrong_nodes(rounds, reference) == 0  # the head read the accepted paths' states the static forward kept

