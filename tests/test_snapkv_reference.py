"""SnapKV against a hand computation from the library's own attention weights.

`kv/sparse.py` scores the prefix by re-running the last `window` prompt tokens over the full cache
(`ScoringView`): per layer and KV head, the attention weights of those queries summed over the observation
window and over the query heads that share the KV head (query head h reads KV head h // group, as the
library's `repeat_kv` does), max-pooled over 7 neighbouring positions (SnapKV's kernel), and keeps the
`budget - window` best positions below the recent window. Here that is computed by hand from transformers'
eager attention weights (`output_attentions=True`) of the whole prompt, and the sparse cache's forward is
compared with a dense attention whose mask allows exactly the kept positions per KV head plus the recent
window: the selection and the attention over it, neither computed by sdbench.
"""

from __future__ import annotations

import pytest
import torch

from sdbench.forward_step import Step
from sdbench.kv.cache import DenseKVCache
from sdbench.kv.sparse import SparseSpec, compress
from sdbench.models.forward.runner import ModelRunner
from sdbench.padding import right_pad
from tests.conftest import VOCAB, tiny_model
from tests.references import perturbed

POOL = 7  # SnapKV's pooling kernel: a position scores the best weight among its 3 neighbours each side
BUDGET, WINDOW = 12, 4  # 8 static slots chosen per KV head, 4 recent positions
LENGTHS = (30, 24)  # rows of different lengths: their own floors, a scattered re-run


def _model():
    return perturbed(tiny_model(0), 100)  # 4 query heads over 2 KV heads: the grouping matters


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(21)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def snap(prompts):
    """(runner, the sparse cache SnapKV made after prefilling the prompts)."""
    runner = ModelRunner(_model(), "snap")
    dense = runner.new_cache(len(prompts), 64)
    runner.prefill(dense, prompts)
    lengths = [len(p) for p in prompts]
    sparse = compress(runner, dense, lengths, right_pad(prompts), SparseSpec("snapkv", BUDGET, window=WINDOW), 3)
    return runner, sparse


@pytest.fixture(scope="module")
def hand_scores(prompts):
    """Per row, per layer: [H_kv, P] SnapKV scores from transformers' eager attention weights, by hand, pooled
    and (to show that the pooling matters) not pooled."""
    model = _model()
    model.set_attn_implementation("eager")
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    obs = min(WINDOW, *LENGTHS)
    pooled, raw = [], []
    for p in prompts:
        with torch.no_grad():
            att = model(torch.tensor([p]), output_attentions=True).attentions  # per layer [1, Hq, P, P]
        raw.append([a[0, :, -obs:, :].float().sum(1)  # [Hq, P]: summed over the observation window's queries
                    .view(kv, heads // kv, len(p)).sum(1) for a in att])  # heads g*kv .. read KV head g
        pooled.append([torch.stack([w[:, max(0, s - POOL // 2): s + POOL // 2 + 1].max(-1).values
                                    for s in range(len(p))], dim=-1) for w in raw[-1]])
    return pooled, raw


def _kept(sparse, layer: int, b: int, h: int) -> list[int]:
    pos = sparse.static_pos[layer, b, h]
    return sorted(int(x) for x in pos[pos >= 0])


def test_snapkv_keeps_the_prefix_positions_the_last_window_attends_to_most(snap, hand_scores):
    runner, sparse = snap
    pooled, raw = hand_scores
    n = BUDGET - WINDOW
    pooling_matters, heads_differ = False, False
    for b, length in enumerate(LENGTHS):
        floor = length - WINDOW  # below the recent window
        for layer in range(len(runner.layers)):
            kept_by_head = []
            for h in range(runner.n_kv_heads):
                kept = _kept(sparse, layer, b, h)
                kept_by_head.append(kept)
                score = pooled[b][layer][h, :floor]
                assert len(kept) == n and len(set(kept)) == n and all(0 <= k < floor for k in kept)
                rest = sorted(set(range(floor)) - set(kept))
                # the kept positions are a top n of the hand scores: none left out scores more than one kept.
                # Pooling makes runs of equal scores (a run shares its best weight), and the cut usually falls
                # inside one, so which of a run's positions are kept is a tie-break; the scores kept are not
                tol = 1e-5 * float(score.max())
                assert float(score[kept].min()) >= float(score[rest].max()) - tol, (b, layer, h)
                torch.testing.assert_close(score[kept].sort().values, score.topk(n).values.sort().values,
                                           atol=tol, rtol=0)
                pooling_matters |= sorted(raw[b][layer][h, :floor].topk(n).indices.tolist()) != kept
            heads_differ |= kept_by_head[0] != kept_by_head[1]
    # the case tells SnapKV from its near misses: the pooling and the KV head change what is kept
    assert pooling_matters and heads_differ


class KeptDense(DenseKVCache):
    """Reference: a full cache whose mask, once `kept` is set (per layer [B, H_kv, n] positions), lets query head
    h at position q see exactly the positions KV head h // group kept, and the recent positions in
    (q - WINDOW, q] at or above the row's floor, causal throughout."""

    kept: list | None = None
    floor: torch.Tensor | None = None
    group = 1

    def update(self, layer, k, v, step):
        keys, values, mask = super().update(layer, k, v, step)
        if self.kept is None:
            return keys, values, mask
        B, H, _ = self.kept[layer].shape
        pos = torch.arange(step.kv_len)
        static = torch.zeros(B, H, step.kv_len, dtype=torch.bool)
        for b in range(B):
            for h in range(H):
                static[b, h, self.kept[layer][b, h]] = True
        static = static.repeat_interleave(self.group, dim=1)[:, :, None, :]  # [B, Hq, 1, S]
        q = step.positions[:, None, :, None]  # [B, 1, T, 1]
        recent = (pos >= self.floor[:, None, None, None]) & (pos > q - WINDOW)
        allowed = (pos <= q) & (static | recent)  # [B, Hq, T, S]
        return keys, values, torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))


def test_sparse_forward_equals_dense_attention_restricted_to_the_kept_positions(snap, prompts):
    runner, sparse = snap
    ref = KeptDense(len(runner.layers), len(prompts), runner.n_kv_heads, runner.head_dim, 64, runner.dtype,
                    runner.device)
    runner.prefill(ref, prompts)
    # the positions SnapKV kept (checked against the hand scores above), keys and values from the full cache
    ref.kept = [sparse.static_pos[layer].clone() for layer in range(len(runner.layers))]
    assert all((k >= 0).all() for k in ref.kept)
    ref.floor = torch.tensor(LENGTHS) - WINDOW
    ref.group = runner.n_heads // runner.n_kv_heads
    nxt = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    start = list(LENGTHS)
    # three tokens at once (rows at their own positions), one more, a rewind, then on past the window's reach
    steps = ((nxt[:, :3], start), (nxt[:, 3:4], [s + 3 for s in start]), (nxt[:, 4:6], [s + 1 for s in start]),
             (nxt[:, :4], [s + 3 for s in start]), (nxt[:, 4:5], [s + 7 for s in start]))
    for tokens, at in steps:
        torch.testing.assert_close(runner.run(sparse, Step(tokens, at)), runner.run(ref, Step(tokens, at)),
                                   atol=1e-4, rtol=1e-4)
