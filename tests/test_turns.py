"""Multi-turn conversations, the passkey retrieval task, and the turn/depth/found columns in results."""

from __future__ import annotations

import pandas as pd
import pytest
from rich.console import Console

from sdbench.data import Prompt
from sdbench.data.passkey import INTRO, NEEDLE, QUESTION, answer_found, passkey_prompts, spread_depths
from sdbench.errors import SdbenchError
from sdbench.reporting.report import print_report
from sdbench.reporting.results import read_results
from sdbench.reporting.schema import COLUMNS
from sdbench.reporting.summary import summarize
from sdbench.reporting.writer import RunWriter
from sdbench.data.records import book_pool
from sdbench.data.sources import resolve
from sdbench.data.tasks import dataset_available, dataset_label, encode_prompt, load_prompts
from sdbench.data.turns import Conversations
from tests.test_tasks import bos_tokenizer, offline  # noqa: F401 (fixtures)

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


TWO = Prompt(id="t/1", category="writing", turns=("Write of Noah.", "Now shorter."))
ONE = Prompt(id="t/2", category="qa", turns=("Who was Moses?",))


def test_a_later_turn_holds_the_earlier_turn_and_its_answer(bos_tokenizer):
    bos_tokenizer.chat_template = CHAT_TEMPLATE
    try:
        talk = Conversations([TWO, ONE], bos_tokenizer)
        assert talk.count == [2, 1] and talk.most == 2 and talk.members([0, 1], 1) == [0]
        first = talk.encode(0, 0)
        assert first == encode_prompt(TWO, bos_tokenizer)
        answer = bos_tokenizer("And God spake unto Noah", add_special_tokens=False)["input_ids"] + [1]  # + EOS
        talk.record([0, 1], 0, [answer, [5]])
        text = bos_tokenizer.decode(talk.encode(0, 1))
        assert text.index("Write of Noah.") < text.index("And God spake unto Noah") < text.index("Now shorter.")
        assert text.count("<|user|>") == 2 and text.count("<|assistant|>") == 2 and "</s>" not in text
        assert len(talk.encode(0, 1)) <= talk.longest(max_new_tokens=len(answer))
    finally:
        bos_tokenizer.chat_template = None


def test_turns_without_a_chat_template_are_paragraphs(bos_tokenizer):
    ids = encode_prompt(TWO, bos_tokenizer, ["He built an ark."])
    assert bos_tokenizer.decode(ids, skip_special_tokens=True) == "Write of Noah.\n\nHe built an ark.\n\nNow shorter."


def test_turns_option_caps_the_conversation():
    assert Conversations([TWO, ONE], None, turns=1).count == [1, 1]
    assert Conversations([TWO, ONE], None, turns=5).count == [2, 1]


def test_mt_bench_prompts_carry_both_turns():
    prompts = load_prompts("mt-bench", limit=3)
    assert all(len(p.turns) == 2 for p in prompts)


# --- passkey retrieval -------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [300, 1000])
def test_passkey_prompts_are_exact_with_the_key_at_its_depth(bos_tokenizer, prompt_len):
    prompts = load_prompts("passkey", limit=3, seed=2, prompt_len=prompt_len, tokenizer=bos_tokenizer)
    assert [p.depth for p in prompts] == [0.0, 0.5, 1.0]
    assert [p.category for p in prompts] == ["depth 0%", "depth 50%", "depth 100%"]
    for p in prompts:
        assert len(p.input_ids) == prompt_len and p.input_ids[0] == bos_tokenizer.bos_token_id and not p.chat
        text = bos_tokenizer.decode(p.input_ids, skip_special_tokens=True)
        assert text.endswith("What is the pass key? The pass key is") and text.count(p.answer) == 2
        start, end = len(INTRO), len(text) - len(QUESTION) - len(NEEDLE.format(key=p.answer))  # book text
        where = (text.index(f"The pass key is {p.answer}") - start) / (end - start)
        assert abs(where - p.depth) < 0.08
    assert len({p.answer for p in prompts}) == 3 and len({p.id for p in prompts}) == 3
    assert prompts == load_prompts("passkey", limit=3, seed=2, prompt_len=prompt_len, tokenizer=bos_tokenizer)


def test_passkey_depths_given_and_checked(bos_tokenizer):
    prompts = load_prompts("passkey", limit=3, prompt_len=400, tokenizer=bos_tokenizer, depths=(0.25,))
    assert {p.depth for p in prompts} == {0.25}
    assert spread_depths(1) == [0.5] and spread_depths(3, (0.0, 1.0)) == [0.0, 1.0, 0.0]
    with pytest.raises(SdbenchError, match="--depth 1.5"):
        spread_depths(2, (1.5,))


def test_passkey_needs_a_prompt_len_that_fits(bos_tokenizer):
    with pytest.raises(SdbenchError, match="needs --prompt-len"):
        load_prompts("passkey", limit=1, tokenizer=bos_tokenizer)
    with pytest.raises(SdbenchError, match="too short for a passkey prompt"):
        load_prompts("passkey", limit=1, prompt_len=40, tokenizer=bos_tokenizer)


