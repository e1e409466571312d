"""Tiny random trained heads written as the formats they are read from (tests only): EAGLE-3 in the
speculators and the EAGLE repository's layouts, EAGLE-1, Medusa-1, DFlash in the speculators and z-lab layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file


def _rand(g, *shape, scale=0.3):
    return scale * torch.randn(*shape, generator=g)


def _layer(g, H: int, width: int, heads: int, kv: int, inter: int, input_norm: bool = True) -> dict:
    """One Llama decoder layer's weights whose attention reads `width` features; norms off 1."""
    D = H // heads
    w = {"self_attn.q_proj.weight": _rand(g, heads * D, width), "self_attn.k_proj.weight": _rand(g, kv * D, width),
         "self_attn.v_proj.weight": _rand(g, kv * D, width), "self_attn.o_proj.weight": _rand(g, H, heads * D),
         "mlp.gate_proj.weight": _rand(g, inter, H), "mlp.up_proj.weight": _rand(g, inter, H),
         "mlp.down_proj.weight": _rand(g, H, inter),
         "post_attention_layernorm.weight": 1 + _rand(g, H, scale=0.2)}
    if input_norm:
        w["input_layernorm.weight"] = 1 + _rand(g, H, scale=0.2)
    return w


def _layer_config(target, heads: int = 2, kv: int = 1) -> dict:
    cfg = target.config
    return {"model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": 2 * cfg.hidden_size,
            "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": 1,
            "head_dim": cfg.hidden_size // heads, "rms_norm_eps": 1e-6, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": 1024, "rope_theta": 10000.0}


def eagle3_weights(target, seed: int = 0, draft_vocab: int | None = None, layers: int = 3) -> dict:
    """EAGLE-3 weights (speculators names); draft_vocab < the target's: every other target id, with d2t."""
    g = torch.Generator().manual_seed(seed)
    H, V = target.config.hidden_size, target.config.vocab_size
    lc = _layer_config(target)
    w = {f"layers.0.{k}": v for k, v in _layer(g, H, 2 * H, lc["num_attention_heads"], lc["num_key_value_heads"],
                                                lc["intermediate_size"]).items()}
    w["layers.0.hidden_norm.weight"] = 1 + _rand(g, H, scale=0.2)
    Vd = draft_vocab or V
    w.update({"fc.weight": _rand(g, H, layers * H, scale=0.15), "norm.weight": 1 + _rand(g, H, scale=0.2),
              "lm_head.weight": _rand(g, Vd, H, scale=0.6)})
    ids = torch.arange(Vd) * V // Vd  # the draft vocabulary's target ids, spread over the target's
    w["d2t"] = ids - torch.arange(Vd)
    w["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)
    return w


def eagle3_dir(folder, target, fmt: str = "speculators", seed: int = 0, draft_vocab: int | None = None,
               layer_ids=None, drop=(), norm_before_residual: bool = False) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    w = eagle3_weights(target, seed, draft_vocab, len(layer_ids) if layer_ids else 3)
    lc = _layer_config(target)
    Vd = w["lm_head.weight"].shape[0]
    if fmt in ("speculators", "peagle"):
        cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
               "transformer_layer_config": lc, "draft_vocab_size": Vd, "norm_before_residual": norm_before_residual}
        if layer_ids is not None:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(layer_ids)
        if fmt == "peagle":  # P-EAGLE: the mask token and the state its parallel positions hold
            cfg.update({"speculators_model_type": "peagle", "architectures": ["PEagleSpeculator"],
                        "mask_token_id": target.config.vocab_size - 1})
            width = w["fc.weight"].shape[1]
            w["mask_hidden"] = torch.randn(1, 1, width, generator=torch.Generator().manual_seed(seed + 7))
    else:  # the EAGLE repository's
        cfg = {**lc, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": Vd}
        w = {k.replace("layers.0.", "midlayer."): v for k, v in w.items()}
    for k in drop:
        w.pop(k)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in w.items()}, str(folder / "model.safetensors"))
    return folder


