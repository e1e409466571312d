"""The static-shape forward behind CUDA graphs: the same logits and tokens as the eager forward.

On CPU the static path runs without capture (`ModelRunner(static=True)`), which checks everything the graphs
replay: fixed buffers, attention over the whole cache under a device-side mask, scattered cache writes,
pooled caches reused across generations. Capture itself is checked by the CUDA tests at the bottom.
"""

import pytest
import torch

from sdbench.forward_step import Step
from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate
from sdbench.kv.sparse import SparseSpec, compress
from sdbench.models.forward.graphs import CAPACITY_STEP
from sdbench.models.probing.probe import TOLERANCE
from sdbench.models.forward.forward_paths import CudaGraphs
from sdbench.models.forward.runner import ModelRunner
from sdbench.padding import right_pad
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.magicdec import MagicDec
from sdbench.strategies.polybasic import Polybasic
from tests.conftest import VOCAB, tiny_model
from tests.references import perturbed

GREEDY = SamplingConfig()


@pytest.fixture(scope="module")
def static_target():
    return ModelRunner(tiny_model(0), "tiny-target", static=True)


@pytest.fixture(scope="module")
def static_draft():
    return ModelRunner(tiny_model(1, layers=1, hidden=32, heads=2, kv=1), "tiny-draft", static=True)


def _prefilled(runner, prompts, capacity=64):
    cache = runner.new_cache(len(prompts), capacity)
    runner.prefill(cache, prompts)
    return cache


@pytest.mark.parametrize("width", [1, 2, 5])
def test_static_forward_equals_eager(target, static_target, prompts, width):
    g = torch.Generator().manual_seed(width)
    tokens = torch.randint(0, VOCAB, (len(prompts), width), generator=g)
    start = [len(p) for p in prompts]  # rows at different positions
    eager = target.run(_prefilled(target, prompts), Step(tokens, start))
    cache = _prefilled(static_target, prompts)  # pooled: may hold graphs of earlier tests' batches of this size
    before = set(cache.graphs)
    assert cache.capacity % CAPACITY_STEP == 0 and cache.capacity >= 64
    static = static_target.run(cache, Step(tokens, start))
    torch.testing.assert_close(static, eager, atol=1e-4, rtol=1e-4)
    # the same buffers again, at other positions (a rewind): the mask and scatter follow the new inputs
    eager2 = target.run(_prefilled(target, prompts), Step(tokens.flip(1), [s - 1 for s in start]))
    static2 = static_target.run(cache, Step(tokens.flip(1), [s - 1 for s in start]))
    torch.testing.assert_close(static2, eager2, atol=1e-4, rtol=1e-4)
    assert (len(prompts), width) in cache.graphs and set(cache.graphs) - before <= {(len(prompts), width)}


def test_static_forward_on_a_sparse_cache_equals_eager(target, static_target):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (40, 33)]
    spec, lens = SparseSpec("streamingllm", 12, sink=3), [len(p) for p in prompts]
    tokens = right_pad(prompts, 48)
    out = []
    for runner in (target, static_target):
        sparse = compress(runner, _prefilled(runner, prompts), lens, tokens, spec, lookahead=4)
        step = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(1))
        out.append(runner.run(sparse, Step(step, lens)))
    torch.testing.assert_close(out[1], out[0], atol=1e-4, rtol=1e-4)


def test_overflow_is_an_error_not_an_out_of_bounds_write(static_target):
    cache = static_target.new_cache(1, 10)
    with pytest.raises(RuntimeError, match="overflow"):
        static_target.run(cache, Step(torch.zeros(1, 3, dtype=torch.long), [cache.capacity - 2]))


def _ids(runner, proposer, prompts, new=24):
    return generate(runner, proposer, prompts, max_new_tokens=new, sampling=GREEDY).output_ids


