"""Position-indexed KV cache.

A row's key/value for the token at sequence position ``p`` lives at slot ``p``. Nothing records how many
slots are valid: every forward says where its tokens start (``start[b]``), writes there, and attends to
slots ``<= p`` for a query at position ``p``. Rewinding after a rejected draft is therefore free: the
caller simply starts the next forward at the shorter length, and the stale slots beyond it are either
overwritten or masked out. Storage is allocated once for the whole generation.

A layer with a sliding window W (`models/forward/windows.py`) attends to slots in (p - W, p] only; its storage stays
full-length all the same (a ring of W slots per windowed layer would save memory, a later optimisation).
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVCache(Protocol):
    """Everything a ModelRunner uses of a cache. The caches (dense, sparse, the SnapKV scoring view) subclass it
    and set every attribute; `queries` does nothing unless a cache wants the queries."""

    capacity: int  # a forward may write positions below it
    static_kv_len: int | None  # slots a static-shape forward attends over (every slot, masked); None: eager only
    wants_queries: bool  # True: after `update`, each layer's queries go to `queries` (SnapKV scoring)
    graphs: dict  # (B, T) -> StaticForward captured over this cache's storage
    pool_key: tuple | None  # the runner's pool key (static shapes); None: never pooled
    prompt_len: torch.Tensor  # [B] on the host: each row's prompt length (set by a prefill), which decides the
    # rotation of the rope types the library rescales per call (`models/forward/rotary.py`)
    ids: torch.Tensor | None  # [B, capacity] the token at each position, kept only for a model whose keys may
    # have to be computed again (`models/forward/recompute.py`); None otherwise
    crossed: torch.Tensor | None  # [B] bool on the host, beside `ids`: the row's keys are its long-rope ones
    varied: int = 0  # forwards past the prompts' prefill whose rows' arithmetic depended on how many tokens shared
    # the step (`ModelRunner.run`): 0 after a generation means its every verification was plain decoding's bits

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, step: "StepIndex"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store the new keys/values and return (keys, values, mask) to attend over; mask: additive, in the
        keys' dtype (see `additive`), or None."""
        ...

    def queries(self, layer: int, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None) -> None:
        """The layer's queries [B, Hq, T, D] against the keys [B, H_kv, S, D] it attends to (when wants_queries)."""


def prompt_lengths(cache) -> torch.Tensor | None:
    """The rows' prompt lengths [B] a cache records (None for a cache that records none)."""
    return getattr(cache, "prompt_len", None)


def set_prompt_lengths(cache, lengths) -> None:
    """Record the rows' prompt lengths (in place: a row view writes its parent's); rows start with the keys of
    their prompt (not crossed)."""
    held = prompt_lengths(cache)
    if held is not None:
        held.copy_(torch.as_tensor(lengths, dtype=torch.long))
    if getattr(cache, "crossed", None) is not None:
        cache.crossed.zero_()


