"""The engines users deploy, driven through their servers: adapters against recorded replies of the real servers,
a server's life (ready, never ready, taken port, death mid-run) on a stand-in server (tests/fake_engine.py: the
OpenAI API over transformers' own greedy generate), bench --engine end to end on it, and the real engines where they
are installed (`make engines`)."""

from __future__ import annotations

import json
import socket
import stat
import sys
from pathlib import Path

import pandas as pd
import pytest

from sdbench.servers.client import Streamed
from sdbench.servers.engines import EngineRole, EngineTotals, Reply, token_gaps
from sdbench.servers.llamacpp import LlamaCpp
from sdbench.servers.process import EngineFailed, Server
from sdbench.servers.systems import EngineSystem
from sdbench.servers.vllm import Vllm, parse_metrics
from tests.conftest import run_cli
from tests.references import tiny_model_dir

FAKE = Path(__file__).with_name("fake_engine.py")
RECORDED = Path(__file__).parent / "data" / "engines"


def fake_vllm(root: Path) -> Path:
    """An engines folder whose vLLM environment's python runs the stand-in server, installed."""
    exe = root / "vllm" / "bin" / "python"
    exe.parent.mkdir(parents=True)
    exe.write_text(f"#!/bin/sh\nshift 2\nexec {sys.executable} {FAKE} \"$@\"\n")  # drops `-m MODULE`
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    (root / "vllm" / ".installed").touch()
    return exe


# --- adapters against recorded replies of the real servers ------------------------------------------------------


def _recorded(name: str) -> Streamed:
    data = json.loads((RECORDED / name).read_text())
    return Streamed(data["events"], data["times"], data["seconds"])


def test_llamacpp_reply_counts_token_ids_and_reads_its_draft_counters():
    """A real llama-server's stream (draft-simple, γ=4, SmolLM2 drafting for itself): token ids in order from the
    events, the draft counters from the last event's timings, TTFT at the first event carrying a token."""
    data = json.loads((RECORDED / "llamacpp-draft.json").read_text())
    reply = LlamaCpp().reply(_recorded("llamacpp-draft.json"), "http://x", None)
    assert reply.tokens == data["expected_tokens"]
    timings = data["events"][-1]["timings"]
    assert (reply.drafted, reply.accepted) == (timings["draft_n"], timings["draft_n_accepted"])
    first = next(t for e, t in zip(data["events"], data["times"]) if e.get("tokens"))
    assert reply.ttft == first and reply.seconds == data["seconds"]


def test_llamacpp_plain_reply_has_no_draft_counters():
    reply = LlamaCpp().reply(_recorded("llamacpp-plain.json"), "http://x", None)
    data = json.loads((RECORDED / "llamacpp-plain.json").read_text())
    assert reply.tokens == data["expected_tokens"] and reply.drafted is None


def test_vllm_metrics_parse_the_spec_decode_counters_of_a_real_server():
    text = (RECORDED / "vllm-draft-metrics.txt").read_text()
    found = parse_metrics(text)
    # the figures as the recorded text states them, read by hand
    expected = json.loads((RECORDED / "vllm-draft-metrics.expected.json").read_text())
    assert found["draft_tokens"] == expected["draft_tokens"]
    assert found["accepted_tokens"] == expected["accepted_tokens"]
    assert found["per_position"] == {int(k): v for k, v in expected["per_position"].items()}
    assert parse_metrics("# nothing about drafts\nvllm:num_requests_running 0.0\n")["draft_tokens"] == 0


def test_vllm_reply_counts_token_ids_of_a_real_stream():
    data = json.loads((RECORDED / "vllm-plain.json").read_text())
    reply = Vllm().reply(_recorded("vllm-plain.json"), "http://x", None)
    assert reply.tokens == data["expected_tokens"] and reply.drafted is None


