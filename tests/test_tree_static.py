"""Token trees on the static-shape forward behind CUDA graphs (`ModelRunner(static=True)`, which is what runs on
CUDA with --fast; on the CPU it runs uncaptured, and graph mode runs with capture and replay stand-ins).

A tree runs in a graph captured for a fixed node count (models/forward/graphs.py TREE_WIDTHS), padded to it. Its logits
and the keys it leaves for its real nodes must equal the eager tree forward's, for rows with trees of different
sizes; the padding nodes see no other node and no node sees them (the mask, read directly). Greedy decoding must
give exactly the library's greedy `generate` (batch 1 and a ragged batch) for a draft model's tree (the draft's
own level forwards static too), n-gram trees and MagicDec's sparse-cache trees; under sampling every output
position must follow the target's exact marginal, at T = 1 and at T = 0.6, top-p = 0.8. Trees of different sizes
up to one width share one capture. A node budget above the widest captured width is refused in one line before
anything runs. On CUDA (skipped elsewhere) a real capture must replay the eager tree forward's tokens.
"""

from __future__ import annotations

import pytest
import torch

from sdbench.forward_step import Step
from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate
from sdbench.engine.tree import Tree, TreeBatch
from sdbench.errors import SdbenchError
from sdbench.models.forward.graphs import TREE_WIDTHS, StaticTreeForward
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.magicdec import MagicDec
from sdbench.strategies.ngram import NGram
from tests.references import hf_generate
from tests.test_static import fake_graphs  # noqa: F401
from tests.test_tree_draft import _pair, _prompts
from tests.test_tree_loop import (POINTS, V, assert_target_marginals_through_branches, sampled,  # noqa: F401
                                  sampled_checks, warped_checks)

GREEDY = SamplingConfig()
NEW = 24
TREES = (Tree.from_vllm("[(0,), (1,), (0, 0)]").with_root(),  # 4 nodes with the root
         Tree.chain(1).with_root(),  # 2
         Tree.from_vllm("[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]").with_root())  # 7


def _prefilled(runner, prompts):
    cache = runner.new_cache(len(prompts), 64)
    runner.prefill(cache, [p[:-1] for p in prompts])
    return cache


def test_a_padded_tree_forward_equals_the_eager_one():
    target, _ = _pair("llama")
    prompts = _prompts(V)
    eager, static = ModelRunner(target), ModelRunner(target, static=True)
    batch = TreeBatch.of(TREES)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (3, batch.valid.shape[1]), generator=g)
    tokens[:, 0] = torch.tensor([p[-1] for p in prompts])
    start = [len(p) - 1 for p in prompts]
    caches = [_prefilled(r, prompts) for r in (eager, static)]
    want = eager.run(caches[0], Step(tokens, start, tree=batch))
    got = static.run(caches[1], Step(tokens, start, tree=batch))
    assert got.shape == want.shape == (3, 7, V)
    for b, tree in enumerate(TREES):
        n = len(tree)
        torch.testing.assert_close(got[b, :n], want[b, :n], atol=1e-4, rtol=1e-4)
        for x, y in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):  # the prefix and the tree's keys
            torch.testing.assert_close(y[b, :, : start[b] + n], x[b, :, : start[b] + n], atol=1e-5, rtol=1e-5)
    assert set(caches[1].graphs) == {("tree", 3, 8)}  # 7 nodes, padded to 8
    at = torch.tensor([[0, 1]] * 3)
    torch.testing.assert_close(static.run(caches[1], Step(tokens, start, at=at, tree=batch)),
                               eager.run(caches[0], Step(tokens, start, at=at, tree=batch)), atol=1e-4, rtol=1e-4)


def test_padding_nodes_see_no_other_node_and_no_node_sees_them():
    target, _ = _pair("llama")
    runner = ModelRunner(target, static=True)
    cache = runner.new_cache(1, 32)
    forward = StaticTreeForward(runner, cache, 1, 8)
    tree = TreeBatch.of([TREES[0]])  # 4 real nodes, 4 padding
    forward(Step(torch.zeros(1, 4, dtype=torch.long), [5], tree=tree))
    allowed = forward.step().causal_mask(torch.float32)[0, 0] == 0  # [8, kv]: who sees which slot
    block = allowed[:, 5:13]
    assert torch.equal(block[:4, :4], TREES[0].ancestors)  # real nodes: ancestors and self
    assert not block[:4, 4:].any()  # nobody sees the padding
    assert torch.equal(block[4:, 4:], torch.eye(4, dtype=torch.bool)) and not block[4:, :4].any()
    assert allowed[:, :5].all() and not allowed[:, 13:].any()  # every node sees the prefix, none past the block
    assert forward.rotated[0].tolist() == [5, 6, 6, 7, 5, 5, 5, 5]  # padding rotated at its row's start


