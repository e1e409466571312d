"""Hand references for the trained heads, written from the papers' equations with plain tensor algebra: no
cache, no positions carried over, the whole sequence recomputed for every draft (so they share nothing with
sdbench's cached, rewinding forwards but the equations). The target's states come from transformers' own
forward (`output_hidden_states`: index i < L the input of layer i, index L the final-norm output).

EAGLE-1: x_i = fc([e(t_{i+1}); f_i]), f_i the target's final state; o = layer(x) with no input norm; a draft
is argmax of the target's lm_head(o_last), fed back as (its embedding, o_last).
EAGLE-3: x_i = fc([h_a; h_b; h_c]_i); the layer's attention reads [rms(e); rms(x)] with residual x; o is fed
back as x; draft logits lm_head(rms(o)) over the draft vocabulary, token j being target token j + d2t[j].
Medusa-1: head k's logits W_k ResBlock^n(f_N-2), ResBlock(x) = x + SiLU(A x + b).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rotate(x, theta: float):
    """x [T, heads, D] rotated for positions 0..T-1 (rotate-half convention)."""
    T, _, D = x.shape
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]  # [T, D/2]
    ang = torch.cat((ang, ang), -1)[:, None].float()
    half = torch.cat((-x[..., D // 2:], x[..., : D // 2]), -1)
    return x * ang.cos() + half * ang.sin()


def layer(w: dict, cfg: dict, attn_in, residual):
    """One decoder layer over a whole sequence: attn_in [T, W], residual [T, H] -> output [T, H]."""
    T = attn_in.shape[0]
    nh, nkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q = _rotate((attn_in @ w["self_attn.q_proj.weight"].T).view(T, nh, D), cfg["rope_theta"])
    k = _rotate((attn_in @ w["self_attn.k_proj.weight"].T).view(T, nkv, D), cfg["rope_theta"])
    v = (attn_in @ w["self_attn.v_proj.weight"].T).view(T, nkv, D)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / D**0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, nh * D)
    h = residual + o @ w["self_attn.o_proj.weight"].T
    x = rms(h, w["post_attention_layernorm.weight"], cfg["rms_norm_eps"])
    mlp = (F.silu(x @ w["mlp.gate_proj.weight"].T) * (x @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    return h + mlp


def target_states(target, ctx: list[int], layers) -> torch.Tensor:
    """[len(ctx) - 1, k*H]: the target's states of every committed token but the last."""
    with torch.no_grad():
        hs = target(torch.tensor([ctx[:-1]]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in layers], -1)


def eagle3_chain(target, w: dict, cfg: dict, ctx: list[int], gamma: int, layers) -> list[int]:
    """The greedy chain an EAGLE-3 head drafts after the committed tokens ctx (weights by speculators names)."""
    lw = {k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")}
    emb = target.get_input_embeddings().weight
    ids = torch.arange(len(w["d2t"])) + w["d2t"]  # draft id -> target id
    with torch.no_grad():
        x = target_states(target, ctx, layers) @ w["fc.weight"].T
        toks, out = list(ctx[1:]), []
        for _ in range(gamma):
            e = rms(emb[torch.tensor(toks)], lw["input_layernorm.weight"], cfg["rms_norm_eps"])
            xn = rms(x, lw["hidden_norm.weight"], cfg["rms_norm_eps"])
            o = layer(lw, cfg, torch.cat((e, xn), -1), x)
            d = int(ids[(rms(o[-1], w["norm.weight"], cfg["rms_norm_eps"]) @ w["lm_head.weight"].T).argmax()])
            out.append(d)
            toks.append(d)
            x = torch.cat((x, o[-1:]))
    return out


def eagle1_chain(target, w: dict, cfg: dict, ctx: list[int], gamma: int) -> list[int]:
    lw = {k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")}
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    with torch.no_grad():
        f = target_states(target, ctx, [-1])
        toks, out = list(ctx[1:]), []
        for _ in range(gamma):
            x = torch.cat((emb[torch.tensor(toks)], f), -1) @ w["fc.weight"].T + w["fc.bias"]
            o = layer(lw, cfg, x, x)
            d = int((o[-1] @ head.T).argmax())
            out.append(d)
            toks.append(d)
            f = torch.cat((f, o[-1:]))
    return out


def medusa_chain(target, w: dict, n_layers: int, ctx: list[int], gamma: int) -> list[int]:
    with torch.no_grad():
        f = target_states(target, ctx, [-1])[-1]
        out = []
        for k in range(gamma):
            h = f
            for j in range(n_layers):
                h = h + F.silu(h @ w[f"{k}.{j}.linear.weight"].T + w[f"{k}.{j}.linear.bias"])
            out.append(int((h @ w[f"{k}.{n_layers}.weight"].T).argmax()))
    return out


def eagle3_logits(target, w: dict, cfg: dict, ctx: list[int], path: list[int], layers) -> torch.Tensor:
    """The EAGLE-3 head's logits over the target's vocabulary [V] (-inf outside the draft vocabulary) at the tree
    node whose path from the root is `path` (tokens; [] : the root): the chain drafted along that path, each
    token fed with the head's own last output, as `eagle3_chain` feeds its argmax."""
    lw = {k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")}
    emb = target.get_input_embeddings().weight
    ids = torch.arange(len(w["d2t"])) + w["d2t"]
    with torch.no_grad():
        x = target_states(target, ctx, layers) @ w["fc.weight"].T
        toks = list(ctx[1:])
        for d in [*path, None]:
            e = rms(emb[torch.tensor(toks)], lw["input_layernorm.weight"], cfg["rms_norm_eps"])
            o = layer(lw, cfg, torch.cat((e, rms(x, lw["hidden_norm.weight"], cfg["rms_norm_eps"])), -1), x)
            if d is None:
                full = torch.full((target.config.vocab_size,), float("-inf"))
                full[ids] = rms(o[-1], w["norm.weight"], cfg["rms_norm_eps"]) @ w["lm_head.weight"].T
                return full
            toks.append(d)
            x = torch.cat((x, o[-1:]))


def eagle1_logits(target, w: dict, cfg: dict, ctx: list[int], path: list[int]) -> torch.Tensor:
    """`eagle3_logits` for an EAGLE-1 head: [V] through the target's own lm_head."""
    lw = {k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")}
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    with torch.no_grad():
        f = target_states(target, ctx, [-1])
        toks = list(ctx[1:])
        for d in [*path, None]:
            x = torch.cat((emb[torch.tensor(toks)], f), -1) @ w["fc.weight"].T + w["fc.bias"]
            o = layer(lw, cfg, x, x)
            if d is None:
                return o[-1] @ head.T
            toks.append(d)
            f = torch.cat((f, o[-1:]))


def medusa_logits(target, w: dict, n_layers: int, ctx: list[int], k: int) -> torch.Tensor:
    """Medusa head k's logits [V] after the committed tokens ctx."""
    with torch.no_grad():
        h = target_states(target, ctx, [-1])[-1]
        for j in range(n_layers):
            h = h + F.silu(h @ w[f"{k}.{j}.linear.weight"].T + w[f"{k}.{j}.linear.bias"])
        return h @ w[f"{k}.{n_layers}.weight"].T