def test_token_gaps_and_totals_by_hand():
    ttft, gaps = token_gaps([0.5, 0.7, 0.75, 1.0], [1, 0, 2, 1])
    assert ttft == 0.5 and gaps == pytest.approx([0.25, 0.25])
    totals = EngineTotals()
    totals.add(Reply([1, 2, 3], 1.0, 0.2, [0.4, 0.4], 8, 2))
    totals.add(Reply([4, 5], 0.9, 0.3, [0.6], 4, 4))
    assert (totals.drafted, totals.accepted) == (12, 6) and totals.acceptance == pytest.approx(0.5)
    assert totals.itl == pytest.approx(0.4)  # the median of the gaps 0.4, 0.4 and 0.6


def test_engine_rounds_by_hand_with_drafts_accepted_past_the_budget():
    """22 tokens after the first at γ = 4: at least ceil(22 / 5) = 5 rounds, so of the 20 accepted drafts the engine
    counted (its last round's past the budget included) at most 17 were returned; 10 tokens with 2 accepted: 8
    rounds as counted."""
    totals = EngineTotals(gamma=4)
    totals.add(Reply(list(range(23)), 3.0, 0.8, [], 20, 20))
    totals.add(Reply(list(range(11)), 1.5, 0.5, [], 8, 2))
    r = totals.rounds()
    assert (r.tokens, r.rounds, r.accepted, r.drafted) == (32, 5 + 8, 17 + 2, 28)
    assert r.seconds == pytest.approx(2.2 + 1.0) and r.tokens_per_round == pytest.approx(1 + 19 / 13)


def test_llamacpp_commands_map_each_strategy_to_its_own_decoder(monkeypatch, tmp_path):
    eng = LlamaCpp()
    monkeypatch.setattr(LlamaCpp, "gguf", lambda self, model, dtype: Path(f"/m/{model}-{dtype}.gguf"))
    plain = eng.command("t", EngineRole("autoregressive"), "float32", 512, 2)
    assert plain[plain.index("-m") + 1] == "/m/t-float32.gguf" and "--spec-type" not in plain
    assert plain[plain.index("-c") + 1] == "512" and plain[plain.index("-t") + 1] == "2"
    ngram = eng.command("t", EngineRole("ngram", 5), "float32", 512, 2)
    assert ngram[ngram.index("--spec-type") + 1] == "ngram-simple"
    assert ngram[ngram.index("--spec-ngram-simple-size-m") + 1] == "5"
    draft = eng.command("t", EngineRole("draft", 3, "d"), "float32", 512, 2)
    assert draft[draft.index("--spec-type") + 1] == "draft-simple" and draft[draft.index("-md") + 1] == "/m/d-float32.gguf"
    assert draft[draft.index("--spec-draft-n-max") + 1] == "3"
    assert "EAGLE-3" in eng.refuse(EngineRole("eagle", 3, "h"))


def test_llamacpp_retypes_a_gguf_to_the_runs_block_type_or_the_models_own(monkeypatch, tmp_path):
    """--dtype q8_0 re-types the file to Q8_0 and a draft named MODEL@q4_0 to Q4_0, each with --pure (every tensor
    in that type, as sdbench's block copy has them); each file made once."""
    monkeypatch.setenv("SDBENCH_ENGINES", str(tmp_path / "engines"))
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    tool = tmp_path / "engines" / "llama.cpp" / "build" / "bin" / "llama-quantize"
    tool.parent.mkdir(parents=True)
    log = tmp_path / "calls"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {log}\ncp "$3" "$4"\n')
    tool.chmod(0o755)
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    eng = LlamaCpp()
    assert eng.gguf(str(source), "q8_0").name.endswith("-Q8_0.gguf")
    assert eng.gguf(f"{source}@q4_0", "q8_0").name.endswith("-Q4_0.gguf")
    assert eng.gguf(str(source), "q8_0").is_file()
    calls = log.read_text().splitlines()
    assert calls == [f"--allow-requantize --pure {source} {p} {t}" for p, t in
                     ((eng.gguf(str(source), "q8_0").with_suffix(".part"), "Q8_0"),
                      (eng.gguf(f"{source}@q4_0", "float32").with_suffix(".part"), "Q4_0"))]


