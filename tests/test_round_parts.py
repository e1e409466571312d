"""Where a round's time goes: the decode loop's parts sum to the decode time and each lands where it is spent; a
draft that is its target starts from the target's prefill; the round overhead the carry-over predicts with, its
rest split into parts, and the roofline's read, each against a hand computation."""

from __future__ import annotations

import math
import time

import pandas as pd
import pytest
import torch

from sdbench.analysis.bandwidth import Bandwidth, with_decodings
from sdbench.analysis.carry import EngineCosts, predicted, rest_parts
from sdbench.analysis.costs import Parts, median_times
from sdbench.commands import bench_costs
from sdbench.config import SamplingConfig
from sdbench.drafting.model import ModelDrafter
from sdbench.engine.counters import Rounds
from sdbench.engine.loop import generate
from sdbench.reporting.round_parts import round_parts
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.ngram import NGram

GREEDY = SamplingConfig()
PARTS = ("draft_s", "verify_s", "accept_s", "observe_s", "loop_s")


class SlowObserve(NGram):
    """An n-gram lookup whose bookkeeping after each verdict takes 20 ms."""

    def observe(self, state, proposal, rnd) -> None:
        time.sleep(0.02)
        super().observe(state, proposal, rnd)


@pytest.mark.parametrize("make", [lambda t, d: Autoregressive(), lambda t, d: DraftModel(d, 4),
                                  lambda t, d: SlowObserve(4)])
def test_a_rounds_parts_sum_to_the_decode_time(target, small_draft, prompts, make):
    """One prompt, so its row took part in every round: drafting (with the draft's setup), verification,
    acceptance, observe and the loop's own add up to the time after the first token, to the loop's few
    microseconds outside any round; a proposer's slow observe is counted as observe, nowhere else."""
    proposer = make(target, small_draft)
    out = generate(target, proposer, [prompts[0] * 3], max_new_tokens=16, sampling=GREEDY)
    row = out.rows[0]
    parts = [getattr(row, p) for p in PARTS]
    assert all(p >= 0 for p in parts) and row.verify_s > 0 and row.accept_s > 0
    assert sum(parts) == pytest.approx(out.wall_s - out.ttft_s, abs=3e-4)
    if isinstance(proposer, SlowObserve):
        assert row.observe_s >= 0.02 * row.steps and row.accept_s < 0.02 * row.steps
        assert row.loop_s < 0.02


class SlowFirstPropose(NGram):
    """An n-gram lookup whose first propose of a decoding takes 0.2 s more (as a head's reading of the prompt's
    states in its first round)."""

    def begin(self, state) -> None:
        super().begin(state)
        self.first = True

    def propose(self, state):
        if self.first:
            time.sleep(0.2)
            self.first = False
        return super().propose(state)


def test_the_round_probe_times_the_second_round_and_counts_the_firsts_excess_as_setup(target, prompts):
    """`round_probe` runs the loop's own rounds, two of them: its drafting is the second's (a steady round), and what
    the first round's drafting spent beyond it is setup; `some_rounds` stops after the rounds asked for."""
    from sdbench.commands.bench_system import SdbenchSystem
    from sdbench.engine.loop import some_rounds

    drafted = []

    def one_by_one(*a) -> None:
        for _ in range(2):
            some_rounds(*a, 1)
            drafted.append(a[3][0].drafted)

    got = generate(target, NGram(4), [prompts[0] * 3], max_new_tokens=16, sampling=GREEDY, rounds=one_by_one)
    assert got.rows[0].steps == 2
    probe = SdbenchSystem(target, lambda: SlowFirstPropose(4), 16, [], 64, ("ngram", None)).round_probe(prompts[0] * 3)
    assert probe["setup"] == pytest.approx(0.2, abs=0.05)
    assert probe["drafting"] < 0.05 and probe["drafts"] == drafted[1] - drafted[0]
    one = SdbenchSystem(target, lambda: NGram(4), 1, [], 64, ("ngram", None)).round_probe(prompts[0])
    assert (one["drafting"], one["drafts"]) == (0.0, 0)  # a one-token budget: done before any round


def test_a_draft_that_is_its_target_starts_from_the_targets_prefill(target, small_draft, prompts, monkeypatch):
    """The draft's cache after its setup holds, at every prompt position, what the runner's own prefill of the
    prompts writes; the target drafting for itself prefills once (its own), another draft model prefills too."""
    ps = [prompts[0] * 2, prompts[1]]
    fresh = target.new_cache(len(ps), 64)
    target.prefill(fresh, ps)
    calls, kept = [], {}
    real_prefill, real_begin = type(target).prefill, ModelDrafter.begin

    def prefill(self, cache, batch, *a, **k):
        calls.append(self.name)
        return real_prefill(self, cache, batch, *a, **k)

    def begin(self, state):
        real_begin(self, state)
        kept["k"] = [k.clone() for k in self.cache.k]

    monkeypatch.setattr(type(target), "prefill", prefill)
    monkeypatch.setattr(ModelDrafter, "begin", begin)
    out = generate(target, DraftModel(target, 4), ps, max_new_tokens=8, sampling=GREEDY)
    assert calls == ["tiny-target"]
    for layer, k in enumerate(kept["k"]):
        for b, p in enumerate(ps):
            assert torch.equal(k[b, :, : len(p)], fresh.k[layer][b, :, : len(p)])
    assert out.output_ids == generate(target, Autoregressive(), ps, max_new_tokens=8, sampling=GREEDY).output_ids
    calls.clear()
    generate(target, DraftModel(small_draft, 4), ps, max_new_tokens=8, sampling=GREEDY)
    assert calls == ["tiny-target", "tiny-draft"]


