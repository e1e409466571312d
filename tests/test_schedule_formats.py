"""`sdbench schedule export --format vllm|trtllm|sglang|llama.cpp`: what each engine loads, checked against the engine
itself where it is installed (vLLM's own SpeculativeConfig and its batch-size lookup; llama-server's own argument
parser) and against the engine's documented schema by hand elsewhere (TensorRT-LLM's DecodingBaseConfig fields and
validator, SGLang's server arguments). Every form must give, at every batch size, the draft length sdbench's own
lookup rule gives."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from sdbench.errors import SdbenchError
from sdbench.schedule import Entry, Schedule
from sdbench.commands.schedule_formats import render, schedule_formats
from tests.conftest import run_cli

NGRAM = {"max_ngram": 4, "min_ngram": 2}
# tuned at 1, 4 and 16: the middle drafts less, the widest not at all
SCHED = Schedule((Entry(1, None, 5, NGRAM), Entry(4, None, 2, NGRAM), Entry(16, None, 0, {"max_ngram": 9})))
HUB = {"llama-1b": "meta-llama/Llama-3.2-1B-Instruct"}.get
DRAFT = Schedule((Entry(2, None, 4, {}, ("llama-1b",)), Entry(8, None, 3, {}, ("llama-1b",))))
SIZES = range(1, 41)


def expected(schedule: Schedule) -> list[int]:
    """sdbench's own lookup rule, batch by batch: what every form must reproduce."""
    return [schedule.lookup(b, None).gamma for b in SIZES]


def test_every_registered_format_renders_or_refuses_in_one_line():
    for form in schedule_formats:
        try:
            text = render(form.name, "ngram", SCHED, HUB)
        except SdbenchError as e:
            assert "\n" not in str(e) and form.name in ("sglang", "llama.cpp") and "--batch" in str(e)
        else:
            assert text.strip()