def test_vllm_commands_carry_the_speculative_config(tmp_path):
    eng = Vllm()
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    plain = eng.command(str(folder), EngineRole("autoregressive"), "float32", 512, 2)
    assert plain[plain.index("--model") + 1] == str(folder.resolve()) and "--speculative-config" not in plain
    ngram = eng.command(str(folder), EngineRole("ngram", 4), "float32", 512, 2)
    spec = json.loads(ngram[ngram.index("--speculative-config") + 1])
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 4
    draft = eng.command(str(folder), EngineRole("draft", 4, str(folder)), "float32", 512, 2)
    assert json.loads(draft[draft.index("--speculative-config") + 1])["method"] == "draft_model"


# --- a server's life ------------------------------------------------------------------------------------------


def _server(tmp_path, monkeypatch, mode: str, model: Path, **kw) -> Server:
    monkeypatch.setenv("FAKE_ENGINE_MODE", mode)
    return Server("fake", [sys.executable, str(FAKE), "--model", str(model), "--port", "{port}"],
                  tmp_path / "fake.log", **kw)


def test_a_server_that_never_becomes_ready_is_stopped_after_a_bounded_wait(tmp_path, monkeypatch, tiny_model_folder):
    server = _server(tmp_path, monkeypatch, "never-ready", tiny_model_folder, ready_timeout=4)
    with pytest.raises(EngineFailed, match="not ready after 4 s"):
        server.start()
    assert server.proc is None  # stopped


def test_a_server_that_exits_on_a_taken_port_says_so(tmp_path, monkeypatch, tiny_model_folder):
    with pytest.raises(EngineFailed, match="is taken"):
        _server(tmp_path, monkeypatch, "exit", tiny_model_folder).start()


def test_a_taken_port_is_refused_before_starting(tmp_path, monkeypatch, tiny_model_folder):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(EngineFailed, match=f"port {port} is taken"):
            _server(tmp_path, monkeypatch, "ok", tiny_model_folder, port=port).start()


def test_a_started_server_is_stopped_on_an_interrupt(tmp_path, monkeypatch, tiny_model_folder):
    server = _server(tmp_path, monkeypatch, "ok", tiny_model_folder)
    with pytest.raises(KeyboardInterrupt):
        with server.start():
            proc = server.proc
            raise KeyboardInterrupt
    assert proc.poll() is not None


@pytest.fixture
def tiny_model_folder(tmp_path):
    return tiny_model_dir(tmp_path / "tiny")


# --- bench --engine -------------------------------------------------------------------------------------------


def test_bench_refuses_an_engine_in_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SDBENCH_ENGINES", str(tmp_path / "none"))
    for args, said in ((["--engine", "tgi"], "unknown engine 'tgi'"),
                       (["--engine", "llama.cpp"], "make engine-llama.cpp"),
                       (["--engine", "vllm"], "make engine-vllm"),
                       (["--engine-url", "http://127.0.0.1:1"], "--engine-url and --engine-port go with"),
                       (["--engine", "vllm", "--engine-url", "http://127.0.0.1:1"], "no server answers GET /health"),
                       (["--engine", "llama.cpp,vllm", "--engine-url", "http://127.0.0.1:1"], "give one --engine"),
                       (["--engine", "vllm", "--dtype", "q8_0"], "--dtype q8_0: vllm runs --dtype float32, bfloat16, "
                                                                 "float16, q4_0 here")):
        code, _, err = run_cli(capsys, "bench", *args)
        assert code != 0 and said in err and "Traceback" not in err, (args, err)


def test_list_engines_says_what_is_installed_and_how(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SDBENCH_ENGINES", str(tmp_path / "engines"))
    fake_vllm(tmp_path / "engines")
    code, out, _ = run_cli(capsys, "list", "engines")
    assert code == 0 and "make engine-llama.cpp" in out and "make engine-vllm" in out
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 3}
    assert "yes" in rows["vllm"] and "no" in rows["llama.cpp"]


