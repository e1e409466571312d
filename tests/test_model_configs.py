"""Model configs without weights: every alias's shipped config.json reads in the installed transformers and
builds at its published size on the meta device; pairs are registered aliases of one vocabulary; `load_config`
reads folders, aliases and the hub cache; and a model no runner serves is refused before any weight is read."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, T5Config

from sdbench.errors import SdbenchError
from sdbench.models.loading import hub, library, loader
from sdbench.models import model_registry
from sdbench.models.loading.aliases import CONFIG_DIR, drafts_of, shipped_config
from sdbench.models.forward.families import serving
from sdbench.models.loading.shapes import config_from_dict, meta_model, parameter_count, size_label

ALIASES = model_registry.names()
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("name", ALIASES)
def test_shipped_config_builds_on_meta_at_the_published_size(name):
    data = shipped_config(name)
    assert data is not None, f"{name} ships no configs/{name}.json"
    AutoConfig.for_model(**data)  # the form the brief names, beside sdbench's own reader
    config = config_from_dict(data)
    model = meta_model(config)
    assert next(model.parameters()).device.type == "meta"
    published = model_registry.entry(name).meta["params"]
    counted = sum(p.numel() for p in model.parameters())
    assert abs(counted - published) / published < 0.03, f"{name}: {counted:,} counted, {published:,.0f} published"


def test_every_shipped_file_belongs_to_an_alias_and_ships_in_the_wheel():
    files = {p.stem for p in (ROOT / "sdbench" / "models" / "loading" / CONFIG_DIR).glob("*.json")}
    assert files == set(ALIASES)
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert f"{CONFIG_DIR}/*.json" in data["tool"]["setuptools"]["package-data"]["sdbench.models.loading"]


def test_shipped_configs_keep_rope_windows_and_soft_caps():
    llama = loader.load_config("llama-3.1-8b")
    assert llama.rope_parameters == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                     "rope_theta": 500000.0}
    assert loader.load_config("llama-1b").rope_parameters["factor"] == 32.0 and loader.load_config("llama-1b").tie_word_embeddings
    gemma3 = loader.load_config("gemma3-27b")
    assert gemma3.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert gemma3.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert gemma3.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"] and gemma3.sliding_window == 1024
    assert gemma3.query_pre_attn_scalar == 168
    gemma2 = loader.load_config("gemma2-27b")
    assert (gemma2.query_pre_attn_scalar, gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (
        144, 50.0, 30.0)
    assert loader.load_config("mistral-7b").sliding_window == 4096
    moe = loader.load_config("qwen3-30b-a3b")
    assert (moe.model_type, moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (
        "qwen3_moe", 128, 8, 768)
    assert loader.load_config("starcoder2-15b").tie_word_embeddings is False
    assert loader.load_config("opt-350m").word_embed_proj_dim == 512


def test_pairs_are_registered_smaller_models_of_one_vocabulary():
    pairs = [(t, d) for t in ALIASES for d in drafts_of(t)]
    assert len(pairs) >= 25
    for target, draft in pairs:
        assert draft in model_registry and draft != target
        t, d = shipped_config(target), shipped_config(draft)
        assert min(t["vocab_size"], d["vocab_size"]) / max(t["vocab_size"], d["vocab_size"]) > 0.99, (target, draft)
        assert model_registry.entry(draft).meta["params"] < model_registry.entry(target).meta["params"]
    assert drafts_of("llama-3.1-70b") == drafts_of("llama-70b") and drafts_of("no-such-model") == ()


def test_every_alias_is_served_by_a_runner():
    for name in ALIASES:
        assert serving(loader.load_config(name)).runner in ("native", "generic"), name


def test_size_labels():
    assert [size_label(n) for n in (8_030_261_248, 999_885_952, 134_515_008, None)] == ["8.0B", "1.0B", "135M", "?"]


def test_parameter_counts_are_cached_per_config(monkeypatch):
    config = loader.load_config("pythia-70m")
    n = parameter_count(config, cached=True)
    monkeypatch.setattr("sdbench.models.loading.shapes.meta_model", lambda c: pytest.fail("built again"))
    assert parameter_count(config, cached=True) == n == 70_426_624
    config.num_hidden_layers = 5  # another config: counted afresh
    with pytest.raises(pytest.fail.Exception):
        parameter_count(config, cached=True)


def test_config_without_a_model_type_is_one_line():
    with pytest.raises(SdbenchError, match="model_type"):
        config_from_dict({"hidden_size": 8})
    with pytest.raises(SdbenchError, match="no-such-family"):
        config_from_dict({"model_type": "no-such-family"})


# --- load_config and the gate -------------------------------------------------------------------------------


def _tiny_llama(folder: Path) -> Path:
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def test_load_config_of_a_folder_reads_no_weights(tmp_path, monkeypatch):
    folder = _tiny_llama(tmp_path / "tiny")
    monkeypatch.setattr(library, "auto_model", lambda *a, **k: pytest.fail("weights read"))
    config = loader.load_config(str(folder))
    assert (config.model_type, config.hidden_size) == ("llama", 32)


def test_load_config_of_an_alias_needs_no_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "from_hub", lambda *a, **k: pytest.fail("hub asked"))
    assert loader.load_config("qwen3-8b").num_hidden_layers == 36


def test_load_config_of_an_unknown_hub_id_offline_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SdbenchError, match="not available"):
        loader.load_config("nobody/no-such-model")


def test_an_encoder_decoder_folder_is_refused_before_any_weight_loads(tmp_path, monkeypatch):
    """A T5 config beside a weights file that cannot be read: only a refusal from the config alone names the
    architecture; reading the weights would fail with a different message."""
    folder = tmp_path / "t5"
    folder.mkdir()
    T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    for attr in ("auto_model", "auto_tokenizer"):
        monkeypatch.setattr(library, attr, lambda *a, **k: pytest.fail("loaded past the gate"))
    with pytest.raises(SdbenchError) as err:
        loader.load_model(str(folder))
    assert "encoder-decoder" in str(err.value) and str(folder) in str(err.value)
    assert "\n" not in str(err.value)


def test_a_served_folder_passes_the_gate_and_loads(tmp_path):
    from tests.test_models_loading import tiny_tokenizer

    folder = _tiny_llama(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(folder)
    loaded = loader.load_model(str(folder))
    assert loaded.model.config.hidden_size == 32 and loaded.model.device == torch.device("cpu")


def test_list_models_shows_family_size_runner_and_drafts(capsys):
    from sdbench.commands.listing import show
    from rich.console import Console

    show("models", Console(width=400))
    rows = {line.split("│")[1].strip().split(",")[0]: [c.strip() for c in line.split("│")[1:-1]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("│")}
    assert set(rows) == set(ALIASES)
    assert rows["llama-8b"][:5] == ["llama-8b, llama-3.1-8b", "llama", "8.0B", "native", "llama-1b, llama-3b"]
    assert rows["qwen3-30b-a3b"][1:4] == ["qwen3_moe", "30.5B", serving(loader.load_config("qwen3-30b-a3b")).runner]
    assert rows["pythia-12b"][4] == "pythia-70m, pythia-160m"
    assert rows["smollm2-135m"][2] == "135M"


# --- random weights at an alias's shape (the start of MODEL@random) -------------------------------------------

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("name", ["llama-1b", "gemma3-4b", "qwen3-30b-a3b", "pythia-70m"])
def test_random_model_is_made_on_the_device_in_dtype_with_the_library_buffers(name):
    from transformers import AutoModelForCausalLM

    from sdbench.models.loading.shapes import random_model

    data = shipped_config(name)
    data.update({k: v for k, v in {**SMALL, "head_dim": 16}.items() if k in data})
    config = config_from_dict(data)
    model = random_model(config, "cpu", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in model.parameters())
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # built the ordinary way
    for (key, mine), (_, theirs) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
        assert torch.equal(mine, theirs), key  # rotary tables, embedding scales: computed, not left empty
    ids = torch.tensor([[1, 5, 7]])
    assert torch.isfinite(model(ids).logits.float()).all()
