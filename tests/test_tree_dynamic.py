"""EAGLE-2's dynamic tree for the draft model (`--strategy draft --set tree_topk=K tree_dynamic=true [tree_nodes=N]`).

The selection (drafting/dynamic.py) on plain arrays against a brute-force reference: for random log-probability
tables, every depth and budget, the kept token paths must be the ones a plain Python rendering of EAGLE-2's
expansion and reranking keeps; the reranking must keep at most N nodes, every one's parent, and none scored
below a node it dropped, also when many scores tie. The draft model's dynamic trees must be those the reference
keeps when scored by transformers' own uncached forward, in a first round and in a next one whose context runs
over the tree's slots. Through the one loop, greedy decoding must give exactly the library's greedy `generate`,
with rows drafting different shapes in one round and second siblings accepted. (Sampling: test_tree_draft.py.)
"""

from __future__ import annotations

import pytest
import torch

from sdbench.config import SamplingConfig
from sdbench.drafting.dynamic import DynamicTree, Expanded, grow, keep_best
from sdbench.drafting.model import ModelDrafter
from sdbench.engine.loop import generate
from sdbench.engine.state import DecodeState
from sdbench.errors import SdbenchError
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies.draft import DraftModel
from tests.references import hf_generate
from tests.test_tree_draft import _grow, _library, _pair, _prompts, _runner

GREEDY = SamplingConfig()
NEW = 30


def reference(logp_after, k: int, depth: int, nodes: int) -> set[tuple[int, ...]]:
    """EAGLE-2 in plain Python: the token paths of the kept nodes. logp_after(path) -> [V] log-probabilities."""
    def top(path):
        values, tokens = logp_after(path).topk(k)
        return [(float(v), int(t)) for v, t in zip(values, tokens)]

    layer = [(v, (t,)) for v, t in top(())]
    pool = list(layer)
    for _ in range(depth - 1):
        frontier = sorted(layer, key=lambda c: -c[0])[:k]
        layer = [(s + v, path + (t,)) for s, path in frontier for v, t in top(path)]
        pool += layer
    return {path for _, path in sorted(pool, key=lambda c: -c[0])[:nodes]}


def token_paths(tree, tokens: list[int]) -> set[tuple[int, ...]]:
    return {tuple(tokens[j] for j in tree.path_to(i)) for i in range(len(tree))}


def _table(seed: int, vocab: int):
    """A random drafter: log-probabilities after each token path, the same every time the path is asked."""
    def logp_after(path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((seed, vocab) + path) % 2**31)
        return (2 * torch.randn(vocab, generator=g)).log_softmax(-1)
    return logp_after


def _frontier_paths(nodes: Expanded, k: int) -> list[list[tuple[int, ...]]]:
    """Per row, the token paths of the frontier (the last k expanded nodes)."""
    out = []
    for tree, tokens in zip(nodes.trees(), nodes.tokens.tolist()):
        out.append([tuple(tokens[j] for j in tree.path_to(i)) for i in range(len(tree) - k, len(tree))])
    return out


@pytest.mark.parametrize("k, depth", [(1, 3), (2, 1), (2, 3), (3, 2), (3, 4)])
def test_grow_keeps_what_a_plain_rendering_of_eagle2_keeps(k, depth):
    vocab, batch = 6, 3
    tables = [_table(100 * k + 10 * depth + b, vocab) for b in range(batch)]
    expanded_sizes = []

    def expand(nodes: Expanded) -> torch.Tensor:
        expanded_sizes.append(nodes.tokens.shape[1])
        paths = _frontier_paths(nodes, k)
        return torch.stack([torch.stack([table(p) for p in row]) for table, row in zip(tables, paths)])

    spec, shapes_differ = DynamicTree(k, depth, 1), False
    for nodes in range(1, spec.candidates + 2):
        expanded_sizes.clear()
        spec = DynamicTree(k, depth, nodes)
        trees, tokens = grow(spec, torch.stack([t(()) for t in tables]), expand)
        assert expanded_sizes == [k * d for d in range(1, depth)]  # K nodes more per level
        assert [len(t) for t in trees] == [min(nodes, spec.candidates)] * batch == [len(spec)] * batch
        for b, (tree, row) in enumerate(zip(trees, tokens.tolist())):
            assert token_paths(tree, row) == reference(tables[b], k, depth, nodes), (nodes, b)
            assert all(len({row[c] for c in kids}) == len(kids) for kids in tree.children)  # distinct siblings
        shapes_differ |= len({t.parents for t in trees}) > 1
    assert shapes_differ or k == 1 or depth == 1  # the rows' shapes differ (a chain, or one level, cannot)


