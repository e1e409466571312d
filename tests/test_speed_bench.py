"""SPEED-Bench as its preparation writes it to disk (Model-Optimizer's prepare_data.py: data/speed/<split>/
test.parquet, written here with the same `datasets` call; NeMo-Skills' prepare.py: <split>.jsonl with user
`messages`), read through the prompt loading a run uses and through `sdbench run` on a tiny model; the hub path
read from a local mirror of the hub's configs; placeholders and missing splits refused in one line."""

from __future__ import annotations

import pytest

from sdbench.data import readers, sources
from sdbench.data.tasks import check_dataset, dataset_available, dataset_label, load_prompts
from sdbench.errors import SdbenchError
from sdbench.reporting.results import read_results
from tests.conftest import run_cli
from tests.references import tiny_model_dir
from tests.test_cli import one_line_error

# written out here, not read from the task file: a wrong marker in tasks/speed-bench*.yaml must fail these tests
PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"
CATEGORIES = ("coding", "humanities", "math", "multilingual", "qa", "rag", "reasoning", "roleplay", "stem",
              "summarization", "writing")
TIERS = ("low_entropy", "mixed", "high_entropy")
PREPARE = "examples/specdec_bench/prepare_data.py --dataset speed --config all"


def record(qid: int, category: str, turns: list[str], source: str = "SPEED-Bench") -> dict:
    """One record with the hub's columns, as the preparation keeps them."""
    return {"question_id": f"{qid:032x}", "category": category, "sub_category": f"{category}-sub", "turns": turns,
            "source": source, "src_id": f"src_{qid}", "difficulty": "medium", "multiturn": len(turns) > 1}


def qualitative() -> list[dict]:
    """Two records per category; the first roleplay one has two turns."""
    rows = []
    for c, category in enumerate(CATEGORIES):
        for k in range(2):
            turns = [f"w{c} {category} question {k}"] + (["w9 and a second turn"] if (category, k) == ("roleplay", 0)
                                                         else [])
            rows.append(record(100 * c + k, category, turns))
    return rows


def throughput(length: str) -> list[dict]:
    """Two records per entropy tier, their text naming the bucket (ids differ per bucket)."""
    base = {"1k": 10_000, "8k": 80_000}[length]
    return [record(base + 10 * t + k, tier, [f"w{t} {length} {tier} prompt {k}"])
            for t, tier in enumerate(TIERS) for k in range(2)]


def write_parquet(path, rows) -> None:
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(str(path))  # prepare_data.py: `_resolved_dataset.to_parquet`


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SDBENCH_SPEED_BENCH_PATH", raising=False)


@pytest.fixture
def prepared(tmp_path, monkeypatch):
    """data/speed as prepare_data.py leaves it (qualitative, throughput_1k and throughput_8k), pointed at."""
    speed = tmp_path / "data" / "speed"
    write_parquet(speed / "qualitative" / "test.parquet", qualitative())
    for length in ("1k", "8k"):
        write_parquet(speed / f"throughput_{length}" / "test.parquet", throughput(length))
    monkeypatch.setenv("SDBENCH_SPEED_BENCH_PATH", str(speed))
    return speed


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert message and "\n" not in message
    return message


# --- the qualitative split -------------------------------------------------------------------------------------


def test_qualitative_split_keeps_ids_categories_and_turns(prepared):
    prompts = load_prompts("speed-bench")
    assert len(prompts) == 22 and {p.category for p in prompts} == set(CATEGORIES)
    by_id = {p.id: p for p in prompts}
    rag = by_id[f"speed-bench/{501:032x}"]  # rag is the 6th category (c = 5), its second record
    assert rag.category == "rag" and rag.turns == ("w5 rag question 1",) and rag.chat and rag.input_ids is None
    roleplay = by_id[f"speed-bench/{700:032x}"]
    assert roleplay.category == "roleplay" and roleplay.turns == ("w7 roleplay question 0", "w9 and a second turn")
    assert sum(len(p.turns) == 2 for p in prompts) == 1
    assert dataset_label("speed-bench") == "speed-bench"
    ok, how = dataset_available("speed-bench")
    assert ok and how == f"local copy from $SDBENCH_SPEED_BENCH_PATH ({prepared / 'qualitative' / 'test.parquet'})"