def stand_in(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(a tiny model's folder, a file of two prompts), with the stand-in vLLM installed as the only engine and a
    cache of the test's own."""
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SDBENCH_ENGINES", str(tmp_path / "engines"))
    fake_vllm(tmp_path / "engines")
    folder = tiny_model_dir(tmp_path / "tiny")
    data = tmp_path / "prompts.csv"
    data.write_text("prompt\n" + "".join(f"\"{' '.join(f'w{(k * i) % 90}' for i in range(9)) * 2}\"\n"
                                         for k in (3, 7)))
    return folder, data


@pytest.fixture
def tiny_engine_bench(tmp_path, monkeypatch):
    folder, data = stand_in(tmp_path, monkeypatch)
    return ["bench", "--target", str(folder), "--dataset", str(data), "--limit", "2", "--max-new-tokens", "12",
            "--repeats", "1", "--engine", "vllm", "--out", str(tmp_path / "bench")]


def test_bench_measures_an_engine_beside_the_others(capsys, tiny_engine_bench, tmp_path):
    """Three engine rows (plain, n-gram, draft model) on the same prompts, counted from the token ids the server
    streams, compared with generate's tokens, with the engine's own counters on its speculative rows."""
    code, out, err = run_cli(capsys, *tiny_engine_bench)
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "bench" / "bench.parquet")
    engine = df[df.engine.notna()]
    assert list(engine.system) == ["vllm plain decoding (float32)", "vllm ngram (γ=4, float32)",
                                   "vllm draft_model (γ=4, float32)"]
    assert (engine.tokens == 24).all() and (engine.same_prompts == 2).all() and engine.failed.isna().all()
    # the stand-in counts 3 rounds of 4 drafts (2 accepted) per 12-token prompt
    spec = engine[engine.system != "vllm plain decoding (float32)"]
    assert (spec.engine_drafted == 24).all() and (spec.engine_accepted == 12).all()
    assert engine.engine_drafted.isna().sum() == 1
    assert "vllm ngram (γ=4, float32): the engine's own counters: 12 of 24 drafted tokens accepted (50%)" in out
    assert (engine.ttft_s > 0).all() and (df[df.engine.isna()].same_output).all()


FAST_PLAIN = "sdbench autoregressive (fast)"
SDBENCH_SPECULATIVE = {"sdbench ngram (γ=4) (fast)": "ngram", "sdbench draft (γ=4) (fast)": "draft"}
CARRY_COLUMNS = ["tokens_per_round", "drafts_per_round", "step_verify_cost", "step_draft_cost", "round_draft_cost",
                 "carried_speedup", "own_predicted_speedup", "decode_speedup", "round_overhead_cost", "round_host_cost",
                 "request_setup_cost"]


def check_sdbench_carry_by_hand(df: pd.DataFrame, verify: dict, widths: dict, gamma: int = 4) -> None:
    """sdbench's own carry-over rows from the run's measured ratios, by the formula docs/engines.md gives: its
    verification cost v(k) = T(k) / T(1), measured at every width k from 1 to γ + 1 (`verify`; the widest is the
    file's `verify_cost`), averaged over the widths its rounds verified (widths[system]: width -> rounds, whose
    mean less one is the row's g), c its own round's drafting per draft (at least the draft model's forward, `draft_cost`; a
    lookup's its lookup), drafting g c, and
    the round's overhead o = h + s R / N (h the host cost, s the setup cost per request, R / N the requests per
    round: 2 prompts over the tokens after each first, over L), predicted = L / (g c + v(g + 1) + o) with the row's
    own L and g (sdbench's acceptance is its own, carried or not); measured: the decode rates' ratio, the fast plain
    row's TPOT over the row's (tokens after the first over the time after it, both)."""
    plain = df.loc[FAST_PLAIN]
    for system, strategy in SDBENCH_SPECULATIVE.items():
        row = df.loc[system]
        big_l, g = row.tokens_per_round, row.drafts_per_round
        o = row.round_host_cost + row.request_setup_cost * 2 * big_l / (row.tokens - 2)
        assert row.round_overhead_cost == pytest.approx(o), system
        counts = widths[system]
        assert sum((k - 1) * n for k, n in counts.items()) / sum(counts.values()) == pytest.approx(g), system
        v = sum(verify[k] * n for k, n in counts.items()) / sum(counts.values())
        assert row.verify_cost == pytest.approx(verify[gamma + 1])
        c = row.step_draft_cost
        assert c > 0 if strategy == "ngram" else c > 0.8 * row.draft_cost, system
        assert row.step_verify_cost == pytest.approx(v), system
        assert row.round_draft_cost == pytest.approx(g * c), system
        assert row.carried_speedup == pytest.approx(big_l / (g * c + v + o)), system
        assert row.own_predicted_speedup == pytest.approx(big_l / (g * c + v + o)), system
        assert row.decode_speedup == pytest.approx(plain.tpot_s / row.tpot_s), system


def test_bench_carries_sdbench_acceptance_over_to_the_engine(capsys, tiny_engine_bench, tmp_path, monkeypatch):
    """The carry-over rows of the stand-in's speculative systems, by hand. Its plain server keeps a prefix cache and
    says a forward over k tokens takes (10 + k) / 11 of one; per 12-token prompt it counts 3 rounds of 4 drafts
    with 2 accepted. Over the 2 prompts' 11 tokens after the first: 12 accepted of 24 drafted in 22 - 12 = 10
    rounds, so L = 2.2 and g = 2.4, and v(3.4) = 13.4 / 11. The draft model is the target (c = 1, its widths the
    target's), and vLLM's first draft forward runs over the verification batch: drafting costs v(3.4) + 2.4 - 1.
    sdbench's own rows from its measured cost ratios (`check_sdbench_carry_by_hand`), whose check fails with v read
    at g instead of g + 1 or with the setup spread over the requests instead of the rounds."""
    import sdbench.commands.bench as bench
    from sdbench.analysis.carry import EngineCosts, interpolate
    from sdbench.reporting.carry import columns

    seen = {}
    real_carry = bench.carry_over
    monkeypatch.setattr(bench, "carry_over", lambda *a, **k: (seen.setdefault("args", a), real_carry(*a, **k))[1])
    code, out, err = run_cli(capsys, *tiny_engine_bench)
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "bench" / "bench.parquet").groupby("system", sort=False).first()
    v = 13.4 / 11
    ngram, draft = df.loc["vllm ngram (γ=4, float32)"], df.loc["vllm draft_model (γ=4, float32)"]
    plain = df.loc["vllm plain decoding (float32)"]
    for row, c, drafting in ((ngram, 0.0, 0.0), (draft, 1.0, v + 1.4)):
        assert (row.tokens_per_round, row.drafts_per_round) == (pytest.approx(2.2), pytest.approx(2.4))
        assert (row.step_verify_cost, row.step_draft_cost) == (pytest.approx(v), c)
        assert row.round_draft_cost == pytest.approx(drafting)
        assert row.own_predicted_speedup == pytest.approx(2.2 / (drafting + v))
        assert row.decode_speedup == pytest.approx(plain.tpot_s / row.tpot_s)  # its decode rate over the plain's
    # carried: sdbench's own L and g of the same strategy with the engine's costs
    for ours, row in (("sdbench ngram (γ=4) (fast)", ngram), ("sdbench draft (γ=4) (fast)", draft)):
        mine = df.loc[ours]
        g = mine.drafts_per_round
        v_g = (10 + g + 1) / 11  # at k = g + 1
        drafting = 0.0 if row is ngram else v_g + g - 1
        assert row.carried_speedup == pytest.approx(mine.tokens_per_round / (drafting + v_g))
    # the target drafting for itself has every draft accepted: per prompt rounds of 4 drafts + 1, 4 + 1, then one
    # draft for the last token (a round drafts no more than the budget has room for), so L = 11 / 3 and g = 9 / 3
    mine = df.loc["sdbench draft (γ=4) (fast)"]
    assert (mine.tokens_per_round, mine.drafts_per_round) == (pytest.approx(11 / 3), pytest.approx(3.0))
    widths = {m.system: m.rounds.widths for m in seen["args"][0] if m.rounds is not None}
    check_sdbench_carry_by_hand(df, seen["args"][5].verify, widths)
    assert pd.isna(plain.carried_speedup) and pd.isna(df.iloc[0].decode_speedup)
    assert "Does it carry over?" in out
    code, out, err = run_cli(capsys, "report", str(tmp_path / "bench" / "bench.parquet"))
    assert code == 0, err
    assert "Does it carry over?" in out and "vllm draft_model" in out and "Time to first token" in out

    # the same check on sdbench's rows made again from the same measurement with one ingredient wrong
    results, fast, _, prompts, gamma, costs = seen["args"][:6]

    def remade() -> pd.DataFrame:
        rows, _ = real_carry(results, fast, [], prompts, gamma, costs, None)
        wrong = df.copy()
        for row in rows:
            wrong.loc[row.system, CARRY_COLUMNS] = [columns(row)[col] for col in CARRY_COLUMNS]
        return wrong

    check_sdbench_carry_by_hand(remade(), costs.verify, widths)  # unchanged, it holds
    with monkeypatch.context() as m:
        m.setattr(EngineCosts, "verify_at", lambda self, width: interpolate(self.verify, width - 1.0))
        with pytest.raises(AssertionError):
            check_sdbench_carry_by_hand(remade(), costs.verify, widths)
    with monkeypatch.context() as m:  # the setup spread over the requests, not the rounds
        m.setattr(EngineCosts, "overhead", lambda self, rounds: self.host + self.setup)
        with pytest.raises(AssertionError):
            check_sdbench_carry_by_hand(remade(), costs.verify, widths)


