"""A multi-token-prediction (MTP) module read from a folder in the speculators format (`speculators_model_type:
mtp`, the layout speculators' converter writes from a Qwen3-Next or Qwen3.5 checkpoint's own `mtp.*` weights, and
vLLM loads): `transformer_layer_config` (the target's decoder config), `num_nextn_predict_layers` (1); weights
`mtp_layers.0.`: `input_proj` ([H, 2H] over cat(token_layernorm(embedding), hidden_layernorm(state))),
`token_layernorm`, `hidden_layernorm`, `final_layernorm` and one decoder layer (`self_attn.*`, `mlp.*`,
`input_layernorm`, `post_attention_layernorm`). The embedding and the output head are the target's. It reads the
target's final-norm state, the state the target's own head reads (the one vLLM's MTP proposers are fed).

Read here: modules whose decoder layer is a plain dense one (Qwen3's: attention with per-head q and k norms, a
SwiGLU MLP); a Qwen3-Next or Qwen3.5 module (gated attention, mixture-of-experts MLP) is refused in one line.
"""

from __future__ import annotations

from sdbench.engine.hidden import FINAL
from sdbench.errors import SdbenchError

MTP = "mtp"
DENSE_TYPES = ("qwen3", "qwen2", "llama")  # decoder layers this forward computes


def parse_mtp(source: str, config: dict, weights: dict, head_type):
    """The MTP module a speculators folder holds, as a `head_type` (load.Head)."""
    layer = dict(config.get("transformer_layer_config") or {})
    kind = layer.get("model_type", "qwen3")
    if kind not in DENSE_TYPES:
        raise SdbenchError(f"--head {source}: an MTP module of a {kind} decoder layer is not supported yet (a dense "
                           f"one is: {', '.join(DENSE_TYPES)})")
    n = config.get("num_nextn_predict_layers", 1)
    if n != 1:
        raise SdbenchError(f"--head {source}: num_nextn_predict_layers is {n!r}; one MTP module is read")
    from transformers import AutoConfig  # slow to import; only an MTP head needs it here

    try:  # speculators writes the layer config's differences from its type's defaults: the defaults filled in
        layer = AutoConfig.for_model(kind, **{k: v for k, v in layer.items() if k != "model_type"}).to_dict()
    except (ValueError, TypeError) as err:
        raise SdbenchError(f"--head {source}: its transformer_layer_config is not one sdbench reads ({err})") from None
    layer.pop("layer_types", None)  # the target's, one per target layer: the module is one full-attention layer
    prefix = "mtp_layers.0."
    return head_type(source, MTP, (FINAL,), layer, {(k[len(prefix):] if k.startswith(prefix) else k): v
                                                   for k, v in weights.items()})


def check_mtp(head, H: int, V: int, check_shapes, count) -> None:
    """An MTP module's weights against its config, the target's hidden size H and vocabulary V (one line on the
    first misfit); a layer of a type the library runs (mtp_layer.py) is checked as it loads.
    check_shapes, count: load.py's `_check_shapes` and `_count`."""
    hidden = head.config.get("hidden_size", H)
    if hidden != H:
        raise SdbenchError(f"--head {head.name} has hidden size {hidden}, but the target's is {H} (an MTP module "
                           "shares the target's embedding and head)")
    module = {"input_proj.weight": (H, 2 * H), "token_layernorm.weight": (H,), "hidden_layernorm.weight": (H,),
              "final_layernorm.weight": (H,)}
    own = {"embed_tokens.weight": (V, H), "lm_head.weight": (V, H)}  # a checkpoint's copies of the target's
    if head.config.get("model_type", "qwen3") not in DENSE_TYPES:  # the library's layer: checked as it loads
        return check_shapes(head, module, own)
    n = count(head, "num_attention_heads")
    kv, D, inter = count(head, "num_key_value_heads", n), count(head, "head_dim", H // n), count(head,
                                                                                              "intermediate_size")
    need = {**module, "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
            "self_attn.q_proj.weight": (n * D, H), "self_attn.k_proj.weight": (kv * D, H),
            "self_attn.v_proj.weight": (kv * D, H), "self_attn.o_proj.weight": (H, n * D),
            "mlp.gate_proj.weight": (inter, H), "mlp.up_proj.weight": (inter, H), "mlp.down_proj.weight": (H, inter)}
    optional = {"self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,), "self_attn.q_proj.bias": (n * D,),
                "self_attn.k_proj.bias": (kv * D,), "self_attn.v_proj.bias": (kv * D,), **own}
    check_shapes(head, need, optional)