def test_a_small_limit_covers_one_prompt_per_category(prepared):
    picked = load_prompts("speed-bench", limit=11, seed=3)
    assert sorted(p.category for p in picked) == sorted(CATEGORIES)
    assert [p.id for p in picked] == [p.id for p in load_prompts("speed-bench", limit=11, seed=3)]


def test_one_category_with_task_at_category(prepared):
    assert [p.id for p in load_prompts("speed-bench@math")] == [f"speed-bench/{200:032x}", f"speed-bench/{201:032x}"]
    assert dataset_label("speed-bench@math") == "speed-bench@math"
    with pytest.raises(SdbenchError) as exc:
        check_dataset("speed-bench@cooking")
    assert one_line(exc) == f"task 'speed-bench' has no category 'cooking': {', '.join(sorted(CATEGORIES))}"


@pytest.mark.parametrize("where", ["data", "file"])
def test_the_variable_may_name_the_output_folder_or_the_split_file(prepared, monkeypatch, where):
    path = prepared.parent if where == "data" else prepared / "qualitative" / "test.parquet"
    monkeypatch.setenv("SDBENCH_SPEED_BENCH_PATH", str(path))
    prompts = load_prompts("speed-bench")
    assert len(prompts) == 22 and prompts[0].id == f"speed-bench/{0:032x}"
    assert prompts[0].turns == ("w0 coding question 0",)
    if where == "file":  # one split's file is not the others'
        with pytest.raises(SdbenchError) as exc:
            check_dataset("speed-bench-throughput", prompt_len=1024)
        assert "is not the throughput_1k split" in one_line(exc) and PREPARE in one_line(exc)


def test_nemo_skills_json_lines_read_as_the_same_prompts(prepared, tmp_path, monkeypatch):
    import datasets

    rows = [{**{k: v for k, v in r.items() if k != "turns"}, "messages": [{"role": "user", "content": t}
                                                                          for t in r["turns"]]}
            for r in qualitative()]
    (tmp_path / "nemo").mkdir()
    datasets.Dataset.from_list(rows).to_json(str(tmp_path / "nemo" / "qualitative.jsonl"))  # prepare.py's call
    expected = [(p.id, p.category, p.turns) for p in load_prompts("speed-bench")]
    monkeypatch.setenv("SDBENCH_SPEED_BENCH_PATH", str(tmp_path / "nemo"))
    assert [(p.id, p.category, p.turns) for p in load_prompts("speed-bench")] == expected


@pytest.mark.parametrize("name, text, said", [
    ("qualitative.jsonl", '{"question_id": "a", "category": "qa", "prompt": "hi"}\n',
     "record 1 has neither `turns` nor a list of `messages`"),
    ("qualitative/test.parquet", "not parquet", "not a readable parquet file ("),
])
def test_a_bad_prepared_file_is_one_line_naming_it(tmp_path, monkeypatch, name, text, said):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(text)
    monkeypatch.setenv("SDBENCH_SPEED_BENCH_PATH", str(tmp_path))
    with pytest.raises(SdbenchError) as exc:
        load_prompts("speed-bench")
    assert one_line(exc).startswith(f"{tmp_path / name}: {said}")


# --- the throughput splits: --prompt-len picks the bucket, TASK@TIER the tier ------------------------------------


@pytest.mark.parametrize("prompt_len, length", [(1024, "1k"), (1000, "1k"), (8192, "8k"), (8000, "8k")])
def test_prompt_len_picks_the_bucket(prepared, prompt_len, length):
    prompts = load_prompts("speed-bench-throughput", prompt_len=prompt_len)
    base = {"1k": 10_000, "8k": 80_000}[length]
    assert [p.id for p in prompts] == [f"speed-bench-throughput/{base + 10 * t + k:032x}" for t in range(3)
                                       for k in range(2)]
    assert prompts[5].category == "high_entropy" and prompts[5].turns == (f"w2 {length} high_entropy prompt 1",)
    assert dataset_label("speed-bench-throughput", prompt_len) == f"speed-bench-throughput-{length}"