SAME_DECODING = {  # each row's engine row of the same decoding
    "vllm plain decoding (float32)": ["transformers generate (dynamic cache)", "sdbench autoregressive (no fast path)",
                                      FAST_PLAIN, "sdbench autoregressive, generic runner (the library's forward)"],
    "vllm ngram (γ=4, float32)": ["transformers prompt lookup (γ=4)", "sdbench ngram (γ=4) (fast)"],
    "vllm draft_model (γ=4, float32)": ["transformers assisted (γ=4)", "sdbench draft (γ=4) (fast)"],
}


def test_bench_times_every_system_alike(capsys, tiny_engine_bench, tmp_path, monkeypatch):
    """Every row has a time to first token and per output token, taken by the same loop: by hand from the times it
    recorded of each call (start, first token, end; tokens from the ids), and the ratios over the engine's row of
    the same decoding by hand from those. Where each first token falls, against what is known to come before it:
    sdbench's and transformers' prefills are made DELAY slower, which each row's TTFT must hold; the stand-in
    engine computes its whole answer before it streams the first token, so its TTFT is most of each call."""
    import functools
    import statistics
    import time

    from transformers import LlamaForCausalLM

    import sdbench.commands.bench as bench
    from sdbench.engine.state import DecodeState

    delay = 0.05
    for_prompts, forward = DecodeState.for_prompts, LlamaForCausalLM.forward

    def slow_state(cls, *args, **kwargs):  # sdbench's decode loop, before its prefill
        time.sleep(delay)
        return for_prompts(*args, **kwargs)

    @functools.wraps(forward)
    def slow_forward(self, *args, **kwargs):  # the library's forward over an empty cache: a prefill
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None or cache.get_seq_length() == 0:
            time.sleep(delay)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DecodeState, "for_prompts", classmethod(slow_state))
    monkeypatch.setattr(LlamaForCausalLM, "forward", slow_forward)
    seen = {}
    real_measure = bench.measure_systems
    monkeypatch.setattr(bench, "measure_systems", lambda *a: seen.setdefault("results", real_measure(*a)))
    code, out, err = run_cli(capsys, *tiny_engine_bench)
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "bench" / "bench.parquet").set_index("system")
    results = {m.system: m for m in seen["results"]}
    assert set(results) == set(df.index) and len(df) == 11  # 8 of sdbench's and transformers', 3 of the engine's
    assert ((df.ttft_s > 0) & (df.tpot_s > 0)).all()  # finite, every row
    for system, m in results.items():
        assert [c.tokens for c in m.calls] == [12, 12]  # one repeat of two prompts, counted from the ids
        for c in m.calls:
            if m.engine is None:
                assert c.first - c.start >= delay, system
            else:
                assert c.first - c.start > 0.5 * (c.end - c.start), system
        ttft = statistics.median(c.first - c.start for c in m.calls)
        tpot = sum(c.end - c.first for c in m.calls) / sum(c.tokens - 1 for c in m.calls)
        assert (df.loc[system, "ttft_s"], df.loc[system, "tpot_s"]) == (pytest.approx(ttft), pytest.approx(tpot))
    for engine_row, systems in SAME_DECODING.items():
        theirs = df.loc[engine_row]
        for system in systems:
            row = df.loc[system]
            assert row.vs_vllm_end_to_end == pytest.approx(row.tokens_per_s / theirs.tokens_per_s), system
            assert row.vs_vllm_decode == pytest.approx(theirs.tpot_s / row.tpot_s), system
        assert pd.isna(theirs.vs_vllm_end_to_end) and pd.isna(theirs.vs_vllm_decode)
    assert "Time to first token and per output token" in out and "vs vllm" in out


