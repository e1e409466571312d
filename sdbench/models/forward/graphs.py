"""Static-shape forwards and CUDA graphs.

A decode step or a verification is a few hundred small kernels; on a GPU, launching them one by one costs
more than running them at batch 1. The fix (as in gpt-fast and vLLM) is to give every forward fixed shapes
and addresses and replay it as a CUDA graph:

- the inputs (tokens [B, T], their positions and their rotary cos/sin) are copied into buffers owned by the
  graph: the host, which knows the positions, looks cos/sin up (or computes them, for the rope types whose
  scaling depends on the forward's length) outside the graph, so a graph reads no table that may grow;
- attention always runs over the cache's full, pre-allocated length, with a mask built on the device from
  the positions (a dense cache: slot <= position; a sparse cache: its own static + ring mask), and the new
  keys/values are scattered to their positions, so no shape depends on how long the sequence is;
- one graph per (cache, T): decode (T = 1), catch-up (T = 2) and each verification width (T = gamma + 1);
- a token tree (`StaticTreeForward`) runs in a graph captured for a fixed node count, the smallest of
  TREE_WIDTHS that holds it: the tree is padded to it with nodes that see the prefix and themselves only and
  that no node sees, whose keys land in slots past the tree's (stale, as a rejected draft's, in the spare slots
  a static cache keeps for them); a tree of more nodes than the widest is refused.

Caches come from a per-runner pool (see `CachePool`) so that the next batch reuses both the storage and the
graphs captured over it. A captured graph is checked once against the eager forward of the same inputs; a
capture that fails or disagrees turns graphs off for that runner with a warning (the eager static path is
still exact). On CPU the same static forward runs eagerly (`ModelRunner(static=True)`), which is how the
tests check everything but the capture itself, or compiled (the CPU fast path's compiled steps,
`models/forward/cpucompile.py`).
"""

from __future__ import annotations

import torch

from sdbench.engine.hidden import Taps
from sdbench.forward_step import Step
from sdbench.errors import SdbenchError
from sdbench.kv.cache import StepIndex, TreeStep

CAPACITY_STEP = 256  # pooled dense caches round their length up to a multiple of this
POOL_MAX = 8  # caches a runner keeps for reuse
REUSE_SPAN = 4  # a pooled dense cache serves requests down to a quarter of its length
CHECK_ATOL = 2e-2  # capture self-check: logits of a replay vs the eager forward (bf16-safe)
TREE_WIDTHS = (8, 16, 32, 64)  # the node counts (the root included) tree graphs are captured for
# the most padding nodes a tree graph writes past a tree (a tree of 33 nodes in the 64-node graph): the slots a
# static dense cache keeps past its length for them
TREE_SPARE = max(width - low - 1 for low, width in zip((0, *TREE_WIDTHS), TREE_WIDTHS))


def tree_width(nodes: int) -> int:
    """The captured width a tree of `nodes` nodes is padded to; raises past the widest."""
    for width in TREE_WIDTHS:
        if nodes <= width:
            return width
    raise SdbenchError(tree_budget_refusal(nodes))


def tree_budget_refusal(nodes: int) -> str:
    return (f"token trees of {nodes} nodes (the root included) on the static-shape (CUDA graph) forward: a node "
            f"budget above what a CUDA graph was captured for ({TREE_WIDTHS[-1]}); --no-fast runs the eager "
            "forward, which takes them")


class StaticForward:
    """Logits [B, T, V] for one cache and one (B, T), with fixed input buffers; replayed as a CUDA graph
    while the runner's `graphs` is on. layers: also keep these hidden states (engine/hidden.py), returned as
    (logits, states [B, T, k*H])."""

    def __init__(self, runner, cache, batch: int, width: int, layers: tuple[int, ...] | None = None):
        dev = runner.device
        self.runner, self.cache, self.layers = runner, cache, layers
        self.tokens = torch.zeros(batch, width, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, width, dtype=torch.long, device=dev)
        self.offsets = torch.arange(width, dtype=torch.long)
        # {layer type: (cos, sin')} [B, 1, T, Dr], filled per call
        lengths = runner.rotary.scaling_lengths([0] * batch, width, None)
        self.cos_sin = {t: tuple(torch.zeros_like(x) for x in pair)
                        for t, pair in runner.rotary.for_forward(self.positions, width, lengths).items()}
        self.graph = None
        self.out = None

    def step(self) -> StepIndex:
        return StepIndex.fixed(self.positions, self.cache.static_kv_len)

    def _eager(self):
        """The forward over the filled buffers, op by op or, on the CPU-compiled path, its layers compiled."""
        taps = None if self.layers is None else Taps(self.layers)
        h = self.runner.compiled_layers(self, taps) if self.runner.path.compiled else None
        if h is None:
            self.runner.path.ready()
            h = self.runner.run_layers(self.cache, self.tokens, self.step(), self.cos_sin, taps)
        logits = self.runner.logits(h)
        return logits if taps is None else (logits, taps.states())

    def __call__(self, step: Step) -> torch.Tensor:
        """The forward of a step (`forward_step.py`) of this batch and width: its inputs copied into the buffers."""
        tokens, start = step.tokens, step.start
        self.tokens.copy_(tokens, non_blocking=True)
        self.positions.copy_(torch.tensor(start, dtype=torch.long)[:, None] + self.offsets, non_blocking=True)
        rotary, width = self.runner.rotary, len(self.offsets)
        lengths = rotary.scaling_lengths(start, width, self.runner.scaling_floor(self.cache))
        for t, (cos, sin) in rotary.for_forward(self.positions, max(start) + width, lengths).items():
            self.cos_sin[t][0].copy_(cos)
            self.cos_sin[t][1].copy_(sin)
        return self._run()

    def _run(self):
        """The forward over the filled buffers: eagerly, by replaying the graph, or capturing it first."""
        if not self.runner.graphs:
            return self._eager()
        if self.graph is not None:
            self.graph.replay()
            return _clone(self.out)  # the next replay overwrites out
        return self._record()

    def _record(self) -> torch.Tensor:
        """Capture over the current inputs (writing the cache is idempotent: the same keys at the same
        slots), replay, and check the replay against the eager result."""
        runner = self.runner
        eager = warm_up(self._eager)
        try:
            graph, out = capture(self._eager, runner)
            graph.replay()
            ok = all(torch.allclose(a, b, atol=CHECK_ATOL, rtol=CHECK_ATOL) for a, b in zip(_parts(out), _parts(eager)))
        except Exception as exc:  # noqa: BLE001 - an op that cannot be captured, whatever torch raises
            runner.disable_graphs(f"CUDA graph capture failed ({str(exc).splitlines()[0]})")
            return eager
        if not ok:
            err = max(float((a - b).abs().max()) for a, b in zip(_parts(out), _parts(eager)))
            runner.disable_graphs(f"a CUDA graph replay differed from the eager forward by {err:.3g}")
            return eager
        self.graph, self.out = graph, out
        return _clone(out)


