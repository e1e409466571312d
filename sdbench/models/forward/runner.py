"""ModelRunner: sdbench's own forward pass over a Hugging Face decoder's weights.

The runner borrows the loaded model's modules (embeddings, projections, MLPs, norms) and owns attention (with
sliding windows, `models/forward/windows.py`), the rotary embedding (`models/forward/rotary.py`: computed from the config; the
library's module is never called) and the KV cache, so that every strategy sees the same position-indexed
cache: several new tokens per row, each row at its own position, rewind by starting the next forward earlier.
Logits match the library's own forward (tests/test_runner_fidelity.py checks this on random tiny models).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from sdbench.errors import SdbenchError
from sdbench.kv.cache import DenseKVCache, KVCache, StepIndex, TreeStep, set_prompt_lengths
from sdbench.kv.sparse import SparseKVCache
from sdbench.models.forward import cpucompile, cpufast, cpulayer, forward_paths, recompute
from sdbench.models.forward.families import NATIVE, family, soft_cap
from sdbench.engine.hidden import FINAL, Taps
from sdbench.forward_step import Step
from sdbench.engine.state import needed_capacity
from sdbench.models.forward.graphs import (CAPACITY_STEP, TREE_SPARE, TREE_WIDTHS, CachePool, StaticForward, StaticTreeForward,
                                   tree_budget_refusal, tree_width)
from sdbench.models.forward.rotary import Rotary, rope
from sdbench.models.forward.windows import layer_windows
from sdbench.padding import right_pad

SUPPORTED = NATIVE  # kept for callers that name it
PREFILL_TOKENS = 1024  # a prefill forward's tokens, over all its rows
_ACROSS_ORIGINAL = "token trees are not supported across Phi-3's original context (its cache's recomputation) yet"


def _capped_attention(q, keys, values, mask, scale: float, cap: float) -> torch.Tensor:
    """Attention whose logits are soft-capped (Gemma2/3), which scaled_dot_product_attention cannot do, as the
    library's eager attention computes it: scale, cap * tanh(x / cap), mask, softmax in float32.
    q [B, Hq, T, D]; keys, values [B, Hk, S, D]; mask additive [B, 1, T, S] or None -> [B, Hq, T, D]."""
    B, Hq, T, D = q.shape
    Hk, S = keys.shape[1], keys.shape[2]
    grouped = q.reshape(B, Hk, Hq // Hk * T, D)  # query heads sharing a key head, side by side
    scores = (torch.matmul(grouped, keys.transpose(-1, -2)) * scale).view(B, Hq, T, S)
    scores = soft_cap(scores, cap)
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights.view(B, Hk, Hq // Hk * T, S), values).view(B, Hq, T, D)


class ModelRunner:
    """Forward over new tokens at given positions, for a decoder of a native family (`models/forward/families.py`:
    Llama's layer loop with the family's differences read once, here).

    fast: take the fast forward path for the device (`models/forward/forward_paths.py`, chosen here once): on CPU in
    float32, fused projections packed for sdbench's products or oneDNN's (one copy of the weights) and one-op
    norms where a short measurement at this shape finds them faster: the model is packed by this runner's first
    forward and unpacked by the first forward of a plain runner on it; a head left plain (tied, or the model
    unpacked) is read by the product measured fastest per width; on CUDA, decode and verification steps replayed as CUDA
    graphs over static shapes (`models/forward/graphs.py`).
    static: use the static-shape forward (pooled caches, attention over the full cache) without capturing
    graphs; defaults to on exactly when graphs are. Tests turn it on to check the graph path's maths on CPU.
    """

    def __init__(self, model, name: str = "", fast: bool = False, static: bool | None = None):
        cfg = model.config
        if cfg.model_type not in SUPPORTED:
            raise SdbenchError(
                f"model '{name or cfg.model_type}' has architecture '{cfg.model_type}', which sdbench's runner "
                f"does not support yet (supported: {', '.join(SUPPORTED)})"
            )
        model.requires_grad_(False)
        self.model = model
        self.name = name
        self.config = cfg
        self.family = family(cfg)
        self.decoder = model.model
        self.layers = list(self.decoder.layers)
        self.lm_head = model.lm_head
        self.vocab_size = self.lm_head.weight.shape[0]
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.hidden_size = cfg.hidden_size
        p = self.lm_head.weight
        self.device, self.dtype = p.device, p.dtype
        self.rotary = Rotary(cfg, self.device, self.dtype)  # cos/sin per layer type (`rotary.layer_types`)
        self.recompute_at = recompute.recompute_threshold(cfg, self.rotary.length_dependent)  # Phi-3's O, else None
        self.prefill_tokens = PREFILL_TOKENS
        self.windows = layer_windows(cfg)  # per layer: its sliding window, or None
        self.path = forward_paths.choose(model, bool(fast), self.device, self.family.rms_norm)
        self.fast = self.path.kind != forward_paths.EAGER  # what result rows record (`fast`)
        self.static = self.path.static if static is None else static
        self.pool = CachePool()
        self.graph_pool = None  # CUDA graphs' shared memory pool, made at the first capture
        # per layer: the norm modules (attention in, attention out, MLP in, MLP out), None where there is none
        self._norms = [tuple(name and getattr(layer, name) for name in self.family.norms) for layer in self.layers]
        self._scale = self.family.attn_scale or self.head_dim**-0.5  # soft-capped attention's
        self._compiled = None  # cpucompile.CompiledLayers, made at the first compiled step
        if self.path.kind == forward_paths.CPU_PACKED and static is None and cpucompile.wanted():
            self.path, self.static = forward_paths.compiled(self.path), True
        self.fused_layers = cpulayer.fits(self)  # its layers' steps may run fused (`models/forward/cpulayer.py`)
        self.width_invariant = cpulayer.invariant(self)  # a fused step's rows are their tokens' bits decoded alone

    @property
    def cpu_fast(self) -> bool:
        """The weights are packed (`cpupacked.LAYOUT_NAMES`) while this runner runs (the CPU fast path, where it
        measured faster)."""
        return self.path.kind in (forward_paths.CPU_PACKED, forward_paths.CPU_COMPILED)

    @property
    def graphs(self) -> bool:
        """Static steps are captured as CUDA graphs (off again after a failed capture: `disable_graphs`)."""
        return self.path.graphs

    # ---- caches -----------------------------------------------------------------------------------------
    def new_cache(self, batch: int, capacity: int) -> DenseKVCache:
        """A dense cache; with static shapes, a pooled one (length rounded up) whose graphs are kept, with room
        past the last position for the most padding a tree graph writes past a tree (`models/forward/graphs.py`)."""
        if self.static:
            capacity = -(-(capacity + TREE_SPARE) // CAPACITY_STEP) * CAPACITY_STEP
        self.rotary.reserve(capacity)
        key = ("dense", batch)
        cache = self.pool.take(key, capacity) if self.static else None
        if cache is None:
            cache = DenseKVCache(len(self.layers), batch, self.n_kv_heads, self.head_dim, capacity,
                                 self.dtype, self.device, self.windows)
            cache.pool_key = key if self.static else None
        if self.recompute_at is not None:
            cache.keep_ids()
        cache.maker = self  # a cache this runner prefilled holds what its prefill writes (`DenseKVCache.copy_prefix`)
        cache.varied = 0  # a pooled cache's last generation's count is not this one's
        set_prompt_lengths(cache, [0] * batch)  # a pooled cache's last prompts are not this generation's
        return cache

    def new_sparse_cache(self, batch: int, n_static: int, window: torch.Tensor, lookahead: int) -> SparseKVCache:
        """A sparse draft cache (see kv/sparse.py), emptied; pooled like dense caches. With static shapes its
        ring also holds a tree graph's padding (a tree of `lookahead` nodes padded to its captured width)."""
        if self.static and lookahead <= TREE_WIDTHS[-1]:
            lookahead = tree_width(lookahead)
        ring = needed_capacity(int(window.max()), 0, lookahead)  # the widest window and one step's drafts
        key = ("sparse", batch, n_static, ring)
        cache = self.pool.take(key) if self.static else None
        if cache is None:
            cache = SparseKVCache(len(self.layers), batch, self.n_kv_heads, self.head_dim, n_static, ring,
                                  self.dtype, self.device, self.windows, self.n_heads)
            cache.pool_key = key if self.static else None
        cache.reset(window)
        return cache

    def release(self, cache) -> None:
        """Give a cache back for reuse by a later generation (static shapes only; otherwise a no-op)."""
        if self.static:
            self.pool.give(cache)

    def share_plain(self) -> None:
        """Put the weights back in the library's layout (a packed copy cannot be shared with worker processes);
        a packing runner packs them again at its next forward."""
        cpufast.disable(self.model)

    def own_layout(self) -> None:
        """Put the weights in the layout this runner's forward uses (packed, or the library's) now, so that its
        first forward does not (a benchmark readies each side before timing it)."""
        self.path.ready()

    def library_forward(self):
        """A context for the library's own forward over the model's weights (the packing restored after it; a model
        in blocks de-quantised one product at a time: `cpufast.library_forward`)."""
        return cpufast.library_forward(self.model)

    def fast_path_note(self) -> str | None:
        """Which forward the CPU fast path uses at this shape (packed or plain, as measured), or None off it."""
        if self.device.type != "cpu" or not (cpufast.available() and cpufast.supports(self.model)):
            return None
        return cpufast.choose(self.model).describe()

    def block_activations(self) -> str | None:
        """A block copy's activations on this runner's fast path ("int8" or "float32", `cpufast.block_activations`);
        None for float weights or off the fast path (the library's products over the de-quantised weights)."""
        return cpufast.block_activations(self.model) if getattr(self.path, "fast", None) is not None else None

    def compiled_layers(self, forward, taps: Taps | None) -> torch.Tensor | None:
        """A static forward's hidden states through the compiled layers (`models/forward/cpucompile.py`), or None where
        compiling failed (the path is then the eager packed one)."""
        if self._compiled is None:
            self._compiled = cpucompile.CompiledLayers(self)
        return self._compiled(forward, taps)

    def disable_graphs(self, reason: str) -> None:
        self.path = forward_paths.Eager(self.model)
        warnings.warn(f"{self.name or 'model'}: {reason}; using the eager forward", RuntimeWarning, stacklevel=2)

    # ---- forward ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def hidden(self, cache: KVCache, step: Step, counted: bool = False) -> torch.Tensor:
        """Final-norm hidden states [B, T, H] of a step's tokens (its `at` is the caller's to apply), each token
        rotated as plain decoding rotates it, for the prompt lengths the cache records (`Rotary.scaling_lengths`).
        A tree step is placed by its `kv.cache.TreeStep`, or refused in one line where this path cannot take it.
        counted (a step past the prompts' prefill): the cache's `varied` counts it unless it runs width-invariant."""
        index = self._tree_index(cache, step) if step.tree is not None else \
            StepIndex(step.start, step.width, self.device)
        if counted and not (self.width_invariant and cpulayer.wanted(cache, index)
                            and step.tokens.numel() <= cpulayer.INVARIANT_ROWS):
            cache.varied += 1
        lengths = self.rotary.scaling_lengths(step.start, step.width, self.scaling_floor(cache),
                                              index.rotated if step.tree is not None else None)
        cos_sin = self.rotary.for_forward(index.rotated, index.kv_len, lengths)
        self.path.ready()
        return self.run_layers(cache, step.tokens, index, cos_sin, step.taps)

    def run_layers(self, cache: KVCache, tokens: torch.Tensor, step: StepIndex, cos_sin: dict,
                   taps: Taps | None = None) -> torch.Tensor:
        """`hidden` once its positions (`step`) and rotation are prepared and the weights are in this path's layout: tensor
        work only, which a compiled step (`models/forward/cpucompile.py`) traces whole (it is not decorated: a change of
        inference mode inside a traced function fails to compile)."""
        if cache.ids is not None:
            cache.ids.scatter_(1, step.positions, tokens.to(self.device))
        h = self.decoder.embed_tokens(tokens.to(self.device))  # Gemma's sqrt(hidden) scale is the module's
        fam = self.family
        if fam.embed_scale is not None:
            h = h * fam.embed_scale
        r = fam.residual_scale
        fused = self.fused_layers and cpulayer.wanted(cache, step)  # a Llama layer's step in a few calls
        if fused:
            cos_sin, tree = cpulayer.tables(cos_sin, tokens.shape[0]), cpulayer.ancestors(step)
        for i, layer in enumerate(self.layers):
            if taps is not None:
                taps.put(i, h)
            cos, sin = cos_sin[self.rotary.layer_types[i]]
            if fused:
                h = cpulayer.layer(self, i, h, cache, step, cos, sin, tree)
                continue
            fast = self.path.layer(i)
            attn_in, attn_out, mlp_in, mlp_out = self._norms[i]  # Llama: (input, None, post_attention, None)
            x = h if attn_in is None else self.path.norm(attn_in, h)
            a = self._attention(layer.self_attn, fast, x, cache, i, step, cos, sin)
            if attn_out is not None:
                a = self.path.norm(attn_out, a)
            h = h + a if r is None else h + a * r
            x = h if mlp_in is None else self.path.norm(mlp_in, h)
            m = fast.mlp(layer.mlp, x) if fast else layer.mlp(x)
            if mlp_out is not None:
                m = self.path.norm(mlp_out, m)
            h = h + m if r is None else h + m * r
        if taps is None:
            return self.path.norm(self.decoder.norm, h)
        taps.put(len(self.layers), h)
        out = self.path.norm(self.decoder.norm, h)
        taps.put(FINAL, out)
        return out

    def scaling_floor(self, cache) -> torch.Tensor | None:
        """The rows' floors of the rope's scaling length (`Rotary.scaling_lengths`): their prompt lengths, and
        past Phi-3's O for rows whose keys are the long-rope ones (`models/forward/recompute.py`)."""
        return recompute.scaling_floor(cache, self.recompute_at)

    def _project(self, attn, fast, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys side by side [B, T, (Hq + Hk) * D] and values [B, T, Hk * D], from separate or
        fused projections, q/k normalised here when the family norms them whole (OLMo2)."""
        Hq, Hk, D = self.n_heads, self.n_kv_heads, self.head_dim
        fused = fast.qkv if fast else (getattr(attn, self.family.qkv) if self.family.qkv else None)
        whole = self.family.qk_norm == "all"
        if fused is not None and not whole:
            return fused(x).split([(Hq + Hk) * D, Hk * D], dim=-1)
        if fused is not None:
            q, k, v = fused(x).split([Hq * D, Hk * D, Hk * D], dim=-1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if whole:
            q, k = self.path.norm(attn.q_norm, q), self.path.norm(attn.k_norm, k)
        return torch.cat((q, k), dim=-1), v

    def _attention(self, attn, fast, x, cache, i, step, cos, sin) -> torch.Tensor:
        B, T, _ = x.shape
        Hq, Hk, D = self.n_heads, self.n_kv_heads, self.head_dim
        qk, v = self._project(attn, fast, x)
        qk = qk.view(B, T, Hq + Hk, D)
        v = v.view(B, T, Hk, D).transpose(1, 2)
        if self.family.qk_norm == "head":  # Qwen3, Gemma3: per head, before rotary
            q, k = qk.split([Hq, Hk], dim=2)
            qk = torch.cat((self.path.norm(attn.q_norm, q), self.path.norm(attn.k_norm, k)), dim=2)
        q, k = rope(qk.transpose(1, 2), cos, sin).split([Hq, Hk], dim=1)  # [B, H, T, D]
        keys, values, mask = cache.update(i, k, v, step)
        if cache.wants_queries:  # a scoring view (SnapKV) looks at the queries too
            cache.queries(i, q, keys, mask)
        if self.family.attn_softcap is None:
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.family.attn_scale,
                                               enable_gqa=Hq != Hk)
        else:
            o = _capped_attention(q, keys, values, mask, self._scale, self.family.attn_softcap)
        o = o.transpose(1, 2).reshape(B, T, Hq * D)
        return fast.o(o) if fast else attn.o_proj(o)

    @torch.inference_mode()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embeddings [B, T, H] of tokens [B, T], as the library's embedding module gives them."""
        return self.decoder.embed_tokens(tokens.to(self.device))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's own head over final-norm hidden states [..., H]: logits [..., V] (float32)."""
        out = self.path.head(hidden)  # [..., V], scaled and capped in the model's dtype, as the library does
        if self.family.logits_divisor is not None:
            out = out / self.family.logits_divisor
        return soft_cap(out, self.family.final_softcap).float()

    @torch.inference_mode()
    def run(self, cache: KVCache, step: Step) -> torch.Tensor:
        """Logits [B, T, V] (float32) of one forward call (`forward_step.py`), or at its `at` only (eagerly, the
        vocabulary projection then runs only there: it costs as much as a few layers). The path: the row-by-row
        forward of a call that crosses Phi-3's original context; a static-shape forward (`models/forward/graphs.py`:
        replayed as a CUDA graph, compiled or eager) over a pooled cache; else the eager layer loop."""
        if step.tree is None and recompute.switches(cache, self.recompute_at, step.start, step.width):
            cache.varied += 1
            return recompute.forward_switching(self, cache, step, self.recompute_at)
        if self.static and cache.static_kv_len is not None:
            cache.varied += 1  # the library's products over static shapes (cuBLAS, oneDNN): chosen per shape
            return step.pick(self._static(cache, step))
        h = self.hidden(cache, step, counted=True)
        return self.logits(step.pick(h))

    def _tree_index(self, cache, step: Step) -> TreeStep:
        """The positions and mask of a tree step, or the one-line refusal of a path that cannot take a tree yet."""
        why = self.tree_refusal(cache, ahead=False)
        if why is None and recompute.switches(cache, self.recompute_at, step.start, step.width):
            why = _ACROSS_ORIGINAL
        if why:
            raise SdbenchError(why)
        return TreeStep(step.start, step.tree, self.device)

    def tree_refusal(self, cache, ahead: bool = True, nodes: int | None = None) -> str | None:
        """Why tree forwards cannot run over this cache, in one line, or None. ahead (before a run): a cache
        that may reach Phi-3's original context is refused whole, so that the run is refused before it starts,
        not in the round that crosses it. nodes: the most nodes of one tree forward (the root included), which
        the static-shape forward takes up to the widest captured width (`models/forward/graphs.py`)."""
        if self.static and cache.static_kv_len is not None and nodes is not None and nodes > TREE_WIDTHS[-1]:
            return tree_budget_refusal(nodes)
        if not isinstance(cache, (DenseKVCache, SparseKVCache)):  # the SnapKV scoring view: never a tree's
            return "token trees need a dense or sparse KV cache"
        if ahead and self.recompute_at is not None and getattr(cache, "ids", None) is not None \
                and cache.capacity > self.recompute_at:
            return _ACROSS_ORIGINAL
        return None

    def _static(self, cache, step: Step) -> torch.Tensor:
        """Logits of every token of a step on the static-shape path, through the forward captured for its
        (batch, width, kept states) over this cache; a tree's padded to the captured node count
        (`StaticTreeForward`), the padding's logits (and states) dropped."""
        B, T = step.tokens.shape
        width = T if step.tree is None else tree_width(T)
        if step.tree is not None and recompute.switches(cache, self.recompute_at, step.start, width):
            raise SdbenchError(_ACROSS_ORIGINAL)
        need = max(step.start) + width
        if need > cache.capacity:
            raise RuntimeError(f"KV cache overflow: need {need} slots, have {cache.capacity}")
        layers = None if step.taps is None else step.taps.layers
        key = (B, width) if step.tree is None else ("tree", B, width)
        key = key if layers is None else (*key, layers)  # a forward keeping states is a graph of its own
        forward = cache.graphs.get(key)
        if forward is None:
            kind = StaticForward if step.tree is None else StaticTreeForward
            forward = cache.graphs[key] = kind(self, cache, B, width, layers)
        out = forward(step)
        if layers is None:
            return out[:, :T]
        logits, states = out
        step.taps.put_joined(states[:, :T])
        return logits[:, :T]

    @torch.inference_mode()
    def prefill(self, cache: KVCache, prompts: list[list[int]], chunk: int | None = None,
                taps: Taps | None = None) -> torch.Tensor:
        """Write every prompt into the cache from position 0; logits [B, V] after each prompt's last token.
        taps: the hidden states to keep too, of every position (right-padded rows: [B, longest, k*H]).

        Prompts of different lengths are right-padded; a padded slot lies beyond its row's length, so it is
        overwritten before any query of that row can see it. chunk: positions per forward [default: PREFILL_TOKENS
        shared by the rows, so that a forward's attention scores, [B, H, chunk, S] in float32 where attention
        runs under a mask, take no more at batch 32 than at batch 1: 34 GB for Llama-3.1-8B's shape at batch 32 x
        8,192 tokens otherwise].
        """
        chunk = chunk or max(1, self.prefill_tokens // len(prompts))
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1:
            raise SdbenchError("empty prompt: a prompt needs at least one token")
        tokens = right_pad(prompts)
        width = tokens.shape[1]
        last = torch.tensor(lengths) - 1
        set_prompt_lengths(cache, lengths)  # every prompt token is rotated as the prompt's one forward does
        final = torch.empty(len(prompts), self.hidden_size, dtype=self.dtype, device=self.device)
        for c0 in range(0, width, chunk):
            c1 = min(c0 + chunk, width)
            h = self.hidden(cache, Step(tokens[:, c0:c1], [c0] * len(prompts), taps=taps))
            rows = ((last >= c0) & (last < c1)).nonzero().flatten()
            if len(rows):
                final[rows.to(self.device)] = h[rows.to(self.device), (last[rows] - c0).to(self.device)]
        return self.logits(final)
