"""Trained heads read from a folder (or a hub id): which kind, its shapes, its weights under one set of names,
checked against the target before any drafting.

Formats read:
- EAGLE-3 as the `speculators` package writes it (and vLLM loads): config `speculators_model_type: eagle3` with
  `transformer_layer_config`, `draft_vocab_size`, `norm_before_residual`, `eagle_aux_hidden_state_layer_ids`;
  weights `fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d` (`embed_tokens` optional: the target's otherwise);
- EAGLE-3 as the EAGLE repository writes it: `LlamaForCausalLMEagle3`, the layer as `midlayer.*`;
- EAGLE-1 (the EAGLE repository, vLLM's `EAGLEModel`): a Llama config of one layer, `fc` over
  cat(embedding, hidden state) with a bias, `layers.0.*` without an input norm; the target's head;
- Medusa-1: `medusa_num_heads`, `medusa_num_layers`; weights `{k}.{j}.linear.*` (residual blocks) and
  `{k}.{layers}.weight` (head k's vocabulary projection).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sdbench.engine.hidden import FINAL, eagle3_layers
from sdbench.errors import SdbenchError

EAGLE3, EAGLE1, MEDUSA = "eagle3", "eagle1", "medusa"
# EAGLE-3 variants of the speculators format that this forward does not compute (one line each, refused)
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


@dataclass
class Head:
    """A loaded head: kind, the target states it reads, its layer's config and its weights by canonical name
    (the decoder layer's without prefix: `q_proj.weight`, `hidden_norm.weight`, ...)."""

    name: str
    kind: str  # EAGLE3, EAGLE1 or MEDUSA
    layers: tuple[int, ...]  # the target states it reads (engine/hidden.py)
    config: dict  # the decoder layer's (EAGLE) or the heads' (Medusa) settings
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    norm_before_residual: bool = False


def load_head(source: str, target, kinds: tuple[str, ...] = (EAGLE3, EAGLE1, MEDUSA), strategy: str = "") -> Head:
    """The head at `source` (a folder, else a hub id), for the target runner `target`; raises SdbenchError on a
    folder that is not a head this reads, a head of another kind than `kinds` (what `strategy` drafts with),
    or a head made for another target."""
    folder = _folder(source)
    config = _read_config(folder, source)
    weights = _read_weights(folder, source)
    head = _parse(source, config, weights, target)
    if head.kind not in kinds:
        other = "medusa" if head.kind == MEDUSA else "eagle"
        raise SdbenchError(f"--head {source} is a {head.kind} head, which --strategy {strategy or kinds[0]} does not "
                           f"draft with: use --strategy {other}")
    check_against(head, target)
    return head


def _folder(source: str) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists() or source.count("/") != 1:
        raise SdbenchError(f"--head {source}: not a folder, nor a hub id (owner/name)")
    from sdbench.models.loader import hub_snapshot  # huggingface_hub: slow to import; only a hub head needs it

    return hub_snapshot(source)


def _read_config(folder: Path, source: str) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise SdbenchError(f"--head {source}: no config.json in {folder}")
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise SdbenchError(f"--head {source}: config.json is not JSON ({err})") from None


def _read_weights(folder: Path, source: str) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        return {k: v for f in files for k, v in load_file(str(f)).items()}
    files = sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt"))
    if not files:
        raise SdbenchError(f"--head {source}: no weights in {folder} (*.safetensors, *.bin or *.pt)")
    return {k: v for f in files for k, v in torch.load(f, map_location="cpu", weights_only=True).items()}


def _parse(source: str, config: dict, weights: dict, target) -> Head:
    n_layers = _text(target.config).num_hidden_layers
    if "medusa_num_heads" in config:
        return Head(source, MEDUSA, (FINAL,), dict(config), _strip(weights, "medusa_head."))
    if config.get("speculators_model_type") == "eagle3":
        bad = [f for f in UNSUPPORTED_FLAGS if config.get(f)]
        if bad:
            raise SdbenchError(f"--head {source}: EAGLE-3 with {bad[0]} is not supported yet")
        layer = dict(config.get("transformer_layer_config") or {})
        layer["draft_vocab_size"] = config.get("draft_vocab_size", layer.get("vocab_size"))
        ids = config.get("eagle_aux_hidden_state_layer_ids") or eagle3_layers(n_layers)
        return Head(source, EAGLE3, tuple(ids), layer, _strip(weights, "layers.0."),
                    bool(config.get("norm_before_residual", False)))
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []) or any(k.startswith("midlayer.") for k in weights):
        ids = config.get("eagle_aux_hidden_state_layer_ids") or eagle3_layers(n_layers)
        return Head(source, EAGLE3, tuple(ids), dict(config), _strip(weights, "midlayer."))
    if "fc.weight" in weights and any(k.startswith("layers.0.") for k in weights):
        return Head(source, EAGLE1, (FINAL,), dict(config), _strip(weights, "layers.0."))
    raise SdbenchError(f"--head {source}: not a head sdbench reads (EAGLE-3 in the speculators or EAGLE format, "
                       "EAGLE-1, Medusa-1)")


