"""The native runner against the library's own forward: every rope type and sliding-window attention.

Tiny random models of any family (`tiny_config`, `perturbed_model`: float32, every 1-D weight moved off its
init so that norms and biases matter) are run through sdbench's runner (plain, CPU fast path, static path) and
through the library, and must agree within 1e-4: logits at prefill, single-token steps and 5-token
verifications after a cached prefix, at positions past the window and past the rope's original context,
before and after the rotary tables have grown; and 32 greedy tokens against `model.generate`.

The reference is the library's cached forward called as plain decoding calls it (`library_decoding`: the
prompt in one call, then one token per call, which is what `generate` runs), whatever the runner's calls
were; for the rope types whose tables do not depend on the length, the library's cached forward called in the
runner's chunks and its uncached forward over the whole sequence are that too. For the length-dependent types
(dynamic, longrope) the library rescales per call from that call's largest position, so its own 5-token call
differs from decoding those 5 tokens one by one (`test_the_cases_exercise_windows_and_scaling` shows it); the
runner rotates each token as decoding does, so a verification equals plain decoding for them too.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from sdbench.forward_step import Step
from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate
from sdbench.kv.cache import DenseKVCache, set_prompt_lengths
from sdbench.kv.sparse import SparseSpec, compress
from sdbench.models.forward import cpufast
from sdbench.models.forward.generic import cache_keyword
from sdbench.models.forward.rotary import length_dependent_type, reset_library_rotary
from sdbench.models.forward.runner import ModelRunner
from sdbench.models.forward.windows import layer_windows
from sdbench.strategies.autoregressive import Autoregressive
from tests.conftest import VOCAB

TOL = dict(atol=1e-4, rtol=1e-4)
ORIGINAL = 16  # the rope's original context: every test goes past it
HALF = 8  # head_dim / 2 of `tiny_config`: longrope's factor lists
ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},  # scales past max_position_embeddings
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
                 "long_factor": [1.5 + 0.5 * i for i in range(HALF)],
                 "original_max_position_embeddings": ORIGINAL},
}
WINDOW = 8
CASES = {  # name -> (model_type, config overrides)
    **{f"llama-{name}": ("llama", {"rope_parameters": dict(rp, rope_theta=10000.0),
                                   "max_position_embeddings": ORIGINAL if name == "dynamic" else 64})
       for name, rp in ROPES.items()},
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3-window": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
}
PROMPT = 12  # past the window; the steps then cross the original context
WIDTHS = (PROMPT, 1, 1, 1, 5, 1, 5, 1, 5, 1)  # prefill, steps, verifications after a cached prefix: up to 33


# ---- helpers (general: any family, any config) ------------------------------------------------------------
def tiny_config(model_type: str, **overrides):
    """A tiny config of any family: hidden 64, 2 layers, 4 heads (2 KV), VOCAB tokens, no special tokens."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, initializer_range=0.3, max_position_embeddings=64, tie_word_embeddings=False,
                eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return AutoConfig.for_model(model_type, **{**base, **overrides})


def perturbed_model(config, seed: int = 0):
    """A float32 model of this config with random weights and every 1-D weight (norms, biases) perturbed."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model.requires_grad_(False)


def rotary_modules(model) -> list:
    return [m for m in model.modules() if any(n.endswith("inv_freq") for n, _ in m.named_buffers(recurse=False))]


def rotary_state(model) -> list[dict]:
    """Every rotary module's buffers and plain attributes (what a stateful rope rewrites), copied."""
    return [{**{n: b.clone() for n, b in m.named_buffers(recurse=False)},
             **{k: v for k, v in vars(m).items() if isinstance(v, (int, float, str))}} for m in rotary_modules(model)]


def same_state(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x)
        for x, y in zip(a, b))