@pytest.mark.parametrize("asked", ["high_entropy", "high"])
def test_one_entropy_tier(prepared, asked):
    prompts = load_prompts(f"speed-bench-throughput@{asked}", prompt_len=8192)
    assert [(p.id, p.category, p.turns) for p in prompts] == [
        (f"speed-bench-throughput/{80_020 + k:032x}", "high_entropy", (f"w2 8k high_entropy prompt {k}",))
        for k in range(2)]
    assert dataset_label(f"speed-bench-throughput@{asked}", 8192) == "speed-bench-throughput-8k@high_entropy"


def test_the_tiers_are_the_categories_and_a_limit_covers_them(prepared):
    picked = load_prompts("speed-bench-throughput", prompt_len=1024, limit=3, seed=0)
    assert sorted(p.category for p in picked) == sorted(TIERS)
    ok, how = dataset_available("speed-bench-throughput")
    assert ok and how.endswith("; --prompt-len 1k, 8k")


@pytest.mark.parametrize("task, prompt_len, said", [
    ("speed-bench-throughput", None, "task 'speed-bench-throughput' needs --prompt-len: one of 1k, 2k, 8k, 16k, 32k"),
    ("speed-bench-throughput", 4096, "--prompt-len 4096: task 'speed-bench-throughput' has input lengths of 1k, 2k, "
                                     "8k, 16k, 32k tokens only"),
    ("speed-bench-throughput", 2048, "does not hold the throughput_2k split (throughput_2k/test.parquet, "
                                     "speed/throughput_2k/test.parquet or throughput_2k.jsonl): prepare it with"),
    ("speed-bench", 1024, "--prompt-len needs a book dataset (kjv, pg19) or a data set of input-length buckets "
                          "(speed-bench-throughput); 'speed-bench' is a set of prompts"),
    ("speed-bench-throughput@medium", 1024, "task 'speed-bench-throughput' has no category 'medium': high_entropy, "
                                            "low_entropy, mixed"),
])
def test_a_length_or_tier_it_cannot_take_is_one_line(prepared, task, prompt_len, said):
    with pytest.raises(SdbenchError) as exc:
        check_dataset(task, prompt_len=prompt_len)
    assert said in one_line(exc)


# --- placeholders and missing data ------------------------------------------------------------------------------


@pytest.mark.parametrize("turns", [[f"{PLACEHOLDER}\n\nSummarize this article: {{article}}"], [PLACEHOLDER],
                                   ["w1 a real first turn", PLACEHOLDER]])
def test_placeholders_are_refused_in_one_line(tmp_path, monkeypatch, turns):
    rows = qualitative()[:3] + [record(999, "summarization", turns, source="abisee/cnn_dailymail")]
    write_parquet(tmp_path / "qualitative" / "test.parquet", rows)
    monkeypatch.setenv("SDBENCH_SPEED_BENCH_PATH", str(tmp_path))
    for call in (lambda: check_dataset("speed-bench"), lambda: load_prompts("speed-bench", limit=1)):
        with pytest.raises(SdbenchError) as exc:
            call()
        line = one_line(exc)
        assert line.startswith(f"task 'speed-bench': 1 of 4 prompts in {tmp_path / 'qualitative' / 'test.parquet'} "
                               f"are placeholders, not prompts (the first: speed-bench/{999:032x}, summarization)")
        assert PREPARE in line and "SDBENCH_SPEED_BENCH_PATH" in line


def test_missing_data_says_how_to_get_it(monkeypatch, tmp_path):
    for task in ("speed-bench", "speed-bench-throughput"):
        ok, how = dataset_available(task)
        assert not ok and how.startswith(f"task '{task}': not available offline: prepare it with NVIDIA "
                                         f"Model-Optimizer's {PREPARE}") and "SDBENCH_SPEED_BENCH_PATH" in how
        with pytest.raises(SdbenchError) as exc:
            check_dataset(task, prompt_len=1024 if task.endswith("throughput") else None)
        assert one_line(exc) == how
    monkeypatch.setenv("SDBENCH_SPEED_BENCH_PATH", str(tmp_path / "nowhere"))
    with pytest.raises(SdbenchError, match=r"points at .*nowhere, which does not exist"):
        check_dataset("speed-bench")


