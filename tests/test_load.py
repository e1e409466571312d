"""Serving under load: requests joining a running batch through the one decode loop, and `run --request-rate /
--concurrency` through the CLI on a tiny model folder.

References: each request decoded alone (sdbench's plain `generate`, and transformers' `generate`), a plain
batch-1 run, the Poisson arrivals recomputed by hand from numpy, and the latency identities recomputed by hand
from the recorded commit times.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate, serve
from sdbench.engine.scheduler import Request, Scheduler, arrival_times
from sdbench.engine.serving import parse_slo, serving_summary
from sdbench.reporting.results import read_results
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.ngram import NGram
from tests.conftest import VOCAB, run_cli
from tests.references import hf_generate, tiny_model_dir
from tests.test_cli import one_line_error

GREEDY = SamplingConfig()
BUDGETS = [5, 14, 7, 9, 3, 6]


def _requests(prompts, arrivals=None):
    arrivals = arrivals or [0.0] * len(prompts)
    return [Request(i, p, a, m) for i, (p, a, m) in enumerate(zip(prompts, arrivals, BUDGETS))]


@pytest.fixture(scope="module")
def joining_prompts():
    g = torch.Generator().manual_seed(11)
    base = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (6, 11, 3, 8, 5, 9)]
    return [p + p[:4] for p in base]  # a repeated stretch gives prompt lookup something to find


def _joined_mid_run(requests) -> bool:
    """Some request took its slot while another had committed tokens and was not finished."""
    return any(o.token_s[0] < r.scheduled_s < o.token_s[-1] for r in requests for o in requests if o is not r)


@pytest.mark.parametrize("make", [Autoregressive, lambda t, d: NGram(3), lambda t, d: DraftModel(t, 3),
                                  lambda t, d: DraftModel(d, 2)], ids=["autoregressive", "ngram", "self-draft", "draft"])
def test_requests_joining_a_running_batch_decode_as_each_alone(target, small_draft, joining_prompts, make):
    proposer = make(target, small_draft) if make is not Autoregressive else Autoregressive()
    alone = [generate(target, Autoregressive(), [p], max_new_tokens=m, sampling=GREEDY).output_ids[0]
             for p, m in zip(joining_prompts, BUDGETS)]
    eos = alone[1][4]  # request 1 leaves at an EOS (its fifth token), before its budget
    alone = [generate(target, Autoregressive(), [p], max_new_tokens=m, sampling=GREEDY, eos_ids=[eos]).output_ids[0]
             for p, m in zip(joining_prompts, BUDGETS)]
    assert len(alone[1]) < BUDGETS[1]
    done = serve(target, proposer, Scheduler(_requests(joining_prompts), 2), sampling=GREEDY, eos_ids=[eos])
    assert [r.output_ids for r in done.requests] == alone
    assert _joined_mid_run(done.requests)
    assert all(sum(r.chunk_tokens) == len(r.output_ids) for r in done.requests)
    if isinstance(proposer, DraftModel) and proposer.runner is target:  # the target drafting for itself: its
        # cache row holds the joining prompt's keys alone, so every draft is the target's own next token
        assert all(r.stats.accepted == r.stats.drafted > 0 for r in done.requests if len(r.output_ids) > 2)


def test_requests_join_on_the_generic_runner(target, joining_prompts):
    from sdbench.models.forward.generic import GenericRunner

    generic = GenericRunner(target.model, "generic")
    done = serve(generic, NGram(3), Scheduler(_requests(joining_prompts), 2), sampling=GREEDY)
    assert _joined_mid_run(done.requests)
    assert [r.output_ids for r in done.requests] == [
        generate(target, Autoregressive(), [p], max_new_tokens=m, sampling=GREEDY).output_ids[0]
        for p, m in zip(joining_prompts, BUDGETS)]


def test_a_joined_request_matches_transformers_generate(target, joining_prompts):
    done = serve(target, DraftModel(target, 3), Scheduler(_requests(joining_prompts), 2), sampling=GREEDY)
    assert _joined_mid_run(done.requests)
    for r in done.requests[2:4]:  # requests that took a slot another request had used
        assert r.output_ids == hf_generate(target.model, r.prompt, r.max_new_tokens)


class FakeClock:
    """Time that passes only by sleeping: the scheduler's idle waits, measured exactly."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def test_with_nothing_running_the_scheduler_waits_for_the_next_arrival(target, joining_prompts):
    clock = FakeClock()
    reqs = _requests(joining_prompts[:3], [0.0, 4.0, 4.5])
    done = serve(target, NGram(3), Scheduler(reqs, 2, clock=clock, sleep=clock.sleep), sampling=GREEDY)
    # decoding takes no time on this clock: each request finishes before the next arrives, which is waited for
    assert [r.scheduled_s for r in reqs] == [0.0, 4.0, 4.5]
    assert [r.token_s[-1] for r in reqs] == [0.0, 4.0, 4.5]
    assert done.idle_s == pytest.approx(4.5) and done.duration_s == pytest.approx(4.5)


