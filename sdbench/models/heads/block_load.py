"""Block drafters read from a folder: the formats engines load, parsed into a `Head` and checked against the
target before any drafting.

DFlash (block diffusion: a block of `block_size` tokens filled in one non-causal forward), as
- the `speculators` package writes it (and vLLM loads): config `speculators_model_type: dflash` with
  `transformer_layer_config` (a Qwen3 decoder's), `aux_hidden_state_layer_ids` (engine/hidden.py's numbering:
  i < L the input of layer i), `block_size`, `mask_token_id`, `draft_vocab_size`, `sample_from_anchor`;
  weights `layers.{i}.*`, `fc`, `hidden_norm`, `norm`, and `lm_head`, `d2t` for a draft vocabulary smaller than
  the target's (the embedding and a full-vocabulary head are the target's);
- z-lab's own folders (`DFlashDraftModel`): a Qwen3 config with `dflash_config` (`target_layer_ids`, counted
  from the first layer's output, so one less than engine/hidden.py's; `mask_token_id`), `block_size`,
  `num_target_layers`; the same weight names.

DSpark (DFlash plus a Markov head and a confidence head), as the `speculators` package writes it: a DFlash config
with `speculators_model_type: dspark`, `markov_rank` (0: no Markov head), `markov_head_type` (vanilla, gated or
rnn), `enable_confidence_head`, `confidence_head_with_markov`, and `sample_from_anchor` true unless it says
otherwise; weights `markov_head.markov_w1` (target vocabulary x rank), `markov_head.markov_w2` (rank -> draft
vocabulary), `markov_head.gate_proj` (gated) or `markov_head.joint_proj` (rnn), `confidence_head.proj`.

DFlash 2 (DFlash plus local convolutions and a candidate selector), as speculators writes it
(`speculators_model_type: dflash2`) and as z-lab's folders hold it (`DFlash2DraftModel`, its settings in
`dflash_config` or at the top): `conv_kernel_size` (2), `conv_group_size` (16), `selector_rank` (256),
`selector_top_k` (16); weights `layers.{i}.attention_conv.*` and `layers.{i}.mlp_conv.*` (`base_kernel`
[2, kernel, H], `kernel_projection` [2 * kernel * H / group, H]) and `candidate_selector.predecessor_codebook`,
`successor_codebook` ([V, rank]; z-lab's Embedding names with `.weight` read alike) and `hidden_projection`.
It drafts over the target's whole vocabulary (speculators refuses a draft vocabulary for it).
"""

from __future__ import annotations

from sdbench.errors import SdbenchError

DFLASH, DFLASH2, DSPARK = "dflash", "dflash2", "dspark"
BLOCK_KINDS = (DFLASH, DFLASH2, DSPARK)
SCALES = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")  # z-lab's, read by dflash.py
SELECTOR = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}  # defaults
MARKOV_TYPES = ("vanilla", "gated", "rnn")
# config keys of a z-lab folder that are not the draft decoder's own
_ZLAB_KEYS = ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers")