def _strip(weights: dict, prefix: str) -> dict:
    """The decoder layer's weights without their prefix; the rest as they are."""
    return {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in weights.items()}


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_against(head: Head, target) -> None:
    """One line on the first way the head does not fit the target: hidden size, vocabulary, layer ids."""
    cfg = _text(target.config)
    H, L, V = cfg.hidden_size, cfg.num_hidden_layers, target.vocab_size
    where = f"--head {head.name}"
    # i < L: the input of layer i; L: the last layer's output (vLLM's and speculators' numbering)
    bad = [i for i in head.layers if not 0 <= i <= L and not (i == FINAL and head.kind != EAGLE3)]
    if bad:
        raise SdbenchError(f"{where} reads target layer {bad[0]}, but the target has {L} layers (0 to {L})")
    if head.kind == MEDUSA:
        return _check_medusa(head, H, V)
    need = len(head.layers) * H
    fc = head.weights.get("fc.weight")
    if fc is None:
        raise SdbenchError(f"{where}: no fc.weight in its weights")
    if fc.shape[1] != need + (H if head.kind == EAGLE1 else 0):
        got = fc.shape[1] - (H if head.kind == EAGLE1 else 0)
        raise SdbenchError(f"{where} reads hidden states of width {got}, but the target's layers {head.layers} "
                           f"give {need} (hidden size {H})")
    if head.kind == EAGLE3:
        _check_vocab(head, V)


def _check_vocab(head: Head, V: int) -> None:
    where = f"--head {head.name}"
    target_vocab = head.config.get("vocab_size", V)
    if target_vocab != V:
        raise SdbenchError(f"{where} was made for a vocabulary of {target_vocab} tokens, but the target has {V}")
    lm = head.weights.get("lm_head.weight")
    if lm is None:
        raise SdbenchError(f"{where}: no lm_head.weight in its weights")
    d2t = head.weights.get("d2t")
    if d2t is None and lm.shape[0] != V:
        raise SdbenchError(f"{where} drafts over {lm.shape[0]} tokens and has no d2t (draft-to-target token map)")
    if d2t is not None:
        if d2t.shape[0] != lm.shape[0]:
            raise SdbenchError(f"{where}: d2t maps {d2t.shape[0]} tokens, but its head drafts over {lm.shape[0]}")
        ids = d2t.long() + torch.arange(d2t.shape[0])
        if int(ids.min()) < 0 or int(ids.max()) >= V:
            raise SdbenchError(f"{where}: d2t maps to token {int(ids.max())}, past the target's {V} tokens")


def _check_medusa(head: Head, H: int, V: int) -> None:
    where = f"--head {head.name}"
    n, depth = int(head.config["medusa_num_heads"]), int(head.config.get("medusa_num_layers", 1))
    for k in range(n):
        out = head.weights.get(f"{k}.{depth}.weight")
        if out is None:
            raise SdbenchError(f"{where}: no {k}.{depth}.weight (head {k}'s vocabulary projection) in its weights")
        if out.shape != (V, H):
            raise SdbenchError(f"{where}: head {k} maps hidden size {out.shape[1]} to {out.shape[0]} tokens, but "
                               f"the target has hidden size {H} and {V} tokens")