def test_poisson_arrivals_by_hand():
    gaps = np.random.default_rng([3, 1]).exponential(1 / 2.5, size=4)
    assert arrival_times(5, 2.5, [3, 1]) == [0.0, *np.cumsum(gaps).tolist()]
    assert arrival_times(3, math.inf, [3, 1]) == [0.0] * 3


def test_slo_parsing_and_goodput():
    assert parse_slo("ttft:500ms,tpot:0.05s,e2el:900") == {"ttft": 500.0, "tpot": 50.0, "e2el": 900.0}
    rows = [{"ttft_ms": 10.0, "tpot_ms": 2.0, "itl_ms": [2.0], "e2el_ms": 12.0, "new_tokens": 2,
             "prompt_tokens": 4, "slo_met": ok} for ok in (True, False, True)]
    summary = serving_summary(rows, 2.0)
    assert summary["request_goodput"] == 1.0 and summary["request_throughput"] == 1.5
    assert summary["output_throughput"] == 3.0 and summary["total_token_throughput"] == 9.0


# ---- through the CLI --------------------------------------------------------------------------------------------
RECORDS = [{"question_id": i, "category": "c", "turns": [" ".join(f"w{(i * 7 + j * 3) % 40}" for j in range(n)) * 2]}
           for i, n in enumerate((3, 5, 4, 6, 2))]
NEW = 10


@pytest.fixture(scope="module")
def cli_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    folder = tiny_model_dir(root / "tiny")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return ["run", "--target", str(folder), "--strategy", "ngram", "--gamma", "3", "--dataset", str(data), "--limit",
            "5", "--max-new-tokens", str(NEW), "--device", "cpu", "--no-probe"], root


def _run(capsys, args, out, *extra):
    code, stdout, err = run_cli(capsys, *args, "--out", str(out), *extra)
    assert code == 0, err
    return read_results([out]), stdout


def _ids(df) -> dict:
    return {(r.role, r.prompt_id): list(r.output_ids) for r in df.itertuples()}


def test_closed_loop_at_concurrency_one_equals_a_plain_batch_one_run(capsys, cli_setup, monkeypatch, tmp_path):
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    args, _ = cli_setup
    plain, _ = _run(capsys, args, tmp_path / "plain")
    loaded, stdout = _run(capsys, args, tmp_path / "loaded", "--concurrency", "1")
    assert "under load: throughput" in stdout and "under load: latencies" in stdout
    assert _ids(loaded) == _ids(plain) and len(plain) == 10
    assert (loaded["concurrency"] == 1).all() and np.isinf(loaded["request_rate"]).all()
    assert loaded.loc[loaded["role"] == "strategy", "lossless"].all()
    assert loaded["accepted"].sum() > 0  # prompt lookup did draft and get accepted: not plain decoding twice


