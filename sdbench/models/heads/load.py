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
  `{k}.{layers}.weight` (head k's vocabulary projection);
- the block drafters' formats (block_load.py: DFlash).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sdbench.engine.hidden import FINAL, eagle3_layers
from sdbench.errors import SdbenchError
from sdbench.models.heads.block_load import BLOCK_KINDS, check_block, parse_block
from sdbench.models.heads.mtp_load import MTP, check_mtp, parse_mtp
from sdbench.models.heads.mtp_native import has_own_module, read_own_mtp

EAGLE3, EAGLE1, MEDUSA, PEAGLE = "eagle3", "eagle1", "medusa", "peagle"
EAGLE3_LIKE = (EAGLE3, PEAGLE)  # P-EAGLE: EAGLE-3's layer, drafting several positions in one forward
# EAGLE-3 variants of the speculators format that this forward does not compute (one line each, refused)
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


@dataclass
class Head:
    """A loaded head: kind, the target states it reads, its layer's config and its weights by canonical name
    (the decoder layer's without prefix: `q_proj.weight`, `hidden_norm.weight`, ...)."""

    name: str
    kind: str  # EAGLE3, EAGLE1, MEDUSA, PEAGLE or a block drafter's (block_load.py)
    layers: tuple[int, ...]  # the target states it reads (engine/hidden.py)
    config: dict  # the decoder layer's (EAGLE, a block drafter) or the heads' (Medusa) settings
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    norm_before_residual: bool = False
    block_size: int = 0  # a block drafter: the tokens of its one forward (the anchor, then mask tokens)
    mask_token_id: int | None = None  # a block drafter, P-EAGLE: the token its drafted positions hold
    anchor_drafts: bool = False  # a block drafter: the anchor's slot drafts too (speculators' sample_from_anchor)
    markov: dict = field(default_factory=dict)  # DSpark: its Markov and confidence heads' settings; DFlash 2: its
    # convolutions' and candidate selector's (block_load.py)
    layout: str = ""  # an MTP module read from a model's own checkpoint: its family's layout (mtp_native.py)


def load_head(source: str, target, kinds: tuple[str, ...] = (EAGLE3, EAGLE1, MEDUSA, PEAGLE, MTP, *BLOCK_KINDS),
              strategy: str = "") -> Head:
    """The head at `source` (a folder, else a hub id), for the target runner `target`; raises SdbenchError on a
    folder that is not a head this reads, a head of another kind than `kinds` (what `strategy` drafts with),
    or a head made for another target."""
    folder = _folder(source)
    config = _read_config(folder, source)
    if has_own_module(config):  # a model's checkpoint: its own MTP module's tensors alone are read
        head = read_own_mtp(source, folder, config, Head)
    else:
        head = _parse(source, config, _read_weights(folder, source), target)
    if head.kind not in kinds:
        other = ("dflash" if head.kind == "dflash2" else head.kind) if head.kind in (MEDUSA, PEAGLE, MTP, *BLOCK_KINDS) \
            else "eagle"
        raise SdbenchError(f"--head {source} is a {head.kind} head, which --strategy {strategy or kinds[0]} does not "
                           f"draft with: use --strategy {other}")
    check_against(head, target)
    return head


def looks_like_path(source: str) -> bool:
    """A head the user named as a folder (a hub id is `owner/name`)."""
    return source.startswith((".", "/", "~")) or source.count("/") != 1 or "\\" in source


def _folder(source: str) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise SdbenchError(f"--head {source}: not a folder (a head is a folder of config.json and weights)")
    if looks_like_path(source):
        raise SdbenchError(f"--head {source}: no such folder, nor a hub id (owner/name)")
    from sdbench.models.loading.hub import snapshot  # huggingface_hub: slow to import; only a hub head needs it

    return snapshot(source)


def check_folder(source: str) -> None:
    """A head named as a local folder, checked before any model loads: the folder, a config.json that parses and
    weight files in it (their contents are read with the head); a hub id is left to its download."""
    path = Path(source).expanduser()
    if not path.exists() and not looks_like_path(source):
        return
    folder = _folder(source)
    _read_config(folder, source)
    if not _weight_files(folder):
        raise SdbenchError(f"--head {source}: no weights in {folder} (*.safetensors, *.bin or *.pt)")


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt"))


def config_kind(source: str) -> str | None:
    """What a head folder holds, from its config alone: MEDUSA, PEAGLE, MTP, a block drafter's kind, else None
    (an EAGLE head, or a config not readable)."""
    if medusa_heads(source) is not None:
        return MEDUSA
    block = _block_of(source)
    if block is not None:
        return block.kind
    try:
        config = _read_config(_folder(source), source)
    except SdbenchError:
        return None
    kind = MTP if has_own_module(config) else config.get("speculators_model_type")
    return kind if kind in (PEAGLE, MTP) else None


def block_drafts(source: str) -> int | None:
    """The tokens one block of a block drafter drafts, from its config alone (None: not a block drafter, or not
    readable)."""
    block = _block_of(source)
    return None if block is None else block.block_size - (0 if block.anchor_drafts else 1)


def _block_of(source: str) -> Head | None:
    """The block drafter a folder's config describes (no weights read); None: none, or not readable."""
    try:
        return parse_block(source, _read_config(_folder(source), source), {}, 1, Head)
    except SdbenchError:
        return None


def medusa_heads(source: str) -> int | None:
    """A Medusa head's number of heads, from its config alone (None: not a Medusa config, or not readable)."""
    try:
        n = _read_config(_folder(source), source).get("medusa_num_heads")
    except SdbenchError:
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _read_config(folder: Path, source: str) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise SdbenchError(f"--head {source}: no config.json in {folder}")
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise SdbenchError(f"--head {source}: config.json is not JSON ({err})") from None


def _read_weights(folder: Path, source: str) -> dict[str, torch.Tensor]:
    files = _weight_files(folder)
    if not files:
        raise SdbenchError(f"--head {source}: no weights in {folder} (*.safetensors, *.bin or *.pt)")
    weights = {}
    for f in files:
        try:
            if f.suffix == ".safetensors":
                from safetensors.torch import load_file

                part = load_file(str(f))
            else:
                part = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as err:  # safetensors, pickle and zip errors alike: the file is not readable weights
            line = (str(err).strip() or type(err).__name__).splitlines()[0]
            raise SdbenchError(f"--head {source}: {f} is not a readable weights file ({line})") from None
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise SdbenchError(f"--head {source}: {f} does not hold a dictionary of tensors")
        weights.update(part)
    return weights


def _parse(source: str, config: dict, weights: dict, target) -> Head:
    n_layers = _text(target.config).num_hidden_layers
    block = parse_block(source, config, weights, n_layers, Head)
    if block is not None:
        return block
    if "medusa_num_heads" in config:
        return Head(source, MEDUSA, (FINAL,), dict(config), _strip(weights, "medusa_head."))
    if config.get("speculators_model_type") == MTP:
        return parse_mtp(source, config, weights, Head)
    kind = config.get("speculators_model_type")
    if kind in EAGLE3_LIKE:
        name = "EAGLE-3" if kind == EAGLE3 else "P-EAGLE"
        bad = [f for f in UNSUPPORTED_FLAGS if config.get(f)]
        if bad:
            raise SdbenchError(f"--head {source}: {name} with {bad[0]} is not supported yet")
        layer = dict(config.get("transformer_layer_config") or {})
        if layer.get("num_hidden_layers", 1) != 1:
            raise SdbenchError(f"--head {source}: {name} with {layer['num_hidden_layers']} decoder layers is not "
                               "supported yet (one is)")
        layer["draft_vocab_size"] = config.get("draft_vocab_size", layer.get("vocab_size"))
        ids = _layer_ids(source, config) or eagle3_layers(n_layers)
        mask = config.get("mask_token_id")
        if kind == PEAGLE and (isinstance(mask, bool) or not isinstance(mask, int)):
            raise SdbenchError(f"--head {source}: its config.json names no mask_token_id (the token P-EAGLE's "
                               "parallel positions hold)")
        return Head(source, kind, tuple(ids), layer, _strip(weights, "layers.0."),
                    bool(config.get("norm_before_residual", False)), mask_token_id=mask)
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []) or any(k.startswith("midlayer.") for k in weights):
        ids = _layer_ids(source, config) or eagle3_layers(n_layers)
        return Head(source, EAGLE3, tuple(ids), dict(config), _strip(weights, "midlayer."))
    if "fc.weight" in weights and any(k.startswith("layers.0.") for k in weights):
        return Head(source, EAGLE1, (FINAL,), dict(config), _strip(weights, "layers.0."))
    raise SdbenchError(f"--head {source}: not a head sdbench reads (EAGLE-3 in the speculators or EAGLE format, "
                       "P-EAGLE, EAGLE-1, Medusa-1, MTP, DFlash in the speculators or z-lab format, DSpark in "
                       "the speculators format)")