def test_vllm_form_field_by_field_and_its_ranges_as_sdbench_looks_up():
    config = json.loads(render("vllm", "ngram", SCHED))
    assert config == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
                      "num_speculative_tokens_per_batch_size": [[1, 3, 5], [4, 15, 2], [16, 16, 0]]}
    draft = json.loads(render("vllm", "draft", DRAFT, HUB))
    assert draft == {"method": "draft_model", "num_speculative_tokens": 4, "model": "meta-llama/Llama-3.2-1B-Instruct",
                     "num_speculative_tokens_per_batch_size": [[1, 7, 4], [8, 8, 3]]}  # below every size: the smallest
    one = json.loads(render("vllm", "ngram", SCHED, batch=6))  # the bucket a batch of 6 runs, without a schedule
    assert one == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def test_the_installed_vllm_takes_the_export_and_looks_up_what_sdbench_does(vllm):
    """vLLM's own SpeculativeConfig validates the JSON (unknown keys and bad ranges fail there), and its own dense
    lookup (the scheduler's) gives every batch size 1-40 the draft length sdbench's rule gives."""
    check = ("import json, sys\n"
             "from vllm.config.speculative import SpeculativeConfig\n"
             "from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup\n"
             "c = SpeculativeConfig(**json.loads(sys.argv[1]))\n"
             "dense = build_dynamic_sd_schedule_lookup(c.num_speculative_tokens_per_batch_size, int(sys.argv[2]),"
             " c.num_speculative_tokens)\n"
             "print(json.dumps([c.method, c.prompt_lookup_max, c.prompt_lookup_min, dense[1:]]))\n")
    for schedule in (SCHED, Schedule((Entry(2, None, 3, {}), Entry(5, None, 4, {}), Entry(9, None, 1, {})))):
        text = render("vllm", "ngram", schedule)
        done = subprocess.run([str(vllm.executable()), "-c", check, text, str(max(SIZES))], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        method, longest, shortest, dense = json.loads(done.stdout.strip().splitlines()[-1])
        assert method == "ngram" and (longest, shortest) == (int(schedule.entries[0].options.get("max_ngram", 3)),
                                                             int(schedule.entries[0].options.get("min_ngram", 1)))
        assert dense == expected(schedule)
    bad = json.loads(render("vllm", "ngram", SCHED))
    bad["num_speculative_tokens_per_batch_size"][0][0] = 2  # a schedule that leaves batch 1 out: vLLM refuses it
    done = subprocess.run([str(vllm.executable()), "-c", check, json.dumps(bad), "8"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and "must start at 1" in done.stderr


# TensorRT-LLM's DecodingBaseConfig (llmapi/llm_args.py) forbids unknown keys; these are its fields for the two types
TRTLLM_FIELDS = {"NGram": {"decoding_type", "max_draft_len", "max_matching_ngram_size", "draft_len_schedule"},
                 "Draft_Target": {"decoding_type", "max_draft_len", "speculative_model", "draft_len_schedule"}}


def trtllm_lookup(schedule: dict, batch: int) -> int:
    """TensorRT-LLM's documented rule: the draft length of the largest threshold at or below the batch size."""
    return schedule[max(k for k in schedule if k <= batch)]


def test_trtllm_form_meets_its_validator_and_its_thresholds_look_up_what_sdbench_does():
    for strategy, schedule in (("ngram", SCHED), ("draft", DRAFT)):
        config = yaml.safe_load(render("trtllm", strategy, schedule, HUB))["speculative_config"]
        assert set(config) <= TRTLLM_FIELDS[config["decoding_type"]]
        table = config["draft_len_schedule"]
        # its validator: keys >= 1 with 1 among them, lengths >= 0, table[1] == max_draft_len >= every length
        assert 1 in table and table[1] == config["max_draft_len"] > 0
        assert all(k >= 1 and 0 <= v <= config["max_draft_len"] for k, v in table.items())
        assert [trtllm_lookup(table, b) for b in SIZES] == expected(schedule)
    ngram = yaml.safe_load(render("trtllm", "ngram", SCHED))["speculative_config"]
    assert ngram == {"decoding_type": "NGram", "max_draft_len": 5, "max_matching_ngram_size": 4,
                     "draft_len_schedule": {1: 5, 4: 2, 16: 0}}
    assert yaml.safe_load(render("trtllm", "draft", DRAFT, HUB))["speculative_config"]["speculative_model"] == \
        "meta-llama/Llama-3.2-1B-Instruct"
    with pytest.raises(SdbenchError, match="drafts the most tokens at batch 1"):
        render("trtllm", "ngram", Schedule((Entry(1, None, 2, {}), Entry(4, None, 3, {}))))


def sglang_args(line: str) -> dict:
    """SGLang's server arguments as its argparse reads them (flag -> value; flags as documented by its server_args)."""
    import shlex

    words, out = shlex.split(line), {}
    while words:
        flag, value = words.pop(0), words.pop(0)
        assert flag.startswith("--") and flag not in out
        out[flag] = value
    return out


def test_sglang_form_is_a_chain_of_the_bucket_draft_length():
    args = sglang_args(render("sglang", "ngram", SCHED, batch=6))
    assert args == {"--max-running-requests": "6", "--speculative-algorithm": "NGRAM",
                    "--speculative-num-draft-tokens": "3",  # the bucket's 2 drafted tokens and the verified one
                    "--speculative-ngram-max-match-window-size": "4", "--speculative-ngram-min-match-window-size": "2",
                    "--speculative-ngram-max-bfs-breadth": "1", "--speculative-ngram-min-bfs-breadth": "1"}
    args = sglang_args(render("sglang", "draft", DRAFT, HUB, batch=1))
    assert args["--speculative-algorithm"] == "STANDALONE" and args["--speculative-num-steps"] == "4"
    assert args["--speculative-num-draft-tokens"] == "5" and args["--speculative-eagle-topk"] == "1"
    assert args["--speculative-draft-model-path"] == "meta-llama/Llama-3.2-1B-Instruct"
    steady = Schedule((Entry(1, None, 3, {}), Entry(8, None, 3, {})))  # one draft length: no --batch needed
    assert "--max-running-requests" not in sglang_args(render("sglang", "ngram", steady))


def test_llama_server_parses_the_llamacpp_form(llamacpp, tmp_path):
    """llama-server's own parser takes every flag (an unknown flag or value stops it before the model loads; with
    them all taken it goes on to load the (absent) model)."""
    line = render("llama.cpp", "ngram", SCHED, batch=6)
    assert line.split()[:2] == ["-np", "6"]
    assert "--spec-ngram-simple-size-m 2" in line and "--spec-draft-n-max 2" in line
    draft = tmp_path / "draft.gguf"
    draft.write_bytes(b"")
    from unittest import mock

    with mock.patch("sdbench.servers.llamacpp.model_files", return_value=("gguf", str(draft))):
        draft_line = render("llama.cpp", "draft", DRAFT, HUB, batch=8)
    assert f"-md {draft}" in draft_line and "--spec-type draft-simple" in draft_line
    import shlex

    for flags in (line, draft_line, "--spec-draft-n-max x"):
        done = subprocess.run([str(llamacpp.executable()), "-m", str(tmp_path / "absent.gguf"), "--port", "0",
                               *shlex.split(flags)], capture_output=True, text=True, timeout=60)
        said = done.stdout + done.stderr
        parsed = "error while handling argument" not in said and "invalid argument" not in said
        assert parsed == (flags != "--spec-draft-n-max x"), said[-1500:]
        if parsed:
            assert "failed to load model" in said


def test_schedule_export_writes_each_form_through_the_cli(capsys, tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("SDBENCH_CONFIG", str(home))
    (home / "strategies").mkdir(parents=True)
    (home / "strategies" / "sched.yaml").write_text(yaml.safe_dump(
        {"name": "sched", "strategy": "ngram", "schedule": SCHED.spec()}))
    for fmt, read in (("vllm", json.loads), ("trtllm", yaml.safe_load)):
        out = tmp_path / f"sched.{fmt}"
        code, said, err = run_cli(capsys, "schedule", "export", "sched", "--format", fmt, "--out", str(out))
        assert code == 0 and str(out) in said, err
        assert out.read_text() == render(fmt, "ngram", SCHED) + "\n" and read(out.read_text())
    code, said, err = run_cli(capsys, "schedule", "export", "sched", "--format", "llama.cpp", "--batch", "4")
    assert code == 0 and said.strip() == render("llama.cpp", "ngram", SCHED, batch=4), err
