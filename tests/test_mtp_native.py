"""An MTP module read from the target's own checkpoint (DeepSeek-V3's and GLM-4.5's `model.layers.{L}` layout with
a mixture-of-experts layer, MLA for DeepSeek; MiMo's `model.mtp_layers.0` over a Qwen2 layer), against a
reference written from vLLM's `deepseek_mtp` / `glm4_moe_mtp` / `mimo_mtp` forwards whose decoder layer the
library itself loads from the same checkpoint (the checkpoint read with one more layer: its MTP block, the
experts fused by the library's own loader): the first draft at every position and a chained step; then greedy
output equal to the library's `generate` (chains and a token tree) with no --head, the module found in the
target's checkpoint; bad checkpoints one line each."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate
from sdbench.errors import SdbenchError
from sdbench.models.forward.generic import make_runner
from sdbench.models.heads.load import load_head
from sdbench.models.heads.mtp import MTPHead
from sdbench.models.heads.mtp_layer import fuse_experts
from sdbench.models.loading.library import auto_model
from sdbench.strategies import BuildContext
from sdbench.strategies.mtp import MTPStrategy
from tests.conftest import run_cli
from tests.references import hf_generate, word_tokenizer

V, H, L = 6, 32, 2  # vocabulary, hidden size, the target's layers (the MTP block is layer L)
COMMON = dict(vocab_size=V, hidden_size=H, num_hidden_layers=L + 1, intermediate_size=48, num_attention_heads=4,
              max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              tie_word_embeddings=False, initializer_range=0.3)
FAMILIES = {
    "deepseek_v3": dict(num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8,
                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6, n_shared_experts=1),
    "glm4_moe": dict(num_key_value_heads=2, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                     n_group=1, topk_group=1, first_k_dense_replace=1, head_dim=8, partial_rotary_factor=0.5,
                     n_shared_experts=1, attention_bias=True),
    "mimo": dict(num_key_value_heads=2),  # MiMo: a Qwen2 model (model_type mimo) with its module under mtp_layers.0
}


def _full_model(family: str, seed: int = 0, vocab: int = V):
    """A random model of L + 1 layers (its last one the MTP block), 1-D weights and routing biases moved off their
    init so that a skipped norm or bias shows."""
    kind = "qwen2" if family == "mimo" else family
    torch.manual_seed(seed)
    config = AutoConfig.for_model(kind, **{**COMMON, "vocab_size": vocab}, **FAMILIES[family])
    model = AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


def own_mtp_checkpoint(folder: Path, family: str, seed: int = 0, vocab: int = V) -> Path:
    """A target checkpoint of L layers with an MTP module of its own, in its family's layout: the model's layer L
    as the module's block, plus its input norms, projection and (DeepSeek, GLM) shared head."""
    _full_model(family, seed, vocab).save_pretrained(folder)
    weights = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 2)
    extra = {"proj": 0.3 * torch.randn(H, 2 * H, generator=g), "en": 1 + 0.3 * torch.randn(H, generator=g),
             "hn": 1 + 0.3 * torch.randn(H, generator=g), "out": 1 + 0.3 * torch.randn(H, generator=g)}
    block = f"model.layers.{L}."
    if family == "mimo":
        weights = {(k.replace(block, "model.mtp_layers.0.") if k.startswith(block) else k): v for k, v in weights.items()}
        p = "model.mtp_layers.0."
        weights.update({p + "input_proj.weight": extra["proj"], p + "token_layernorm.weight": extra["en"],
                        p + "hidden_layernorm.weight": extra["hn"], p + "final_layernorm.weight": extra["out"]})
    else:
        weights.update({block + "eh_proj.weight": extra["proj"], block + "enorm.weight": extra["en"],
                        block + "hnorm.weight": extra["hn"], block + "shared_head.norm.weight": extra["out"],
                        block + "shared_head.head.weight": 0.3 * torch.randn(vocab, H, generator=g),
                        block + "embed_tokens.weight": weights["model.embed_tokens.weight"].clone()})
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config.update(num_hidden_layers=L, num_nextn_predict_layers=1)
    if family == "mimo":  # as MiMo's own config.json names it: a type the library has no class for
        config.update(model_type="mimo", architectures=["MiMoForCausalLM"])
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:L]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def reference_steps(family: str, seed: int, folder: Path, tokens: torch.Tensor, states: torch.Tensor,
                    drafted: int):
    """vLLM's MTP forward written out on the checkpoint's tensors, its decoder layer the library's own (the full
    model of L + 1 layers as the library loads it, seed `seed`): the logits of the first step at every position
    (pair (state t, token t + 1) at position t) and of one chained step at the next position (the token `drafted`,
    the last first-step output fed back)."""
    full = _full_model(family, seed)
    layer, rotary = full.model.layers[L], full.model.rotary_emb
    w = load_file(str(folder / "model.safetensors"))
    eps, deepseek = full.config.rms_norm_eps, family != "mimo"
    p = f"model.layers.{L}." if deepseek else "model.mtp_layers.0."
    names = (("enorm", "hnorm", "eh_proj", "shared_head.norm") if deepseek else
             ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"))
    en, hn, proj, out_norm = (w[p + n + ".weight"] for n in names)
    head = w[p + "shared_head.head.weight"] if deepseek else full.lm_head.weight

    def compose(e, h, positions):
        e = e.masked_fill((positions == 0)[..., None], 0)
        pair = (_rms(e, en, eps), _rms(h, hn, eps)) if deepseek else (_rms(h, hn, eps), _rms(e, en, eps))
        return torch.cat(pair, -1) @ proj.T

    def run(x):
        n = x.shape[1]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = layer(x, attention_mask=mask, position_embeddings=rotary(x, pos))
        return y if deepseek else _rms(y, out_norm, eps)

    def logits(y):
        return (_rms(y, out_norm, eps) if deepseek else y) @ head.T

    with torch.no_grad():
        n = tokens.shape[1] - 1
        embed = full.model.embed_tokens
        first = compose(embed(tokens[:, 1:]), states[:, :n], torch.arange(n)[None])
        y = run(first)
        chained = compose(embed(torch.tensor([[drafted]])), y[:, -1:], torch.tensor([[n]]))
        y2 = run(torch.cat((first, chained), 1))
        return logits(y), logits(y2[:, -1])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_drafts_equal_the_reference_forward(tmp_path, family):
    """The module's first step at every position and a chained step after the last, through sdbench's cache (the
    library's layer over its slots for DeepSeek and GLM, sdbench's own Qwen2 layer for MiMo), give the reference
    forward's logits on the same checkpoint."""
    folder = own_mtp_checkpoint(tmp_path / family, family)
    target = auto_model(str(folder), torch.float32).eval()
    runner = make_runner(target, family, "native" if family == "mimo" else "generic")
    loaded = load_head(str(folder), runner, ("mtp",))
    head = MTPHead(loaded, runner)
    g = torch.Generator().manual_seed(5)
    S = 9
    tokens, states = torch.randint(0, V, (1, S), generator=g), torch.randn(1, S, H, generator=g)
    first, chained = reference_steps(family, 0, folder, tokens, states, drafted=3)
    cache = head.new_cache(1, 32)
    with torch.no_grad():
        ours, out = head.forward(cache, tokens[:, 1:], states[:, :S - 1], [0], None)
        step, _ = head.forward(cache, torch.tensor([[3]]), out[:, -1:], [S - 1], torch.tensor([0]))
    torch.testing.assert_close(ours, first.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step, chained.float(), atol=1e-4, rtol=1e-4)
    assert loaded.layout == ("mimo" if family == "mimo" else "deepseek")


def test_experts_fuse_as_the_library_loads_them(tmp_path):
    """fuse_experts on a checkpoint's per-expert tensors gives the library's own loaded (fused) parameters."""
    folder = own_mtp_checkpoint(tmp_path / "ds", "deepseek_v3")
    model = auto_model(str(folder), torch.float32).eval()
    w = load_file(str(folder / "model.safetensors"))
    prefix = "model.layers.1."
    fused = fuse_experts({k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix + "mlp.experts.")})
    params = dict(model.model.layers[1].named_parameters())
    assert set(fused) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    for name, value in fused.items():
        torch.testing.assert_close(value, params[name], atol=0, rtol=0)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "mimo"])