class StaticTreeForward(StaticForward):
    """`StaticForward` over a token tree per row, padded to a fixed node count `width` (`tree_width`): its
    buffers also hold each node's rotated position and the ancestor mask (`kv.cache.TreeStep.fixed_tree`).
    Returns the logits of every node, padding included [B, width, V] (or with the states, as StaticForward)."""

    def __init__(self, runner, cache, batch: int, width: int, layers: tuple[int, ...] | None = None):
        super().__init__(runner, cache, batch, width, layers)
        dev = runner.device
        self.rotated = torch.zeros(batch, width, dtype=torch.long, device=dev)
        self.ancestors = torch.eye(width, dtype=torch.bool, device=dev).repeat(batch, 1, 1)

    def step(self) -> StepIndex:
        return TreeStep.fixed_tree(self.positions, self.rotated, self.ancestors, self.cache.static_kv_len)

    def __call__(self, step: Step) -> torch.Tensor:
        """A tree step's forward: tokens [B, N] one per node of its trees, N <= width."""
        tokens, start, tree = step.tokens, step.start, step.tree
        B, N = tokens.shape
        width = len(self.offsets)
        rotated = torch.tensor(start, dtype=torch.long)[:, None].repeat(1, width)  # padding: its row's start
        rotated[:, :N] = tree.positions(torch.tensor(start)).cpu()
        ancestors = torch.eye(width, dtype=torch.bool).repeat(B, 1, 1)  # padding sees itself, and nobody it
        ancestors[:, :N, :N] = tree.ancestors.cpu()
        self.tokens[:, N:].zero_()
        self.tokens[:, :N].copy_(tokens, non_blocking=True)  # drafts stay on the device: no wait for them
        self.positions.copy_(torch.tensor(start, dtype=torch.long)[:, None] + self.offsets, non_blocking=True)
        self.rotated.copy_(rotated, non_blocking=True)
        self.ancestors.copy_(ancestors, non_blocking=True)
        rotary = self.runner.rotary
        lengths = rotary.scaling_lengths(start, width, self.runner.scaling_floor(self.cache), rotated)
        for t, (cos, sin) in rotary.for_forward(rotated.to(self.rotated.device), max(start) + width,
                                                 lengths).items():
            self.cos_sin[t][0].copy_(cos)
            self.cos_sin[t][1].copy_(sin)
        return self._run()


def _parts(out) -> tuple:
    """A static forward's outputs as a tuple: (logits,) or (logits, states)."""
    return out if isinstance(out, tuple) else (out,)


def _clone(out):
    return tuple(x.clone() for x in out) if isinstance(out, tuple) else out.clone()


def warm_up(fn):
    """Run fn once on a side stream, as capture requires (lazy initialisations happen outside the graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        result = fn()
    torch.cuda.current_stream().wait_stream(side)
    return result


def capture(fn, runner):
    """(graph, output) for fn captured as a CUDA graph."""
    # one memory pool per model, as vLLM does across its graphs: graphs replay one at a time and every
    # output is cloned on return, so one graph's scratch may reuse another's
    if runner.graph_pool is None:
        runner.graph_pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    # thread_local: a drafter thread (DSI) may use CUDA while this thread captures
    with torch.cuda.graph(graph, pool=runner.graph_pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


class CachePool:
    """Caches handed out by `take` and given back by `give`; a given-back cache keeps its captured graphs.

    A cache that is never given back is simply not reused (a new one is allocated), so forgetting to give
    one back costs memory and a capture, never correctness. A dense cache serves any request of the same
    batch up to REUSE_SPAN times shorter than it (the extra slots are masked: a little more attention work
    instead of a new capture)."""

    def __init__(self):
        self.free: list = []

    def take(self, key: tuple, length: int | None = None):
        """A free cache with this key (and room for `length` positions: the shortest that fits), or None."""
        fits = [c for c in self.free if c.pool_key == key
                and (length is None or length <= c.capacity <= REUSE_SPAN * length)]
        if not fits:
            return None
        best = min(fits, key=lambda c: c.capacity)
        self.free = [c for c in self.free if c is not best]
        return best

    def give(self, cache) -> None:
        if cache.pool_key is not None and all(c is not cache for c in self.free):
            self.free.append(cache)
            del self.free[:-POOL_MAX]
