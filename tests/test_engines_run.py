"""`run --engine`: every role of a run decoded by an engine's server, each reply a row as sdbench's own loop writes
it. The request bodies of both adapters, greedy and sampled; a reply's counters as a row's by hand; the run end to
end on the stand-in server (tests/fake_engine.py: transformers' own greedy `generate`, and its sampled `generate`
at the request's seed, with made-up counters of 3 rounds of 4 drafts with 2 accepted per 12-token prompt); the
refusals; an engine that dies mid-run; and the real llama.cpp where `make engine-llama.cpp` installed it."""

from __future__ import annotations

import hashlib

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sdbench.config import SamplingConfig
from sdbench.data.tasks import encode_prompt, load_prompts
from sdbench.reporting.results import read_results
from sdbench.reporting.writer import unfinished_path
from sdbench.servers.engines import Reply, request_seed
from sdbench.servers.llamacpp import LlamaCpp
from sdbench.servers.runs import row_stats
from sdbench.servers.vllm import Vllm
from tests.conftest import run_cli
from tests.references import hf_generate
from tests.test_engines import stand_in

NEW = 12
PROMPT = [5, 9, 13, 5, 9]


# --- requests and replies, by hand --------------------------------------------------------------------------------


def test_llamacpp_requests_are_greedy_or_plainly_sampled_at_the_requests_seed():
    path, greedy = LlamaCpp().request(PROMPT, 7)
    assert path == "/completion" and greedy["prompt"] == PROMPT and greedy["n_predict"] == 7
    assert greedy["temperature"] == 0.0 and "top_k" not in greedy and "top_p" not in greedy
    _, sampled = LlamaCpp().request(PROMPT, 7, SamplingConfig(0.7, 0.9, 1234))
    # its default chain would also cut at top-k 40 and min-p 0.05: both off, so temperature and top-p alone
    assert (sampled["temperature"], sampled["top_p"], sampled["seed"]) == (0.7, 0.9, 1234)
    assert (sampled["top_k"], sampled["min_p"]) == (0, 0.0)
    assert sampled["stream"] and sampled["return_tokens"] and not sampled["cache_prompt"]
    assert LlamaCpp().request(PROMPT, 7, SamplingConfig(0.0, 0.9, 5))[1] == {**greedy}  # temperature 0: greedy


def test_vllm_requests_are_greedy_or_sampled_at_the_requests_seed():
    path, greedy = Vllm().request(PROMPT, 7)
    assert path == "/v1/completions" and greedy["max_tokens"] == 7 and greedy["temperature"] == 0.0
    assert "top_p" not in greedy
    _, sampled = Vllm().request(PROMPT, 7, SamplingConfig(0.7, 0.9, 1234))
    assert (sampled["temperature"], sampled["top_p"], sampled["seed"]) == (0.7, 0.9, 1234)
    assert sampled["stream"] and sampled["return_token_ids"] and sampled["prompt"] == PROMPT


def test_a_requests_seed_comes_from_the_runs_and_the_prompt():
    by_hand = int.from_bytes(hashlib.sha256(b"42:5,9,13,5,9").digest()[:4], "big") & 0x7FFFFFFF
    assert request_seed(42, PROMPT) == by_hand
    assert request_seed(43, PROMPT) != by_hand and request_seed(42, PROMPT[:-1]) != by_hand
    assert 0 <= by_hand < 2 ** 31


def test_a_replys_counters_as_a_rows():
    """12 tokens with 6 of 12 drafts accepted: the 11 after the first took 11 - 6 = 5 target steps (mean accepted
    length 11 / 5 = 2.2); without counters, plain decoding: one step per token after the first."""
    spec = row_stats(Reply(list(range(12)), 1.0, 0.1, [], 12, 6), counted=True)
    assert (spec.steps, spec.drafted, spec.accepted) == (5, 12, 6)
    plain = row_stats(Reply(list(range(12)), 1.0, 0.1, []), counted=False)
    assert (plain.steps, plain.drafted, plain.accepted) == (11, 0, 0)
    assert row_stats(Reply([], 1.0, None, [], 0, 0), counted=True).steps == 0
    # at γ = 4 the 11 tokens need at least ceil(11 / 5) = 3 rounds: of 10 drafts the engine counted as accepted (its
    # last round's past the budget included), at most 8 were returned
    held = row_stats(Reply(list(range(12)), 1.0, 0.1, [], 12, 10), counted=True, gamma=4)
    assert (held.steps, held.drafted, held.accepted) == (3, 12, 8)


# --- run --engine end to end on the stand-in server -----------------------------------------------------------