def test_static_decoding_is_token_identical(target, small_draft, static_target, static_draft, prompts):
    reference = _ids(target, Autoregressive(), prompts)
    assert _ids(static_target, Autoregressive(), prompts) == reference
    assert _ids(static_target, DraftModel(static_draft, 3), prompts) == reference
    assert _ids(static_target, DraftModel(static_target, 4), prompts) == reference
    assert _ids(static_target, Polybasic([static_target, static_draft, "ngram"], 3, "4"), prompts) == reference


def test_magicdec_static_is_token_identical(target, static_target):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (50, 37)]
    reference = _ids(target, Autoregressive(), prompts)
    for kv in ("streamingllm", "snapkv"):
        assert _ids(static_target, MagicDec(static_target, 3, kv, 16, sink=4, window=6), prompts) == reference


def test_pooled_caches_are_reused_and_never_shared(static_target, prompts):
    runner = ModelRunner(tiny_model(0), "pool", static=True)
    seen = []

    class Watched(DraftModel):  # the target drafting for itself: two caches of one runner at once
        def begin(self, state):
            super().begin(state)
            assert self.drafter.cache is not state.target_cache
            seen.append({id(state.target_cache), id(self.drafter.cache)})

    first = _ids(runner, Watched(runner, 2), prompts)
    assert len(runner.pool.free) == 2  # both given back when the generation ended
    assert _ids(runner, Watched(runner, 2), prompts) == first  # a new proposer, the same two caches
    assert seen[0] == seen[1] and len(runner.pool.free) == 2
    # a different prompt mix still matches plain decoding after reuse (stale slots are masked by position)
    shorter = [p[:3] for p in prompts]
    assert _ids(runner, Watched(runner, 2), shorter) == _ids(static_target, Autoregressive(), shorter)


def test_rotary_tables_grow_by_appending_rows():
    runner = ModelRunner(tiny_model(0), "rope", static=True)
    runner.new_cache(1, 16)
    emb = runner.rotary.embeddings[None]
    before = [t.clone() for t in emb._tables["base"]]
    runner.new_cache(1, 2000)  # larger than any table so far
    after = emb._tables["base"]
    assert after[0].shape[0] >= 2000 and all(torch.equal(a[: len(b)], b) for a, b in zip(after, before))


class _ReplayedGraph:
    """A CPU stand-in for a CUDA graph: replay re-runs the captured function into the captured output
    (what a real replay does to the graph's fixed buffers)."""

    def __init__(self, fn, out, log):
        self.fn, self.out, self.log = fn, out, log

    def replay(self):
        self.log.append("replay")
        self.out.copy_(self.fn())


@pytest.fixture()
def fake_graphs(monkeypatch):
    """Graph mode on CPU: capture and replay stand-ins, so the recording logic runs without a GPU."""
    from sdbench.models.forward import graphs

    log = []

    def capture(fn, runner):
        log.append("capture")
        out = fn()
        return _ReplayedGraph(fn, out, log), out

    monkeypatch.setattr(graphs, "warm_up", lambda fn: fn())
    monkeypatch.setattr(graphs, "capture", capture)
    runner = ModelRunner(tiny_model(0), "graphed", static=True)
    runner.path = CudaGraphs(runner.model)
    return runner, log


def test_graph_mode_captures_once_per_width_and_replays(target, prompts, fake_graphs):
    runner, log = fake_graphs
    reference = _ids(target, Autoregressive(), prompts)
    assert _ids(runner, Autoregressive(), prompts) == reference
    assert _ids(runner, DraftModel(runner, 3), prompts) == reference
    captures = log.count("capture")
    assert captures >= 2 and log.count("replay") > 3 * captures
    assert _ids(runner, DraftModel(runner, 3), prompts) == reference  # pooled caches: nothing new to capture
    assert log.count("capture") == captures and runner.graphs