@pytest.mark.parametrize("tree", [{}, {"tree_topk": 2}])
def test_greedy_output_equals_generate_without_a_head(tmp_path, family, tree):
    """--strategy mtp with no --head drafts with the module in the target's own checkpoint; greedy output equals
    the library's generate, for a chain and a top-2 tree."""
    folder = own_mtp_checkpoint(tmp_path / family, family, seed=1)
    target = auto_model(str(folder), torch.float32).eval()
    runner = make_runner(target, family, "native" if family == "mimo" else "generic")
    proposer = MTPStrategy.build(BuildContext(target=runner, gamma=3, options=dict(tree)))
    prompts = [[1, 5, 0, 3, 4, 2], [4, 4, 1]]
    out = generate(runner, proposer, prompts, max_new_tokens=16, sampling=SamplingConfig())
    for prompt, ours in zip(prompts, out.output_ids):
        assert ours == hf_generate(target, prompt, 16)
    assert sum(r.accepted for r in out.rows) > 0  # drafts both kept and rejected


def test_no_module_and_bad_modules_are_one_line(tmp_path):
    folder = own_mtp_checkpoint(tmp_path / "glm", "glm4_moe")
    target = auto_model(str(folder), torch.float32).eval()
    runner = make_runner(target, "glm", "generic")
    plain = tmp_path / "plain"
    target.save_pretrained(plain)  # the same model written again: the library left its module out
    config = json.loads((plain / "config.json").read_text())
    config.pop("num_nextn_predict_layers")
    (plain / "config.json").write_text(json.dumps(config))
    other = make_runner(AutoModelForCausalLM.from_pretrained(plain).eval(), "plain", "generic")
    with pytest.raises(SdbenchError, match="has no MTP module of its own"):
        MTPStrategy.build(BuildContext(target=other, gamma=3))
    config["num_nextn_predict_layers"] = 1
    (plain / "config.json").write_text(json.dumps(config))
    with pytest.raises(SdbenchError, match="hold no MTP module"):
        load_head(str(plain), runner, ("mtp",))
    w = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in w.items() if "mlp.gate.weight" not in k or f"layers.{L}." not in k},
              str(folder / "model.safetensors"))
    with pytest.raises(SdbenchError, match=r"MTP layer has no mlp\.gate\.weight"):
        MTPHead(load_head(str(folder), runner, ("mtp",)), runner)
    save_file({k: v for k, v in w.items() if k != f"model.layers.{L}.mlp.experts.1.up_proj.weight"},
              str(folder / "model.safetensors"))
    with pytest.raises(SdbenchError, match="an expert of its MTP layer has no up_proj"):
        MTPHead(load_head(str(folder), runner, ("mtp",)), runner)