def _layer_ids(source: str, config: dict) -> list | None:
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and not isinstance(ids, list):
        raise SdbenchError(f"--head {source}: eagle_aux_hidden_state_layer_ids in its config.json is {ids!r}, not a "
                           "list of layer ids")
    return ids


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
    bad = [i for i in head.layers if isinstance(i, bool) or not isinstance(i, int)
           or not 0 <= i <= L and not (i == FINAL and head.kind not in EAGLE3_LIKE)]
    if bad:
        raise SdbenchError(f"{where} reads target layer {bad[0]}, but the target has {L} layers (0 to {L})")
    if head.kind == MEDUSA:
        return _check_medusa(head, H, V)
    if head.kind == MTP:
        return check_mtp(head, H, V, _check_shapes, _count)
    if head.kind in BLOCK_KINDS:
        check_block(head, H, V, _check_shapes, _count)
        if "lm_head.weight" in head.weights:
            _check_vocab(head, V)
        return
    need = len(head.layers) * H
    fc = head.weights.get("fc.weight")
    if fc is None:
        raise SdbenchError(f"{where}: no fc.weight in its weights")
    if fc.shape[1] != need + (H if head.kind == EAGLE1 else 0):
        got = fc.shape[1] - (H if head.kind == EAGLE1 else 0)
        raise SdbenchError(f"{where} reads hidden states of width {got}, but the target's layers {head.layers} "
                           f"give {need} (hidden size {H})")
    if head.kind in EAGLE3_LIKE:
        _check_vocab(head, V)
    if head.kind == PEAGLE:
        _check_mask(head, need, V)
    _check_layer(head, H, V)


