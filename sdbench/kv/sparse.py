"""Fixed-size draft caches for self-speculation (MagicDec): a sparse view of a full cache.

Layout per layer: [B, H_kv, n_static + ring, D].
  static slots  - kept for the whole generation: the first `sink` positions (StreamingLLM attention sinks)
                  or, per KV head, the prefix positions the last prompt tokens attend to most (SnapKV);
  ring slots    - the most recent positions; position p lives in slot n_static + p % ring, so new tokens
                  overwrite the oldest ones and a rewind needs nothing (as in the dense cache, the next
                  forward simply writes from the earlier position again).
A query at position q attends to the static slots and to ring slots holding positions in
(q - window, q] at or above the row's `floor` (the first position the window may hold), so it sees exactly
budget keys once the context is long enough: the draft's cost stays flat as context grows. A row whose
prompt leaves static slots unused gives them to its window, so a budget at least as long as the context
attends to everything, exactly like the full cache.
Keys are stored already rotated at their true positions.

A layer with its own sliding window W (`models/forward/windows.py`) also drops every key at or below q - W, ring or
static: static slots record their true positions per layer and KV head (`static_pos`; SnapKV picks them per
layer and head), so such a layer's mask is per KV head, made for all the layers of one window at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sdbench.errors import SdbenchError
from sdbench.forward_step import Step
from sdbench.kv.cache import DenseKVCache, KVCache, StepIndex, TreeStep, additive, keep_path_index

SELECTORS = ("streamingllm", "snapkv")


@dataclass(frozen=True)
class SparseSpec:
    """How to compress: selector, total budget (tokens attended), sink count, window size."""

    selector: str = "streamingllm"
    budget: int = 256
    sink: int = 16
    window: int = 32  # SnapKV: recent window = observation window; StreamingLLM: budget - sink

    def __post_init__(self):
        if self.selector not in SELECTORS:
            raise SdbenchError(f"unknown KV selector '{self.selector}'; choose one of {', '.join(SELECTORS)}")
        if self.budget < 2:
            raise SdbenchError(f"--set budget={self.budget}: a sparse KV budget needs at least 2 tokens")
        if self.selector == "streamingllm" and not 0 <= self.sink < self.budget:
            raise SdbenchError(f"--set sink={self.sink}: need 0 <= sink < budget ({self.budget})")
        if self.selector == "snapkv" and not 1 <= self.window <= self.budget:
            raise SdbenchError(f"--set window={self.window}: need 1 <= window <= budget ({self.budget})")

    @property
    def n_static(self) -> int:
        return self.sink if self.selector == "streamingllm" else self.budget - self.window

    @property
    def recent(self) -> int:
        return self.budget - self.n_static


class SparseKVCache(KVCache):
    """Static slots plus a position-indexed ring; see the module docstring."""

    wants_queries = False

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, n_static: int, ring: int,
                 dtype: torch.dtype, device: torch.device, windows: list[int | None] | None = None,
                 n_heads: int | None = None):
        """ring: slots for the largest window plus one step's speculative tokens (and two spare); windows: each
        layer's own sliding window (None: none); n_heads: query heads (a windowed layer's mask is per head)."""
        self.n_static = n_static
        self.windows = list(windows) if windows else [None] * n_layers
        self.group = (n_heads or n_kv_heads) // n_kv_heads
        self.ring = ring
        size = n_static + self.ring
        self.window = torch.zeros(batch, dtype=torch.long, device=device)  # [B] recent positions attended
        shape = (batch, n_kv_heads, size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.slot_pos = torch.full((batch, size), -1, dtype=torch.long, device=device)  # position per slot
        # static slots' true positions [L, B, H_kv, n_static] (-1: unused), read by windowed layers only
        self.static_pos = torch.full((n_layers, batch, n_kv_heads, n_static), -1, dtype=torch.long, device=device)
        self.floor = torch.zeros(batch, dtype=torch.long, device=device)
        self.capacity = 1 << 62  # positions are unbounded: the ring wraps
        self._rows = torch.arange(batch, device=device)[:, None]
        self._step: StepIndex | None = None  # the forward the next three were made for
        self._at: slice | torch.Tensor | None = None  # its slots
        self._masks: list = []  # per layer, its additive mask: [B, 1, T, slots], or [B, Hq, T, slots] if windowed
        self.static_kv_len = size  # a static-shape forward attends over every slot (masked), as always
        self.graphs: dict = {}  # (B, T) -> StaticForward captured over this cache's storage
        self.pool_key = None
        self.prompt_len = torch.zeros(batch, dtype=torch.long)
        self.ids = self.crossed = None  # no recomputation (models/forward/recompute.py): a sparse cache only drafts, and a
        # draft's stale keys cost acceptance, never the output

    def reset(self, window: torch.Tensor) -> None:
        """Empty the cache (in place: captured graphs keep reading the same tensors) for a new generation."""
        self.prompt_len.zero_()
        self.window.copy_(window)
        self.slot_pos.fill_(-1)
        self.static_pos.fill_(-1)
        self.floor.zero_()
        self._step = self._at = None
        self._masks = []

    def ring_slots(self, positions):
        """Slot of each position (a tensor, or one int)."""
        return self.n_static + positions % self.ring

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, step: StepIndex):
        # k, v: [B, H_kv, T, D] at positions step.positions [B, T]
        if self._step is not step:  # once per forward, at the first layer: slots, their positions, the mask
            self._begin(step, k.dtype)
        at = self._at
        if isinstance(at, slice):
            self.k[layer][:, :, at] = k
            self.v[layer][:, :, at] = v
        else:
            self.k[layer][self._rows, :, at] = k.transpose(1, 2)
            self.v[layer][self._rows, :, at] = v.transpose(1, 2)
        return self.k[layer], self.v[layer], self._masks[layer]

    def _begin(self, step: StepIndex, dtype: torch.dtype) -> None:
        """Where this forward's keys go, shared by every layer: one run of slots for all rows when the rows
        start at one position and the run does not wrap (a plain copy), else the slots [B, T] (a scatter).
        A tree's node j goes where a chain's token j would (`TreeStep.positions`), its slot recording that
        position, so that what a tree leaves behind is stale exactly as a rejected chain draft is."""
        slots = self.ring_slots(step.positions)  # [B, T]
        self._at = slots
        if step.start is not None and step.uniform:
            first = self.ring_slots(step.start[0])
            if first + step.T <= self.n_static + self.ring:
                self._at = slice(first, first + step.T)
        self.slot_pos[self._rows, slots] = step.positions
        tree = step if isinstance(step, TreeStep) else None
        self._masks, self._step = self._layer_masks(step.rotated, dtype, tree), step

    @torch.inference_mode()
    def keep_path(self, b: int, start: int, nodes) -> None:
        """After a tree forward from `start`, row b keeps the accepted path (`DenseKVCache.keep_path`): the
        keys and values of block nodes `nodes` (1-based, ascending) move to the ring slots of positions
        start + 1, start + 2, ..., which record those positions. Static slots, the floor and the window are
        untouched: a tree step writes ring slots only, as a chain step does."""
        src, dst = keep_path_index(start, nodes, self.slot_pos.device)
        src, dst = self.ring_slots(src), self.ring_slots(dst)
        for kv in (self.k, self.v):
            for x in kv:
                x[b, :, dst] = x[b, :, src]
        self.slot_pos[b, dst] = start + 1 + torch.arange(len(dst), device=dst.device)

    def _key_positions(self, tree: TreeStep | None):
        """Each slot's key position [B, S] (a tree node's is its rotated one, not its slot's) and, for a tree
        forward, which keys each query may see beyond the window rule [B, T, S] (outside the tree's block:
        all; inside: its ancestors and itself), else None."""
        pos = self.slot_pos
        if tree is None:
            return pos, None
        B, T = tree.positions.shape
        node = pos - tree.first[:, None]  # [B, S]: index in the row's block
        ring = torch.arange(pos.shape[1], device=pos.device) >= self.n_static
        inside = ring & (node >= 0) & (node < T)
        at = node.clamp(0, T - 1)
        key_pos = torch.where(inside, tree.rotated.gather(1, at), pos)
        seen = ~inside[:, None] | tree.ancestors.gather(2, at[:, None].expand(B, T, -1))
        return key_pos, seen

    def _attend_mask(self, q: torch.Tensor, key_pos: torch.Tensor, seen: torch.Tensor | None) -> torch.Tensor:
        """[B, 1, T, slots] bool for queries at positions q [B, T]."""
        pos = key_pos[:, None, :]  # [B, 1, S]
        is_static = torch.arange(pos.shape[-1], device=pos.device) < self.n_static
        static = is_static & (self.slot_pos[:, None, :] >= 0)
        recent = (~is_static) & (self.slot_pos[:, None, :] >= self.floor[:, None, None]) & (pos <= q[..., None]) & (
            pos > q[..., None] - self.window[:, None, None])
        allowed = static | recent
        if seen is not None:
            allowed &= seen
        return allowed[:, None]

    def _layer_masks(self, q: torch.Tensor, dtype: torch.dtype, tree: TreeStep | None = None) -> list:
        """Each layer's additive mask for queries at q [B, T]: one shared by the layers without a window of
        their own, and for the others one batch per window (`_windowed`)."""
        key_pos, seen = self._key_positions(tree)
        allowed = self._attend_mask(q, key_pos, seen)
        by_window: dict = {}
        for layer, w in enumerate(self.windows):
            by_window.setdefault(w, []).append(layer)
        masks: list = [None] * len(self.windows)
        for w, layers in by_window.items():
            if w is None:
                made = [additive(allowed, dtype)] * len(layers)
            else:
                made = self._windowed(allowed, q, key_pos, w, layers, dtype)
            for layer, mask in zip(layers, made):
                masks[layer] = mask
        return masks

    def _windowed(self, allowed: torch.Tensor, q: torch.Tensor, key_pos: torch.Tensor, w: int, layers: list[int],
                  dtype) -> list:
        """Masks of `layers` (window w): `allowed` [B, 1, T, S] less the keys at or below q - w; static slots by
        their true position per layer and KV head, so then a mask per layer, per query head [B, Hq, T, S]."""
        lo = q[:, None, :, None] - w  # [B, 1, T, 1]
        recent = allowed[..., self.n_static :] & (key_pos[:, None, None, self.n_static :] > lo)
        if not self.n_static:
            return [additive(recent, dtype)] * len(layers)
        sp = self.static_pos[layers][:, :, :, None, :]  # [l, B, H, 1, n]
        static = (sp >= 0) & (sp > lo[None])  # [l, B, H, T, n]
        both = torch.cat((static, recent[None].expand(*static.shape[:-1], recent.shape[-1])), dim=-1)
        l, B, H, T, S = both.shape  # query head h reads KV head h // group, as the attention does
        both = both[:, :, :, None].expand(l, B, H, self.group, T, S).reshape(l, B, H * self.group, T, S)
        return list(additive(both, dtype).unbind(0))


class ScoringView(KVCache):
    """Read-only view of a dense cache that records SnapKV scores while the last prompt tokens are re-run.

    The keys of the re-run positions are already in the dense cache, so nothing is written (rewriting them
    could change the target's cache in the last bits and with it the greedy reference). Only the eager
    forward runs over it: it is used once per prompt, never pooled or captured."""

    wants_queries = True
    static_kv_len = None
    pool_key = None

    def __init__(self, dense: DenseKVCache, pool: int = 7):
        self.dense = dense
        self.capacity = dense.capacity
        self.prompt_len = dense.prompt_len  # the re-run prompt tokens rotate as the prefill rotated them
        self.ids = self.crossed = None  # the re-run tokens are already the dense cache's
        self.graphs: dict = {}
        self.pool = pool
        self.scores: dict[int, torch.Tensor] = {}  # layer -> [B, H_kv, kv_len]

    def update(self, layer: int, k, v, step: StepIndex):
        keys = self.dense.k[layer]
        mask = step.causal_mask(keys.dtype, self.dense.windows[layer])  # a mask even for one query: the scores'
        # columns must stay the cache's positions
        return keys[:, :, : step.kv_len], self.dense.v[layer][:, :, : step.kv_len], mask

    def queries(self, layer: int, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None) -> None:
        # q [B, Hq, T, D]; keys [B, H_kv, S, D]
        B, Hq, T, D = q.shape
        H = keys.shape[1]
        logits = torch.einsum("bhgtd,bhsd->bhgts", q.view(B, H, Hq // H, T, D).float(), keys.float()) * D**-0.5
        if mask is not None:  # additive [B, 1, T, S]
            logits = logits + mask[:, :, None].float()
        weight = logits.softmax(-1).sum(dim=(2, 3))  # [B, H_kv, S]
        self.scores[layer] = F.max_pool1d(weight, self.pool, stride=1, padding=self.pool // 2)


def compress(runner, dense: DenseKVCache, lengths: list[int], tokens: torch.Tensor, spec: SparseSpec,
             lookahead: int) -> SparseKVCache:
    """A sparse cache holding, per row b, a budgeted view of positions [0, lengths[b]) of `dense`.

    tokens [B, >= max(lengths)]: the rows' tokens (SnapKV re-runs the last `window` of them to score)."""
    B = len(lengths)
    P = torch.tensor(lengths, device=runner.device)
    n = spec.n_static
    floor = P.clamp(max=n) if spec.selector == "streamingllm" else (P - spec.recent).clamp(min=0)
    used_static = floor.clamp(max=n)
    cache = runner.new_sparse_cache(B, n, spec.budget - used_static, lookahead)
    cache.prompt_len.copy_(torch.tensor(lengths, dtype=torch.long))
    cache.floor[:] = floor
    if spec.selector == "streamingllm":
        first = torch.arange(n, device=runner.device)
        static = first.clamp(max=dense.capacity - 1).expand(B, runner.n_kv_heads, n)  # [B, H, n]
        valid = first[None] < P[:, None]  # [B, n]
        scores = None
    else:
        scores = _snapkv_scores(runner, dense, lengths, tokens, spec.recent)
    for layer in range(len(runner.layers)):
        if scores is not None:
            static, valid = _select(scores[layer], cache.floor, n)
        _fill(cache, dense, layer, static, valid, P)
    return cache


def filled_for_profile(runner, batch: int, context: int, sink: int, window: int, lookahead: int) -> SparseKVCache:
    """A sparse cache laid out as after a `context`-token prompt (the first `sink` positions static, the last
    `window` in the ring) with random keys and values instead of a prefill: a forward over it costs what a
    draft step at that context costs, which is all `predict magicdec` times."""
    cache = runner.new_sparse_cache(batch, sink, torch.full((batch,), window), lookahead)
    for t in cache.k + cache.v:
        t.normal_(0, 0.1)
    cache.slot_pos[:, :sink] = 0
    cache.static_pos[:] = torch.arange(sink, device=cache.slot_pos.device)
    recent = torch.arange(context - window, context, device=cache.slot_pos.device)
    cache.slot_pos[:, cache.ring_slots(recent)] = recent
    cache.floor[:] = sink
    return cache


def _snapkv_scores(runner, dense, lengths, tokens, window) -> dict[int, torch.Tensor]:
    obs = min(window, min(lengths))
    start = [n - obs for n in lengths]
    chunk = torch.stack([tokens[b, s : s + obs] for b, s in enumerate(start)])
    view = ScoringView(dense)
    runner.hidden(view, Step(chunk, start))
    return view.scores


def _select(scores: torch.Tensor, floor: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, the n best-scored positions below each row's floor: indices [B, H, n] (valid ones first,
    in position order) and which slots are valid [B, n] (all, unless the row has fewer than n positions)."""
    B, H, S = scores.shape
    below = torch.arange(S, device=scores.device)[None, None] < floor[:, None, None]
    k = min(n, S)
    picked = scores.masked_fill(~below, float("-inf")).topk(k, dim=-1).indices  # [B, H, k]
    invalid = picked >= floor[:, None, None]
    order = (picked + invalid * S).sort(dim=-1).indices
    idx = picked.gather(-1, order)
    valid = torch.arange(k, device=scores.device)[None] < floor[:, None]  # [B, k]
    return F.pad(idx, (0, n - k)), F.pad(valid, (0, n - k))


def _fill(cache: SparseKVCache, dense: DenseKVCache, layer: int, static: torch.Tensor, valid: torch.Tensor,
          P: torch.Tensor) -> None:
    B, H, _, D = dense.k[layer].shape
    n = cache.n_static
    if n:
        gather = static[..., None].expand(B, H, n, D)
        cache.k[layer][:, :, :n] = dense.k[layer].gather(2, gather)
        cache.v[layer][:, :, :n] = dense.v[layer].gather(2, gather)
        if layer == 0:  # for the sparse window, static slots only need validity: they always lie below it
            cache.slot_pos[:, :n] = torch.where(valid, 0, -1)
        cache.static_pos[layer] = torch.where(valid[:, None], static, -1)  # a layer's own window needs them
    for b in range(B):  # the most recent positions into the ring
        lo = max(int(cache.floor[b]), int(P[b]) - int(cache.window[b]))
        positions = torch.arange(lo, int(P[b]), device=P.device)
        slots = cache.ring_slots(positions)
        cache.k[layer][b, :, slots] = dense.k[layer][b, :, positions]
        cache.v[layer][b, :, slots] = dense.v[layer][b, :, positions]
        if layer == 0:
            cache.slot_pos[b, slots] = positions
