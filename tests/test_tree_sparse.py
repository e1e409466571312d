"""Token trees over sparse KV caches: MagicDec's self-speculation (`--strategy magicdec --set tree_topk=K`) and a
draft model's sparse cache (`--strategy draft --set draft_kv=streamingllm tree_topk=K`).

The sparse-cache draft grows the tree (each node the draft's ranked token after its path, as over a dense cache)
and the target verifies it over its full cache. Greedy decoding must give exactly the library's greedy `generate`,
for one prompt and for a batch of prompts of different lengths, StreamingLLM and SnapKV, with budgets smaller than
the context (the window slides during the run) and second siblings really accepted. After several tree rounds
whose accepted paths are not the tree's first nodes, the sparse cache must hold what a chain fed the same accepted
tokens holds: the same positions in the same slots (static slots, window, floor untouched), the same keys and
values there, the same logits for the next token; and the check must fail when the accepted path is not moved into
place, and when the nodes attend as a chain's tokens would (no tree mask). Under sampling, every output position
must follow the target's exact marginal (chi-square per depth), at T = 1 and away from it (T = 0.6 with top-p 0.8
over StreamingLLM, T = 1.3 with sampled children over SnapKV).
"""

from __future__ import annotations

import pytest
import torch

from sdbench.config import SamplingConfig
from sdbench.drafting.model import ModelDrafter, feed_context
from sdbench.drafting.prefix import CachedPrefix
from sdbench.engine.loop import generate
from sdbench.engine.state import DecodeState
from sdbench.engine.tree import Tree
from sdbench.kv.sparse import SparseKVCache, SparseSpec, compress
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies.draft import DraftModel, DraftStrategy
from sdbench.strategies.magicdec import MagicDec, MagicDecStrategy
from tests.references import hf_generate
from tests.test_tree_draft import _pair, _prompts
from tests.test_tree_loop import (POINTS, V, assert_target_marginals_through_branches, sampled,  # noqa: F401
                                  sampled_checks, warped_checks)

GREEDY = SamplingConfig()
NEW = 24
SHAPE = Tree.from_vllm("[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]")  # 7 nodes, 3 levels


# ---- greedy through the one loop: the library's own generate --------------------------------------------------

@pytest.mark.parametrize("kv", ["streamingllm", "snapkv"])
@pytest.mark.parametrize("rows", [1, 3])
def test_magicdec_trees_give_the_librarys_greedy_tokens(kv, rows):
    target, _ = _pair("llama")
    prompts = _prompts(V)[:rows]
    proposer = MagicDec(ModelRunner(target), 3, kv, budget=6, sink=2, window=3, tree_topk=3, tree_nodes=9)
    assert proposer.proposes_trees and proposer.max_lookahead == 9
    out = generate(ModelRunner(target), proposer, prompts, max_new_tokens=NEW, sampling=GREEDY)
    assert out.output_ids == [hf_generate(target, p, NEW) for p in prompts]
    assert all(r.tree_steps == r.steps for r in out.rows)
    assert sum(r.sibling_accepts for r in out.rows) > 0  # a budget of 6 misses often: second siblings win


@pytest.mark.parametrize("kv", ["streamingllm", "snapkv"])
def test_a_draft_models_sparse_cache_grows_trees_the_library_agrees_with(kv):
    target, draft = _pair("llama")
    prompts = _prompts(V)
    proposer = DraftModel(ModelRunner(draft), 3, kv, budget=8, sink=2, window=4, tree_shape=SHAPE.to_vllm())
    out = generate(ModelRunner(target), proposer, prompts, max_new_tokens=NEW, sampling=GREEDY)
    assert out.output_ids == [hf_generate(target, p, NEW) for p in prompts]
    assert sum(r.sibling_accepts for r in out.rows) > 0
    assert sum(sum(r.accepted_per_position[1:]) for r in out.rows) > 0  # accepted at depth >= 2


def test_the_tree_settings_are_magicdecs_too():
    options = {o.name: o.default for o in MagicDecStrategy.options}
    MagicDecStrategy.validate(3, {**options, "tree_topk": 2, "tree_nodes": 5}, (), GREEDY)
    DraftStrategy.validate(3, {**{o.name: o.default for o in DraftStrategy.options}, "draft_kv": "snapkv",
                               "tree_shape": "[(0,), (1,)]"}, ("d",), GREEDY)
    target, _ = _pair("llama")
    made = MagicDec(ModelRunner(target), 3, "snapkv", 16, window=4, tree_topk=2, tree_nodes=5)
    assert made.params() == {"gamma": 3, "kv": "snapkv", "budget": 16, "window": 4, "tree_topk": 2,
                             "tree_nodes": 5}


