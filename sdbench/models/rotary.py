"""Rotary position embeddings computed from a model's config for the positions each forward really has.

The library's rotary module is stateful for the length-dependent types: it rewrites its `inv_freq` buffer on
every call from that call's largest position. sdbench never calls it; it computes the same numbers from the
config with the library's pure functions (`ROPE_INIT_FUNCTIONS`, the rope maths as a function of the config
and a length) and follows the rule the library applies per call (`dynamic_rope_update`): a forward whose
largest position is p has seq_len = p + 1, and

- static types (default, linear, llama3, yarn, ...): one inv_freq; cos/sin are rows of a table grown on
  demand by appending rows, so an entry, once made, never changes;
- longrope: the short factors while seq_len <= original_max_position_embeddings, the long ones past it: two
  static tables, one picked per forward (for the whole forward, as the library does);
- dynamic (NTK): the unscaled table while seq_len <= max_position_embeddings; past it, inv_freq is
  recomputed for that seq_len and cos/sin are computed for this forward's positions only.

Keys already in a cache keep the rotation they were written with, exactly as in the library's cache. So for
the length-dependent types a forward's result depends on the widest position in it (a verification of
gamma + 1 tokens past the original context rotates with the scaling of its last position): that is the
model's own property, and speculative decoding there is not exactly plain decoding.

Models whose `config.rope_parameters` is keyed by layer type (Gemma 3: another base on its local layers)
get one embedding per layer type; `Rotary.layer_types[i]` names layer i's.
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from sdbench.errors import SdbenchError

LENGTH_DEPENDENT = ("dynamic", "longrope")
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
        elif self.rope_type == "dynamic":
            self.threshold = config.max_position_embeddings
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (cos [S, Dr], sin' [S, Dr])

    @property
    def length_dependent(self) -> bool:
        return self.rope_type in LENGTH_DEPENDENT

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

    def cos_sin(self, positions: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin' [*positions.shape, Dr] for positions (a device tensor) of one forward whose largest
        position is seq_len - 1 (host-side: the caller knows it; no device sync)."""
        name = "base"
        if self.threshold is not None and seq_len > self.threshold:
            if self.rope_type == "dynamic":  # a new inv_freq for this length: no table
                inv, _ = self._init(torch.tensor(seq_len, device=self.device), self.device)
                return self._compute(positions, inv)
            name = "long"
        cos, sin = self._table(name, seq_len)
        return cos[positions], sin[positions]

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

    def cos_sin(self, positions: torch.Tensor, seq_len: int, layer_type: str | None = None):
        """cos, sin' [*positions.shape, Dr] of one layer type (see `RotaryEmbedding.cos_sin`)."""
        return self.embeddings[layer_type].cos_sin(positions, seq_len)

    def for_forward(self, positions: torch.Tensor, seq_len: int) -> dict:
        """{layer type: (cos, sin') [B, 1, T, Dr]} for a forward over positions [B, T], once per layer type."""
        out = {}
        for t, e in self.embeddings.items():
            cos, sin = e.cos_sin(positions, seq_len)
            out[t] = cos[:, None], sin[:, None]
        return out

    def reserve(self, n: int) -> None:
        for e in self.embeddings.values():
            e.reserve(n)


def reset_library_rotary(model) -> None:
    """The library's rotary modules put back as after loading. A length-dependent rope (`dynamic`) keeps the
    scaling of the longest call it has seen; a reference computed with the library starts from the state a
    freshly loaded model has (sdbench's own runner never reads these modules)."""
    for m in model.modules():
        buffers = dict(m.named_buffers(recurse=False))
        for name, buf in buffers.items():
            if name.endswith("original_inv_freq"):
                m.register_buffer(name.replace("original_", ""), buf.clone(), persistent=False)
        if hasattr(m, "original_max_seq_len") and any(n.endswith("inv_freq") for n in buffers):
            m.max_seq_len_cached = m.original_max_seq_len
