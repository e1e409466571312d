"""MagicDec: the sparse draft cache attends to exactly its budget, and self-speculation stays lossless."""

import pytest
import torch

from sdbench.forward_step import Step
from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate
from sdbench.errors import SdbenchError
from sdbench.kv.cache import DenseKVCache
from sdbench.kv.sparse import SparseSpec, _select, compress
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.magicdec import MagicDec, MagicDecStrategy
from tests.conftest import VOCAB

GREEDY = SamplingConfig()
NEW = 20


@pytest.fixture(scope="module")
def long_prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (40, 23, 57)]


def reference(target, prompts):
    return generate(target, Autoregressive(), prompts, max_new_tokens=NEW, sampling=GREEDY).output_ids


@pytest.mark.parametrize("kv", ["streamingllm", "snapkv"])
@pytest.mark.parametrize("budget", [6, 24, 80])  # smaller than, near, and larger than prompt + output
@pytest.mark.parametrize("batch", [1, 3])
def test_self_speculation_is_lossless(target, long_prompts, kv, budget, batch):
    ps = long_prompts[:batch]
    ref = reference(target, ps)
    for gamma in (1, 4):
        out = generate(target, MagicDec(target, gamma, kv, budget, sink=4, window=5), ps, max_new_tokens=NEW,
                       sampling=GREEDY)
        assert out.output_ids == ref
        if budget >= max(len(p) for p in ps) + NEW:  # the whole context fits: the draft is the target
            assert all(r.accepted == r.drafted for r in out.rows)


def test_small_budget_drafts_worse_than_large(target, long_prompts):
    rates = []
    for budget in (6, 80):
        out = generate(target, MagicDec(target, 3, "streamingllm", budget, sink=2), long_prompts,
                       max_new_tokens=NEW, sampling=GREEDY)
        rates.append(sum(r.accepted for r in out.rows) / sum(r.drafted for r in out.rows))
    assert rates[0] < rates[1] == 1.0


@pytest.mark.parametrize("kv", ["streamingllm", "snapkv"])
def test_small_draft_model_with_sparse_cache_is_lossless(target, small_draft, long_prompts, kv):
    out = generate(target, DraftModel(small_draft, 3, kv, 12, 3, 4), long_prompts, max_new_tokens=NEW,
                   sampling=GREEDY)
    assert out.output_ids == reference(target, long_prompts)


class WindowedDense(DenseKVCache):
    """Reference: a dense cache whose mask, once `windowed` is set, allows only sinks and the last `window`
    positions (the prompt itself is prefilled with full attention, as the target does)."""

    def __init__(self, *args, sink, window, **kwargs):
        super().__init__(*args, **kwargs)
        self.sink, self.window, self.windowed = sink, window, False

    def update(self, layer, k, v, step):
        keys, values, mask = super().update(layer, k, v, step)
        if not self.windowed:
            return keys, values, mask
        pos = torch.arange(step.kv_len)[None, None, :]
        q = step.positions[:, :, None]
        allowed = (pos <= q) & ((pos < self.sink) | (pos > q - self.window))
        return keys, values, allowed[:, None]


def test_streamingllm_attention_equals_sink_plus_window(target):
    """The sparse cache computes exactly attention over sinks + the most recent window."""
    sink, budget, gamma = 3, 10, 2
    prompt = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    dense = target.new_cache(1, 64)
    target.prefill(dense, [prompt])
    sparse = compress(target, dense, [30], torch.tensor([prompt]), SparseSpec("streamingllm", budget, sink),
                      gamma)
    ref = WindowedDense(len(target.layers), 1, target.n_kv_heads, target.head_dim, 64, target.dtype,
                        target.device, sink=sink, window=budget - sink)
    target.prefill(ref, [prompt])
    ref.windowed = True
    nxt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    # two tokens at once, then one, then a rewind to an earlier position: both caches agree throughout
    for tokens, start in ((nxt[:, :2], 30), (nxt[:, 2:3], 32), (nxt[:, 3:5], 31)):
        torch.testing.assert_close(target.run(sparse, Step(tokens, [start])), target.run(ref, Step(tokens, [start])),
                                   atol=1e-4, rtol=1e-4)