def test_passkey_answer_is_checked(bos_tokenizer):
    prompt = passkey_prompts(list(book_pool(resolve("kjv"), None)), "kjv", 1, 0, 300, bos_tokenizer)[0]
    right = bos_tokenizer(f" {prompt.answer}.", add_special_tokens=False)["input_ids"]
    wrong = bos_tokenizer(" 12.", add_special_tokens=False)["input_ids"]
    assert answer_found(prompt, right, bos_tokenizer) is True and answer_found(prompt, wrong, bos_tokenizer) is False
    assert answer_found(ONE, right, bos_tokenizer) is None


def test_passkey_is_listed_and_labelled_with_its_haystack():
    available, how = dataset_available("passkey")
    assert available and how.startswith("built locally from")
    assert dataset_label("passkey") == "passkey in kjv-bible (PG-19 stand-in)"


def test_spec_bench_offline_says_how_to_get_it(monkeypatch):
    monkeypatch.delenv("SDBENCH_SPEC_BENCH_PATH", raising=False)
    available, how = dataset_available("spec-bench")
    assert not available and "SDBENCH_SPEC_BENCH_PATH" in how and "\n" not in how
    with pytest.raises(SdbenchError, match="SDBENCH_SPEC_BENCH_PATH"):
        load_prompts("spec-bench", limit=2)


def test_spec_bench_from_its_path_is_stratified(monkeypatch, tmp_path):
    records = [{"question_id": 100 * c + i, "category": cat, "turns": [f"{cat} {i}"] * (2 if c == 0 else 1)}
               for c, cat in enumerate(("writing", "translation", "rag")) for i in range(4)]
    path = tmp_path / "question.jsonl"
    path.write_text("".join(__import__("json").dumps(r) + "\n" for r in records))
    monkeypatch.setenv("SDBENCH_SPEC_BENCH_PATH", str(path))
    picked = load_prompts("spec-bench", limit=3, seed=0)
    assert {p.category for p in picked} == {"writing", "translation", "rag"}
    assert dataset_label("spec-bench") == "spec-bench"
    assert picked[0].id.startswith("spec-bench/")


# --- results and tables ---------------------------------------------------------------------------------------


def _row(role, prompt, turn, tokens, wall, **extra):
    return {"role": role, "strategy": "autoregressive" if role == "baseline" else "ngram", "prompt_id": prompt,
            "category": "writing", "repeat": 0, "batch_id": turn - 1, "turn": turn, "new_tokens": tokens,
            "wall_s": wall, "steps": tokens, "drafted": 0, "accepted": 0, "ttft_s": 0.0, **extra}


def test_turns_are_stored_and_split_in_the_tables(tmp_path):
    with RunWriter(tmp_path, "r") as writer:
        writer.append([_row("baseline", "p", 1, 10, 1.0), _row("strategy", "p", 1, 10, 0.5),
                       _row("baseline", "p", 2, 10, 1.0), _row("strategy", "p", 2, 10, 0.25)])
    df = read_results([tmp_path])
    assert {"turn", "depth", "found"} <= set(COLUMNS) and list(df["turn"]) == [1, 1, 2, 2]
    by_turn = summarize(df, ("turn",)).set_index(["role", "turn"])
    assert by_turn.loc[("strategy", 1), "speedup"] == pytest.approx(2.0)
    assert by_turn.loc[("strategy", 2), "speedup"] == pytest.approx(4.0)
    console = Console(record=True, width=160)
    print_report(df, console)
    assert "by turn" in console.export_text()
    with pytest.raises(SdbenchError, match="--by colour"):
        print_report(df, console, by=("colour",))


def test_files_from_before_turns_read_as_first_turns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    old = pa.table({"run_id": ["r", "r"], "role": ["baseline", "strategy"], "prompt_id": ["p", "p"],
                    "repeat": [0, 0], "new_tokens": [4, 4], "wall_s": [1.0, 0.5], "steps": [4, 2]})
    pq.write_table(old, tmp_path / "r.parquet")
    df = read_results([tmp_path])
    assert df["turn"].isna().all()
    assert list(summarize(df, ("turn",))["turn"]) == [1, 1, "ALL", "ALL"]
    assert RunWriter(tmp_path, "r").done_keys() == {("baseline", "p", 0, 1), ("strategy", "p", 0, 1)}


def test_retrieval_rows_get_a_found_table(tmp_path):
    rows = [_row(role, f"p{d}", 1, 4, 1.0, depth=d, found=ok, prompt_tokens=300)
            for role in ("baseline", "strategy") for d, ok in ((0.0, True), (1.0, False))]
    console = Console(record=True, width=160)
    print_report(pd.DataFrame(rows).assign(run_id="r"), console)
    text = console.export_text()
    assert "Answer found" in text and "1/1" in text and "0/1" in text
