"""Token trees through the runners' one forward, and the cache kept to the accepted path, against the library.

A tree forward (`forward(..., tree=TreeBatch)`, the verifying forward's `with_root()` trees) places node j of
row b in slot start[b] + j at position start[b] - 1 + depth, seeing the prefix, its ancestors and itself. Its
logits at each node must be the library's own uncached forward at the last token of prefix + the root-to-node
path (float32, tiny random models with perturbed norms and biases: llama, qwen3, gemma2 with a window that
binds on the native runner, eager and packed for oneDNN's products and for sdbench's; llama and GPT-2 on the generic
runner). A tree step on sdbench's products runs the layer loop, not the fused layer (which attends causally). After
`keep_path`, the next plain forward must be the library's over prefix + that path + the next token, for a
batch of two rows with different trees and prompt lengths. The chain as a tree is today's chain forward.
"""

from __future__ import annotations

import functools

import pytest
import torch

from sdbench.forward_step import Step
from sdbench.engine.tree import Tree, TreeBatch
from sdbench.errors import SdbenchError
from sdbench.kv.cache import DenseKVCache
from sdbench.kv.sparse import ScoringView
from sdbench.models.forward import cpufast, cpukernel, cpulayer, cpumeasure, cpupacked
from sdbench.models.forward.generic import GenericCache, GenericRunner
from sdbench.models.forward.runner import ModelRunner
from tests.conftest import VOCAB, skip_unless_ci
from tests.test_families import tiny
from tests.test_generic import tiny_generic
from tests.test_rope_lossless import CASES
from tests.test_runner_fidelity import library_decoding, perturbed_model, tiny_config

TREE = Tree.from_vllm("[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]")  # 7 nodes, 3 levels
SMALL = Tree.from_vllm("[(0,), (0, 0), (0, 1), (0, 0, 0)]")  # 4 nodes: padded in a batch with TREE
# a leaf per tree whose path is not the block's first nodes, so that keeping it moves keys: TREE's (0, 1, 0)
# (nodes 0, 3, 6) and SMALL's (0, 1) (nodes 0, 2)
LEAVES = {TREE: 6, SMALL: 2}

MODELS = {
    "llama": lambda: perturbed_model(tiny_config("llama")),
    "qwen3": lambda: perturbed_model(tiny_config("qwen3", head_dim=16)),
    "gemma2-window": lambda: tiny("gemma2", sliding_window=6),  # local layer 0: binds past 6 positions
    "gpt2": lambda: tiny_generic("gpt2"),
}
RUNNERS = {  # label -> (model, runner kind: native, generic, or the fast path packed as FAST_ENV names it)
    "llama": ("llama", "native"), "llama-packed": ("llama", "packed"), "llama-kernel": ("llama", "kernel"),
    "qwen3": ("qwen3", "native"), "gemma2-window": ("gemma2-window", "native"),
    "llama-generic": ("llama", "generic"), "gpt2-generic": ("gpt2", "generic"),
}

LAYOUTS = {"packed": cpupacked.ONEDNN, "kernel": cpupacked.KERNEL}  # FAST_ENV's override -> the layout it packs


@functools.cache
def _model(name: str):
    return MODELS[name]()


def _runner(label: str):
    name, kind = RUNNERS[label]
    model = _model(name)
    if kind == "generic":
        return GenericRunner(model, name)
    if kind == "native":
        return ModelRunner(model, name)
    if kind == "kernel" and not cpukernel.available():
        skip_unless_ci(f"needs sdbench's CPU products ({cpukernel.why_not()})")
    with pytest.MonkeyPatch.context() as mp:  # the CPU fast path in this layout, whatever a measurement would choose
        mp.setenv(cpumeasure.FAST_ENV, kind)
        mp.setattr(cpufast, "_chosen", {})
        runner = ModelRunner(model, name, fast=True)
    if not runner.cpu_fast:
        skip_unless_ci("needs oneDNN's packing")
    assert runner.path.fast.layout == LAYOUTS[kind]
    return runner


def _library(model, rows: list[list[int]]) -> torch.Tensor:
    """[len(rows), V] the library's logits after each token list (its uncached forward, one call each)."""
    with cpufast.plain(model), torch.no_grad():
        return torch.stack([model(torch.tensor([r])).logits[0, -1].float() for r in rows])


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tree_forward(runner, prompts: list[list[int]], trees: list[Tree], seed: int = 0):
    """Each prompt but its last token prefilled, then one tree forward: the last token as the root, a random
    token per node. -> (cache, tokens [B, N+1], the with-root batch, start, logits [B, N+1, V])."""
    cache = runner.new_cache(len(prompts), 48)
    runner.prefill(cache, [p[:-1] for p in prompts])
    batch = TreeBatch.of([t.with_root() for t in trees])
    tokens = torch.randint(0, VOCAB, batch.valid.shape, generator=torch.Generator().manual_seed(seed))
    tokens[:, 0] = torch.tensor([p[-1] for p in prompts])
    start = [len(p) - 1 for p in prompts]
    return cache, tokens, batch, start, runner.run(cache, Step(tokens, start, tree=batch))