def test_bench_waits_out_an_engines_busy_loop_untimed(capsys, tiny_engine_bench, monkeypatch):
    """After each of an engine's calls, the wait for its server to go quiet (vLLM's workers spin for a second after a
    reply) comes after the call's clock stopped and before the next system's started, and is that engine's."""
    import time

    from sdbench.commands import bench

    monkeypatch.setattr(Vllm, "busy_after_s", 0.3)
    waits = []
    monkeypatch.setattr("sdbench.servers.systems.sleep", lambda s: waits.append((time.perf_counter(), s)))
    seen = {}
    real_measure = bench.measure_systems
    monkeypatch.setattr(bench, "measure_systems", lambda *a: seen.setdefault("results", real_measure(*a)))
    code, _, err = run_cli(capsys, *tiny_engine_bench)
    assert code == 0, err
    calls = sorted((c.start, c.end, m.engine is not None) for m in seen["results"] for c in m.calls)
    assert waits and all(s == 0.3 for _, s in waits)
    for (_, end, engine), (start, _, _) in zip(calls, calls[1:]):
        if engine:  # one wait between this call's end and the next one's start
            assert sum(end <= t <= start for t, _ in waits) == 1
        else:
            assert not any(end <= t <= start for t, _ in waits)


def test_bench_keeps_every_other_row_when_an_engine_dies_mid_run(capsys, tiny_engine_bench, tmp_path, monkeypatch):
    # each server answers its warm-up and the first prompt, then exits during the second
    monkeypatch.setenv("FAKE_ENGINE_MODE", "die-after:2")
    code, out, err = run_cli(capsys, *tiny_engine_bench)
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "bench" / "bench.parquet")
    engine = df[df.engine.notna()]
    assert len(engine) == 3 and engine.failed.str.contains("exited mid-run").all()
    assert (df[df.engine.isna()].tokens == 24).all()
    assert "failed mid-measurement, left out" in out and "Traceback" not in err


