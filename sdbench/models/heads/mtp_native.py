"""An MTP module read from the target's own checkpoint, in the layout its family ships (the weights vLLM's
`deepseek_mtp`, `glm4_moe_mtp` and `mimo_mtp` read; the library drops them when it loads the target):

- DeepSeek-V3 and GLM-4.5 (`model.layers.{L}.`, L = num_hidden_layers): `enorm` and `hnorm` over the next token's
  embedding e and the state h, `eh_proj` over cat(enorm(e), hnorm(h)), one decoder layer of the family's own
  type (multi-head latent attention, a mixture of experts), `shared_head.norm` and `shared_head.head` for the
  logits; the state fed to the next step is the layer's output before `shared_head.norm`;
- MiMo (`model.mtp_layers.0.`): `token_layernorm`, `hidden_layernorm`, `input_proj` over cat(h, e) (the other
  order), one Qwen2 layer, `final_layernorm`, whose output is both fed back and read by the target's head.

Both zero the embedding at position 0 (vLLM: "not needed by MTP"). Only the module's tensors are read, shard by
shard through the checkpoint's index, never the whole model. The weights are renamed to the speculators format's
names (models/heads/mtp.py reads one set); MiMo's `input_proj` columns are swapped into cat(e, h) order.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sdbench.engine.hidden import FINAL
from sdbench.errors import SdbenchError
from sdbench.models.loading.library import STAND_INS

DEEPSEEK, MIMO = "deepseek", "mimo"  # the layouts read (Head.layout; "" is the speculators format)
_RENAMED = {"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight",
            "eh_proj.weight": "input_proj.weight", "shared_head.norm.weight": "final_layernorm.weight",
            "shared_head.head.weight": "lm_head.weight"}  # DeepSeek's names within its module -> the ones read


def has_own_module(config: dict) -> bool:
    """A model checkpoint's config (not a head's) that declares MTP modules of its own."""
    n = config.get("num_nextn_predict_layers")
    return "speculators_model_type" not in config and isinstance(n, int) and not isinstance(n, bool) and n > 0


def read_own_mtp(source: str, folder: Path, config: dict, head_type):
    """The first MTP module of the checkpoint in `folder` (its config.json: `config`), as a `head_type`
    (load.Head); one line where it holds none sdbench reads."""
    keys = _checkpoint_keys(folder, source)
    L = config.get("num_hidden_layers")
    if f"model.layers.{L}.eh_proj.weight" in keys:
        layout, prefix = DEEPSEEK, f"model.layers.{L}."
    elif "model.mtp_layers.0.input_proj.weight" in keys:
        layout, prefix = MIMO, "model.mtp_layers.0."
    elif any(k.startswith("mtp.") for k in keys):
        raise SdbenchError(f"--head {source}: its MTP module is in the Qwen3-Next layout (mtp.*), whose target keeps "
                           "a recurrent state sdbench cannot rewind")
    else:
        raise SdbenchError(f"--head {source}: its config declares num_nextn_predict_layers, but its weights hold no "
                           f"MTP module (model.layers.{L}.eh_proj or model.mtp_layers.0.input_proj)")
    weights = _read(folder, keys, prefix)
    weights = {_RENAMED.get(k, k): v for k, v in weights.items()}
    proj = weights["input_proj.weight"]
    if layout == MIMO and proj.dim() == 2 and proj.shape[1] % 2 == 0:  # cat(h, e) -> cat(e, h)
        weights["input_proj.weight"] = torch.cat(proj.chunk(2, dim=1)[::-1], dim=1)
    layer = {k: v for k, v in config.items() if k not in ("architectures", "auto_map", "quantization_config")}
    layer.pop("layer_types", None)  # the target's, one per target layer: the module is one full-attention layer
    layer["model_type"] = STAND_INS.get(layer.get("model_type"), layer.get("model_type", "llama"))
    return head_type(source, "mtp", (FINAL,), layer, weights, layout=layout)


def _checkpoint_keys(folder: Path, source: str) -> dict[str, Path]:
    """Every tensor name of the checkpoint -> the safetensors file holding it (the index's map, else each file's
    own names)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise SdbenchError(f"--head {source}: {index.name} is not a safetensors index ({err})") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SdbenchError(f"--head {source}: no *.safetensors in {folder} (a model's own MTP module is read from "
                           "safetensors files)")
    from safetensors import safe_open

    names = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as opened:
                names.update(dict.fromkeys(opened.keys(), f))
        except Exception as err:  # safetensors' own errors: the file is not readable weights
            raise SdbenchError(f"--head {source}: {f} is not a readable safetensors file ({err})") from None
    return names


def _read(folder: Path, keys: dict[str, Path], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix`, the prefix stripped, each file opened once."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for k, f in keys.items():
        if k.startswith(prefix):
            by_file.setdefault(f, []).append(k)
    out = {}
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as opened:
            out.update({k[len(prefix):]: opened.get_tensor(k) for k in names})
    return out