def test_the_round_overhead_spreads_the_setup_over_the_requests_rounds():
    """o = h + s R / N: 2 requests in 10 rounds, h = 0.05, s = 1.5 give 0.35; predicted L / (g c + v + o)."""
    rounds = Rounds(tokens=40, seconds=2.0, rounds=10, drafted=40, accepted=30, requests=2)
    costs = EngineCosts({1: 1.0, 5: 1.2}, 0.3, host=0.05, setup=1.5)
    assert costs.overhead(rounds) == pytest.approx(0.35)
    assert predicted(rounds, costs) == pytest.approx(4.0 / (4 * 0.3 + 1.2 + 0.35))


def test_the_rest_factors_into_forwards_host_and_setup_by_hand():
    """Plain: 100 tokens in 2.2 s, 0.2 s of it host work: 22 ms a token. Speculative: 10 rounds in 1.0 s for 2
    requests, 0.05 s host, 0.1 s setup. Per round in plain tokens: measured S = 0.01 / 0.022, H = (0.005 - 0.002)
    / 0.022, F = 0.1 / 0.022 - S - H; predicted F = 4 (0.3) + 1.2, H = 0.05, S = 1.5 x 2 / 10. Each factor swaps
    one predicted part for its measured one; together they are measured / own."""
    plain = Rounds(tokens=100, seconds=2.2, rounds=100, requests=2, host_s=0.2)
    own = Rounds(tokens=40, seconds=1.0, rounds=10, drafted=40, accepted=30, requests=2, setup_s=0.1, host_s=0.05)
    costs = EngineCosts({1: 1.0, 5: 1.2}, 0.3, host=0.05, setup=1.5)
    unit = 0.022
    s_m, h_m = 0.01 / unit, (0.005 - 0.002) / unit
    f_m = 0.1 / unit - s_m - h_m
    f_p, h_p, s_p = 2.4, 0.05, 0.3
    forwards, host, setup = rest_parts(own, plain, costs)
    assert forwards == pytest.approx((f_p + h_p + s_p) / (f_m + h_p + s_p))
    assert host == pytest.approx((f_m + h_p + s_p) / (f_m + h_m + s_p))
    assert setup == pytest.approx((f_m + h_m + s_p) / (f_m + h_m + s_m))
    measured = (own.tokens / own.seconds) / (plain.tokens / plain.seconds)
    assert forwards * host * setup == pytest.approx(measured / predicted(own, costs))
    assert all(math.isnan(x) for x in rest_parts(Rounds(tokens=40, seconds=1.0, rounds=10), plain, costs))


def test_the_probes_by_hand(monkeypatch, target, prompts):
    """Per prompt, its interleaved medians (given here): v the verification over the one-token forward, c the
    draft's forward over it, h the verdict on gamma drafts less a plain step's over it, a drafting system's c its
    round's drafting per draft (a block drafter's: the whole round) over it, its s the setup over it; the median
    over the prompts of each ratio, s the mean (a request's setup adds up)."""
    d, h = ("draft", "d"), ("dflash", "h")

    def widths(one: float, five: float) -> dict:  # a forward over 2 to 4 tokens costs one over 1, over 5 more
        return {("verify", k): one for k in (2, 3, 4)} | {("verify", 5): five}

    each = iter([
        {"target": 0.010, **widths(0.010, 0.013), "draft": 0.002, ("verdict", 4): 0.003, ("verdict", 0): 0.001,
         (d, "drafting"): 0.03, (d, "drafts"): 4, (d, "setup"): 0.02, (h, "drafting"): 0.03, (h, "drafts"): 4,
         (h, "setup"): 0.0},
        {"target": 0.020, **widths(0.020, 0.030), "draft": 0.006, ("verdict", 4): 0.005, ("verdict", 0): 0.001,
         (d, "drafting"): 0.06, (d, "drafts"): 3, (d, "setup"): 0.05, (h, "drafting"): 0.03, (h, "drafts"): 4,
         (h, "setup"): 0.0}])
    asked = []
    monkeypatch.setattr(bench_costs, "median_times", lambda fns, device, reps: (asked.append(set(fns)), next(each))[1])

    class System:
        def __init__(self, key, block=False):
            self.key, self.block = key, block

        def round_probe(self, prompt):
            raise AssertionError("median_times is given, not run")

    plain = System(("autoregressive", None))
    costs = bench_costs.step_costs(target, target, [System(d), System(h, block=True), plain], prompts[:2], 4)
    assert asked[0] == {"target", *widths(0, 0), "draft", ("verdict", 4), ("verdict", 0), d, h}  # one interleaved pass
    assert costs.verify == pytest.approx({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: (1.3 + 1.5) / 2})
    assert costs.draft == pytest.approx((0.2 + 0.3) / 2)
    assert costs.own.host == pytest.approx(0.2)  # (3 - 1) / 10 and (5 - 1) / 20
    # per draft: 0.03 / 4 / 0.01 and 0.06 / 3 / 0.02 (median 0.875); a block: the whole round, 3.0 and 1.5
    assert costs.own.draft == {d: pytest.approx(0.875), h: pytest.approx(2.25)}
    assert costs.own.setup == {d: pytest.approx((2.0 + 2.5) / 2), h: 0.0}
    assert costs.own.blocks == frozenset({h})