def test_sparse_writes_across_the_ring_end_and_rewinds_equal_the_reference(target):
    """Two rows through the ring's every kind of write: one run of slots shared by the rows (a copy), a run
    crossing the ring's end, and rows at different positions (scatters), with a rewind between them; logits
    and the slots' positions equal those of sinks + window over a full cache."""
    sink, budget, gamma, n = 3, 10, 2, 30
    prompts = torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(5))
    dense = target.new_cache(2, 64)
    target.prefill(dense, prompts.tolist())
    sparse = compress(target, dense, [n, n], prompts, SparseSpec("streamingllm", budget, sink), gamma)
    ref = WindowedDense(len(target.layers), 2, target.n_kv_heads, target.head_dim, 64, target.dtype,
                        target.device, sink=sink, window=budget - sink)
    target.prefill(ref, prompts.tolist())
    ref.windowed = True
    ring_end = n + sparse.ring - n % sparse.ring  # the first position that goes back to the ring's first slot
    nxt = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(6))
    steps = [(2, [n, n]), (2, [ring_end - 1] * 2), (1, [ring_end + 1] * 2), (3, [ring_end] * 2),
             (2, [ring_end + 3, ring_end + 2])]
    kinds = []
    for width, start in steps:
        torch.testing.assert_close(target.run(sparse, Step(nxt[:, :width], start)),
                                   target.run(ref, Step(nxt[:, :width], start)), atol=1e-4, rtol=1e-4)
        kinds.append(isinstance(sparse._at, slice))
        top = max(start) + width  # every slot holds the latest position written there
        for b in range(2):
            held = {int(sparse.ring_slots(p)): p for p in range(n - budget + sink, top - (start[0] - start[b]))}
            assert {s: int(sparse.slot_pos[b, s]) for s in held} == held
    assert kinds == [True, False, True, True, False]  # copies and scatters, the ring's end crossed


def test_snapkv_selection_keeps_top_positions_below_floor():
    scores = torch.tensor([[[0.1, 0.9, 0.3, 0.8, 0.7, 5.0]]]).repeat(2, 1, 1)  # [B=2, H=1, S=6]
    idx, valid = _select(scores, torch.tensor([5, 2]), 3)  # row 0: positions 0..4 eligible; row 1: 0..1
    assert idx[0, 0].tolist() == [1, 3, 4] and valid[0].tolist() == [True, True, True]
    assert idx[1, 0, :2].tolist() == [0, 1] and valid[1].tolist() == [True, True, False]


@pytest.mark.parametrize("args, message", [
    (("h2o", 64), "unknown KV selector"),
    (("streamingllm", 1), "at least 2"),
    (("streamingllm", 8, 8), "sink"),
    (("snapkv", 8, 4, 9), "window"),
])
def test_bad_sparse_settings(args, message):
    with pytest.raises(SdbenchError, match=message):
        SparseSpec(*args)


def test_cost_model_profile_and_critical_length(target):
    from sdbench.analysis.costs import critical_lengths, predictions, profile
    from sdbench.analysis.theory import alpha_from_tokens_per_step
    from sdbench.engine.iid_model import expected_tokens_per_step

    p = profile(target, 2, 48, gammas=(1, 3), budgets=(8, 64))
    assert p.target_s > 0 and set(p.verify_s) == {1, 3} and set(p.draft_s) == {8}  # 64 >= context: skipped
    rows = predictions(p, 0.8)
    assert {(r["gamma"], r["budget"]) for r in rows} == {(1, 8), (3, 8)}
    assert critical_lengths([
        {"batch": 1, "context": 256, "predicted_speedup": 0.9}, {"batch": 1, "context": 1024, "predicted_speedup": 1.2},
        {"batch": 1, "context": 4096, "predicted_speedup": 1.5}, {"batch": 8, "context": 256, "predicted_speedup": 0.7},
    ]) == {1: 1024, 8: None}
    for alpha in (0.0, 0.35, 0.9):
        assert alpha_from_tokens_per_step(expected_tokens_per_step(alpha, 4), 4) == pytest.approx(alpha, abs=1e-6)


def test_critical_length_is_interpolated_per_batch():
    from sdbench.analysis.costs import crossing_lengths

    points = [(1, 256, 0.9), (1, 1024, 1.2), (1, 4096, 1.5), (1, 1024, 0.5), (8, 256, 0.7), (8, 512, 0.9),
              (4, 256, 1.1), (4, 512, 0.9)]
    rows = [{"batch": b, "context": s, "predicted_speedup": v} for b, s, v in points]
    found = crossing_lengths(rows)
    # 0.9 at 256 and 1.2 at 1024 (the better setting there): a third of the way in log context, 256 * 4^(1/3)
    assert found[1][0] == "at" and found[1][1] == pytest.approx(256 * 4 ** (1 / 3))
    assert found[8] == ("above", 512) and found[4] == ("below", 256)