def test_rotary_growth_needs_no_recapture(prompts, fake_graphs):
    """A graph reads its own cos/sin buffers, filled per call by the host: a rotary table re-allocated by its
    growth is never read by a graph, so nothing is captured again."""
    runner, log = fake_graphs
    cache = runner.new_cache(1, 40)
    runner.prefill(cache, [prompts[0]])
    x = torch.zeros(1, 1, dtype=torch.long)
    first = runner.run(cache, Step(x, [len(prompts[0])]))
    runner.run(cache, Step(x, [len(prompts[0])]))
    assert log.count("capture") == 1
    runner.rotary.reserve(5000)  # re-allocated
    torch.testing.assert_close(runner.run(cache, Step(x, [len(prompts[0])])), first)
    assert log.count("capture") == 1


def test_failed_or_wrong_capture_falls_back_to_eager(target, prompts, fake_graphs, monkeypatch):
    from sdbench.models.forward import graphs

    runner, _ = fake_graphs
    reference = _ids(target, Autoregressive(), prompts)

    def broken(fn, runner):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "capture", broken)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        assert _ids(runner, Autoregressive(), prompts) == reference
    assert not runner.graphs

    def wrong(fn, runner):  # a replay that does not reproduce the captured forward
        out = fn()
        return _ReplayedGraph(lambda: fn() + 1, out, []), out

    runner.path = CudaGraphs(runner.model)
    monkeypatch.setattr(graphs, "capture", wrong)
    with pytest.warns(RuntimeWarning, match="differed from the eager forward"):
        assert _ids(runner, DraftModel(runner, 2), prompts) == reference
    assert not runner.graphs


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
def test_cuda_graphs_match_eager_and_are_replayed(prompts):
    model = tiny_model(0).to("cuda")
    eager = ModelRunner(model, "eager", fast=False)
    graphed = ModelRunner(model, "graphed", fast=True)
    assert graphed.graphs and graphed.static and not eager.static
    reference = _ids(eager, Autoregressive(), prompts)
    assert _ids(graphed, Autoregressive(), prompts) == reference
    assert _ids(graphed, DraftModel(graphed, 3), prompts) == reference
    assert graphed.graphs, "a capture failed or disagreed with the eager forward"
    cache = graphed.pool.free[0]
    assert any(f.graph is not None for f in cache.graphs.values())
    assert _ids(graphed, Autoregressive(), prompts) == reference  # replayed from the pooled cache


@pytest.mark.cuda
@cuda
def test_cuda_graphs_for_the_sparse_draft_view():
    model = tiny_model(0).to("cuda")
    eager, graphed = ModelRunner(model, "eager"), ModelRunner(model, "graphed", fast=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (50, 37)]
    reference = _ids(eager, Autoregressive(), prompts)
    assert _ids(graphed, MagicDec(graphed, 3, "streamingllm", 16, sink=4), prompts) == reference
    assert graphed.graphs


def test_pool_hands_out_the_shortest_cache_that_fits():
    runner = ModelRunner(tiny_model(0), "span", static=True)
    small, large = runner.new_cache(2, 100), runner.new_cache(2, 1100)
    assert (small.capacity, large.capacity) == (256, 1280)
    runner.release(large)
    runner.release(small)
    runner.release(small)  # twice: still pooled once
    assert len(runner.pool.free) == 2
    assert runner.new_cache(2, 200) is small
    assert runner.new_cache(2, 300) is large  # longer, within the reuse span
    assert runner.new_cache(1, 10) not in (small, large)  # another batch size never matches
    runner.release(large)
    assert runner.new_cache(2, 100) is not large  # 1280 slots for 256 (100 rounded up): beyond the span


def test_eager_runner_does_not_pool(target):
    cache = target.new_cache(1, 100)
    target.release(cache)
    assert cache.capacity == 100 and not target.pool.free