def test_median_times_interleaves_and_keeps_the_parts_a_call_timed_itself(monkeypatch):
    clock, order = [0.0], []
    monkeypatch.setattr("sdbench.analysis.costs.now", lambda device=None: clock[0])
    drafting = iter([9.0, 0.3, 0.1, 0.2])  # the warm-up's, then three repetitions'

    def forward():
        order.append("forward")
        clock[0] += 0.01

    def probe():
        order.append("probe")
        clock[0] += 1.0  # its own prefill and setup: not what it reports
        return Parts(drafting=next(drafting), drafts=4)

    got = median_times({"forward": forward, "probe": probe}, None, reps=3, warmup=1)
    assert order == ["forward", "probe"] * 4
    assert got == {"forward": pytest.approx(0.01), ("probe", "drafting"): 0.2, ("probe", "drafts"): 4}


def test_two_bandwidth_probes_keep_the_faster_and_each_kernels_best():
    before = Bandwidth(27e9, "matrix-vector", {"sum": 26e9, "matrix-vector": 27e9})
    after = Bandwidth(31e9, "matrix-vector", {"sum": 25e9, "matrix-vector": 31e9, "amax": 20e9})
    for best in (before.best(after), after.best(before)):
        assert (best.bytes_per_s, best.kernel) == (31e9, "matrix-vector")
        assert best.rates == {"sum": 26e9, "matrix-vector": 31e9, "amax": 20e9}


def test_the_roofline_reads_at_least_the_fastest_plain_decoding():
    probe = Bandwidth(20e9, "sum", {"sum": 20e9, "amax": 15e9})
    faster = with_decodings(probe, {"llama.cpp plain": 27e9, "sdbench plain": 22e9, "failed": float("nan")})
    assert (faster.bytes_per_s, faster.kernel) == (27e9, "llama.cpp plain's decoding")
    assert faster.rates == {"sum": 20e9, "amax": 15e9, "llama.cpp plain's decoding": 27e9}
    assert with_decodings(probe, {"sdbench plain": 18e9}) == probe


def test_the_round_table_by_hand():
    """Two batches of one prompt: per round the parts in ms, the setup spread over the rounds, other the decode
    time no part holds, outside the share of decode spent neither drafting nor verifying."""
    rows = []
    for b in range(2):
        rows.append(dict(run_id="r", prompt_id=f"p{b}", batch_id=b, repeat=0, category="c", role="strategy",
                         strategy="draft", new_tokens=21, steps=5, accepted=15, drafted=20, wall_s=0.6, ttft_s=0.1,
                         draft_s=0.2, verify_s=0.25, accept_s=0.01, observe_s=0.005, loop_s=0.001, setup_s=0.05,
                         drafted_per_position=[5] * 4))
    [row] = round_parts(pd.DataFrame(rows)).to_dict("records")
    assert row["rounds"] == 10
    assert row["setup"] == pytest.approx(10.0) and row["draft"] == pytest.approx(30.0)
    assert (row["verify"], row["accept"], row["observe"], row["loop"]) == pytest.approx((50.0, 2.0, 1.0, 0.2))
    assert row["round"] == pytest.approx(100.0) and row["other"] == pytest.approx(100.0 - 93.2)
    assert row["outside"] == pytest.approx((2.0 + 1.0 + 0.2 + 10.0 + 6.8) / 100.0)


def test_predict_speedup_adds_the_overhead_to_each_round(capsys):
    """alpha 0.8, gamma 4: Omega = (1 - 0.8^5) / 0.2 = 3.3616 over 4 (0.1) + 1.2 + 0.3 = 1.9 forwards: 1.77x."""
    from tests.conftest import run_cli

    code, out, err = run_cli(capsys, "predict", "speedup", "--alpha", "0.8", "--gamma", "4", "--draft-cost", "0.1",
                             "--verify-cost", "1.2", "--overhead", "0.3")
    assert code == 0, err
    assert f"{3.3616 / 1.9:.2f}x" in out and "overhead=0.3" in out
    code, _, err = run_cli(capsys, "predict", "speedup", "--alpha", "0.8", "--overhead", "-1")
    assert code != 0 and "--overhead >= 0" in err