@pytest.fixture
def tiny_engine_run(tmp_path, monkeypatch):
    """(run arguments through the stand-in vLLM on a tiny model, the model folder, the prompts' file)."""
    folder, data = stand_in(tmp_path, monkeypatch)
    args = ["run", "--target", str(folder), "--dataset", str(data), "--limit", "2", "--max-new-tokens", str(NEW),
            "--strategy", "ngram", "--gamma", "4", "--device", "cpu", "--engine", "vllm", "--out", str(tmp_path / "r")]
    return args, folder, data


def _prompts(folder, data) -> dict:
    tok = AutoTokenizer.from_pretrained(folder)
    return {p.id: encode_prompt(p, tok) for p in load_prompts(str(data))}


def _results(tmp_path) -> pd.DataFrame:
    [path] = (tmp_path / "r").glob("*.parquet")
    return read_results([path])


def test_run_through_an_engine_writes_its_rows_as_any_run(capsys, tiny_engine_run, tmp_path):
    """Baseline and strategy rows per prompt, recorded as the engine's; tokens are generate's greedy ones; the
    strategy's counters are the stand-in's (3 rounds of 4 drafts, 2 accepted, per 12-token prompt), the
    baseline's plain decoding's; `report` reads the run; every server is stopped at the end."""
    args, folder, data = tiny_engine_run
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    df = _results(tmp_path)
    assert sorted(df.role) == ["baseline", "baseline", "strategy", "strategy"] and (df.engine == "vllm").all()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompts = _prompts(folder, data)
    for row in df.itertuples():
        assert list(row.output_ids) == hf_generate(model, prompts[row.prompt_id], NEW)
        assert row.prompt_tokens == len(prompts[row.prompt_id]) and row.wall_s > row.ttft_s > 0
    spec, base = df[df.role == "strategy"], df[df.role == "baseline"]
    assert (spec.new_tokens == 12).all() and (spec.drafted == 12).all() and (spec.accepted == 6).all()
    assert (spec.steps == 5).all() and spec.mean_accepted_len.tolist() == pytest.approx([2.2, 2.2])
    assert spec.acceptance_rate.tolist() == pytest.approx([0.5, 0.5]) and (spec.lossless == True).all()  # noqa: E712
    assert (base.steps == 11).all() and (base.drafted == 0).all() and base.mean_accepted_len.tolist() == [1.0, 1.0]
    assert '"decoding": "ngram"' in spec.params.iloc[0] and (spec.gamma == 4).all() and spec.runner.isna().all()
    assert "Traceback" not in err
    code, out, err = run_cli(capsys, "report", str(tmp_path / "r"))
    assert code == 0 and "ngram" in out and "through vllm's server" in " ".join(out.split()), err
    logs = sorted((tmp_path / "r" / "engine-logs").glob("*.log"))
    assert [p.name for p in logs] == ["vllm-0-autoregressive.log", "vllm-1-ngram.log"]


def test_a_sampled_run_sends_each_request_its_own_seed(capsys, tiny_engine_run, tmp_path):
    """At temperature 0.8 / top-p 0.9 each request samples at the seed made, by hand, from the run's seed, the
    repeat and the prompt's batch (as `run` seeds its own loop) and the prompt's ids: the stand-in's tokens are
    transformers' sampled generate at that seed; the two repeats differ, the same run again gives the same."""
    args, folder, data = tiny_engine_run
    args = [a if a != "2" else "1" for a in args] + ["--temperature", "0.8", "--top-p", "0.9", "--seed", "3",
                                                     "--repeats", "2", "--no-baseline"]
    code, _, err = run_cli(capsys, *args)
    assert code == 0, err
    df = _results(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    pid = df.prompt_id.iloc[0]
    prompt = _prompts(folder, data)[pid]
    for repeat in (0, 1):
        base = 3 * 1_000_003 + repeat * 10_007 + 0  # run's seed, repeat, batch 0
        seed = int.from_bytes(hashlib.sha256(f"{base}:{','.join(map(str, prompt))}".encode()).digest()[:4],
                              "big") & 0x7FFFFFFF
        torch.manual_seed(seed)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=True,
                                  temperature=0.8, top_p=0.9, top_k=0)[0, len(prompt):].tolist()
        row = df[(df.repeat == repeat) & (df.prompt_id == pid)].iloc[0]
        assert list(row.output_ids) == want and row.temperature == 0.8
    outputs = [list(o) for o in df.sort_values("repeat").output_ids]
    assert outputs[0] != outputs[1] and outputs[0] != hf_generate(model, prompt, NEW)