@pytest.mark.parametrize("rows", [1, 3])
def test_static_tree_runs_give_the_librarys_greedy_tokens(rows):
    target, draft = _pair("llama")
    prompts = _prompts(V)[:rows]
    ref = [hf_generate(target, p, NEW) for p in prompts]
    runner = ModelRunner(target, static=True)
    proposers = {"draft": DraftModel(ModelRunner(draft, static=True), 3, tree_topk=3, tree_nodes=9),
                 "ngram": NGram(2, tree=4),
                 "magicdec-streamingllm": MagicDec(runner, 3, "streamingllm", 6, sink=2, tree_topk=3, tree_nodes=9),
                 "magicdec-snapkv": MagicDec(runner, 3, "snapkv", 6, window=3, tree_topk=3, tree_nodes=9)}
    siblings = {}
    for name, proposer in proposers.items():
        out = generate(runner, proposer, prompts, max_new_tokens=NEW, sampling=GREEDY)
        assert out.output_ids == ref, name
        assert all(r.tree_steps == r.steps for r in out.rows)
        siblings[name] = sum(r.sibling_accepts for r in out.rows)
    assert siblings["draft"] > 0 and siblings["magicdec-snapkv"] > 0


def test_trees_up_to_one_width_share_one_capture(fake_graphs):
    runner, log = fake_graphs
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7]]
    ref = generate(ModelRunner(runner.model), NGram(2, tree=3), prompts, max_new_tokens=NEW,
                   sampling=GREEDY).output_ids
    out = generate(runner, NGram(2, tree=3), prompts, max_new_tokens=NEW, sampling=GREEDY)
    assert out.output_ids == ref
    captured = [k for cache in runner.pool.free for k in cache.graphs if k[0] == "tree"]
    assert captured == [("tree", 2, 8)]
    assert runner.graphs and log.count("replay") > log.count("capture")


def test_a_node_budget_above_the_widest_graph_is_refused_before_anything_runs(monkeypatch):
    target, draft = _pair("llama")
    static = ModelRunner(draft, static=True)
    monkeypatch.setattr(static, "prefill", lambda *a, **k: pytest.fail("the draft prefilled before the refusal"))
    widest = TREE_WIDTHS[-1]
    with pytest.raises(SdbenchError, match="a node budget above what a CUDA graph was captured for") as caught:
        generate(ModelRunner(target, static=True), DraftModel(static, 8, tree_topk=8, tree_nodes=widest),
                 _prompts(V), max_new_tokens=4, sampling=GREEDY)
    assert "\n" not in str(caught.value) and f"{widest + 1} nodes" in str(caught.value)
    runner = ModelRunner(target, static=True)  # and a forward given such a tree says the same
    cache = runner.new_cache(1, 200)
    big = TreeBatch.of([Tree.chain(widest + 1)])
    with pytest.raises(SdbenchError, match="a node budget above what a CUDA graph was captured for"):
        runner.run(cache, Step(torch.zeros(1, widest + 1, dtype=torch.long), [3], tree=big))
    generate(ModelRunner(target, static=True), DraftModel(ModelRunner(draft, static=True), 8, tree_topk=8,
                                                          tree_nodes=widest - 1), _prompts(V)[:1],
             max_new_tokens=4, sampling=GREEDY)  # the widest graph's own budget runs


def test_sampled_static_trees_follow_the_targets_marginals(sampled):  # noqa: F811
    model, marginals = sampled
    runner = ModelRunner(model, static=True)
    assert_target_marginals_through_branches(*sampled_checks(runner, NGram(2, tree=4), marginals))


def test_sampled_static_trees_follow_the_targets_marginals_at_temperature_and_top_p(sampled):  # noqa: F811
    model, _ = sampled
    runner = ModelRunner(model, static=True)
    assert_target_marginals_through_branches(*warped_checks(runner, NGram(2, tree=4), model, POINTS[0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs CUDA")
def test_captured_tree_graphs_decode_as_the_library_does():
    target, draft = _pair("llama")
    model = target.to("cuda")
    try:
        runner = ModelRunner(model, fast=True)
        assert runner.graphs and runner.static
        prompts = _prompts(V)
        out = generate(runner, NGram(2, tree=4), prompts, max_new_tokens=NEW, sampling=GREEDY)
        assert out.output_ids == [hf_generate(model, p, NEW) for p in prompts]
        assert runner.graphs  # no capture failed or disagreed with the eager forward
    finally:
        target.to("cpu")