def test_latencies_from_the_recorded_times_and_the_same_arrivals_for_both_sides(capsys, cli_setup, monkeypatch,
                                                                                tmp_path):
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    args, _ = cli_setup
    df, _ = _run(capsys, args, tmp_path / "a", "--request-rate", "200", "--concurrency", "2", "--seed", "4",
                 "--slo", "ttft:1000ms,tpot:1ms")
    gaps = np.random.default_rng([4, 0]).exponential(1 / 200, size=4)
    by_hand = [0.0, *np.cumsum(gaps)]
    for role, side in df.groupby("role"):
        assert sorted(side["arrival_s"]) == pytest.approx(sorted(by_hand), abs=0)  # the same arrivals, both roles
    for r in df.itertuples():
        t, n = np.asarray(r.token_s), int(r.new_tokens)
        assert n == len(r.output_ids) == sum(r.chunk_tokens) and len(t) == len(r.chunk_tokens)
        assert r.arrival_s <= r.scheduled_s <= t[0] and (np.diff(t) >= 0).all()
        assert r.ttft_ms == pytest.approx((t[0] - r.arrival_s) * 1e3)
        assert r.e2el_ms == pytest.approx((t[-1] - r.arrival_s) * 1e3)
        assert list(r.itl_ms) == pytest.approx(list(np.diff(t) * 1e3))
        assert r.e2el_ms == pytest.approx(r.ttft_ms + sum(r.itl_ms))
        assert r.tpot_ms == pytest.approx((r.e2el_ms - r.ttft_ms) / (n - 1))
        assert r.queue_ms == pytest.approx((r.scheduled_s - r.arrival_s) * 1e3)
        assert r.slo_met == (r.ttft_ms <= 1000 and r.tpot_ms <= 1)
        assert t[-1] <= r.duration_s
    strategy = df[df["role"] == "strategy"]
    assert strategy["lossless"].all() and (strategy["slo"] == "ttft:1000ms,tpot:1ms").all()
    again, _ = _run(capsys, args, tmp_path / "b", "--request-rate", "200", "--concurrency", "2", "--seed", "4")
    other, _ = _run(capsys, args, tmp_path / "c", "--request-rate", "200", "--concurrency", "2", "--seed", "5")

    def arrivals(d):
        return d.sort_values(["role", "prompt_id"])["arrival_s"].tolist()

    assert arrivals(again) == arrivals(df) != arrivals(other)


def test_a_request_rate_alone_admits_every_arrival(capsys, cli_setup, monkeypatch, tmp_path):
    """As `vllm bench serve` without --max-concurrency: no arrival waits for a slot (the cap is every request)."""
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    args, _ = cli_setup
    df, stdout = _run(capsys, args, tmp_path / "a", "--request-rate", "1000", "--max-new-tokens", "40")
    assert (df["concurrency"] == len(RECORDS)).all() and (df["request_rate"] == 1000).all()
    assert f"1000 req/s · ≤{len(RECORDS)} in flight" in stdout
    for _, side in df.groupby("role"):  # some request joined while another was running: none queued behind one
        spans = sorted(zip(side["scheduled_s"], side["scheduled_s"] + side["e2el_ms"] / 1e3 - side["queue_ms"] / 1e3))
        assert any(later < end for (_, end), (later, _) in zip(spans, spans[1:]))


@pytest.mark.parametrize("extra, expect", [
    (["--request-rate", "-1"], "--request-rate -1: expected distinct rates above 0"),
    (["--request-rate", "fast"], "--request-rate fast"),
    (["--concurrency", "0"], "--concurrency 0: every value must be at least 1"),
    (["--concurrency", "2", "--batch-size", "4"], "--batch-size sets static batches; under load --concurrency caps"),
    (["--request-rate", "2", "--batch-size", "4"], "--batch-size sets static batches; under load --concurrency caps"),
    (["--concurrency", "2", "--strategy", "magicdec"], "strategy 'magicdec' cannot serve requests joining"),
    (["--concurrency", "2", "--strategy", "adaptive"], "strategy 'adaptive' cannot serve requests joining"),
    (["--concurrency", "2", "--strategy", "polybasic", "--draft", "x", "--draft", "ngram"], "strategy 'polybasic' cannot"),
    (["--concurrency", "2", "--strategy", "dsi", "--draft", "x"], "runs its own decode loop"),
    (["--concurrency", "2", "--strategy", "draft", "--draft", "x", "--set", "draft_kv=snapkv"], "sparse draft cache"),
    (["--concurrency", "2", "--slo", "ttft:fast"], "--slo ttft:fast: expected"),
    (["--concurrency", "2", "--slo", "latency:5ms"], "--slo latency:5ms: expected"),
    (["--slo", "ttft:5ms"], "--slo applies to runs under load"),
    (["--concurrency", "2", "--turns", "2"], "--turns"),
])
def test_bad_load_input_is_one_line(capsys, tmp_path, extra, expect):
    code, _, err = run_cli(capsys, "run", "--out", str(tmp_path), *extra)
    assert expect in one_line_error(code, err)


# ---- latencies on a clock that only the target's forwards move ------------------------------------------------
PREFILL_S, STEP_S = 0.010, 0.004


class Timed:
    """The target runner, with the fake clock moved by each prefill (PREFILL_S) and each forward (STEP_S):
    every latency is then a sum of these, computable by hand."""

    def __init__(self, runner, clock: FakeClock):
        self.runner, self.clock = runner, clock

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def prefill(self, *args, **kwargs):
        self.clock.sleep(PREFILL_S)
        return self.runner.prefill(*args, **kwargs)

    def run(self, *args, **kwargs):
        self.clock.sleep(STEP_S)
        return self.runner.run(*args, **kwargs)


