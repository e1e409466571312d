"""Schedules: `tune --batch` writes one, `run` looks its entry up per batch size, `schedule export` writes vLLM's
form (each engine's form: test_schedule_formats.py). Through the CLI on a tiny model folder; the rules by hand."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from sdbench.errors import SdbenchError
from sdbench.reporting.results import read_results
from sdbench.schedule import Schedule, bucket, pick
from tests.conftest import run_cli


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    from tests.references import tiny_cli_files

    prompts = ["w1 w2 w3 w1 w2 w3 w4", "w5 w6 w5 w6 w5", "w7 w8 w9 w7 w8"]
    return [*tiny_cli_files(tmp_path, monkeypatch, prompts), "--max-new-tokens", "6", "--device", "cpu"]


def write_preset(home, name: str, spec: dict) -> None:
    folder = home / "strategies"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(yaml.safe_dump({"name": name, **spec}))


def ran(out) -> "object":
    rows = read_results(out)
    return rows[rows["role"] != "baseline"]


def test_lookup_rule_takes_the_largest_tuned_size_at_or_below():
    assert [bucket({1, 4}, b) for b in (1, 2, 3, 4, 5, 64)] == [1, 1, 1, 4, 4, 4]
    assert bucket({2, 8}, 1) == 2  # below every tuned size: the smallest
    sched = Schedule.from_spec({"entries": [
        {"batch": 1, "prompt_len": 1024, "gamma": 3, "options": {"budget": 256}},
        {"batch": 1, "prompt_len": 4096, "gamma": 2, "options": {"budget": 512}},
        {"batch": 8, "prompt_len": 1024, "gamma": 1, "options": {"budget": 128}}]}, "t")
    assert sched.lookup(4, 5000).options == {"budget": 512} and sched.lookup(4, 5000).label == "batch 1, 4096 tokens"
    assert sched.lookup(16, 9000).gamma == 1  # batch 8 was tuned at 1024 only
    with pytest.raises(SdbenchError, match="give --prompt-len"):
        sched.lookup(1, None)


def test_selection_rule_gives_a_tie_inside_the_interval_to_the_smaller_gamma():
    # trial values with their 95 % intervals and gammas
    assert pick([(1.30, (1.20, 1.40), 4), (1.25, (1.15, 1.35), 2), (1.10, (1.0, 1.2), 1)]) == 1
    assert pick([(1.30, (1.28, 1.32), 4), (1.25, (1.15, 1.35), 2)]) == 0  # 1.25 is below the best's interval
    assert pick([(1.30, (math.nan, math.nan), 4), (1.30, (1.2, 1.4), 2)]) == 1  # equal values: smaller gamma
    assert pick([(1.1, (None, None), 3)]) == 0


def test_a_schedule_entry_is_applied_at_its_batch_size(capsys, tmp_path, tiny):
    write_preset(tmp_path / "home", "sched", {"strategy": "ngram", "gamma": 2, "schedule": {"entries": [
        {"batch": 1, "gamma": 2, "options": {"max_ngram": 2}}, {"batch": 2, "gamma": 3, "options": {"max_ngram": 1}}]}})
    for size, gamma, max_ngram, label in ((1, 2, 2, "batch 1"), (2, 3, 1, "batch 2"), (3, 3, 1, "batch 2")):
        out = tmp_path / f"out{size}"
        code, stdout, err = run_cli(capsys, "run", *tiny, "--strategy", "sched", "--batch-size", str(size),
                                    "--limit", "3", "--out", str(out))
        assert code == 0, err
        assert f"the {label} entry" in stdout
        rows = ran(out)
        assert set(rows["schedule_entry"]) == {label}
        assert set(rows["gamma"]) == {gamma}
        assert {json.loads(p)["max_ngram"] for p in rows["params"]} == {max_ngram}
        assert rows["lossless"].all()


def test_tune_over_batch_sizes_writes_a_schedule_that_run_applies(capsys, tmp_path, tiny):
    """The smallest batch tunes every setting (its one trial enqueued, so the test knows what wins); the larger
    tunes gamma alone with the rest held as batch 1 chose them, in a study named after what it holds; the
    schedule then exports to vLLM, and run applies each entry at its batch size."""
    import optuna

    (tmp_path / "tune").mkdir()
    url = f"sqlite:///{tmp_path / 'tune' / 'tune.db'}"
    optuna.create_study(study_name="s-b1", storage=url, direction="maximize").enqueue_trial(
        {"gamma": 3, "max_ngram": 2, "min_ngram": 2})
    code, out, err = run_cli(capsys, "tune", *tiny, "--strategy", "ngram", "--batch", "2,1", "--limit", "2",
                             "--trials", "1", "--study", "s", "--preset", "mine", "--out", str(tmp_path / "tune"))
    assert code == 0, err
    spec = yaml.safe_load((tmp_path / "home" / "strategies" / "mine.yaml").read_text())
    entries = spec["schedule"]["entries"]
    assert spec["strategy"] == "ngram" and [e["batch"] for e in entries] == [1, 2]
    assert entries[0]["tuned"]["study"] == "s-b1" and entries[1]["tuned"]["study"].startswith("s-b2-held-")
    assert entries[0]["options"] == entries[1]["options"] == {"max_ngram": 2, "min_ngram": 2}
    assert "gamma alone; max_ngram=2 min_ngram=2 held" in out
    held = optuna.load_study(study_name=entries[1]["tuned"]["study"], storage=url)
    assert all((t.params["max_ngram"], t.params["min_ngram"]) == (2, 2) for t in held.trials)
    code, exported, err = run_cli(capsys, "schedule", "export", "mine", "--format", "vllm")
    assert code == 0, err
    assert json.loads(exported)["num_speculative_tokens_per_batch_size"] == [[1, 1, entries[0]["gamma"]],
                                                                             [2, 2, entries[1]["gamma"]]]
    for size, entry in zip((1, 2), entries):
        code, _, err = run_cli(capsys, "run", *tiny, "--strategy", "mine", "--batch-size", str(size), "--limit", "2",
                               "--out", str(tmp_path / f"run{size}"))
        assert code == 0, err
        rows = ran(tmp_path / f"run{size}")
        assert set(rows["schedule_entry"]) == {f"batch {size}"} and set(rows["gamma"]) == {entry["gamma"]}
        assert {json.dumps(json.loads(p), sort_keys=True) for p in rows["params"]} == {
            json.dumps({"gamma": entry["gamma"], **entry["options"]}, sort_keys=True)}
    code, out, err = run_cli(capsys, "schedule", "export", "mine", "--format", "json")
    assert code == 0, err
    assert [e["gamma"] for e in json.loads(out)["entries"]] == [e["gamma"] for e in entries]
    code, out, err = run_cli(capsys, "schedule", "show", "mine")
    assert code == 0 and "schedule mine" in out, err


@pytest.mark.parametrize("argv, said", [
    (["schedule", "export", "nothing"], "no preset named 'nothing'"),
    (["schedule", "export", "plain"], "preset 'plain' has no schedule"),
    (["schedule", "export", "twice"], "two schedule entries share a bucket"),
    (["schedule", "export", "ctx", "--format", "vllm"], "not per context length"),
    (["schedule", "export", "sched", "--format", "yamlish"], "unknown schedule format 'yamlish'"),
    (["schedule", "export", "sched", "--batch", "0"], "--batch 0: expected a whole number of at least 1"),
    (["schedule", "export", "ctx", "--format", "llama.cpp", "--batch", "2"], "tuned per context length too"),
    (["schedule", "export", "varied", "--format", "llama.cpp"], "with --batch B"),
    (["schedule", "export", "varied", "--format", "trtllm"], "drafts the most tokens at batch 1"),
    (["schedule", "export", "mixed", "--format", "vllm"], "max_ngram is 2 at batch 1 and 3 at batch 4"),
    (["schedule", "export", "tree", "--format", "vllm"], "grows a token tree"),
    (["schedule", "export", "magic", "--format", "sglang"], "strategy 'magicdec' has no SGLang form"),
    (["tune", "--batch", "1,1"], "--batch 1,1: expected distinct whole numbers"),
    (["tune", "--batch", "1,2", "--batch-size", "2"], "either --batch"),
    (["tune", "--per-bucket", "all"], "--per-bucket applies to a schedule"),
    (["tune", "--batch", "1,2", "--per-bucket", "some"], "--per-bucket some: use one of gamma, all"),
])
def test_bad_schedules_are_one_line(capsys, tmp_path, monkeypatch, argv, said):
    monkeypatch.setenv("SDBENCH_CONFIG", str(tmp_path / "home"))
    home = tmp_path / "home"
    write_preset(home, "plain", {"strategy": "ngram", "gamma": 2})
    write_preset(home, "twice", {"strategy": "ngram", "schedule": {"entries": [{"batch": 1, "gamma": 2},
                                                                               {"batch": 1, "gamma": 3}]}})
    write_preset(home, "ctx", {"strategy": "ngram", "schedule": {"entries": [{"batch": 1, "prompt_len": 64, "gamma": 2}]}})
    write_preset(home, "sched", {"strategy": "ngram", "schedule": {"entries": [{"batch": 1, "gamma": 2}]}})
    write_preset(home, "varied", {"strategy": "ngram", "schedule": {"entries": [{"batch": 1, "gamma": 2},
                                                                                {"batch": 4, "gamma": 3}]}})
    write_preset(home, "mixed", {"strategy": "ngram", "schedule": {"entries": [
        {"batch": 1, "gamma": 2, "options": {"max_ngram": 2}}, {"batch": 4, "gamma": 3, "options": {"max_ngram": 3}}]}})
    write_preset(home, "tree", {"strategy": "ngram", "schedule": {"entries": [
        {"batch": 1, "gamma": 2, "options": {"tree": 2}}]}})
    write_preset(home, "magic", {"strategy": "magicdec", "schedule": {"entries": [
        {"batch": 1, "gamma": 2, "options": {"budget": 256}}]}})
    code, _, err = run_cli(capsys, *argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and said in lines[0], err


def test_a_schedule_holds_tree_settings_per_batch_size(capsys, tmp_path, tiny):
    """`tune --trees --batch 1,2`: each bucket's trial (enqueued, so that the test knows which wins) becomes its
    entry with its tree settings, and `run` grows that bucket's tree, or the chain, at each batch size."""
    import optuna

    model = tiny[1]
    (tmp_path / "tune").mkdir()
    url = f"sqlite:///{tmp_path / 'tune' / 'tune.db'}"
    for bucket_, params in (("b1", {"gamma": 3, "tree_topk": 2, "tree_nodes": 4}), ("b2", {"gamma": 2, "tree_topk": 0})):
        optuna.create_study(study_name=f"s-{bucket_}", storage=url, direction="maximize").enqueue_trial(params)
    code, out, err = run_cli(capsys, "tune", *tiny, "--strategy", "draft", "--draft", model, "--trees", "--batch",
                             "1,2", "--per-bucket", "all", "--limit", "2", "--trials", "1", "--study", "s", "--preset", "mine",
                             "--objective", "tokens", "--out", str(tmp_path / "tune"))
    assert code == 0, err
    spec = yaml.safe_load((tmp_path / "home" / "strategies" / "mine.yaml").read_text())
    entries = spec["schedule"]["entries"]
    assert [(e["batch"], e["gamma"], e["options"]) for e in entries] == [
        (1, 3, {"tree_topk": 2, "tree_nodes": 4}), (2, 2, {})]
    for size, label, gamma, tree in ((1, "batch 1", 3, {"tree_topk": 2, "tree_nodes": 4}), (2, "batch 2", 2, {}),
                                     (3, "batch 2", 2, {})):
        code, _, err = run_cli(capsys, "run", *tiny, "--strategy", "mine", "--batch-size", str(size), "--limit", "3",
                               "--out", str(tmp_path / f"run{size}"))
        assert code == 0, err
        rows = ran(tmp_path / f"run{size}")
        assert set(rows["schedule_entry"]) == {label} and rows["lossless"].all()
        assert {json.dumps(json.loads(p), sort_keys=True) for p in rows["params"]} == {
            json.dumps({"gamma": gamma, **tree}, sort_keys=True)}
        steps = list(rows["tree_steps"])  # a result column
        assert all(steps) if tree else not any(steps)  # batch 1 verified trees, the others chains
    code, out, err = run_cli(capsys, "schedule", "show", "mine")
    assert code == 0 and "tree_topk=2 tree_nodes=4" in out, err
    code, _, err = run_cli(capsys, "schedule", "export", "mine", "--format", "vllm")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "the batch 1 entry grows a token tree (tree_topk=2 tree_nodes=4), which vLLM's draft speculation" in lines[0]
    code, out, err = run_cli(capsys, "schedule", "export", "mine", "--format", "json")
    assert code == 0 and json.loads(out)["entries"][0]["options"] == {"tree_topk": 2, "tree_nodes": 4}, err