# ---- the sparse cache after tree rounds: what a chain fed the same tokens holds ----------------------------------

def _compressed(runner, prompts, spec: SparseSpec, lookahead: int):
    state = DecodeState.for_prompts(prompts, 40, 96, sampling=GREEDY)
    fed = [n - 1 for n in state.lengths]
    full = runner.new_cache(len(prompts), 96)
    runner.prefill(full, [p[:-1] for p in prompts])
    return state, compress(runner, full, fed, state.tokens, spec, lookahead)


def _visible(cache: SparseKVCache, q: list[int]):
    """What a query at position q[b] attends to in the ring, the context before it: per row {position: (keys,
    values) [L, H_kv, D] over the layers}. (The slot of q itself holds whatever a draft left there, a chain's as
    a tree's, until the next forward writes it.)"""
    out = []
    mask = cache._attend_mask(torch.tensor(q)[:, None], cache.slot_pos, None)[:, 0, 0]  # [B, S]
    for b in range(len(q)):
        ring = {}
        for s in mask[b].nonzero().flatten().tolist():
            if s >= cache.n_static and int(cache.slot_pos[b, s]) < q[b]:
                ring[int(cache.slot_pos[b, s])] = (torch.stack([k[b, :, s] for k in cache.k]),
                                                    torch.stack([v[b, :, s] for v in cache.v]))
        out.append(ring)
    return out


def _tree_rounds(keep: bool, kv: str):
    """Three rounds of a sparse-cache draft tree with an accepted path that is not the first nodes (node 0, then
    its second child), then a correction token; and a second sparse cache fed the same accepted tokens as a
    chain feeds them. Returns both drafters' caches and the final context."""
    _, model = _pair("llama")
    runner = ModelRunner(model)
    prompts = _prompts(V)
    spec = SparseSpec(kv, budget=6, sink=2, window=3)
    state = DecodeState.for_prompts(prompts, 40, 96, sampling=GREEDY)
    tree = ModelDrafter(runner, spec, len(SHAPE), tree=SHAPE)
    tree.begin(state)
    chain_state, chain_cache = _compressed(runner, prompts, spec, len(SHAPE))
    chain = CachedPrefix(len(prompts), 96)
    chain.holds(chain_state.tokens, [n - 1 for n in chain_state.lengths])
    ctx, lengths = state.tokens.clone(), list(state.lengths)
    for _ in range(3):
        proposal = tree.draft(ctx, lengths, [3] * len(prompts))
        tokens = proposal.tokens.tolist()
        path = [0, 4]  # node 0, then its second child (node 4): fed, both, by the tree's forwards
        if keep:
            rnd = type("Round", (), {"paths": [path] * len(prompts), "active": [True] * len(prompts),
                                     "trees": proposal.trees})
            tree.keep_paths(proposal, rnd)
        else:
            tree._grown = None
        new = [[t[i] for i in path] + [(t[4] + 1) % V] for t in tokens]
        for b, t in enumerate(new):
            ctx[b, lengths[b] : lengths[b] + len(t)] = torch.tensor(t)
        # the chain: the root, then the accepted drafts, one forward each, as a chain's drafts are written
        for j in range(len(path) + 1):
            feed_context(runner, chain_cache, chain, ctx, [n + j for n in lengths])
        lengths = [n + len(t) for n, t in zip(lengths, new)]
    chain.agree(ctx, lengths)
    tree.prefix.agree(ctx, lengths)
    return tree, chain, chain_cache, ctx, lengths