def test_latencies_and_their_percentiles_by_hand_on_an_injected_clock(target, joining_prompts):
    """Two slots, four requests (arrival ms, budget): r0 (0, 3), r1 (0, 2), r2 (10, 3), r3 (100, 2), plain
    decoding; a prefill takes 10 ms and a round 4 ms. By hand: r0 and r1 are prefilled at 0-10 and 10-20; rounds
    end at 24 (r1 done), r2 is prefilled 24-34, rounds end at 38 (r0 done) and 42 (r2 done); nothing runs until
    r3 arrives at 100, prefilled 100-110, its round ends at 114. Each request's tokens, in ms:
    r0 10, 24, 38; r1 20, 24; r2 34, 38, 42; r3 110, 114."""
    from rich.console import Console

    from sdbench.engine.serving import served_row_metrics
    from sdbench.reporting.load import latency_table, summarize_load

    clock = FakeClock()
    reqs = [Request(i, p, a, m) for i, (p, a, m) in enumerate(zip(joining_prompts, (0.0, 0.0, 0.010, 0.100),
                                                                   (3, 2, 3, 2)))]
    done = serve(Timed(target, clock), Autoregressive(), Scheduler(reqs, 2, clock=clock, sleep=clock.sleep),
                 sampling=GREEDY)
    assert done.duration_s == pytest.approx(0.114) and done.idle_s == pytest.approx(0.058)
    ms = [[t * 1e3 for t in r.token_s] for r in reqs]
    assert ms == [pytest.approx(x) for x in ([10, 24, 38], [20, 24], [34, 38, 42], [110, 114])]
    rows = [dataclasses.asdict(served_row_metrics(r, done.duration_s, {}, 0.0).served) for r in reqs]
    by_hand = {"ttft_ms": [10, 20, 24, 10], "e2el_ms": [38, 24, 32, 14], "tpot_ms": [14, 4, 4, 4],
               "queue_ms": [0, 10, 14, 0], "prefill_ms": [10, 10, 10, 10]}
    for name, values in by_hand.items():
        assert [r[name] for r in rows] == pytest.approx(values), name
    assert [r["itl_ms"] for r in rows] == [pytest.approx(x) for x in ([14, 14], [4], [4, 4], [4])]

    # the percentiles, interpolated by hand: rank q/100 * (n - 1) into the sorted values
    for r, req in zip(rows, reqs):
        r.update(new_tokens=len(req.output_ids), prompt_tokens=len(req.prompt), slo_met=None, run_id="x",
                 request_rate=math.inf, concurrency=2, repeat=0, lossless=True, strategy="ngram")
    base = [{**r, "strategy": "baseline", "duration_s": 2 * r["duration_s"]} for r in rows]
    import pandas as pd

    summary = summarize_load(pd.DataFrame(rows + base)).set_index("strategy").loc["ngram"]
    expected = {"ttft_ms": (15.0, 20 + 0.7 * 4, 20 + 0.97 * 4),  # sorted 10, 10, 20, 24
                "tpot_ms": (4.0, 4 + 0.7 * 10, 4 + 0.97 * 10),  # sorted 4, 4, 4, 14
                "itl_ms": (4.0, 14.0, 14.0),  # every gap: sorted 4, 4, 4, 4, 14, 14 (ranks 2.5, 4.5, 4.95)
                "e2el_ms": (28.0, 32 + 0.7 * 6, 32 + 0.97 * 6)}  # sorted 14, 24, 32, 38
    for name, (p50, p90, p99) in expected.items():
        assert (summary[f"p50_{name}"], summary[f"p90_{name}"], summary[f"p99_{name}"]) == pytest.approx(
            (p50, p90, p99)), name
    assert summary["mean_itl_ms"] == pytest.approx(44 / 6) and summary["mean_tpot_ms"] == pytest.approx(6.5)
    assert summary["completed"] == 4 and summary["output_throughput"] == pytest.approx(10 / 0.114)
    assert summary["request_throughput"] == pytest.approx(4 / 0.114) and summary["vs_baseline"] == pytest.approx(2.0)
    console = Console(width=300, record=True)
    console.print(latency_table(summarize_load(pd.DataFrame(rows))))
    text = console.export_text()
    assert "15.0/22.8/23.9" in text and "4.0/11.0/13.7" in text and "28.0/36.2/37.8" in text