@pytest.mark.parametrize("family", ["deepseek_v3", "mimo"])
def test_run_finds_the_module_in_the_target_checkpoint(tmp_path, monkeypatch, capsys, family):
    """`sdbench run --target CHECKPOINT --strategy mtp` (no --head) drafts with the checkpoint's own module (MiMo's
    config names a type the library lacks: loaded as the Qwen2 model it is): every
    row lossless against the run's plain decoding; a target without one is one line, a non-zero exit."""
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SDBENCH_CONFIG", str(tmp_path / "home"))
    folder = own_mtp_checkpoint(tmp_path / "ds", family, seed=1)
    word_tokenizer(V, eos=False).save_pretrained(folder)  # every row decodes its 12 tokens
    (tmp_path / "p.csv").write_text('prompt\n"w0 w1 w2 w1"\n"w2 w2 w0"\n')
    args = ["run", "--dataset", str(tmp_path / "p.csv"), "--max-new-tokens", "12", "--device", "cpu", "--gamma",
            "3", "--strategy", "mtp"]
    code, _, err = run_cli(capsys, *args, "--target", str(folder), "--out", str(tmp_path / "o"))
    assert code == 0, err
    rows = pd.read_parquet(next((tmp_path / "o").glob("*.parquet")))
    mine = rows[rows.role != "baseline"]
    assert len(mine) == 2 and mine.lossless.all() and (mine.strategy == "mtp").all() and (mine.drafted > 0).all()
    assert (rows.new_tokens == 12).all()
    plain = tmp_path / "plain"
    auto_model(str(folder), torch.float32).save_pretrained(plain)
    word_tokenizer(V).save_pretrained(plain)
    config = json.loads((plain / "config.json").read_text())
    config.pop("num_nextn_predict_layers")
    (plain / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, *args, "--target", str(plain), "--out", str(tmp_path / "o1"))
    assert code != 0 and "has no MTP module of its own" in err and "Traceback" not in err, (code, err)