@pytest.mark.parametrize("kv", ["streamingllm", "snapkv"])
def test_after_tree_rounds_the_sparse_cache_holds_what_a_chain_holds(kv):
    tree, chain, chain_cache, ctx, lengths = _tree_rounds(True, kv)
    cache = tree.cache
    # every accepted path was fed by the tree's forwards and moved into place: nothing to feed again but the
    # correction, as after a chain's accepted drafts
    assert tree.prefix.fed == [n - 1 for n in lengths] == chain.fed
    assert torch.equal(cache.floor, chain_cache.floor) and torch.equal(cache.window, chain_cache.window)
    n = cache.n_static
    assert torch.equal(cache.slot_pos[:, :n], chain_cache.slot_pos[:, :n])
    assert torch.equal(cache.static_pos, chain_cache.static_pos)
    for x, y in zip(cache.k + cache.v, chain_cache.k + chain_cache.v):
        assert torch.equal(x[:, :, :n], y[:, :, :n])  # the sinks / SnapKV's slots: never written by a step
    q = [n - 1 for n in lengths]  # the correction's position: the next forward's query
    seen, want = _visible(cache, q), _visible(chain_cache, q)
    for b in range(len(q)):
        assert sorted(seen[b]) == sorted(want[b]) == list(range(q[b] - int(cache.window[b]) + 1, q[b]))
        for p in want[b]:
            for x, y in zip(seen[b][p], want[b][p]):
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    runner = tree.runner
    logits = feed_context(runner, cache, tree.prefix, ctx, lengths)
    torch.testing.assert_close(logits, feed_context(runner, chain_cache, chain, ctx, lengths), atol=1e-4, rtol=1e-4)


def _differs(tree, chain_cache, lengths) -> bool:
    q = [n - 1 for n in lengths]
    seen, want = _visible(tree.cache, q), _visible(chain_cache, q)
    return any(p not in seen[b] or not torch.allclose(seen[b][p][0], want[b][p][0], atol=1e-3)
               for b in range(len(q)) for p in want[b])


def test_the_same_check_catches_a_path_left_where_the_tree_wrote_it(monkeypatch):
    """The bookkeeping told the path was kept while its keys stay at the tree's slots: the window then holds
    the second child's sibling's keys."""
    tree, _, chain_cache, _, lengths = _tree_rounds(True, "streamingllm")
    assert not _differs(tree, chain_cache, lengths)  # unbroken, the same check passes
    monkeypatch.setattr(SparseKVCache, "keep_path", lambda self, b, start, nodes: None)
    tree, _, chain_cache, _, lengths = _tree_rounds(True, "streamingllm")
    assert _differs(tree, chain_cache, lengths)


def test_the_same_check_catches_nodes_that_see_their_cousins(monkeypatch):
    """Tree nodes attending as a chain's tokens would (every node before them in the block, at slot positions)."""
    monkeypatch.setattr(SparseKVCache, "_key_positions", lambda self, tree: (self.slot_pos, None))
    tree, _, chain_cache, _, lengths = _tree_rounds(True, "snapkv")
    assert _differs(tree, chain_cache, lengths)


def test_a_path_not_kept_is_fed_again():
    """Without keep_paths the drafter feeds the accepted path once more: correct too, only slower."""
    tree, chain, chain_cache, ctx, lengths = _tree_rounds(False, "streamingllm")
    assert all(f < n - 1 for f, n in zip(tree.prefix.fed, lengths))
    logits = feed_context(tree.runner, tree.cache, tree.prefix, ctx, lengths)
    torch.testing.assert_close(logits, feed_context(tree.runner, chain_cache, chain, ctx, lengths), atol=1e-4,
                               rtol=1e-4)


# ---- sampling: the target's exact marginals ----------------------------------------------------------------------

@pytest.mark.parametrize("kv", ["streamingllm", "snapkv"])
def test_sampled_magicdec_trees_follow_the_targets_marginals(sampled, kv):  # noqa: F811
    model, marginals = sampled
    proposer = MagicDec(ModelRunner(model), 2, kv, budget=6, sink=2, window=3, tree_topk=3)
    assert_target_marginals_through_branches(*sampled_checks(ModelRunner(model), proposer, marginals))


WARPED = [("streamingllm", {}, POINTS[0]), ("snapkv", {"tree_sample": True}, POINTS[1])]


@pytest.mark.parametrize("kv, sample, point", WARPED, ids=["streamingllm top-k", "snapkv sampled children"])
def test_sampled_magicdec_trees_follow_the_targets_marginals_at_temperature_and_top_p(sampled, kv, sample,  # noqa: F811
                                                                                    point):
    model, _ = sampled
    proposer = MagicDec(ModelRunner(model), 2, kv, budget=6, sink=2, window=3, tree_topk=3, **sample)
    assert_target_marginals_through_branches(*warped_checks(ModelRunner(model), proposer, model, point))