# --- the real vLLM, where installed ------------------------------------------------------------------------------


def test_bench_through_the_real_vllm(capsys, tmp_path, vllm, monkeypatch):
    """The embedded SmolLM2 through vLLM's real servers: three rows, tokens counted, the speculative rows with the
    engine's own counters. llama.cpp's, which CI builds: tests/test_llamacpp_real.py. The servers run eager (what is
    checked is the counting, not vLLM's speed): its compilation at start-up costs a minute a server on 2 cores."""
    command = Vllm.command
    monkeypatch.setattr(Vllm, "command", lambda self, *a, **k: [*command(self, *a, **k), "--enforce-eager"])
    eng = Vllm()
    code, out, err = run_cli(capsys, "bench", "--limit", "1", "--max-new-tokens", "16", "--repeats", "1",
                             "--engine", eng.name, "--out", str(tmp_path / "b"))
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "b" / "bench.parquet")
    engine = df[df.engine == eng.name]
    assert len(engine) == 3 and engine.failed.isna().all() and (engine.tokens > 0).all()
    assert engine.engine_drafted.notna().sum() == 2
    # the engine's step costs measured through its plain server (whose context the probes' prefix must fit) and
    # both speculative rows carried over
    spec = engine[engine.engine_drafted.notna()]
    assert spec.carried_speedup.notna().all() and (spec.step_verify_cost > 0).all(), out