def _along(tree: Tree, tokens: list[int], node: int) -> list[int]:
    """The tokens from the root to a node of a with-root tree, both included."""
    return [tokens[j] for j in tree.path_to(node)]


def _check_nodes(runner, prompts, batch, tokens, logits) -> None:
    for b, (prompt, tree) in enumerate(zip(prompts, batch.trees)):
        row = tokens[b].tolist()
        want = _library(runner.model, [prompt[:-1] + _along(tree, row, j) for j in range(len(tree))])
        torch.testing.assert_close(logits[b, : len(tree)], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("label", list(RUNNERS))
def test_each_node_sees_the_prefix_and_its_own_path(label):
    runner = _runner(label)
    prompts = [_prompt(6, 1)]
    cache, tokens, batch, start, logits = _tree_forward(runner, prompts, [TREE])
    assert logits.shape == (1, len(TREE) + 1, VOCAB)
    _check_nodes(runner, prompts, batch, tokens, logits)
    at = runner.run(cache, Step(tokens, start, at=torch.tensor([[2, 7]]), tree=batch))  # the vocabulary at two
    torch.testing.assert_close(at, logits[:, [2, 7]], atol=1e-5, rtol=1e-5)


def _fused_layers_run(monkeypatch) -> list[int]:
    """The layers run by the fused layer (`cpulayer.layer`) from now on, in call order."""
    calls, real = [], cpulayer.layer
    monkeypatch.setattr(cpulayer, "layer", lambda *a: calls.append(a[1]) or real(*a))
    return calls


def test_a_tree_step_on_sdbench_products_runs_fused_and_gives_the_librarys_logits(monkeypatch):
    """A tree step runs the fused layer too, its attention reading the tree (`cpulayer.ancestors`): every node's
    logits are the library's over its path."""
    runner = _runner("llama-kernel")
    assert runner.fused_layers
    fused = _fused_layers_run(monkeypatch)
    prompts = [_prompt(6, 1)]
    cache, tokens, batch, start, logits = _tree_forward(runner, prompts, [TREE])
    assert fused == [0, 1, 0, 1]  # the prefill's two layers, then the tree step's
    _check_nodes(runner, prompts, batch, tokens, logits)


def test_a_tree_step_attended_as_a_chain_is_caught(monkeypatch):
    """The check above fails when the fused layer is not handed the tree: its nodes then see every earlier node of
    the block, so the root and the first child (whose earlier nodes are their ancestors) stay right, and every
    later node, each after a node off its path (node 2, the root's second child, sees its sibling), is wrong."""
    runner = _runner("llama-kernel")
    fused = _fused_layers_run(monkeypatch)
    monkeypatch.setattr(cpulayer, "ancestors", lambda step: None)
    prompts = [_prompt(6, 1)]
    cache, tokens, batch, start, logits = _tree_forward(runner, prompts, [TREE])
    assert fused == [0, 1, 0, 1]  # the prefill, then the tree step
    with pytest.raises(AssertionError):
        _check_nodes(runner, prompts, batch, tokens, logits)
    row, tree = tokens[0].tolist(), batch.trees[0]
    want = _library(runner.model, [prompts[0][:-1] + _along(tree, row, j) for j in range(len(tree))])
    error = (logits[0, : len(tree)] - want).abs().amax(-1)
    assert error[:2].max() < 1e-4 and error[2:].min() > 1e-2, error


@pytest.mark.parametrize("name", ["llama-dynamic", "llama-longrope"])
def test_a_rope_rescaled_per_token_rotates_each_node_for_its_depth(name):
    """Past the rope's original context (16) each node is rotated as plain decoding of its path rotates it
    (scaling length: its position + 1, not its slot's)."""
    model = perturbed_model(CASES[name](), seed=3)
    runner = ModelRunner(model)
    prompts = [_prompt(14, 9)]
    cache, tokens, batch, start, logits = _tree_forward(runner, prompts, [TREE])
    row, tree = tokens[0].tolist(), batch.trees[0]
    for j in range(len(tree)):
        ids = torch.tensor([prompts[0] + _along(tree, row, j)[1:]])
        want = library_decoding(model, ids, 13)[0, -1]  # the prefill's 13, then one token per call
        torch.testing.assert_close(logits[0, j], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("label", ["llama", "llama-packed", "llama-kernel", "llama-generic"])
def test_the_chain_as_a_tree_is_the_chain_forward(label):
    runner = _runner(label)
    prompt = _prompt(7, 2)
    draft = torch.tensor([prompt[-1:] + _prompt(4, 3)])  # the root, then 4 drafts
    out = []
    for tree in (None, TreeBatch.of([Tree.chain(4).with_root()])):
        cache = runner.new_cache(1, 32)
        runner.prefill(cache, [prompt[:-1]])
        logits = runner.run(cache, Step(draft, [6], tree=tree))
        out.append((logits, runner.run(cache, Step(draft[:, 3:4], [9]))))  # reads the first two drafts' keys
    tol = 1e-4 if label == "llama-kernel" else 1e-6  # there the chain's steps run fused, the tree's the layer loop
    torch.testing.assert_close(out[1], out[0], atol=tol, rtol=tol)


@pytest.mark.parametrize("label", ["llama", "llama-kernel", "gemma2-window", "llama-generic", "gpt2-generic"])
def test_the_kept_path_is_the_cache_of_its_tokens_in_a_ragged_batch(label):
    runner = _runner(label)
    prompts, trees = [_prompt(5, 4), _prompt(8, 5)], [TREE, SMALL]
    cache, tokens, batch, start, logits = _tree_forward(runner, prompts, trees, seed=6)
    _check_nodes(runner, prompts, batch, tokens, logits)
    kept, nxt = [], [11, 29]
    for b, tree in enumerate(trees):
        path = tuple(j + 1 for j in tree.path_to(LEAVES[tree]))  # node i of the tree is node i + 1 of the block
        cache.keep_path(b, start[b], path)
        kept.append(prompts[b] + [int(tokens[b, j]) for j in path])
    after = runner.run(cache, Step(torch.tensor(nxt)[:, None], [len(k) for k in kept]))[:, 0]
    torch.testing.assert_close(after, _library(runner.model, [k + [n] for k, n in zip(kept, nxt)]),
                               atol=1e-4, rtol=1e-4)


def test_keep_path_moves_the_kept_token_ids():
    dense = DenseKVCache(1, 1, 1, 2, 12, torch.float32, torch.device("cpu"))
    dense.keep_ids()
    dense.ids[0] = torch.arange(12)
    dense.k[0][0, 0, :, 0] = torch.arange(12.0)
    dense.keep_path(0, 3, [2, 5])
    assert dense.ids[0, :6].tolist() == [0, 1, 2, 3, 5, 8] and dense.k[0][0, 0, :6, 0].tolist() == [0, 1, 2, 3, 5, 8]
    generic = GenericCache(1, 12)
    generic.ids[0].extend(range(10))
    generic.keep_path(0, 3, [2, 5])
    assert generic.ids[0][:6] == [0, 1, 2, 3, 5, 8]


def _refused(runner, cache, match: str, start=(3,), T: int = 3) -> None:
    batch = TreeBatch.of([Tree.chain(T - 1).with_root()] * len(start))
    with pytest.raises(SdbenchError, match=match):
        runner.run(cache, Step(torch.zeros(len(start), T, dtype=torch.long), list(start), tree=batch))


def test_paths_that_cannot_take_a_tree_refuse_it_in_one_line():
    llama = _model("llama")
    static = ModelRunner(llama, static=True)
    _refused(static, static.new_cache(1, 16), "a node budget above what a CUDA graph was captured for", T=65)
    native = ModelRunner(llama)
    _refused(native, ScoringView(native.new_cache(1, 16)), "dense or sparse KV cache")
    with pytest.raises(SdbenchError, match="one token per node"):  # 2 tokens for 8 nodes
        native.run(native.new_cache(1, 16), Step(torch.zeros(1, 2, dtype=torch.long), [0], tree=TreeBatch.of([TREE.with_root()])))
    phi = ModelRunner(perturbed_model(CASES["phi3-longrope"]()))  # original context: 16 positions
    cache = phi.new_cache(1, 32)
    phi.prefill(cache, [_prompt(14, 7)])
    _refused(phi, cache, "Phi-3's original context", start=(14,), T=4)  # queries on both sides of 16
    for model, match in ((tiny("gemma2", sliding_window=6), "sliding windows"),
                         (tiny_generic("falcon-alibi"), "ALiBi"),
                         (perturbed_model(CASES["phi3-longrope"]()), "rope rescaled per call")):
        generic = GenericRunner(model)
        cache = generic.new_cache(1, 16)
        generic.prefill(cache, [_prompt(3, 8)])
        _refused(generic, cache, match)