def eagle1_dir(folder, target, seed: int = 0) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    lc = _layer_config(target)
    H = lc["hidden_size"]
    w = {f"layers.0.{k}": v for k, v in _layer(g, H, H, lc["num_attention_heads"], lc["num_key_value_heads"],
                                                lc["intermediate_size"], input_norm=False).items()}
    w.update({"fc.weight": _rand(g, H, 2 * H, scale=0.2), "fc.bias": _rand(g, H, scale=0.2)})
    (folder / "config.json").write_text(json.dumps({**lc, "architectures": ["LlamaForCausalLM"]}))
    torch.save(w, folder / "pytorch_model.bin")
    return folder


def medusa_dir(folder, target, heads: int = 3, layers: int = 1, seed: int = 0) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    H, V = target.config.hidden_size, target.config.vocab_size
    w = {}
    for k in range(heads):
        for j in range(layers):
            w[f"{k}.{j}.linear.weight"] = _rand(g, H, H, scale=0.2)
            w[f"{k}.{j}.linear.bias"] = _rand(g, H, scale=0.2)
        w[f"{k}.{layers}.weight"] = _rand(g, V, H, scale=0.6)
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers,
                                                    "base_model_name_or_path": "tiny"}))
    save_file(w, str(folder / "medusa_lm_head.safetensors"))
    return folder