@torch.no_grad()
def library_calls(model, ids: torch.Tensor, widths) -> list[torch.Tensor]:
    """Logits [B, w, V] of each call of the library's cached forward over consecutive chunks of ids."""
    reset_library_rotary(model)
    with cpufast.plain(model):
        cache, out, at = DynamicCache(config=model.config), [], 0
        for w in widths:
            out.append(model(input_ids=ids[:, at : at + w], use_cache=True, **{cache_keyword(model): cache}).logits)
            at += w
    return out


def library_decoding(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits [B, S, V] at every position as plain decoding computes them: the prompt in one call, then one
    token per call."""
    return torch.cat(library_calls(model, ids, (prompt,) + (1,) * (ids.shape[1] - prompt)), 1)


def runner_calls(runner, ids: torch.Tensor, widths, capacity: int = 64) -> list[torch.Tensor]:
    """The same calls through the runner's forward, the first one a prompt (as a DSI worker feeds it)."""
    cache, out, at = runner.new_cache(ids.shape[0], capacity), [], 0
    set_prompt_lengths(cache, [widths[0]] * ids.shape[0])
    for w in widths:
        out.append(runner.run(cache, Step(ids[:, at : at + w], [at] * ids.shape[0])))
        at += w
    runner.release(cache)
    return out


@torch.no_grad()
def library_greedy(model, prompt: list[int], n: int) -> list[int]:
    reset_library_rotary(model)
    ids = torch.tensor([prompt])
    with cpufast.plain(model):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def runner_greedy(runner, prompt: list[int], n: int) -> list[int]:
    return generate(runner, Autoregressive(), [prompt], max_new_tokens=n, sampling=SamplingConfig()).output_ids[0]


def runners(model) -> dict:
    """The runner kinds a model runs under: plain, the CPU fast path (where oneDNN is), the static path."""
    out = {"plain": ModelRunner(model), "static": ModelRunner(model, static=True)}
    fast = ModelRunner(model, fast=True)
    if fast.fast:
        out["fast"] = fast
    return out


def _ids(seed: int, n: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    model_type, overrides = CASES[request.param]
    return request.param, perturbed_model(tiny_config(model_type, **overrides), seed=len(request.param))


# ---- tests ------------------------------------------------------------------------------------------------
def rescaled(name: str) -> bool:
    return length_dependent_type(ROPES.get(name.split("-")[1], {}).get("rope_type", "default"))


def test_the_cases_exercise_windows_and_scaling(case):
    name, model = case
    windows = layer_windows(model.config)
    if name.startswith("mistral"):
        assert windows == [WINDOW, WINDOW]  # no use_sliding_window field: the window applies
    elif name.endswith("window"):
        assert windows == [None, WINDOW]  # from max_window_layers on
    else:
        assert windows == [None, None]
    assert sum(WIDTHS) > max(WINDOW, ORIGINAL) + 5
    ids = _ids(1, sum(WIDTHS))
    chunked = torch.cat(library_calls(model, ids, WIDTHS), 1)
    # the library's own k-token calls are plain decoding exactly for the static rope types
    assert torch.allclose(chunked, library_decoding(model, ids, PROMPT), **TOL) != rescaled(name), name


def test_logits_match_the_library_before_and_after_the_tables_grow(case):
    name, model = case
    ids = _ids(1, sum(WIDTHS))
    want = library_decoding(model, ids, PROMPT)
    if not rescaled(name):  # the cached library calls are the uncached forward, for these rope types
        torch.testing.assert_close(torch.cat(library_calls(model, ids, WIDTHS), 1), model(ids).logits, **TOL)
        torch.testing.assert_close(want, model(ids).logits, **TOL)
    state = rotary_state(model)
    for kind, runner in runners(model).items():
        first = runner_calls(runner, ids, WIDTHS)
        torch.testing.assert_close(torch.cat(first, 1), want, **TOL, msg=lambda m: f"{name} {kind}: {m}")
        cache = runner.new_cache(1, 64)  # the prefill path (chunked) gives the prompt's last logits
        torch.testing.assert_close(runner.prefill(cache, [ids[0, :PROMPT].tolist()], chunk=7), want[:, PROMPT - 1],
                                   **TOL)
        runner_calls(runner, _ids(2, 600), (600, 3), capacity=700)  # a longer batch grows the tables
        again = runner_calls(runner, ids, WIDTHS)
        assert all(torch.equal(a, b) for a, b in zip(again, first)), f"{name} {kind}: moved after growth"
    cpufast.disable(model)
    assert same_state(rotary_state(model), state), "the library's rotary buffers were touched"


def test_greedy_tokens_match_generate(case):
    name, model = case
    prompt = _ids(3, PROMPT)[0].tolist()
    want = library_greedy(model, prompt, 32)
    state = rotary_state(model)
    for kind, runner in runners(model).items():
        assert runner_greedy(runner, prompt, 32) == want, f"{name} {kind}"
    cpufast.disable(model)
    assert same_state(rotary_state(model), state)


@pytest.mark.parametrize("arch", ["mistral-window", "qwen2-window"])
def test_windowed_rows_at_different_positions(arch):
    """Rows at different positions in one forward (a mask per row, also for single tokens) against the
    library's uncached forward of each row."""
    model_type, overrides = CASES[arch]
    model = perturbed_model(tiny_config(model_type, **overrides), seed=5)
    ids = _ids(4, 40, rows=2)
    with torch.no_grad():
        ref = model(ids).logits
    for kind, runner in runners(model).items():
        cache = runner.new_cache(2, 64)
        runner.prefill(cache, [ids[0, :20].tolist(), ids[1, :13].tolist()])
        start = [20, 13]
        for w in (1, 5, 1, 2):
            got = runner.run(cache, Step(torch.stack([ids[b, s : s + w] for b, s in enumerate(start)]), start))
            for b, s in enumerate(start):
                torch.testing.assert_close(got[b], ref[b, s : s + w], **TOL, msg=lambda m: f"{kind} row {b}: {m}")
            start = [s + w for s in start]
    cpufast.disable(model)


class SelectedDense(DenseKVCache):
    """Reference for a sparse cache: a full cache whose mask, once `sparse` is set, lets a query at q of layer l
    and KV head h see the static positions the sparse cache holds for (l, h), the recent positions it keeps
    (at or above its floor, within its window), and of those only the ones inside the layer's own window."""

    sparse = None

    def update(self, layer, k, v, step):
        keys, values, mask = super().update(layer, k, v, step)
        if self.sparse is None:
            return keys, values, mask
        keys, values = self.k[layer][:, :, : step.kv_len], self.v[layer][:, :, : step.kv_len]
        sp, pos, q = self.sparse, torch.arange(step.kv_len), step.positions[:, None, :, None]  # q [B, 1, T, 1]
        static = (sp.static_pos[layer][..., None, :] == pos[:, None]).any(-1)  # [B, H, S]
        recent = (pos >= sp.floor[:, None, None, None]) & (pos > q - sp.window[:, None, None, None])
        allowed = (pos <= q) & (static[:, :, None] | recent)  # [B, H, T, S]
        if self.windows[layer] is not None:
            allowed &= pos > q - self.windows[layer]
        return keys, values, allowed.repeat_interleave(sp.group, dim=1)  # query head h reads KV head h // group


@pytest.mark.parametrize("selector,sink", [("streamingllm", 3), ("streamingllm", 0), ("snapkv", 3)])
def test_a_windowed_layer_in_a_sparse_cache_sees_only_its_window(selector, sink):
    """qwen2 with layer 1 windowed (4 keys) under a sparse budget of 12 (sinks or SnapKV picks, and a recent
    window): layer 1 must also drop the static and ring keys outside its own window."""
    model = perturbed_model(tiny_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
                            seed=6)
    spec = SparseSpec(selector, 12, sink=sink, window=4)
    prompts = _ids(7, 30, rows=2)
    lens = [30, 26]
    for kind, runner in runners(model).items():
        dense = runner.new_cache(2, 64)
        runner.prefill(dense, [prompts[0].tolist(), prompts[1, :26].tolist()])
        sparse = compress(runner, dense, lens, prompts, spec, lookahead=4)
        ref = SelectedDense(len(runner.layers), 2, runner.n_kv_heads, runner.head_dim, 64, runner.dtype, runner.device,
                            [None, 4])
        ref.k, ref.v = [k.clone() for k in dense.k], [v.clone() for v in dense.v]
        ref.sparse = sparse
        nxt = _ids(8, 6, rows=2)
        for width, start in ((2, lens), (1, [32, 28]), (3, [31, 27]), (1, [33, 29])):
            torch.testing.assert_close(runner.run(sparse, Step(nxt[:, :width], start)),
                                       runner.run(ref, Step(nxt[:, :width], start)), **TOL,
                                       msg=lambda m: f"{selector} {kind}: {m}")
    cpufast.disable(model)


# ---- config-level checks (no forward) ----------------------------------------------------------------------
def test_rope_per_layer_type_equals_the_library_module():
    """Gemma 3: local layers on another base, global ones linearly scaled; each layer type's cos/sin equal the
    library module's for that type (sin' = sin with its first half negated)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from sdbench.models.forward.rotary import Rotary

    cfg = tiny_config("gemma3_text", num_hidden_layers=6, head_dim=16, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    rotary, library = Rotary(cfg, torch.device("cpu"), torch.float32), Gemma3RotaryEmbedding(cfg)
    assert rotary.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    pos = torch.arange(40)[None]
    for t in ("full_attention", "sliding_attention"):
        cos, sin = library(torch.zeros(1), pos, layer_type=t)
        h = sin.shape[-1] // 2
        assert torch.equal(rotary.cos_sin(pos, 40, t)[0], cos)
        assert torch.equal(rotary.cos_sin(pos, 40, t)[1], torch.cat((-sin[..., :h], sin[..., h:]), -1))


def test_partial_rotary_leaves_the_other_dimensions():
    from sdbench.models.forward.rotary import rope

    x, angle = torch.randn(2, 3, 5, 16), torch.randn(5, 4)
    emb = torch.cat((angle, angle), -1)
    cos, sin = emb.cos(), emb.sin()
    part = x[..., :8]
    rotated = part * cos + torch.cat((-part[..., 4:], part[..., :4]), -1) * sin
    got = rope(x, cos, torch.cat((-sin[..., :4], sin[..., 4:]), -1))
    torch.testing.assert_close(got, torch.cat((rotated, x[..., 8:]), -1))


@pytest.mark.parametrize("model_type,overrides,want", [
    ("mistral", {"sliding_window": 8}, [8, 8, 8, 8]),
    ("mistral", {"sliding_window": None}, [None] * 4),
    ("mistral", {"sliding_window": 8, "layer_types": ["full_attention"] * 4}, [8] * 4),  # its modeling ignores them
    ("mixtral", {"sliding_window": 8}, [8] * 4),
    ("qwen2", {"sliding_window": 8}, [None] * 4),  # no use_sliding_window: no window
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}, [None, None, 8, 8]),
    ("qwen2_moe", {}, [None] * 4),  # sliding_window 0 when off
    ("gemma2", {"sliding_window": 8}, [8, None, 8, None]),
    ("gemma3_text", {"sliding_window": 8, "sliding_window_pattern": 2}, [8, None, 8, None]),
    ("llama", {}, [None] * 4),
])
def test_layer_windows_follow_the_library(model_type, overrides, want):
    assert layer_windows(tiny_config(model_type, num_hidden_layers=4, **overrides)) == want


def test_unknown_layer_kinds_are_refused():
    from sdbench.errors import SdbenchError

    cfg = tiny_config("qwen2", num_hidden_layers=2)
    cfg.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(SdbenchError, match="chunked_attention"):
        layer_windows(cfg)
