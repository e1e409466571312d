"""--dataset PATH: prompt files in every accepted format, and one clear line for every malformed one."""

from __future__ import annotations

import json

import pytest

from sdbench.data.files import load_prompt_file
from sdbench.errors import SdbenchError
from sdbench.data.tasks import check_dataset, dataset_label, load_prompts

SPEC_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now make it rhyme."]},
    {"question_id": 82, "category": "writing", "turns": ["Write a haiku.", "Translate it to French."]},
    {"question_id": 161, "category": "translation", "turns": ["Translate 'hello' into German."]},
    {"question_id": 241, "category": "summarization", "turns": ["Summarize: the cat sat on the mat."]},
]


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def jsonl(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_spec_bench_format_keeps_ids_categories_and_turns(tmp_path):
    path = write(tmp_path, "question.jsonl", jsonl(SPEC_BENCH))
    prompts = load_prompt_file(path)
    assert [p.id for p in prompts] == ["question/81", "question/82", "question/161", "question/241"]
    assert [p.category for p in prompts] == ["writing", "writing", "translation", "summarization"]
    assert prompts[0].turns == ("Write a poem.", "Now make it rhyme.") and len(prompts[2].turns) == 1
    assert dataset_label(path) == "question.jsonl"


def test_selection_from_a_file_is_stratified_and_seeded(tmp_path):
    path = write(tmp_path, "question.jsonl", jsonl(SPEC_BENCH))
    picked = load_prompts(path, limit=3, seed=1)
    assert len({p.category for p in picked}) == 3
    assert picked == load_prompts(path, limit=3, seed=1)
    assert len(load_prompts(path)) == 4


def test_json_array_and_guessed_fields(tmp_path):
    path = write(tmp_path, "mine.json", json.dumps([{"id": "a", "instruction": "Say hi."},
                                                   {"id": "b", "instruction": "Say bye."}], indent=1))
    prompts = load_prompt_file(path)
    assert [(p.id, p.turns, p.category) for p in prompts] == [("mine/a", ("Say hi.",), "general"),
                                                             ("mine/b", ("Say bye.",), "general")]


def test_csv_with_named_columns(tmp_path):
    text = 'ask,kind,key\n"Hello, world",greet,1\n"Two\nlines",chat,2\n'
    path = write(tmp_path, "product.csv", text)
    prompts = load_prompt_file(path, {"prompt": "ask", "category": "kind", "id": "key"})
    assert [(p.id, p.category, p.turns) for p in prompts] == [
        ("product/1", "greet", ("Hello, world",)), ("product/2", "chat", ("Two\nlines",))]


def test_csv_with_a_guessed_prompt_column_numbers_prompts_by_line(tmp_path):
    path = write(tmp_path, "p.csv", "prompt\nfirst\nsecond\n")
    assert [p.id for p in load_prompt_file(path)] == ["p/2", "p/3"]


@pytest.mark.parametrize("name, text, fields, words", [
    ("e.jsonl", "", {}, "e.jsonl: holds no prompts"),
    ("e.json", "[]", {}, "e.json: holds no prompts"),
    ("e.csv", "prompt\n", {}, "e.csv: holds no prompts"),
    ("bad.jsonl", '{"prompt": "a"}\n{"prompt": \n', {}, "bad.jsonl:2: not valid JSON"),
    ("bad.json", '[\n{"prompt": "a"},\n{"prompt" "b"}\n]', {}, "bad.json:3: not valid JSON"),
    ("obj.json", '{"prompt": "a"}', {}, "obj.json:1: expected a JSON array"),
    ("list.jsonl", '{"prompt": "a"}\n[1, 2]\n', {}, "list.jsonl:2: expected a JSON object, got list"),
    ("none.jsonl", '{"body": "a"}\n', {}, "none.jsonl:1: no prompt field (looked for turns, prompt"),
    ("miss.jsonl", '{"prompt": "a"}\n\n{"text": "b"}\n', {}, "miss.jsonl:3: no value for field 'prompt'"),
    ("named.jsonl", '{"prompt": "a"}\n', {"prompt": "ask"}, "named.jsonl:1: no value for field 'ask'"),
    ("cat.jsonl", '{"prompt": "a", "category": "x"}\n{"prompt": "b"}\n', {}, "cat.jsonl:2: no value for field 'category'"),
    ("empty.jsonl", '{"prompt": "  "}\n', {}, "empty.jsonl:1: field 'prompt' is empty"),
    ("turns.jsonl", '{"turns": [1, 2]}\n', {}, "turns.jsonl:1: field 'turns' must be a string or a list of strings"),
    ("dup.jsonl", '{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', {}, "dup.jsonl:2: id '1' repeats the record on line 1"),
    ("ragged.csv", "prompt,category\na,b\nc,d,e\n", {}, "ragged.csv:3: 1 more value(s) than the header"),
    ("gap.csv", "prompt,category\na,b\nc\n", {}, "gap.csv:3: no value for field 'category'"),
    ("notes.txt", "hello\n", {}, "notes.txt: unknown prompt file type '.txt'"),
])
def test_malformed_files_are_one_line_naming_file_and_line(tmp_path, name, text, fields, words):
    path = write(tmp_path, name, text)
    with pytest.raises(SdbenchError) as info:
        load_prompts(path, limit=2, fields=fields)
    message = str(info.value)
    assert words in message and "\n" not in message and message.startswith(str(tmp_path))


def test_a_missing_or_undecodable_file_is_one_line(tmp_path):
    with pytest.raises(SdbenchError, match="no such prompt file"):
        check_dataset(str(tmp_path / "absent.jsonl"))
    bad = tmp_path / "latin.jsonl"
    bad.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(SdbenchError, match="latin.jsonl: not UTF-8"):
        check_dataset(str(bad))


def test_file_options_are_refused_where_they_do_not_apply(tmp_path):
    with pytest.raises(SdbenchError, match="apply to --dataset FILE only"):
        check_dataset("mt-bench", {"prompt": "x"})
    with pytest.raises(SdbenchError, match="--depth applies to retrieval tasks"):
        check_dataset("mt-bench", depths=(0.5,))
    with pytest.raises(SdbenchError, match="--prompt-len needs a book dataset"):
        load_prompts(write(tmp_path, "p.jsonl", '{"prompt": "a"}\n'), prompt_len=100)


def test_a_changed_file_is_read_again(tmp_path):
    path = write(tmp_path, "p.jsonl", '{"prompt": "a"}\n')
    assert len(load_prompt_file(path)) == 1
    write(tmp_path, "p.jsonl", '{"prompt": "a"}\n{"prompt": "bb"}\n')
    assert len(load_prompt_file(path)) == 2
