"""The generic runner: the library's own forward and KV cache behind the runner's interface.

For every causal LM the native runner (`models/forward/runner.py`) does not compute (GPT-2, GPT-NeoX/Pythia, OPT,
Falcon, ...), and as the fallback for a native family whose runner fails the fidelity probe
(`models/probing/probe.py`). Each row of a batch keeps its own library cache (`DynamicCache`), since rows sit at
different positions and the library's cache has one length for the whole batch; a forward runs row by row.
A forward that starts a row before the end of what its cache holds rewinds by cropping the cache there, so
the runner offers the same position-indexed contract as the native one: `forward(cache, tokens, start, at)`.

What it cannot offer: the sparse draft caches (MagicDec, `draft_kv`), which live in sdbench's own attention,
and a fast path (no packed weights, no CUDA graphs: the library's forward runs as it is).
"""

from __future__ import annotations

import inspect

import torch

from sdbench.engine.hidden import FINAL, Taps
from sdbench.engine.tree import TreeBatch
from sdbench.errors import SdbenchError
from sdbench.forward_step import Step
from sdbench.kv.cache import additive, keep_path_index
from sdbench.models.forward import cpufast
from sdbench.models.forward.families import soft_cap
from sdbench.models.forward.recompute import recompute_threshold
from sdbench.models.forward.windows import layer_windows

SPARSE_REFUSAL = "sparse KV caches (MagicDec, --set draft_kv) need the native runner"


def runner_kind(runner) -> str:
    """'native' or 'generic': which runner computes a model."""
    return getattr(runner, "kind", "native")


def make_runner(model, name: str, kind: str = "native", fast: bool = False, static: bool | None = None):
    """The runner of a kind over a loaded model (a DSI worker builds the kind its target was probed with);
    static: the native runner's static-shape forward without graphs (`ModelRunner`)."""
    if kind == "generic":
        return GenericRunner(model, name)
    from sdbench.models.forward.runner import ModelRunner  # imports transformers (rotary): only a native runner needs it

    return ModelRunner(model, name, fast=fast, static=static)


class GenericCache:
    """One library cache per row. capacity: the positions a forward may write below (as a dense cache)."""

    static_kv_len = None  # never a static-shape forward
    wants_queries = False
    pool_key = None
    varied = 0  # forwards whose rows depend on the step's width: every one (the library's products; kv/cache.py)

    def __init__(self, batch: int, capacity: int):
        from transformers import DynamicCache  # slow to import, and only a generic cache needs it

        # without a config every layer keeps every position (sliding-window layers too: the library's masks
        # apply the window), so a rewind can crop any layer back to any length
        self.rows = [DynamicCache() for _ in range(batch)]
        self.capacity = capacity
        self.batch = batch
        self.graphs: dict = {}
        self.prompt_len = torch.zeros(batch, dtype=torch.long)  # [B] host (see kv/cache.py)
        self.ids = [[] for _ in range(batch)]  # per row, the tokens its library cache holds (models/forward/recompute.py)
        self.crossed = torch.zeros(batch, dtype=torch.bool)  # per row: its keys are the long-rope ones

    def row(self, b: int) -> "GenericCache":
        """A cache over row b alone, sharing its library cache (see DenseKVCache.row)."""
        view = GenericCache.__new__(GenericCache)
        view.rows, view.capacity, view.batch, view.graphs = [self.rows[b]], self.capacity, 1, {}
        view.prompt_len = self.prompt_len[b : b + 1]
        view.ids, view.crossed = [self.ids[b]], self.crossed[b : b + 1]
        return view

    @torch.inference_mode()  # the library's cache tensors were made by an inference-mode forward
    def keep_path(self, b: int, start: int, nodes) -> None:
        """Row b keeps the accepted path of a tree forward from `start` (see DenseKVCache.keep_path), in
        every layer of its library cache."""
        src, dst = keep_path_index(start, nodes, "cpu")
        for layer in self.rows[b].layers:
            for x in (layer.keys, layer.values):  # [1, H_kv, S, D]
                x[:, :, dst.to(x.device)] = x[:, :, src.to(x.device)]
        ids = self.ids[b]  # kept for Phi-3's recomputation only (empty otherwise)
        for i, j in zip(src.tolist(), dst.tolist()):
            if i < len(ids):
                ids[j] = ids[i]

    def length(self, b: int) -> int:
        return self.rows[b].get_seq_length()

    def rewind(self, b: int, start: int) -> None:
        """Row b's cache cut to positions [0, start); starting past its end would leave a hole."""
        held = self.length(b)
        if start > held:
            raise RuntimeError(f"generic cache row {b} holds {held} positions; a forward cannot start at {start}")
        if start < held:
            self.rows[b].crop(start - held)  # the library's crop takes the (negative) count to remove
        del self.ids[b][start:]