def _check_mask(head: Head, width: int, V: int) -> None:
    """P-EAGLE's mask token and the state its parallel positions hold (`mask_hidden`, the target states' width)."""
    if not 0 <= head.mask_token_id < V:
        raise SdbenchError(f"--head {head.name}: mask_token_id {head.mask_token_id} is not one of the target's {V} "
                           "tokens")
    hidden = head.weights.get("mask_hidden")
    if hidden is None or hidden.numel() != width:
        got = "no mask_hidden" if hidden is None else f"mask_hidden of {hidden.numel()} values"
        raise SdbenchError(f"--head {head.name}: {got} in its weights, where its parallel positions need the "
                           f"target states' width ({width})")


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


def _count(head: Head, key: str, default=None, least: int = 1) -> int:
    """A whole-number setting of the head's config, at least `least` (one line otherwise)."""
    value = head.config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise SdbenchError(f"--head {head.name}: {key} in its config.json is {value!r}, not a whole number of at "
                           f"least {least}")
    return value


def _check_shapes(head: Head, need: dict[str, tuple[int, ...]], optional: dict[str, tuple[int, ...]]) -> None:
    """Each weight the forward reads, present (`need`) and of the shape this target asks for."""
    for name, shape in {**need, **optional}.items():
        w = head.weights.get(name)
        if w is None and name in need:
            raise SdbenchError(f"--head {head.name}: no {name} in its weights")
        if w is not None and tuple(w.shape) != shape:
            raise SdbenchError(f"--head {head.name}: {name} has shape {tuple(w.shape)}, but its config and the "
                               f"target's hidden size need {shape}")


def _check_layer(head: Head, H: int, V: int) -> None:
    """The EAGLE decoder layer's weights against its config and the target (hidden size H, V tokens)."""
    hidden = head.config.get("hidden_size", H)
    if hidden != H:
        raise SdbenchError(f"--head {head.name} has hidden size {hidden}, but the target's is {H}")
    n = _count(head, "num_attention_heads")
    kv = _count(head, "num_key_value_heads", n)
    D = _count(head, "head_dim", H // n)
    gate = head.weights.get("mlp.gate_proj.weight")
    inter = gate.shape[0] if gate is not None else _count(head, "intermediate_size")
    width = 2 * H if head.kind in EAGLE3_LIKE else H  # EAGLE-3's attention reads cat(embedding, state)
    need = {"self_attn.q_proj.weight": (n * D, width), "self_attn.k_proj.weight": (kv * D, width),
            "self_attn.v_proj.weight": (kv * D, width), "self_attn.o_proj.weight": (H, n * D),
            "mlp.gate_proj.weight": (inter, H), "mlp.up_proj.weight": (inter, H), "mlp.down_proj.weight": (H, inter),
            "post_attention_layernorm.weight": (H,)}
    optional = {"self_attn.q_proj.bias": (n * D,), "self_attn.k_proj.bias": (kv * D,),
                "self_attn.v_proj.bias": (kv * D,), "self_attn.o_proj.bias": (H,), "self_attn.q_norm.weight": (D,),
                "self_attn.k_norm.weight": (D,), "embed_tokens.weight": (V, H)}
    if head.kind in EAGLE3_LIKE:
        need.update({"input_layernorm.weight": (H,), "hidden_norm.weight": (H,), "norm.weight": (H,)})
        optional["lm_head.weight"] = (head.weights["lm_head.weight"].shape[0], H)
    fc = head.weights["fc.weight"]
    optional.update({"fc.weight": (H, fc.shape[1]), "fc.bias": (H,)})  # the state's width was checked above
    _check_shapes(head, need, optional)


def _check_medusa(head: Head, H: int, V: int) -> None:
    where = f"--head {head.name}"
    n, depth = _count(head, "medusa_num_heads"), _count(head, "medusa_num_layers", 1, least=0)
    for k in range(n):
        out = head.weights.get(f"{k}.{depth}.weight")
        if out is None:
            raise SdbenchError(f"{where}: no {k}.{depth}.weight (head {k}'s vocabulary projection) in its weights")
        if out.shape != (V, H):
            raise SdbenchError(f"{where}: head {k} maps hidden size {out.shape[1]} to {out.shape[0]} tokens, but "
                               f"the target has hidden size {H} and {V} tokens")
    blocks = [(k, j) for k in range(n) for j in range(depth)]  # the residual blocks before each projection
    _check_shapes(head, {f"{k}.{j}.linear.weight": (H, H) for k, j in blocks},
                  {f"{k}.{j}.linear.bias": (H,) for k, j in blocks})