# --- the hub path, served from a local mirror of the hub's configs -------------------------------------------------


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A folder laid out as a hub dataset with configs (README front matter), and `datasets` asked for
    nvidia/SPEED-Bench loading it instead; returns the folder and the calls made."""
    import datasets

    mirror, calls = tmp_path / "mirror", []
    configs = "".join(f"- config_name: {c}\n  data_files:\n  - split: test\n    path: {c}/test-*.parquet\n"
                      for c in ("qualitative", "throughput_1k", "throughput_8k"))
    mirror.mkdir()
    (mirror / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")

    class Hub:
        @staticmethod
        def load_dataset(repo, config, **kwargs):
            calls.append((repo, config, kwargs["split"], kwargs["streaming"]))
            assert repo == "nvidia/SPEED-Bench"
            return datasets.load_dataset(str(mirror), config, **kwargs)

    monkeypatch.setattr(sources, "hub_usable", lambda repo: repo == "nvidia/SPEED-Bench")
    monkeypatch.setattr(readers, "_datasets", lambda: Hub)
    return mirror, calls


def test_the_hub_copy_is_read_by_config_and_refused_while_unprepared(hub):
    mirror, calls = hub
    write_parquet(mirror / "qualitative" / "test-00000-of-00001.parquet",
                  qualitative()[:2] + [record(5, "qa", [PLACEHOLDER + "\n\n{question}"])])
    write_parquet(mirror / "throughput_8k" / "test-00000-of-00001.parquet", throughput("8k"))
    ok, how = dataset_available("speed-bench")
    assert ok and how == "hub: nvidia/SPEED-Bench (qualitative, test split, streaming)"
    with pytest.raises(SdbenchError) as exc:
        check_dataset("speed-bench")
    assert one_line(exc).startswith("task 'speed-bench': 1 of 3 prompts in nvidia/SPEED-Bench (qualitative) are "
                                    "placeholders") and PREPARE in one_line(exc)
    prompts = load_prompts("speed-bench-throughput@low", prompt_len=8192)
    assert [(p.id, p.turns) for p in prompts] == [(f"speed-bench-throughput/{80_000 + k:032x}",
                                                   (f"w0 8k low_entropy prompt {k}",)) for k in range(2)]
    assert ("nvidia/SPEED-Bench", "throughput_8k", "test", True) in calls
    assert {c[1] for c in calls} == {"qualitative", "throughput_8k"}


# --- the command line --------------------------------------------------------------------------------------------


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("SDBENCH_CONFIG", str(tmp_path / "home"))
    return str(tiny_model_dir(tmp_path / "tiny"))


def test_run_over_one_category_with_both_turns(capsys, tmp_path, prepared, tiny):
    code, out, err = run_cli(capsys, "run", "--target", tiny, "--dataset", "speed-bench@roleplay", "--strategy",
                             "ngram", "--max-new-tokens", "4", "--no-probe", "--device", "cpu", "--out",
                             str(tmp_path / "out"))
    assert code == 0, err
    df = read_results([tmp_path / "out"])
    assert set(df["category"]) == {"roleplay"} and set(df["dataset"]) == {"speed-bench@roleplay"}
    first, second = f"speed-bench/{700:032x}", f"speed-bench/{701:032x}"
    assert sorted(df.loc[df["turn"] == 1, "prompt_id"].unique()) == [first, second]
    assert list(df.loc[df["turn"] == 2, "prompt_id"].unique()) == [first]


def test_run_over_a_throughput_bucket_and_tier(capsys, tmp_path, prepared, tiny):
    code, _, err = run_cli(capsys, "run", "--target", tiny, "--dataset", "speed-bench-throughput@high",
                           "--prompt-len", "8k", "--strategy", "ngram", "--max-new-tokens", "4", "--no-probe",
                           "--device", "cpu", "--out", str(tmp_path / "out"))
    assert code == 0, err
    df = read_results([tmp_path / "out"])
    assert set(df["category"]) == {"high_entropy"}
    assert set(df["dataset"]) == {"speed-bench-throughput-8k@high_entropy"}
    assert sorted(df["prompt_id"].unique()) == [f"speed-bench-throughput/{80_020 + k:032x}" for k in range(2)]


@pytest.mark.parametrize("setup, said", [
    ("placeholders", "are placeholders, not prompts"),
    ("missing", "task 'speed-bench': not available offline: prepare it with"),
])
def test_the_run_refuses_before_any_model_loads(capsys, tmp_path, monkeypatch, tiny, setup, said):
    from sdbench.commands.run import RunHarness

    if setup == "placeholders":
        write_parquet(tmp_path / "speed" / "qualitative" / "test.parquet", [record(1, "qa", [PLACEHOLDER])])
        monkeypatch.setenv("SDBENCH_SPEED_BENCH_PATH", str(tmp_path / "speed"))
    monkeypatch.setattr(RunHarness, "_load", lambda self: pytest.fail("a model was loaded"))
    capsys.readouterr()  # the fixture's writing, not the run's
    code, _, err = run_cli(capsys, "run", "--target", tiny, "--dataset", "speed-bench", "--strategy", "ngram",
                           "--out", str(tmp_path / "out"))
    line = one_line_error(code, err)
    assert said in line and PREPARE in " ".join(err.split())


def test_prompt_len_takes_k_forms_and_refuses_others_in_one_line(capsys, tmp_path):
    from sdbench.options import parse_tokens

    assert (parse_tokens("8k"), parse_tokens("8K"), parse_tokens("8192"), parse_tokens("1000")) == (8192, 8192, 8192,
                                                                                                    1000)
    code, _, err = run_cli(capsys, "run", "--dataset", "speed-bench-throughput", "--prompt-len", "8q", "--out",
                           str(tmp_path / "out"))
    assert one_line_error(code, err) == "error: --prompt-len 8q: expected a number of tokens, such as 2048 or 2k"


def test_sweep_over_throughput_buckets_under_concurrency(capsys, tmp_path, prepared, tiny):
    """specdec_bench's throughput curve: speedup against concurrency per input-length bucket (`--prompt-len 1k,8k`),
    each point served as run --concurrency serves it, its measured speedup the output throughput over the
    baseline's on the same arrivals and its predicted one beside it; one tier by TASK@TIER."""
    import pandas as pd

    code, out, err = run_cli(capsys, "sweep", "--target", tiny, "--dataset", "speed-bench-throughput@low",
                             "--prompt-len", "1k,8k", "--concurrency", "1,2", "--strategy", "ngram", "--limit", "2",
                             "--max-new-tokens", "4", "--gamma", "2", "--no-probe", "--device", "cpu",
                             "--out", str(tmp_path / "out"))
    assert code == 0, err
    (folder,) = [p for p in (tmp_path / "out").iterdir() if p.is_dir()]
    rows = read_results([folder])
    for length, label in ((1024, "1k"), (8192, "8k")):
        mine = rows[rows["prompt_len"] == length]
        assert set(mine["dataset"]) == {f"speed-bench-throughput-{label}@low_entropy"}
        assert set(mine["category"]) == {"low_entropy"} and set(mine["concurrency"]) == {1, 2}
        assert mine["lossless"].dropna().all()
    points = pd.read_csv(folder / "points.csv")
    points = points[points["family"] == "ngram"]
    assert sorted(zip(points["size"], points["prompt_len"])) == [(1, 1024), (1, 8192), (2, 1024), (2, 8192)]
    assert (points["axis"] == "concurrency").all()
    assert points["speedup"].notna().all() and points["predicted"].notna().all()


def test_sweep_and_tune_take_k_lengths_and_refuse_others_in_one_line(capsys, tmp_path):
    from sdbench.options import parse_lengths

    assert parse_lengths("1k,2k,8192") == (1024, 2048, 8192) and parse_lengths(None) == ()
    for command in ("sweep", "tune"):
        code, _, err = run_cli(capsys, command, "--prompt-len", "1k,1024", "--out", str(tmp_path / "out"))
        assert "expected distinct numbers of tokens, such as 1024,4096 or 1k,8k" in one_line_error(code, err)