class GenericRunner:
    """Forward over new tokens at given positions through the library's own model and cache."""

    kind = "generic"
    fast = cpu_fast = graphs = static = False

    def __init__(self, model, name: str = ""):
        if getattr(model, "_is_stateful", False) or not _dynamic_cache_ok(model):
            raise SdbenchError(f"model '{name or model.config.model_type}' keeps a recurrent state that cannot be "
                               "rewound; sdbench runs attention-only causal LMs")
        model.requires_grad_(False)
        self.model = model
        self.name = name
        self.config = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.vocab_size = model.config.get_text_config().vocab_size  # (a packed head's own weight is empty)
        self._keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_kw = cache_keyword(model)
        self._positions = "position_ids" in inspect.signature(model.forward).parameters  # a tree needs them
        self._taps: Taps | None = None  # the hidden states the current call keeps (engine/hidden.py)
        # a rope the library rescales per call from the call's largest position (models/forward/rotary.py): each
        # decoded token then runs in a call of its own, the rotary modules put back before every call, so
        # that it is rotated as plain decoding rotates it; the prompt keeps one call
        from sdbench.models.forward.rotary import config_length_dependent, library_rotary_modules  # imports transformers

        text = model.config.get_text_config()
        self._rotary = library_rotary_modules(model) if config_length_dependent(text) else None
        self._recompute_at = recompute_threshold(text, self._rotary is not None)

    # ---- caches -----------------------------------------------------------------------------------------
    def new_cache(self, batch: int, capacity: int) -> GenericCache:
        return GenericCache(batch, capacity)

    def new_sparse_cache(self, *args, **kwargs):
        raise SdbenchError(f"model '{self.name}' runs on the generic runner (the library's own forward), and "
                           f"{SPARSE_REFUSAL}")

    def release(self, cache) -> None:
        """Nothing to give back: caches are not pooled."""

    # ---- forward ----------------------------------------------------------------------------------------
    def _row(self, cache: GenericCache, b: int, tokens: torch.Tensor, start: int,
             keep: torch.Tensor | None, kept: list | None = None) -> torch.Tensor:
        """Logits [K, V] (or [T, V] with keep None) of row b's tokens [T] written from position `start`.
        kept: where the hidden states the runner's `taps` name go, [T, k*H] per call."""
        if start + tokens.shape[0] > cache.capacity:
            raise RuntimeError(f"KV cache overflow: need {start + tokens.shape[0]} slots, have {cache.capacity}")
        if self._rotary is not None:
            if kept is not None:
                raise SdbenchError(f"model '{self.name}' runs on the generic runner with a rope rescaled per call, "
                                   "which cannot give a trained head its hidden states")
            return self._row_rescaled(cache, b, tokens, start, keep)
        return self._call(cache, b, tokens, start, keep, kept)

    def _call(self, cache: GenericCache, b: int, tokens: torch.Tensor, start: int,
              keep: torch.Tensor | None, kept: list | None = None, placed: dict | None = None) -> torch.Tensor:
        """One call of the library's forward over row b's tokens [T] from `start`: logits [K or T, V].
        placed: the tokens' position_ids and 4-D attention_mask (a token tree, `_tree_inputs`)."""
        cache.rewind(b, start)
        if self._rotary is not None:
            from sdbench.models.forward.rotary import reset_library_rotary  # loaded already (see __init__)

            reset_library_rotary(self._rotary)
        kwargs = {"logits_to_keep": keep} if self._keeps and keep is not None else {}
        out = self.model(input_ids=tokens[None].to(self.device), use_cache=True,
                         **{self._cache_kw: cache.rows[b]}, **kwargs, **(placed or {}),
                         output_hidden_states=kept is not None)
        if kept is not None:
            kept.append(self._states(out.hidden_states)[0])
        if self._recompute_at is not None:
            cache.ids[b].extend(tokens.tolist())
        logits = out.logits[0]
        if keep is not None and not self._keeps:
            logits = logits[keep]
        return logits.float()

    def _row_rescaled(self, cache: GenericCache, b: int, tokens: torch.Tensor, start: int,
                      keep: torch.Tensor | None) -> torch.Tensor:
        """`_row` for a rope rescaled per call: the tokens still in row b's prompt in one call, then each
        later token in a call of its own."""
        T = tokens.shape[0]
        cut = min(max(int(cache.prompt_len[b]) - start, 0), T)
        bounds = [0, *range(max(cut, 1), T + 1)]
        wanted = torch.arange(T) if keep is None else keep.reshape(-1).cpu()
        ordered, order = wanted.sort()
        out = []
        for lo, hi in zip(bounds, bounds[1:]):
            here = ordered[(ordered >= lo) & (ordered < hi)] - lo
            earlier = self._switch(cache, b, start + lo, hi - lo)  # Phi-3 past O: the sequence again, here
            back = len(earlier)
            piece = tokens[lo:hi]
            if back:
                piece = torch.cat((torch.tensor(earlier, dtype=tokens.dtype), piece.cpu()))
            logits = self._call(cache, b, piece, start + lo - back,
                                (here + back if len(here) else torch.tensor([back + hi - lo - 1])).to(self.device))
            if len(here):
                out.append(logits)
        return torch.cat(out)[order.argsort().to(self.device)]

    def _switch(self, cache: GenericCache, b: int, start: int, width: int) -> list[int]:
        """For a model whose generate computes the whole sequence again when it first passes O
        (models/forward/recompute.py), before a call of `width` tokens from `start`: where the call's queries lie past
        O and the row's keys are the short-rope ones, the row's earlier tokens, to go first in that call (one
        call up to the first position past O, as generate makes it), its cache emptied; where they lie below O
        and the keys are the long-rope ones (a rewind), the short-rope keys computed again. [] otherwise."""
        limit = self._recompute_at
        if limit is None or int(cache.prompt_len[b]) > limit:
            return []
        long = start + width > limit
        if long == bool(cache.crossed[b]):
            return []
        cache.crossed[b] = long
        earlier = list(cache.ids[b][:start])
        cache.rewind(b, 0)
        if long:
            return earlier
        if earlier:
            self._call(cache, b, torch.tensor(earlier, dtype=torch.long), 0, torch.tensor([len(earlier) - 1]))
        return []

    def _states(self, hidden: tuple) -> torch.Tensor:
        """The states the runner's taps name, from the library's `hidden_states` (the input of each layer,
        then the final-norm output): [1, T, k*H]."""
        n = len(hidden) - 1
        if n in self._taps.layers:
            raise SdbenchError(f"model '{self.name}' runs on the generic runner, whose library forward gives no "
                               "last-layer state before the final norm")
        return torch.cat([hidden[n if i == FINAL else i] for i in self._taps.layers], -1)

    @torch.inference_mode()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The input embeddings [B, T, H] of tokens [B, T], as the library's embedding module gives them."""
        return self.model.get_input_embeddings()(tokens.to(self.device))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's own head over final-norm hidden states [..., H]: logits [..., V] (float32)."""
        cpufast.disable(self.model)
        out = self.model.get_output_embeddings()(hidden)
        cap = getattr(self.config.get_text_config(), "final_logit_softcapping", None)  # as the library's forward
        return soft_cap(out, cap).float()

    def share_plain(self) -> None:
        """Put the weights back in the library's layout (a packed copy cannot be shared with worker processes);
        a packing runner packs them again at its next forward."""
        cpufast.disable(self.model)

    own_layout = share_plain  # this runner's forward is the library's, on its own weights

    def library_forward(self):
        """A context for the library's own forward over the model's weights (as this runner always uses)."""
        return cpufast.library_forward(self.model)

    def fast_path_note(self) -> str | None:
        return None

    def block_activations(self) -> str | None:
        return None  # the library's forward: float32 activations over any weights

    @torch.inference_mode()
    def run(self, cache: GenericCache, step: Step) -> torch.Tensor:
        """Logits [B, T, V] (float32) of one forward call (`forward_step.py`), or at its `at` only: row by row
        through the library's forward; a tree step's trees placed as the native runner places them."""
        cpufast.disable(self.model)  # a model a native runner packed before falling back here
        cache.varied += 1
        rows, kept = [], None if step.taps is None else []
        self._taps = step.taps
        tokens, start, at = step.tokens, step.start, step.at
        placed = None if step.tree is None else self._tree_inputs(cache, tokens, start, step.tree)
        for b in range(step.batch):
            keep = None if at is None else at[b].reshape(-1).to(self.device)
            if placed is None:
                rows.append(self._row(cache, b, tokens[b], start[b], keep, kept))
            else:
                rows.append(self._call(cache, b, tokens[b], start[b], keep, kept, placed[b]))
        if step.taps is not None:
            step.taps.put_joined(torch.stack(kept))
        logits = torch.stack(rows)
        return logits[:, 0] if at is not None and at.dim() == 1 else logits

    def tree_refusal(self, cache=None, nodes: int | None = None) -> str | None:
        """Why this model's tree forwards cannot be placed through the library, in one line, or None."""
        text = self.config.get_text_config()
        why = ("a rope rescaled per call" if self._rotary is not None else
               "sliding windows" if any(layer_windows(text)) else  # the library's masks would drop them
               "ALiBi" if getattr(text, "alibi", False) else  # biases from key offsets, not positions
               "no position_ids" if not self._positions else None)
        return why and f"token trees are not supported on the generic runner for '{text.model_type}' ({why}) yet"

    def _tree_inputs(self, cache: GenericCache, tokens: torch.Tensor, start: list[int],
                     tree: TreeBatch) -> list[dict]:
        """Per row, the library's position_ids [1, T] and additive attention_mask [1, 1, T, start + T] of a
        tree forward (the prefix, ancestors and self), or the refusal of a model they cannot place."""
        why = self.tree_refusal(cache)
        if why:
            raise SdbenchError(why)
        positions = tree.positions(torch.tensor(start)).to(self.device)  # [B, T]
        ancestors = tree.ancestors.to(self.device)  # [B, T, T]
        out = []
        for b, s in enumerate(start):
            seen = torch.cat([ancestors.new_ones(tokens.shape[1], s), ancestors[b]], 1)  # [T, s + T]
            out.append({"position_ids": positions[b : b + 1],
                        "attention_mask": additive(seen[None, None], self.dtype)})
        return out

    @torch.inference_mode()
    def prefill(self, cache: GenericCache, prompts: list[list[int]], chunk: int = 1024,
                taps: Taps | None = None) -> torch.Tensor:
        """Write every prompt into the cache from position 0; logits [B, V] after each prompt's last token.
        taps: the hidden states to keep too, of every position (right-padded rows: [B, longest, k*H])."""
        if min(len(p) for p in prompts) < 1:
            raise SdbenchError("empty prompt: a prompt needs at least one token")
        cpufast.disable(self.model)
        cache.prompt_len.copy_(torch.tensor([len(p) for p in prompts]))
        last, self._taps, rows = [], taps, []
        for b, prompt in enumerate(prompts):
            ids = torch.tensor(prompt, dtype=torch.long)
            if self._rotary is not None:  # a chunk would be rotated for its own end, not the prompt's
                chunk = max(chunk, len(prompt))
            kept = None if taps is None else []
            for c0 in range(0, len(prompt), chunk):  # the library's attention over a whole long prompt at
                piece = ids[c0 : c0 + chunk]         # once may hold [heads, S, S] scores: chunks bound it
                logits = self._row(cache, b, piece, c0, torch.tensor([len(piece) - 1], device=self.device), kept)
            last.append(logits[0])  # the last chunk's: after the prompt's last token
            if kept is not None:
                rows.append(torch.cat(kept))
        if taps is not None:  # rows right-padded to the longest prompt, as the native prefill keeps them
            taps.put_joined(torch.nn.utils.rnn.pad_sequence(rows, batch_first=True))
        return torch.stack(last)


def cache_keyword(model) -> str:
    """The name the library's forward takes its cache by: `cache` (transformers >= 5.24; the older name
    warns there) or `past_key_values` (earlier releases)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _dynamic_cache_ok(model) -> bool:
    supports = getattr(type(model), "_supports_default_dynamic_cache", None)
    return supports is None or bool(supports())