def test_siblings_come_in_the_drafters_rank_order():
    vocab, k = 7, 3
    table = _table(5, vocab)

    def expand(nodes):
        return torch.stack([torch.stack([table(p) for p in paths]) for paths in _frontier_paths(nodes, k)])

    trees, tokens = grow(DynamicTree(k, 3, 9), table(())[None], expand)
    tree, row = trees[0], tokens[0].tolist()
    for a in range(-1, len(tree)):
        kids = tree.children_of(a)
        path = () if a < 0 else tuple(row[j] for j in tree.path_to(a))
        ranked = table(path).topk(len(kids)).indices.tolist()
        assert [row[c] for c in kids] == ranked  # a prefix of the drafter's ranking, in order


def _random_candidates(seed: int, batch: int, size: int, ties: bool):
    """Random candidate trees (parents first) whose scores never rise along a path; with `ties`, scores drawn
    from a few values, zeros (probability 1) included, so children often tie their parents."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, size), -1, dtype=torch.long)
    score = torch.zeros(batch, size)
    for i in range(size):
        up = torch.randint(-1, i, (batch,), generator=g) if i else parents[:, 0]
        step = (torch.randint(0, 3, (batch,), generator=g).float() * -0.5) if ties else \
            -torch.rand(batch, generator=g)
        above = score.gather(1, up.clamp(min=0)[:, None]).squeeze(1)
        parents[:, i] = up
        score[:, i] = torch.where(up >= 0, above, 0.0) + step
    return parents, score


@pytest.mark.parametrize("ties", [False, True])
def test_keep_best_keeps_at_most_n_ancestor_closed_best_scored_nodes(ties):
    for seed in range(20):
        parents, score = _random_candidates(seed, 4, 12, ties)
        tokens = torch.arange(12).expand(4, 12)  # a candidate's token: its index
        for n in (1, 3, 7, 12, 20):
            trees, kept = keep_best(parents, score, tokens, n)
            for b, (tree, row) in enumerate(zip(trees, kept.tolist())):
                assert len(tree) == len(row) == min(n, 12)
                assert row == sorted(row)
                for i, a in enumerate(tree.parents):  # each kept node's parent is the candidate's parent
                    assert (row[a] if a >= 0 else -1) == int(parents[b, row[i]])
                dropped = [i for i in range(12) if i not in row]
                if dropped:
                    assert float(score[b, row].min()) >= float(score[b, dropped].max())


def test_keep_best_stays_ancestor_closed_when_a_child_outscores_its_parent():
    parents = torch.tensor([[-1, -1, 0, 2]])
    score = torch.tensor([[-3.0, -1.0, -0.5, -0.1]])  # node 3 and 2 above their parent 0: they count as -3
    trees, kept = keep_best(parents, score, torch.tensor([[10, 11, 12, 13]]), 2)
    assert kept.tolist() == [[10, 11]] and trees[0].parents == (-1, -1)
    trees, kept = keep_best(parents, score, torch.tensor([[10, 11, 12, 13]]), 3)
    assert kept.tolist() == [[10, 11, 12]] and trees[0].parents == (-1, -1, 0)


def test_the_settings_are_checked():
    with pytest.raises(SdbenchError, match="at least 1"):
        DynamicTree(0, 3, 4)
    spec = DynamicTree(3, 4, 100)
    assert spec.candidates == 3 + 3 * 9 and len(spec) == 30 and spec.slots == 30
    assert len(DynamicTree(4, 5, 8)) == 8 and DynamicTree(4, 5, 8).slots == 16  # the last call feeds 4 x 4
    assert spec.to_depth(2) == DynamicTree(3, 2, 100) and spec.to_depth(9) == spec


# ---- the draft model: EAGLE-2 scored by the library's own forward -----------------------------------------------

def _library_logp(model, ctx: list[int]):
    def logp_after(path):
        return _library(model, [ctx + list(path)])[0].log_softmax(-1)
    return logp_after


@pytest.mark.parametrize("kind", ["native", "generic"])
def test_the_drafters_dynamic_tree_is_the_one_the_librarys_scores_give(kind):
    _, model = _pair("llama")
    spec = DynamicTree(2, 3, 5)
    prompts = _prompts(model.config.vocab_size)
    state = DecodeState.for_prompts(prompts, 20, 64, sampling=GREEDY)
    drafter = ModelDrafter(_runner(model, kind), tree=spec)
    drafter.begin(state)
    ctx, lengths = state.tokens.clone(), list(state.lengths)
    shapes = set()
    for limits in ([3] * 3, [2, 3, 1], [3] * 3):
        proposal = drafter.draft(ctx, lengths, limits)
        assert proposal.probs is None
        for b, (tree, row) in enumerate(zip(proposal.trees, proposal.tokens.tolist())):
            # grown as deep as the deepest row may go, then cut to this row's depth
            grown = reference(_library_logp(model, ctx[b, : lengths[b]].tolist()), 2, max(limits), 5)
            assert token_paths(tree, row[: len(tree)]) == {p for p in grown if len(p) <= limits[b]}, (limits, b)
            shapes.add(tree.parents)
        # the next context runs over the tree's slots: a node's first child, then a token of its own
        lengths = _grow(ctx, lengths, [[t[0], t[tree.children_of(0)[0]] if tree.children_of(0) else 3, 5]
                                       for t, tree in zip(proposal.tokens.tolist(), proposal.trees)])
    drafter.end()
    assert len(shapes) > 1


# ---- greedy through the one loop: the library's own generate ----------------------------------------------------

class Spy(DraftModel):
    """The draft model's dynamic trees, kept per round."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rounds: list[tuple] = []

    def propose(self, state):
        proposal = super().propose(state)
        self.rounds.append(proposal.trees)
        return proposal


@pytest.mark.parametrize("case", ["llama-native", "llama-generic", "qwen3-native"])
def test_greedy_dynamic_trees_give_the_librarys_greedy_tokens(case):
    family, kind = case.split("-")
    target, draft = _pair(family)
    prompts = _prompts(target.config.vocab_size)
    ref = [hf_generate(target, p, NEW) for p in prompts]
    spy = Spy(_runner(draft, kind), 4, tree_topk=2, tree_nodes=6, tree_dynamic=True)
    assert spy.proposes_trees and spy.max_lookahead == 6 and spy.params()["tree_dynamic"] is True
    out = generate(ModelRunner(target), spy, prompts, max_new_tokens=NEW, sampling=GREEDY)
    assert out.output_ids == ref
    rows = out.rows
    assert sum(r.sibling_accepts for r in rows) > 0
    assert sum(sum(r.accepted_per_position[1:]) for r in rows) > 0
    trees = [t for rnd in spy.rounds for t in rnd]
    assert all(len(t) <= 6 for t in trees)
    assert any(len({t.parents for t in rnd}) > 1 for rnd in spy.rounds)  # rows differ within a round
    assert len({t.parents for t in trees}) > 2  # and shapes change from round to round