def test_tune_takes_the_target_module_as_its_candidate(tmp_path, monkeypatch):
    """With no --head and no recorded head, `tune --strategy mtp` chooses among the target's own module (a folder
    whose config.json declares one); a target declaring none still asks for a head in one line."""
    from sdbench.strategies import head_candidates

    monkeypatch.setenv("SDBENCH_CONFIG", str(tmp_path / "home"))
    folder = own_mtp_checkpoint(tmp_path / "glm", "glm4_moe")
    assert head_candidates("mtp", str(folder)) == (str(folder),)
    config = json.loads((folder / "config.json").read_text())
    config.pop("num_nextn_predict_layers")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SdbenchError, match="needs a trained head to tune with"):
        head_candidates("mtp", str(folder))


def test_an_fp8_module_is_one_line(tmp_path):
    """DeepSeek-V3's own release: FP8 weights with block scales (`weight_scale_inv`), refused in one line naming
    the first such tensor."""
    folder = own_mtp_checkpoint(tmp_path / "ds", "deepseek_v3")
    runner = make_runner(auto_model(str(folder), torch.float32).eval(), "ds", "generic")
    w = load_file(str(folder / "model.safetensors"))
    w[f"model.layers.{L}.self_attn.q_a_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(SdbenchError, match="weight_scale_inv, which its layer type does not have"):
        MTPHead(load_head(str(folder), runner, ("mtp",)), runner)


def test_llamacpp_takes_only_a_targets_own_glm_module(tmp_path, capsys):
    """llama.cpp's draft-mtp runs the module in the target's own GGUF, and its converter keeps GLM-4.5's among the
    layouts sdbench reads: a DeepSeek-V3 checkpoint, or --head naming another folder, is one line before anything
    loads or starts."""
    deepseek = own_mtp_checkpoint(tmp_path / "ds", "deepseek_v3")
    glm = own_mtp_checkpoint(tmp_path / "glm", "glm4_moe")
    for argv, says in (
            (["bench", "--target", str(deepseek), "--head", str(deepseek)], "keeps the MTP layers of Glm4MoeForCausalLM"),
            (["run", "--target", str(deepseek), "--strategy", "mtp"], "keeps the MTP layers of Glm4MoeForCausalLM"),
            (["run", "--target", str(glm), "--strategy", "mtp", "--head", str(deepseek)],
             "give --head the target's folder itself")):
        code, out, err = run_cli(capsys, *argv, "--engine", "llama.cpp", "--device", "cpu", "--out", str(tmp_path))
        assert code != 0 and says in err and "Traceback" not in err, err