@pytest.mark.parametrize("extra, said", [
    (["--batch-size", "2"], "one prompt at a time (batch size 1); --batch-size 2"),
    (["--strategy", "suffix"], "vllm runs no 'suffix'"),
    (["--set", "tree=2"], "token trees (--set tree=...)"),
    (["--concurrency", "2"], "serving under load"),
    (["--compare", "suffix"], "--compare runs in sdbench's own loop only"),
    (["--engine", "tgi"], "unknown engine 'tgi'"),
    (["--engine", "llama.cpp"], "make engine-llama.cpp"),
    (["--engine-url", "http://127.0.0.1:1"], "no server answers GET /health"),
    (["--engine", "sdbench", "--engine-port", "9000"], "go with --engine llama.cpp or --engine vllm"),
])
def test_what_an_engine_cannot_run_is_refused_in_one_line_before_anything_loads(capsys, tiny_engine_run, tmp_path,
                                                                                extra, said):
    args, _, _ = tiny_engine_run
    code, _, err = run_cli(capsys, *args, *extra)
    assert code != 0 and said in err and "Traceback" not in err, err
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").glob("*.parquet"))


def test_an_engine_missing_or_lacking_a_strategy_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SDBENCH_ENGINES", str(tmp_path / "none"))
    code, _, err = run_cli(capsys, "run", "--engine", "vllm", "--limit", "1")
    assert code != 0 and "engine 'vllm' is not installed" in err and "make engine-vllm" in err
    code, _, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--strategy", "eagle", "--head", str(tmp_path))
    assert code != 0 and "EAGLE-3" in err and "Traceback" not in err


@pytest.mark.parametrize("change, said", [
    (lambda f: f.joinpath("model.safetensors").rename(f / "model.bin"), "holds no *.safetensors (llama.cpp's converter"),
    (lambda f: f.joinpath("config.json").write_text(f.joinpath("config.json").read_text().replace(
        '"markov_head_type": "vanilla"', '"markov_head_type": "rnn"')), "a vanilla Markov head only (this one's is rnn)"),
])
def test_a_head_llamacpp_cannot_convert_is_refused_in_one_line(capsys, tmp_path, monkeypatch, change, said):
    """Checked from the folder alone, before any model loads or engine is looked for."""
    from tests.heads import dflash_dir, small_vocab_target

    monkeypatch.setenv("SDBENCH_ENGINES", str(tmp_path / "none"))
    folder = dflash_dir(tmp_path / "h", small_vocab_target("qwen3"), dspark={"type": "vanilla"})
    change(folder)
    code, _, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--strategy", "dspark", "--head", str(folder),
                           "--out", str(tmp_path / "o"))
    assert code != 0 and said in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_an_engine_dying_mid_run_keeps_the_finished_prompts_and_says_so(capsys, tiny_engine_run, tmp_path,
                                                                        monkeypatch):
    """Each server answers its warm-up and the first prompt, then exits on the second: one line naming the server,
    the finished prompt's rows readable, the run marked partial; --resume then finishes it."""
    args, _, _ = tiny_engine_run
    monkeypatch.setenv("FAKE_ENGINE_MODE", "die-after:2")
    code, out, err = run_cli(capsys, *args)
    assert code == 1 and "Traceback" not in err
    assert "vllm plain decoding (float32): the server exited mid-run" in err and "finished prompts are saved" in err
    df = _results(tmp_path)
    assert sorted(df.role) == ["baseline", "strategy"] and df.prompt_id.nunique() == 1
    [path] = (tmp_path / "r").glob("*.parquet")
    assert "the engine failed" in unfinished_path(path).read_text()
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    code, out, err = run_cli(capsys, "run", "--resume", path.stem, "--out", str(tmp_path / "r"))
    assert code == 0, err
    df = _results(tmp_path)
    assert len(df) == 4 and df.prompt_id.nunique() == 2 and (df.engine == "vllm").all()


# --- the real engine, where installed ------------------------------------------------------------------------------


def test_run_through_the_real_llamacpp(capsys, tmp_path, llamacpp):
    """The embedded SmolLM2 through llama-server: plain decoding and ngram-simple, one MT-Bench question (both its
    turns, the second carrying the baseline's answer), a few tokens, its own draft counters on the strategy's
    rows."""
    code, out, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--strategy", "ngram", "--limit", "1",
                             "--max-new-tokens", "16", "--out", str(tmp_path / "r"))
    assert code == 0, err
    df = _results(tmp_path)
    assert sorted(zip(df.role, df.turn)) == [("baseline", 1), ("baseline", 2), ("strategy", 1), ("strategy", 2)]
    assert (df.engine == "llama.cpp").all() and df.new_tokens.between(1, 16).all()
    for spec in df[df.role == "strategy"].itertuples():
        assert spec.drafted >= spec.accepted >= 0 and spec.steps == spec.new_tokens - 1 - spec.accepted