def additive(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask (True = may attend) as the 0 / -inf mask scaled_dot_product_attention would otherwise make of
    it in every layer: made once per forward, it is shared by all of them (the same values, so the same
    attention)."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class StepIndex:
    """Positions of the tokens of one forward, shared by all layers.

    start: host list of each row's first position; T: tokens per row in this forward.
    """

    def __init__(self, start: list[int], T: int, device: torch.device):
        self.start = start
        self.T = T
        self.uniform = all(s == start[0] for s in start)
        self.kv_len = max(start) + T  # slots any query of this forward can see
        offs = torch.arange(T, device=device)
        self.positions = torch.tensor(start, device=device)[:, None] + offs  # [B, T]
        self._masks: dict = {}  # window (None: causal) -> additive mask or None

    @property
    def rotated(self) -> torch.Tensor:
        """[B, T] the positions the tokens are rotated at: their slots (a tree's differ, `TreeStep`)."""
        return self.positions

    @classmethod
    def fixed(cls, positions: torch.Tensor, kv_len: int) -> "StepIndex":
        """A step with no host-side positions (a static-shape forward): queries at positions [B, T] (a device
        buffer) attend over the first kv_len slots under a mask computed on the device."""
        step = cls.__new__(cls)
        step.start, step.T, step.uniform, step.kv_len = None, positions.shape[1], False, kv_len
        step.positions, step._masks = positions, {}
        return step

    def causal_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor | None:
        """[B, 1, T, kv_len] additive (`additive`): a query at p sees slots <= p, and with a window W only
        those > p - W. Built once per forward and window (every layer with that window shares it); None when
        every query sees every slot."""
        if window not in self._masks:
            self._masks[window] = None
            if not (self.uniform and self.T == 1 and (window is None or self.kv_len <= window)):
                keys = torch.arange(self.kv_len, device=self.positions.device)[None, None, :]
                q = self.positions[:, :, None]
                allowed = keys <= q
                if window is not None:
                    allowed &= keys > q - window
                self._masks[window] = additive(allowed[:, None], dtype)
        return self._masks[window]


class TreeStep(StepIndex):
    """A forward over one token tree per row (engine/tree.py's TreeBatch, its trees the verifying forward's
    `with_root()` ones): node j of row b goes to slot start[b] + j (`positions`, what the cache writes, as for
    a chain), is rotated at start[b] - 1 + depth (`rotated`: the tree placed with prefix_len = start[b]), and
    sees the slots before start[b], its ancestors and itself; a padding node sees itself only. The chain's
    tree gives the chain's step."""

    def __init__(self, start: list[int], tree, device: torch.device):
        super().__init__(start, tree.valid.shape[1], device)
        self.ancestors = tree.ancestors.to(device)  # [B, T, T]
        self._rotated = tree.positions(torch.tensor(start)).to(device)  # [B, T]
        self.first = self.positions[:, 0]  # [B] each row's first slot (start[b]), on the device

    @classmethod
    def fixed_tree(cls, positions: torch.Tensor, rotated: torch.Tensor, ancestors: torch.Tensor,
                   kv_len: int) -> "TreeStep":
        """A tree step with no host-side positions (a static-shape forward, `StepIndex.fixed`): slots
        positions [B, T], rotated [B, T] and ancestors [B, T, T] are device buffers, the mask made from them on
        the device over the first kv_len slots."""
        step = cls.__new__(cls)
        step.start, step.T, step.uniform, step.kv_len = None, positions.shape[1], False, kv_len
        step.positions, step._masks = positions, {}
        step.ancestors, step._rotated, step.first = ancestors, rotated, positions[:, 0]
        return step

    @property
    def rotated(self) -> torch.Tensor:
        return self._rotated

    def causal_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """[B, 1, T, kv_len] additive: the prefix, ancestors and self; with a window W only keys whose
        position (a slot's own before start, a node's rotated one in the block) is > p - W."""
        if window not in self._masks:
            B, T = self.positions.shape
            device = self.positions.device
            slots = torch.arange(self.kv_len, device=device)[None]  # [1, S]
            node = slots - self.first[:, None]  # [B, S]: index in the row's block
            inside = (node >= 0) & (node < T)
            at = node.clamp(0, T - 1)
            allowed = (node < 0)[:, None] | (inside[:, None] & self.ancestors.gather(2, at[:, None].expand(B, T, -1)))
            if window is not None:
                key_pos = torch.where(inside, self._rotated.gather(1, at), slots)  # [B, S]
                allowed &= key_pos[:, None] > self._rotated[:, :, None] - window
            self._masks[window] = additive(allowed[:, None], dtype)
        return self._masks[window]


def keep_path_index(start: int, nodes, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(from, to) slots of a path kept after a tree forward from `start`: block nodes (ascending, the root
    excluded) to start + 1, start + 2, ..."""
    src = start + torch.as_tensor(nodes, dtype=torch.long, device=device).reshape(-1)
    return src, start + 1 + torch.arange(len(src), device=device)


class DenseKVCache(KVCache):
    """Pre-allocated [L] x [B, H_kv, capacity, D] keys and values."""

    wants_queries = False

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device, windows: list[int | None] | None = None):
        """windows: each layer's sliding window (None: full causal attention)."""
        shape = (batch, n_kv_heads, capacity, head_dim)
        self.windows = list(windows) if windows else [None] * n_layers
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.capacity = capacity
        self.batch = batch
        self.static_kv_len = capacity  # a static-shape forward attends over the whole cache
        self.graphs: dict = {}  # (B, T) -> StaticForward captured over this cache's storage
        self.pool_key = None
        self.prompt_len = torch.zeros(batch, dtype=torch.long)
        self.ids = self.crossed = None
        self.maker = None  # the runner that made it, if one did (its prefill wrote the keys)

    def keep_ids(self) -> None:
        """Keep the token at each position (see KVCache.ids)."""
        if self.ids is None:
            self.ids = torch.zeros(self.batch, self.capacity, dtype=torch.long, device=self.k[0].device)
            self.crossed = torch.zeros(self.batch, dtype=torch.bool)

    def row(self, b: int) -> "DenseKVCache":
        """A cache over row b alone, sharing this cache's storage (a request joining a running batch is
        prefilled into its slot through it). Eager only: never pooled, no static shape."""
        view = DenseKVCache.__new__(DenseKVCache)
        view.windows, view.capacity, view.batch = self.windows, self.capacity, 1
        view.k = [k[b : b + 1] for k in self.k]  # [1, H_kv, capacity, D] views
        view.v = [v[b : b + 1] for v in self.v]
        view.static_kv_len, view.graphs, view.pool_key = None, {}, None
        view.prompt_len = self.prompt_len[b : b + 1]
        view.ids = None if self.ids is None else self.ids[b : b + 1]
        view.crossed = None if self.crossed is None else self.crossed[b : b + 1]
        return view

    @torch.inference_mode()
    def copy_prefix(self, src: "DenseKVCache", lengths: list[int]) -> None:
        """Row b's first lengths[b] positions copied from `src` (a cache of the same shape per position, its rows
        this cache's), as a prefill of the same tokens by the same runner would write them (a draft model that is
        its target starts from the target's prefilled prompt)."""
        n = max(lengths)
        for dst, source in ((self.k, src.k), (self.v, src.v)):
            for x, y in zip(dst, source):
                x[:, :, :n] = y[:, :, :n]
        if self.ids is not None and src.ids is not None:
            self.ids[:, :n] = src.ids[:, :n]
        set_prompt_lengths(self, lengths)

    @torch.inference_mode()
    def keep_path(self, b: int, start: int, nodes) -> None:
        """After a tree forward from `start` (`TreeStep`), row b keeps the accepted path: the keys and values
        (and ids) of block nodes `nodes` (ascending, 1-based: node 0 is the root, already at `start`) move to
        slots start + 1, start + 2, ...; the slots after them are stale, as after any rejected draft."""
        src, dst = keep_path_index(start, nodes, self.k[0].device)
        for kv in (self.k, self.v):
            for x in kv:  # one tensor per layer: one gather and scatter each
                x[b, :, dst] = x[b, :, src]
        if self.ids is not None:
            self.ids[b, dst] = self.ids[b, src]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, step: StepIndex):
        # k, v: [B, H_kv, T, D]
        kc, vc = self.k[layer], self.v[layer]
        if step.kv_len > self.capacity:
            raise RuntimeError(f"KV cache overflow: need {step.kv_len} slots, have {self.capacity}")
        if step.uniform:
            s = step.start[0]
            kc[:, :, s : s + step.T] = k
            vc[:, :, s : s + step.T] = v
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
            # advanced indices on dims 0 and 2 put (B, T) first: [B, T, H_kv, D]
            kc[rows, :, step.positions] = k.transpose(1, 2)
            vc[rows, :, step.positions] = v.transpose(1, 2)
        window = self.windows[layer]
        if step.uniform and step.T == 1 and window is not None:  # one query position: slice, no mask
            lo = max(0, step.kv_len - window)
            return kc[:, :, lo : step.kv_len], vc[:, :, lo : step.kv_len], None
        return kc[:, :, : step.kv_len], vc[:, :, : step.kv_len], step.causal_mask(kc.dtype, window)