def test_the_real_vllms_memory_is_within_its_footprint(tmp_path, vllm):
    """The memory check's estimate (`servers/footprint.py`) against vLLM's real server of SmolLM2 after a request,
    all its processes: it holds the server (with the KV cache it was given for the run: the 2 GiB it had before
    would exceed it) and is at most a GiB above it."""
    from sdbench.servers.footprint import total
    from tests.references import session_memory

    eng, role = Vllm(), EngineRole("autoregressive")
    estimate = total([eng.footprint("smollm2-135m", role, "float32", 256)])
    argv = eng.command("smollm2-135m", role, "float32", 256, 2)
    with Server("vllm", argv, tmp_path / "server.log", eng.health, env=eng.server_env(2)).start() as server:
        EngineSystem(eng, role, "x", server.url, 16, server).ask(list(range(1000, 1060)), 16)
        held = session_memory(server.proc.pid)  # its processes' shared libraries split among them
    assert held <= 1.1 * estimate and estimate <= held + 2**30, (held / 2**30, estimate / 2**30)


def test_bench_measures_a_server_the_user_runs_as_it_runs(capsys, tiny_engine_bench, tmp_path, monkeypatch):
    """--engine-url: no server started, one row named by the URL, its counters read from its /metrics."""
    monkeypatch.setenv("FAKE_ENGINE_MODE", "ok")
    folder = tiny_engine_bench[2]
    with Server("user's", [sys.executable, str(FAKE), "--model", folder, "--port", "{port}", "--speculative-config",
                           '{"num_speculative_tokens": 3}'], tmp_path / "user.log").start() as server:
        code, out, err = run_cli(capsys, *tiny_engine_bench, "--engine-url", server.url)
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "bench" / "bench.parquet")
    engine = df[df.engine.notna()]
    assert list(engine.system) == [f"vllm at {server.url}"] and (engine.same_prompts == 2).all()
    assert (engine.engine_drafted == 18).all()  # 3 rounds of 3 drafts per 12-token prompt, by the stand-in's rule
    assert not list((tmp_path / "bench").glob("engine-logs/*.log"))


def test_sigterm_is_an_interrupt_that_stops_the_servers_started(capsys, tmp_path, monkeypatch, tiny_model_folder):
    """A `timeout` or a cancelled job sends SIGTERM: sdbench takes it as Ctrl-C, so the servers it started stop (their
    context's exit runs) and the command ends with "interrupted"; the handler before is back afterwards."""
    import os
    import signal
    import time

    from sdbench.commands import listing

    started = {}

    def show(what, console):
        with Server("stand-in", [sys.executable, str(FAKE), "--model", str(tiny_model_folder), "--port", "{port}"],
                    tmp_path / "s.log").start() as server:
            started["proc"] = server.proc
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # never reached: the signal interrupts the sleep

    monkeypatch.setattr(listing, "show", show)
    before = signal.getsignal(signal.SIGTERM)
    code, out, err = run_cli(capsys, "list", "engines")
    assert code == 130 and "interrupted" in err
    assert started["proc"].poll() is not None  # stopped
    assert signal.getsignal(signal.SIGTERM) is before