def dflash_dir(folder, target, fmt: str = "speculators", seed: int = 0, block: int = 4, layers: int = 2,
               layer_ids=(1, 3), mask: int | None = None, anchor: bool = False, drop=(), dspark: dict | None = None,
               dflash2: dict | None = None) -> Path:
    """A DFlash head of `layers` Qwen3 layers reading the target states `layer_ids` (engine/hidden.py's numbering),
    its blocks `block` tokens long, the target's last token as the mask token unless `mask` is given; with
    `dspark` (rank, type, confidence: speculators' markov_rank, markov_head_type, enable_confidence_head), a
    DSpark head (speculators format) with those Markov and confidence heads; with `dflash2` (speculators' or
    z-lab's conv_kernel_size, conv_group_size, selector_rank, selector_top_k), a DFlash 2 head."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    lc = {**_layer_config(target), "model_type": "qwen3", "num_hidden_layers": layers}
    H, n, kv, D = lc["hidden_size"], lc["num_attention_heads"], lc["num_key_value_heads"], lc["head_dim"]
    w = {"fc.weight": _rand(g, H, len(layer_ids) * H, scale=0.15), "hidden_norm.weight": 1 + _rand(g, H, scale=0.2),
         "norm.weight": 1 + _rand(g, H, scale=0.2)}
    for i in range(layers):
        layer = _layer(g, H, H, n, kv, lc["intermediate_size"])
        layer.update({"self_attn.q_norm.weight": 1 + _rand(g, D, scale=0.2),
                      "self_attn.k_norm.weight": 1 + _rand(g, D, scale=0.2)})
        w.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    mask = lc["vocab_size"] - 1 if mask is None else mask
    if fmt == "speculators":
        cfg = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"], "transformer_layer_config": lc,
               "draft_vocab_size": lc["vocab_size"], "block_size": block, "aux_hidden_state_layer_ids": list(layer_ids),
               "mask_token_id": mask, "sample_from_anchor": anchor}
    else:  # z-lab's: its layer ids count from the first layer's output
        cfg = {**lc, "architectures": ["DFlashDraftModel"], "block_size": block,
               "num_target_layers": target.config.num_hidden_layers,
               "dflash_config": {"target_layer_ids": [i - 1 for i in layer_ids], "mask_token_id": mask}}
    if dspark is not None:
        cfg.update(_dspark(g, w, dspark, H, lc["vocab_size"]))
    if dflash2 is not None:
        _dflash2(g, w, cfg, dflash2, H, lc["vocab_size"], layers, fmt)
    for k in drop:
        w.pop(k)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in w.items()}, str(folder / "model.safetensors"))
    return folder


def _dflash2(g, w: dict, cfg: dict, settings: dict, H: int, V: int, layers: int, fmt: str) -> None:
    """DFlash 2's config keys (into cfg), its convolution and selector weights (into w), z-lab's or speculators'."""
    k, group, r = settings["conv_kernel_size"], settings["conv_group_size"], settings["selector_rank"]
    for i in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            w[f"layers.{i}.{conv}.base_kernel"] = 1 + _rand(g, 2, k, H, scale=0.3)
            w[f"layers.{i}.{conv}.kernel_projection.weight"] = _rand(g, 2 * k * (H // group), H, scale=0.3)
    end = ".weight" if fmt == "zlab" else ""  # z-lab's codebooks are Embeddings
    w.update({f"candidate_selector.predecessor_codebook{end}": _rand(g, V, r, scale=1.0),
              f"candidate_selector.successor_codebook{end}": _rand(g, V, r, scale=1.0),
              "candidate_selector.hidden_projection.weight": _rand(g, r, H, scale=0.5)})
    if fmt == "zlab":
        cfg["architectures"] = ["DFlash2DraftModel"]
        cfg["dflash_config"].update(settings)
    else:
        cfg.update({"speculators_model_type": "dflash2", "architectures": ["DFlash2DraftModel"], **settings})


def _dspark(g, w: dict, dspark: dict, H: int, V: int) -> dict:
    """DSpark's config keys, its Markov and confidence weights added to w."""
    r, kind, sure = dspark.get("rank", 4), dspark.get("type", "vanilla"), dspark.get("confidence", True)
    if r:
        w.update({"markov_head.markov_w1.weight": _rand(g, V, r, scale=0.8),
                  "markov_head.markov_w2.weight": _rand(g, V, r, scale=0.8)})
    if r and kind == "gated":
        w.update({"markov_head.gate_proj.weight": _rand(g, r, H + r, scale=0.3),
                  "markov_head.gate_proj.bias": _rand(g, r, scale=0.3)})
    if r and kind == "rnn":
        w.update({"markov_head.joint_proj.weight": _rand(g, 3 * r, 2 * r + H, scale=0.3),
                  "markov_head.joint_proj.bias": _rand(g, 3 * r, scale=0.3)})
    if sure:
        w.update({"confidence_head.proj.weight": _rand(g, 1, H + r, scale=0.3),
                  "confidence_head.proj.bias": torch.ones(1)})
    return {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"], "markov_rank": r,
            "markov_head_type": kind, "enable_confidence_head": sure, "confidence_head_with_markov": True}


def small_vocab_target(arch: str, vocab: int = 8, layers: int = 4, seed: int = 0):
    """A tiny perturbed target of a family with a small vocabulary, so that random heads agree with it now and
    then (both acceptance and rejection happen)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    from tests.references import perturbed

    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                          "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                          "mistral": (MistralConfig, MistralForCausalLM)}[arch]
    torch.manual_seed(seed)
    cfg = cfg_cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3, max_position_embeddings=256,
                  tie_word_embeddings=False)
    return perturbed(model_cls(cfg).eval(), seed + 100)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny heads and targets run faster on one thread than on two contended ones (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def mtp_dir(folder, target, seed: int = 0, kind: str = "qwen3", drop=()) -> Path:
    """A random MTP module (speculators format) for `target`: a Qwen3 decoder layer at its attention shape."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    lc = {**_layer_config(target), "model_type": kind, "num_hidden_layers": 1}
    H, D = lc["hidden_size"], lc["head_dim"]
    w = _layer(g, H, H, lc["num_attention_heads"], lc["num_key_value_heads"], lc["intermediate_size"])
    w.update({"self_attn.q_norm.weight": 1 + _rand(g, D, scale=0.2), "self_attn.k_norm.weight": 1 + _rand(g, D, scale=0.2),
              "input_proj.weight": _rand(g, H, 2 * H, scale=0.2), "token_layernorm.weight": 1 + _rand(g, H, scale=0.2),
              "hidden_layernorm.weight": 1 + _rand(g, H, scale=0.2), "final_layernorm.weight": 1 + _rand(g, H, scale=0.2)})
    w = {f"mtp_layers.0.{k}": v for k, v in w.items() if k not in drop}
    cfg = {"speculators_model_type": "mtp", "architectures": ["MTPDraftModel"], "transformer_layer_config": lc,
           "num_nextn_predict_layers": 1}
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in w.items()}, str(folder / "model.safetensors"))
    return folder