def zlab_layers(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """The target layers z-lab's DFlash reads unless its config names them (its `build_target_layer_ids`),
    counted from the first layer's output."""
    if n_draft_layers == 1:
        return [n_target_layers // 2]
    span = n_target_layers - 4
    return [round(1 + i * span / (n_draft_layers - 1)) for i in range(n_draft_layers)]


def parse_block(source: str, config: dict, weights: dict, n_layers: int, head_type):
    """The block drafter a folder holds, as a `head_type` (load.Head); None when it holds none."""
    kind, markov = config.get("speculators_model_type"), {}
    if kind in BLOCK_KINDS:
        layer = dict(config.get("transformer_layer_config") or {})
        ids = config.get("aux_hidden_state_layer_ids")
        ids = _id_list(source, "aux_hidden_state_layer_ids", ids) if ids is not None else [2, n_layers // 2,
                                                                                            n_layers - 3]
        block, mask, anchor = config.get("block_size", 8), config.get("mask_token_id"), config.get(
            "sample_from_anchor", kind == DSPARK)
        if kind == DSPARK:
            markov = _markov(source, config)
        if kind == DFLASH2:
            markov = _selector(source, config)
    elif "DFlashDraftModel" in (config.get("architectures") or []) or "dflash_config" in config:
        extra = config.get("dflash_config") or {}
        if "DFlash2DraftModel" in (config.get("architectures") or []):
            kind, markov = DFLASH2, _selector(source, {**config, **extra})
        layer = {k: v for k, v in config.items() if k not in _ZLAB_KEYS}
        layer.update({k: extra[k] for k in SCALES if k in extra})  # z-lab reads its dflash_config's first
        drafted = extra.get("target_layer_ids", config.get("target_layer_ids"))
        if drafted is None:
            drafted = zlab_layers(config.get("num_target_layers", n_layers), layer.get("num_hidden_layers", 1))
        ids = [i + 1 for i in _id_list(source, "target_layer_ids", drafted)]
        block = config.get("block_size") or extra.get("block_size", 16)
        mask, anchor = extra.get("mask_token_id", config.get("mask_token_id")), False
    else:
        return None
    layer.setdefault("model_type", "qwen3")
    unread = [k for k in ("attention_value_scale", "is_causal", "causal") if layer.get(k) or (
        kind not in BLOCK_KINDS and (config.get("dflash_config") or {}).get(k))]
    if unread:
        raise SdbenchError(f"--head {source}: a DFlash head with {unread[0]} is not supported yet")
    layer["draft_vocab_size"] = config.get("draft_vocab_size", layer.get("vocab_size"))
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        raise SdbenchError(f"--head {source}: block_size in its config.json is {block!r}, not a whole number of "
                           "at least 2")
    if isinstance(mask, bool) or not isinstance(mask, int):
        raise SdbenchError(f"--head {source}: its config.json names no mask_token_id (the token a block's drafted "
                           "positions hold)")
    return head_type(source, kind if kind in BLOCK_KINDS else DFLASH, tuple(ids), layer, _codebooks(weights),
                     block_size=block, mask_token_id=mask, anchor_drafts=bool(anchor), markov=markov)


def _markov(source: str, config: dict) -> dict:
    """A DSpark config's Markov and confidence settings, checked (speculators' defaults where it names none)."""
    got = {"rank": config.get("markov_rank", 256), "type": config.get("markov_head_type", "vanilla"),
           "confidence": config.get("enable_confidence_head", True),
           "with_markov": config.get("confidence_head_with_markov", True)}
    rank = got["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise SdbenchError(f"--head {source}: markov_rank in its config.json is {rank!r}, not a whole number >= 0")
    if got["type"] not in MARKOV_TYPES:
        raise SdbenchError(f"--head {source}: markov_head_type {got['type']!r} is not one of {', '.join(MARKOV_TYPES)}")
    if got["confidence"] and got["with_markov"] and not rank:
        raise SdbenchError(f"--head {source}: its confidence head reads the Markov head's embedding, but markov_rank "
                           "is 0")
    return got


def _selector(source: str, config: dict) -> dict:
    """A DFlash 2 config's convolution and selector settings, checked (speculators' defaults where it names none)."""
    got = {k: config.get(k, v) for k, v in SELECTOR.items()}
    for key, value in got.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SdbenchError(f"--head {source}: {key} in its config.json is {value!r}, not a whole number >= 1")
    return got


def _codebooks(weights: dict) -> dict:
    """The weights with a selector's codebooks under one name (z-lab's Embedding names end in `.weight`)."""
    suffix = "_codebook.weight"
    return {(k.removesuffix(".weight") if k.startswith("candidate_selector.") and k.endswith(suffix) else k): v
            for k, v in weights.items()}


def _id_list(source: str, key: str, ids) -> list:
    if not isinstance(ids, list):
        raise SdbenchError(f"--head {source}: {key} in its config.json is {ids!r}, not a list of layer ids")
    return ids


def check_block(head, H: int, V: int, check_shapes, count) -> None:
    """A block drafter's weights against its config and the target (hidden size H, V tokens): one line on the
    first misfit. check_shapes, count: load.py's `_check_shapes` and `_count`."""
    where = f"--head {head.name}"
    hidden = head.config.get("hidden_size", H)
    if hidden != H:
        raise SdbenchError(f"{where} has hidden size {hidden}, but the target's is {H} (a {head.kind} head "
                           "shares the target's embedding and head)")
    if head.config.get("vocab_size", V) != V:
        raise SdbenchError(f"{where} was made for a vocabulary of {head.config['vocab_size']} tokens, but the "
                           f"target has {V}")
    if not 0 <= head.mask_token_id < V:
        raise SdbenchError(f"{where}: mask_token_id {head.mask_token_id} is not one of the target's {V} tokens")
    if any(t == "sliding_attention" for t in head.config.get("layer_types") or []):
        raise SdbenchError(f"{where}: sliding-window draft layers are not supported yet")
    n, layers = count(head, "num_attention_heads"), count(head, "num_hidden_layers")
    kv, D = count(head, "num_key_value_heads", n), count(head, "head_dim", H // n)
    inter = count(head, "intermediate_size")
    need = {"fc.weight": (H, len(head.layers) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    optional = {}
    for i in range(layers):
        p = f"layers.{i}."
        need.update({p + "self_attn.q_proj.weight": (n * D, H), p + "self_attn.k_proj.weight": (kv * D, H),
                     p + "self_attn.v_proj.weight": (kv * D, H), p + "self_attn.o_proj.weight": (H, n * D),
                     p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                     p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                     p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                     p + "mlp.down_proj.weight": (H, inter)})
        optional.update({p + f"self_attn.{x}_proj.bias": (w,) for x, w in
                         (("q", n * D), ("k", kv * D), ("v", kv * D), ("o", H))})
    lm = head.weights.get("lm_head.weight")
    if lm is not None:  # a draft vocabulary of its own (checked with its d2t by load.py)
        optional["lm_head.weight"] = (lm.shape[0], H)
    if head.kind == DFLASH2:
        _selector_shapes(head, H, V, layers, need)
    elif head.markov:
        _markov_shapes(head.markov, H, V, V if lm is None else lm.shape[0], need)
    check_shapes(head, need, optional)


def _markov_shapes(markov: dict, H: int, V: int, Vd: int, need: dict) -> None:
    """A DSpark head's Markov and confidence weights, added to `need`: name -> shape."""
    r, p = markov["rank"], "markov_head."
    if r:
        need.update({p + "markov_w1.weight": (V, r), p + "markov_w2.weight": (Vd, r)})
    if r and markov["type"] == "gated":
        need.update({p + "gate_proj.weight": (r, H + r), p + "gate_proj.bias": (r,)})
    if r and markov["type"] == "rnn":
        need.update({p + "joint_proj.weight": (3 * r, 2 * r + H), p + "joint_proj.bias": (3 * r,)})
    if markov["confidence"]:
        width = H + (r if markov["with_markov"] else 0)
        need.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})


def _selector_shapes(head, H: int, V: int, layers: int, need: dict) -> None:
    """A DFlash 2 head's convolution and selector weights, added to `need`: name -> shape; one line where its
    settings cannot fit the target."""
    got = head.markov
    kernel, group, rank = got["conv_kernel_size"], got["conv_group_size"], got["selector_rank"]
    where = f"--head {head.name}"
    if "lm_head.weight" in head.weights or head.config.get("draft_vocab_size", V) != V:
        raise SdbenchError(f"{where}: a DFlash 2 head drafts over the target's whole vocabulary, but it has a draft "
                           "vocabulary of its own")
    if H % group or kernel > head.block_size or got["selector_top_k"] > V:
        raise SdbenchError(f"{where}: conv_group_size {group} must divide the hidden size {H}, conv_kernel_size "
                           f"{kernel} be at most block_size {head.block_size}, and selector_top_k "
                           f"{got['selector_top_k']} at most the vocabulary's {V} tokens")
    for i in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            need.update({f"layers.{i}.{conv}.base_kernel": (2, kernel, H),
                         f"layers.{i}.{conv}.kernel_projection.weight": (2 * kernel * (H // group), H)})
    p = "candidate_selector."
    need.update({p + "predecessor_codebook": (V, rank), p + "successor_codebook": (V, rank),
                 p + "hidden_projection.weight": (rank, H)})