def fake_results(runs):
    """A results table of magicdec runs: (run_id, selector, budget, gamma, prompt_tokens, [(new_tokens, steps)])."""
    import json

    import pandas as pd

    rows = [{"role": "baseline", "strategy": "autoregressive", "run_id": "r0", "params": "{}", "prompt_tokens": 100,
             "new_tokens": 10, "steps": 9}]
    for run_id, kv, budget, gamma, length, gens in runs:
        params = json.dumps({"gamma": gamma, "kv": kv, "budget": budget})
        rows += [{"role": "strategy", "strategy": "magicdec", "run_id": run_id, "params": params,
                  "prompt_tokens": length, "new_tokens": n, "steps": k} for n, k in gens]
    return pd.DataFrame(rows)


def test_alpha_is_fitted_per_selector_budget_and_prompt_length(monkeypatch):
    import sdbench.reporting.results as results
    from sdbench.analysis.costs import alpha_for, alphas_from_results, with_alphas
    from sdbench.analysis.theory import alpha_from_tokens_per_step

    # mean accepted length (new - 1) / steps: 3.0 for StreamingLLM, 1.5 for SnapKV, both at budget 64
    table = fake_results([("a", "streamingllm", 64, 4, 512, [(31, 10)]), ("b", "snapkv", 64, 4, 512, [(16, 10)]),
                          ("c", "snapkv", 64, 4, 2048, [(21, 10), (21, 10)]), ("d", "snapkv", 128, 2, 512, [(21, 10)])])
    monkeypatch.setattr(results, "read_results", lambda paths: table)
    measured = alphas_from_results(["x"])
    assert set(measured) == {("streamingllm", 64, 512), ("snapkv", 64, 512), ("snapkv", 64, 2048), ("snapkv", 128, 512)}
    assert measured[("streamingllm", 64, 512)] == pytest.approx(alpha_from_tokens_per_step(3.0, 4))
    assert measured[("snapkv", 64, 512)] == pytest.approx(alpha_from_tokens_per_step(1.5, 4))
    assert measured[("snapkv", 64, 2048)] == pytest.approx(alpha_from_tokens_per_step(2.0, 4))
    # the nearest measured prompt length, in ratio
    assert alpha_for(measured, "snapkv", 64, 1800) == measured[("snapkv", 64, 2048)]
    assert alpha_for(measured, "snapkv", 64, 600) == measured[("snapkv", 64, 512)]
    assert alpha_for(measured, "streamingllm", 128, 512) is None
    row = {"batch": 1, "context": 512, "gamma": 4, "budget": 64, "target_ms": 10.0, "draft_ms": 2.0, "verify_ms": 12.0}
    made = with_alphas([row], measured, 0.6)
    assert [(r["selector"], r["alpha"]) for r in made] == [("snapkv", measured[("snapkv", 64, 512)]),
                                                           ("streamingllm", measured[("streamingllm", 64, 512)])]
    assert made[1]["predicted_speedup"] > made[0]["predicted_speedup"]  # the selector that agrees more wins
    lone = with_alphas([{**row, "budget": 32}], measured, 0.6)  # a budget no run measured: the given alpha
    assert [(r["selector"], r["alpha"]) for r in lone] == [("-", 0.6)]


@pytest.mark.slow
def test_predict_magicdec_command(capsys, tmp_path):
    """On the embedded model: the printed figures are those recomputed from the profile it writes."""
    import pandas as pd

    from sdbench.cli import main
    from tests.test_predict_scale import assert_predict_magicdec_output

    main(["predict", "magicdec", "--batch", "1", "--context", "64", "--budget", "16", "--gamma", "2",
          "--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    df = pd.read_parquet(next(tmp_path.glob("predict-magicdec-*.parquet")))
    assert len(df) == 1 and (df["budget"] == 16).all() and (df["gamma"] == 2).all() and (df["alpha"] == 0.8).all()
    assert_predict_magicdec_output(out, df)


def test_magicdec_search_space_keeps_budgets_below_the_context():
    import optuna

    from sdbench.strategies.spec import SearchContext

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    space = SearchContext(prompt_tokens=150, max_new_tokens=50)
    for _ in range(20):
        gamma, options = MagicDecStrategy.search_space(study.ask(), space)
        assert 1 <= gamma <= 6 and options["kv"] in ("streamingllm", "snapkv")
        assert options["budget"] in (32, 64, 128) and options["window"] <= options["budget"]
