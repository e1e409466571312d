"""An MTP module's decoder layer run as the library's own module, for the layer types sdbench's head forward does
not compute (DeepSeek-V3's multi-head latent attention, DeepSeek's and GLM-4.5's mixtures of experts): the family's
decoder-layer class and rotary embedding, built at the module's layer index, loaded with the weights as the
checkpoint ships them (each expert's projections fused as the library's own loader fuses them), over a cache of
slots (`SlotCache`) that the head's steps write at their positions, so that it rewinds with the target as the
head's own cache does."""

from __future__ import annotations

import importlib
import re

import torch

from sdbench.errors import SdbenchError

LAYER = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")  # a decoder layer's own weights
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class SlotCache:
    """A library layer's cache by slot: whatever the layer caches ([B, heads, T, width] keys and values, or
    DeepSeek's latents) written at the positions of the current step (`step`, set before each forward); a forward
    reads its first step.kv_len slots. capacity: the slots a row may write below."""

    def __init__(self, batch: int, capacity: int):
        self.batch, self.capacity = batch, capacity
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.step = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
        """The library's `Cache.update`: keys and values [B, h, T, d] stored at the step's slots; the first
        kv_len slots of each returned."""
        if self.kv is None:
            self.kv = tuple(x.new_zeros(self.batch, x.shape[1], self.capacity, x.shape[3]) for x in (keys, values))
        rows = torch.arange(self.batch, device=keys.device)[:, None]
        slots = self.step.positions.to(keys.device)  # [B, T]
        for store, new in zip(self.kv, (keys, values)):
            store[rows, :, slots] = new.transpose(1, 2)  # [B, T, h, d]
        return tuple(store[:, :, :self.step.kv_len] for store in self.kv)


def library_layer(model_type: str, config: dict, index: int, weights: dict, source: str, dtype, device,
                  like=None):
    """(decoder layer, rotary embedding) of the library for `model_type`, the layer built at `index` with the
    checkpoint's weights of its decoder layer (`self_attn.*`, `mlp.*`, the two norms), its attention and experts
    computed as in the library config `like` (the target's; else SDPA and the experts' loop); one line where the
    library has no such layer or the weights do not fit it."""
    from transformers import AutoConfig  # slow to import; only a library layer needs it

    layer_cls, rotary_cls = _classes(model_type, source)
    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    cfg._attn_implementation = getattr(like, "_attn_implementation", None) or "sdpa"
    cfg._experts_implementation = getattr(like, "_experts_implementation", None) or "eager"
    layer = layer_cls(cfg, index)
    own = {k: v for k, v in weights.items() if k.startswith(LAYER)}
    try:
        fused = fuse_experts(own)
    except KeyError as err:
        raise SdbenchError(f"--head {source}: an expert of its MTP layer has no {err.args[0]}") from None
    missing, unexpected = layer.load_state_dict(fused, strict=False)
    if missing or unexpected:
        what = f"no {missing[0]}" if missing else f"{unexpected[0]}, which its layer type does not have"
        raise SdbenchError(f"--head {source}: its {model_type} MTP layer has {what}")
    return layer.to(device, dtype).eval(), rotary_cls(cfg).to(device)


def _classes(model_type: str, source: str):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "")
    prefix = name[:-len("ForCausalLM")] if name.endswith("ForCausalLM") else ""
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        return getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}RotaryEmbedding")
    except (ImportError, AttributeError):
        raise SdbenchError(f"--head {source}: the library has no {model_type} decoder layer to run its MTP module "
                           "with") from None


def fuse_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each expert's gate, up and down projections as the library's loader fuses them: `experts.gate_up_proj`
    [E, 2I, H] (gate then up, per expert) and `experts.down_proj` [E, H, I]; everything else as it is."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for k, v in weights.items():
        m = _EXPERT.match(k)
        if m:
            groups.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = v
        else:
            out[k] = v
    for prefix, experts in groups.items():
        order = [experts[i] for i in sorted(experts)]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat((e["gate_proj"], e["up_proj"])) for e in order])
        out[f"{prefix}.down_proj"] = torch.stack([e["down_proj"] for e in order])
    return out
