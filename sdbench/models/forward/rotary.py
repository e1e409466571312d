"""Rotary position embeddings computed from a model's config, each token rotated as plain decoding rotates it.

The library's rotary module is stateful for the length-dependent types (`dynamic`, and every type whose name
contains it, and `longrope`): it rewrites its `inv_freq` from each call's largest position p, seq_len = p + 1
(`dynamic_rope_update`). sdbench never calls it; it computes the same numbers from the config with the
library's pure functions (`ROPE_INIT_FUNCTIONS`) for the scaling length each token gets in the reference,
transformers `generate` with its dynamic cache: the prompt in one forward, then one token per forward. So a
token at position p of a row whose prompt has P tokens is rotated for

    scaling length = max(p + 1, P)

(a prompt token: the prefill's P; a decoded token: its own p + 1), whatever forward computes it. A
verification of gamma + 1 tokens therefore rotates each token as the step that would have decoded it does,
and speculative decoding stays exactly plain decoding for these types too (the library's own k-token call
would rotate all k for its last position). Per type:

- static types (default, linear, llama3, yarn, proportional, ...): one inv_freq; cos/sin are rows of a table
  grown on demand by appending rows, so an entry, once made, never changes;
- longrope: the short factors for a scaling length <= original_max_position_embeddings, the long ones past
  it: two static tables, picked per token;
- dynamic (NTK): the unscaled table for a scaling length <= max_position_embeddings; past it, inv_freq is
  recomputed for that length (kept for the lengths seen lately) and cos/sin computed for those tokens.

Keys already in a cache keep the rotation they were written with, exactly as in the library's cache.

Models whose `config.rope_parameters` is keyed by layer type (Gemma 3: another base on its local layers)
get one embedding per layer type; `Rotary.layer_types[i]` names layer i's.
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from sdbench.errors import SdbenchError

DYNAMIC_KEPT = 4096  # dynamic inv_freq kept per scaling length (a decode needs a new one per token)
TABLE_MIN = 256  # rows a table starts with; it at least doubles when it grows


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., D] with cos/sin [..., Dr] (Dr <= D: a partial rotary leaves the rest).

    x*cos + rotate_half(x)*sin, rotate_half(x) = (-x2, x1), is computed as x*cos + roll(x)*sin' with
    roll(x) = (x2, x1) and sin' = sin with its first half negated (as every table here holds it): the same
    products, so the same values, in one op where rotate_half takes three."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + x.roll(d // 2, -1) * sin
    part = x[..., :d]
    return torch.cat((part * cos + part.roll(d // 2, -1) * sin, x[..., d:]), dim=-1)


def length_dependent_type(rope_type: str) -> bool:
    """Whether the library rescales this rope type per call (as its `dynamic_rope_update` decides)."""
    return "dynamic" in rope_type or rope_type == "longrope"


def config_length_dependent(config) -> bool:
    """Whether any layer of this config has a rope type the library rescales per call."""
    params = getattr(config, "rope_parameters", None) or {}
    sets = [v for v in params.values() if isinstance(v, dict)] or [params]  # keyed by layer type, or one set
    return any(length_dependent_type(s.get("rope_type", s.get("type", "default"))) for s in sets)


def rope_layer_types(config) -> list[str | None]:
    """Per layer, the key of its rotary parameters: its layer type where `config.rope_parameters` is keyed by
    layer type, else None (one set for every layer)."""
    params = getattr(config, "rope_parameters", None) or {}
    nested = config.nested_rope_parameter_keys(params) if hasattr(config, "nested_rope_parameter_keys") else []
    n = config.num_hidden_layers
    return [config.layer_types[i] for i in range(n)] if nested else [None] * n


def _parameters(config, layer_type: str | None) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    params = params if layer_type is None else params.get(layer_type)
    if not params:
        raise SdbenchError(f"'{config.model_type}': no rotary parameters for layer type '{layer_type}'")
    return params


class RotaryEmbedding:
    """cos/sin of one set of rotary parameters (one layer type), in the model's dtype on its device."""

    def __init__(self, config, layer_type: str | None, device: torch.device, dtype: torch.dtype):
        params = _parameters(config, layer_type)
        self.config, self.layer_type, self.device, self.dtype = config, layer_type, device, dtype
        self.rope_type = params.get("rope_type", params.get("type", "default"))
        if self.rope_type != "default" and self.rope_type not in ROPE_INIT_FUNCTIONS:
            raise SdbenchError(f"'{config.model_type}' uses rope type '{self.rope_type}', which sdbench's runner "
                               f"does not compute")
        base, self.scaling = self._init(None, torch.device("cpu"))  # as the library's module at load, then moved
        self._inv = {"base": base.to(device)}
        self.threshold = None  # past this seq_len a length-dependent type changes its inv_freq
        if self.rope_type == "longrope":
            self.threshold = params["original_max_position_embeddings"]
            self._inv["long"] = self._init(self.threshold + 1, device)[0]
        elif self.length_dependent:  # dynamic
            self.threshold = config.max_position_embeddings
            self._dynamic: dict[int, torch.Tensor] = {}  # scaling length -> its inv_freq
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (cos [S, Dr], sin' [S, Dr])

    @property
    def length_dependent(self) -> bool:
        return length_dependent_type(self.rope_type)

    def _init(self, seq_len, device) -> tuple[torch.Tensor, float]:
        """(inv_freq, attention scaling) for a length (None: the config's own)."""
        if self.rope_type == "default":
            params, cfg = _parameters(self.config, self.layer_type), self.config
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
            inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            return inv.to(device), 1.0
        kwargs = {} if self.layer_type is None else {"layer_type": self.layer_type}
        return ROPE_INIT_FUNCTIONS[self.rope_type](self.config, device, seq_len=seq_len, **kwargs)

    def _table(self, name: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The table of inv_freq `name`, covering at least positions [0, n)."""
        cos, sin = self._tables.get(name, (None, None))
        have = 0 if cos is None else cos.shape[0]
        if have < n:
            size = max(n, 2 * have, TABLE_MIN)
            new_cos, new_sin = self._compute(torch.arange(have, size, device=self.device), self._inv[name])
            cos = new_cos if cos is None else torch.cat((cos, new_cos))
            sin = new_sin if sin is None else torch.cat((sin, new_sin))
            self._tables[name] = cos, sin
        return cos, sin

    def _compute(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin' [*positions.shape, Dr] as the library's module computes them (float32, then the dtype)."""
        freqs = positions[..., None].float() * inv_freq.to(device=positions.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
        half = sin.shape[-1] // 2
        return cos.to(self.dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(self.dtype)

    def cos_sin(self, positions: torch.Tensor, kv_len: int, lengths: torch.Tensor | None = None):
        """cos, sin' [*positions.shape, Dr] for positions (a device tensor) of one forward that reaches kv_len
        (host-side: the caller knows it; no device sync). lengths: each token's scaling length (a host tensor
        shaped as positions, see the module docstring); only the length-dependent types read it."""
        if self.threshold is not None and lengths is None:
            raise ValueError(f"rope type '{self.rope_type}' rotates each token for its scaling length: pass them")
        if self.threshold is None or not lengths.numel() or int(lengths.max()) <= self.threshold:  # all < threshold
            cos, sin = self._table("base", kv_len if self.threshold is None else min(kv_len, self.threshold))
            return cos[positions], sin[positions]
        if self.rope_type == "longrope":  # two tables, one picked per token
            base, long = self._table("base", min(kv_len, self.threshold)), self._table("long", kv_len)
            if int(lengths.min()) > self.threshold:
                return long[0][positions], long[1][positions]
            past = (lengths > self.threshold).to(positions.device)[..., None]
            clipped = positions.clamp(max=self.threshold - 1)  # a long token may lie past the short table
            return (torch.where(past, long[0][positions], base[0][clipped]),
                    torch.where(past, long[1][positions], base[1][clipped]))
        return self._compute(positions, self._dynamic_inv(lengths))

    def _dynamic_inv(self, lengths: torch.Tensor) -> torch.Tensor:
        """inv_freq per token [*lengths.shape, Dr/2] of a dynamic rope: the unscaled one up to the threshold,
        past it the one the library computes for that scaling length."""
        keys = torch.where(lengths > self.threshold, lengths, 0)
        found, index = torch.unique(keys, return_inverse=True)
        rows = []
        for n in found.tolist():
            if n == 0:
                rows.append(self._inv["base"])
                continue
            if n not in self._dynamic:
                if len(self._dynamic) >= DYNAMIC_KEPT:
                    self._dynamic.clear()
                self._dynamic[n] = self._init(torch.tensor(n, device=self.device), self.device)[0]
            rows.append(self._dynamic[n])
        return torch.stack(rows)[index.to(self.device)]

    def reserve(self, n: int) -> None:
        """Grow the tables a forward up to n positions may read (so that they need not grow mid-run)."""
        self._table("base", n if self.threshold is None else min(n, self.threshold))
        if self.rope_type == "longrope" and n > self.threshold:
            self._table("long", n)


class Rotary:
    """Every rotary embedding of a model, by layer type (`layer_types[i]`: the key of layer i's)."""

    def __init__(self, config, device: torch.device, dtype: torch.dtype):
        self.layer_types = rope_layer_types(config)
        self.embeddings = {t: RotaryEmbedding(config, t, device, dtype) for t in dict.fromkeys(self.layer_types)}

    @property
    def length_dependent(self) -> bool:
        return any(e.length_dependent for e in self.embeddings.values())

    def cos_sin(self, positions: torch.Tensor, kv_len: int, layer_type: str | None = None,
                lengths: torch.Tensor | None = None):
        """cos, sin' [*positions.shape, Dr] of one layer type (see `RotaryEmbedding.cos_sin`)."""
        return self.embeddings[layer_type].cos_sin(positions, kv_len, lengths)

    def for_forward(self, positions: torch.Tensor, kv_len: int, lengths: torch.Tensor | None = None) -> dict:
        """{layer type: (cos, sin') [B, 1, T, Dr]} for a forward over positions [B, T] reaching kv_len, once
        per layer type; lengths: the tokens' scaling lengths [B, T] (host), for the length-dependent types."""
        out = {}
        for t, e in self.embeddings.items():
            cos, sin = e.cos_sin(positions, kv_len, lengths)
            out[t] = cos[:, None], sin[:, None]
        return out

    def scaling_lengths(self, start: list[int], width: int, prompt_len,
                        positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """Each token's scaling length [B, width] (host) for a forward of `width` tokens per row from
        start[b], in rows whose prompts have prompt_len[b] tokens: max(p + 1, P). None when no layer's
        rotation depends on it (nothing is computed on the hot path of the static types). positions: the
        tokens' own [B, width] where they are not start[b] + t (a token tree's, `kv.cache.TreeStep`)."""
        if not self.length_dependent:
            return None
        floor = torch.zeros(len(start), dtype=torch.long) if prompt_len is None else prompt_len.to("cpu")
        if positions is not None:
            ends = positions.to("cpu") + 1
        else:
            ends = torch.tensor(start, dtype=torch.long)[:, None] + torch.arange(1, width + 1)
        return torch.maximum(ends, floor.reshape(-1, 1))

    def reserve(self, n: int) -> None:
        for e in self.embeddings.values():
            e.reserve(n)


def library_rotary_modules(model) -> list:
    """The library's rotary modules of a model (those that keep an inv_freq)."""
    return [m for m in model.modules() if any(n.endswith("inv_freq") for n, _ in m.named_buffers(recurse=False))]


def reset_library_rotary(model) -> None:
    """The library's rotary modules (of a model, or a list of them) put back as after loading. A length-dependent
    rope (`dynamic`) keeps the scaling of the longest call it has seen; a reference computed with the library
    starts from the state a freshly loaded model has (sdbench's own runner never reads these modules)."""
    for m in model if isinstance(model, list) else library_rotary_modules(model):
        buffers = dict(m.named_buffers(recurse=False))
        for name, buf in buffers.items():
            if name.endswith("original_inv_freq"):
                m.register_buffer(name.replace("original_", ""), buf.clone(), persistent=False)
        if hasattr(m, "original_max_seq_len"):  # per layer type too (`{layer_type}_max_seq_len_cached`)
            for key in [k for k in vars(m) if k.endswith("max_seq_len_cached")] or ["max_seq_len_cached"]:
                setattr(m, key, m.original_max_seq_len)