def test_cached_prefix_reads_drafted_tokens_back_lazily():
    from sdbench.drafting.prefix import CachedPrefix

    prefix = CachedPrefix(2, 16)
    ctx = torch.tensor([[1, 2, 3, 4, 5, 6, 0, 0], [1, 2, 3, 9, 9, 9, 9, 0]])
    prefix.holds(ctx, [3, 3])
    prefix.wrote(torch.tensor([[4, 7], [9, 9]]), [3, 3])  # drafts, not yet read back
    assert prefix.fed == [5, 5] and int(prefix.seen[0, 3]) == 0
    prefix.wrote(torch.tensor([[5], [8]]), [4, 4])  # a later write over position 4 wins
    prefix.agree(ctx, [6, 7])
    # row 0 agrees up to position 4 (5 == 5), row 1 disagrees at 4 (8 vs 9)
    assert prefix.fed == [5, 4]
    tokens, start, todo = prefix.unseen(ctx, [6, 7])
    assert start == [5, 4] and todo == [1, 3] and tokens.tolist() == [[6, 0, 0], [9, 9, 9]]



def test_cost_model_times_through_the_graphs(fake_graphs):
    """`predict magicdec` times the forwards decoding would run: one capture per (cache, width), then replays."""
    from sdbench.analysis.costs import profile

    runner, log = fake_graphs
    p = profile(runner, 2, 48, gammas=(1, 3), budgets=(8,))
    assert p.target_s > 0 and set(p.verify_s) == {1, 3} and set(p.draft_s) == {8}
    # dense cache: widths 1, 2 and 4; sparse cache: width 1; every later call of the same width is a replay
    assert log.count("capture") == 4 and log.count("replay") > 4


@pytest.mark.cuda
@cuda
def test_cost_model_profiles_with_real_cuda_graphs():
    from sdbench.analysis.costs import profile

    runner = ModelRunner(tiny_model(0).to("cuda"), "graphed", fast=True)
    p = profile(runner, 2, 300, gammas=(1, 3), budgets=(64,))
    assert runner.graphs, "a capture failed or disagreed with the eager forward"
    assert p.target_s > 0 and set(p.draft_s) == {64}


# ---- bfloat16: the static path's maths in the dtype CUDA graphs run in ---------------------------------------

BF16_TOL = TOLERANCE[torch.bfloat16]  # the fidelity probe's bound (relative to the logits' scale)


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to b's scale, as the probe measures it."""
    return float((a.float() - b.float()).abs().max()) / max(1.0, float(b.float().abs().max()))


@pytest.fixture(scope="module")
def bf16_model():
    return perturbed(tiny_model(0), 100).to(torch.bfloat16)


@pytest.mark.parametrize("width", [1, 5])
def test_static_forward_in_bfloat16_equals_eager_and_the_library(bf16_model, prompts, width):
    """The static forward (attention over the whole pooled cache under a device-side mask, scattered writes, its
    own cos/sin buffers) in bfloat16 against the eager runner and the library's own bfloat16 forward.

    Tolerance: the fidelity probe's bfloat16 bound, 1e-1 of the logits' scale (bfloat16 keeps 8 significant
    bits; the library's cached and uncached forwards differ by 2.3e-2 on SmolLM2). Measured here: static
    against eager up to 3.5e-2 (attention over the whole cache sums in another order), either against the
    library up to 4e-2; a static path with stale rotary positions is off by far more."""
    eager = ModelRunner(bf16_model, "eager-bf16")
    static = ModelRunner(bf16_model, "static-bf16", static=True)
    assert static.static and not eager.static and static.dtype == eager.dtype == torch.bfloat16
    tokens = torch.randint(0, VOCAB, (len(prompts), width), generator=torch.Generator().manual_seed(width))
    start = [len(p) for p in prompts]  # rows at different positions
    cache = _prefilled(static, prompts)
    got = static.run(cache, Step(tokens, start))
    assert set(cache.graphs) == {(len(prompts), width)}  # it ran the static forward
    want = eager.run(_prefilled(eager, prompts), Step(tokens, start))
    assert _gap(got, want) <= BF16_TOL
    with torch.no_grad():
        library = [bf16_model(torch.tensor([p + t])).logits[0, -width:] for p, t in zip(prompts, tokens.tolist())]
    for b, lib in enumerate(library):
        assert _gap(got[b], lib) <= BF16_TOL and _gap(want[b], lib) <= BF16_TOL
