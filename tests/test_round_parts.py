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


def test_the_probes_of_h_and_s_by_hand(monkeypatch, target, prompts):
    """h: the verdict on gamma drafts less a plain step's, over the one-token forward (3 - 1 ms over 10 ms); s: the
    mean over the prompts of each prompt's median setup over that prompt's forward; c: one round's drafting per
    draft (a block drafter's: the round's) over the forward, the median over the prompts."""
    times = {"target": 0.010, ("verdict", 4): 0.003, ("verdict", 0): 0.001}
    monkeypatch.setattr(bench_costs, "median_times", lambda fns, device: {k: times[k] for k in fns})
    assert bench_costs.host_cost(target, prompts[:2], 4) == pytest.approx(0.2)

    class System:
        def __init__(self, setups, drafting, block=False):
            self.setups, self.drafting_s, self.block = iter(setups), drafting, block

        def setup_s(self, prompt):
            return next(self.setups)

        def drafting(self, prompt):
            return self.drafting_s, 4

    one = {0: 0.01, 1: 0.02}
    draft = System([0.02, 0.03, 0.01, 0.05, 0.04, 0.08], 0.04)  # medians 0.02 and 0.05
    head = System([0.0] * 6, 0.04, block=True)
    systems = {("draft", "d"): draft, ("dflash", "h"): head}
    assert bench_costs.setup_costs(systems, prompts[:2], one) == {("draft", "d"): pytest.approx((2.0 + 2.5) / 2),
                                                                  ("dflash", "h"): 0.0}
    # per draft: 0.04 s over 4 drafts over 0.01 and 0.02 s (median 0.75); a block: the whole round (median 3.0)
    assert bench_costs.drafting_costs(systems, prompts[:2], one) == {("draft", "d"): pytest.approx(0.75),
                                                                     ("dflash", "h"): pytest.approx(3.0)}


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
