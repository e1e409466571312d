"""The carry-over prediction (analysis/carry.py) by hand, and the probes that measure an engine's step costs
(servers/costs.py) against a stand-in engine whose cache and times are known."""

from __future__ import annotations

import math

import pytest

from sdbench.analysis.carry import EngineCosts, carry, decode_speedup, predicted
from sdbench.engine.counters import CHAIN, MIRROR, Rounds, RowStats, WIDE_FIRST
from sdbench.engine.iid_model import expected_tokens_per_step, predicted_speedup, round_speedup
from sdbench.reporting.carry import Carried
from sdbench.servers.costs import PREFIX, CostsUnknown, draft_costs, forward_seconds, prefix_from, target_costs


def test_rounds_count_tokens_per_round_and_drafts_per_round():
    r = Rounds()
    r.add(11, 0.5, 5, 12, 6)  # 11 tokens after the first in 5 rounds: 6 accepted drafts, 5 target tokens
    r.add(11, 0.6, 5, 12, 6)
    assert (r.tokens, r.rounds, r.drafted, r.accepted) == (22, 10, 24, 12)
    assert r.tokens_per_round == pytest.approx(2.2) and r.drafts_per_round == pytest.approx(2.4)
    assert r.tokens_per_s == pytest.approx(22 / 1.1)
    assert math.isnan(Rounds().tokens_per_round) and math.isnan(Rounds().tokens_per_s)


def test_verify_cost_is_linear_between_the_widths_measured_and_held_at_the_ends():
    costs = EngineCosts({1: 1.0, 3: 1.2, 5: 2.0}, 0.5)
    assert costs.verify_at(1) == 1.0 and costs.verify_at(2) == pytest.approx(1.1)
    assert costs.verify_at(4.5) == pytest.approx(1.8) and costs.verify_at(9) == 2.0 and costs.verify_at(0.2) == 1.0


def test_the_predicted_speedup_by_hand():
    """L = 3 tokens per round, g = 4 drafts at c = 0.1, v(5) = 1.4: 3 / (0.4 + 1.4)."""
    r = Rounds(tokens=30, seconds=1.0, rounds=10, drafted=40, accepted=20)
    assert predicted(r, EngineCosts({1: 1.0, 5: 1.4}, 0.1)) == pytest.approx(3 / 1.8)
    # the i.i.d. model's prediction is the same formula with Omega for L
    assert predicted_speedup(0.6, 4, 0.1, 1.4) == pytest.approx(expected_tokens_per_step(0.6, 4) / 1.8)
    assert round_speedup(3.0, 4, 0.1, 1.4) == pytest.approx(3 / 1.8)
    assert math.isnan(round_speedup(3.0, 0, 0.0, 0.0))


def test_a_drafter_that_runs_the_verification_batch_too_costs_its_wide_forward_by_hand():
    """g = 4 drafts, L = 5, c = 0.5, v(5) = 1.5, the draft's own w(5) = 2: a chain drafts in 4 forwards, llama.cpp's
    mirror in w(5) + 4 = 6, vLLM's wide first forward in w(5) + 3 = 5; without the draft's own widths, the
    target's."""
    r = Rounds(tokens=50, seconds=1.0, rounds=10, drafted=40, accepted=40)
    widths = {1: 1.0, 5: 1.5}
    for kind, steps in ((CHAIN, 4), (MIRROR, 6), (WIDE_FIRST, 5)):
        costs = EngineCosts(widths, 0.5, draft_verify={1: 1.0, 5: 2.0}, round=kind)
        assert costs.draft_steps(4) == steps and predicted(r, costs) == pytest.approx(5 / (steps * 0.5 + 1.5))
    assert EngineCosts(widths, 0.5, round=MIRROR).draft_steps(4) == pytest.approx(5.5)


def test_the_gap_and_its_two_factors_by_hand():
    """The engine: 100 tokens after the first in 50 rounds of 2 drafts (L 2, g 2) in 1.25 s against its plain
    decoding's 2 s; sdbench on the same prompts: L 2.5, g 2. With c = 0.25 and v(3) = 1.5 a round costs 2 target
    forwards: own = 2 / 2 = 1, carried = 2.5 / 2 = 1.25, measured = 2 / 1.25 = 1.6. Acceptance = own / carried =
    0.8 (the engine accepts less than sdbench), rest = measured / own = 1.6 (it beats its cost model), and the
    prediction from sdbench's acceptance lands 1.25 / 1.6 - 1 = -21.875 % from the engine."""
    plain = Rounds(tokens=100, seconds=2.0, rounds=100)
    engine = Rounds(tokens=100, seconds=1.25, rounds=50, drafted=100, accepted=50)
    sdbench = Rounds(tokens=100, seconds=1.0, rounds=40, drafted=80, accepted=60)
    costs = EngineCosts({1: 1.0, 3: 1.5}, 0.25)
    row = carry("engine ngram", "llama.cpp", engine, plain, costs, sdbench)
    assert (row.tokens_per_round, row.drafts_per_round) == (2.0, 2.0)
    assert (row.verify, row.draft, row.draft_round) == (1.5, 0.25, 0.5)
    assert (row.own, row.carried, row.measured) == (pytest.approx(1.0), pytest.approx(1.25), pytest.approx(1.6))
    assert decode_speedup(engine, plain) == pytest.approx(1.6)
    assert (row.acceptance, row.rest) == (pytest.approx(0.8), pytest.approx(1.6))
    assert row.gap == pytest.approx(-0.21875)
    assert math.isnan(Carried("x", "y", 1, 1, 1, 1, 1, math.nan, 1, 1).gap)


class StandIn:
    """An engine whose cache holds the previous prompt and whose forward over k tokens takes 10 + k (or what
    `costs` says), computing the prompt from the first token it differs from the previous one."""

    name = "stand-in"

    def __init__(self, step=lambda k: 10.0 + k, cache: bool = True):
        self.previous, self.step, self.cache, self.seen = None, step, cache, []

    def probe(self, url, prompt):
        old = self.previous if self.cache else None
        common = 0 if old is None else next((i for i, (a, b) in enumerate(zip(prompt, old)) if a != b), len(old))
        self.previous = prompt
        k = len(prompt) - common
        self.seen.append((url, k))
        return self.step(k), k


def test_probes_compute_only_their_own_tokens_after_the_cached_prefix():
    prompts = [[5, 6, 7, 8], [9, 10]]
    prefix = prefix_from(prompts)
    assert len(prefix) == PREFIX and prefix[:7] == [5, 6, 7, 8, 9, 10, 5]
    eng = StandIn()
    got = forward_seconds(eng, "u", prefix, [1, 3, 5], repeats=3)
    assert got == {1: 11.0, 3: 13.0, 5: 15.0}
    # the prefix once, each width once unmeasured, then three interleaved rounds: every probe after the first
    # computed exactly its own width
    assert [k for _, k in eng.seen] == [PREFIX + 1] + [1, 3, 5] * 4
    verify, one = target_costs(StandIn(), "u", prompts, 4)
    assert one == 11.0 and verify == {k: pytest.approx((10 + k) / 11) for k in range(1, 6)}
    c, draft_verify = draft_costs(StandIn(step=lambda k: 2.2 * k), "d", prompts, 4, one)
    assert c == pytest.approx(0.2) and draft_verify == {k: pytest.approx(k) for k in range(1, 6)}


def test_an_engine_that_recomputes_the_prefix_is_refused():
    with pytest.raises(CostsUnknown, match="did not hold the prefix"):
        forward_seconds(StandIn(cache=False), "u", prefix_from([[1, 2, 3]]), [1, 2])
    with pytest.raises(CostsUnknown, match="fewer than two distinct"):
        forward_seconds(StandIn(), "u", prefix_from([[4, 4]]), [1])


def test_v_is_the_mean_over_the_widths_the_rounds_verified():
    """Six rounds of no draft and four of four: v = (6 v(1) + 4 v(5)) / 10, not v at the mean width 2.6 (a CPU's
    forward over 2 or 3 tokens costs hardly more than over 1). Rounds without widths (an engine's) read v(g + 1)."""
    rows = RowStats()
    for drafted in [0] * 6 + [4] * 4:
        rows.add_step(drafted, 0, 0.0, 0.0)
    assert rows.verified_widths == {1: 6, 5: 4}
    r = Rounds()
    r.add(10, 1.0, 10, rows.drafted, 0, widths=rows.verified_widths)
    r.add(10, 1.0, 10, rows.drafted, 0, widths=rows.verified_widths)
    assert r.widths == {1: 12, 5: 8} and r.width_shares() == {1: 0.6, 5: 0.4}
    costs = EngineCosts({1: 1.0, 2: 1.01, 3: 1.02, 4: 1.2, 5: 1.5}, 0.0)
    assert costs.verify_for(r) == pytest.approx(0.6 * 1.0 + 0.4 * 1.5)
    engine = Rounds(tokens=20, seconds=2.0, rounds=20, drafted=32)
    assert costs.verify_for(engine) == pytest.approx(1.01 + 0.6 * 0.01)  # v(2.6), between the widths around it
    assert predicted(r, costs) == pytest.approx(r.tokens_per_round / 1.2)


def test_the_measured_speedup_of_each_repeat_bounds_the_runs_noise_by_hand():
    """Two repeats of one 11-token prompt: plain decoding's 10 tokens after the first take 1.0 s, then 1.2 s; the
    system's 0.5 s, then 0.8 s. Its decode speedup is 0.1 / 0.05 = 2.0 in the first repeat and 0.12 / 0.08 = 1.5
    in the second, so a carried prediction of 1.8 lies within the run's noise and one of 2.2 does not."""
    from rich.console import Console

    from sdbench.commands.bench_carry import with_spread
    from sdbench.commands.bench_table import SystemMeasurement
    from sdbench.reporting.carry import carry_table
    from sdbench.reporting.latency import Call

    def measured(after_first: list[float]) -> SystemMeasurement:
        calls = [Call(r, 0.0, 0.1, 0.1 + s, 11) for r, s in enumerate(after_first)]
        return SystemMeasurement("x", True, [11] * len(after_first), [0.1 + s for s in after_first], calls=calls)

    plain, system = measured([1.0, 1.2]), measured([0.5, 0.8])
    inside = with_spread(Carried("sdbench ngram", "sdbench", 2, 2, 1, 0, 0, 1.8, 1.8, 1.75), system, plain)
    assert (inside.measured_low, inside.measured_high) == (pytest.approx(1.5), pytest.approx(2.0))
    assert inside.within_noise is True
    outside = with_spread(Carried("sdbench draft", "sdbench", 2, 2, 1, 0, 0, 2.2, 2.2, 1.75), system, plain)
    assert outside.within_noise is False
    once = with_spread(Carried("one", "sdbench", 2, 2, 1, 0, 0, 1.8, 1.8, 1.75), measured([0.5]), measured([1.0]))
    assert math.isnan(once.measured_low) and once.within_noise is None
    console = Console(record=True, width=300)
    console.print(carry_table([inside, outside, once]))
    lines = {line.split("│")[1].strip(): line for line in console.export_text().splitlines() if "│" in line}
    assert "1.50-2.00x" in lines["sdbench ngram"] and "+3% ~" in lines["sdbench ngram"]
    assert "+26%" in lines["sdbench draft"] and "~" not in lines["sdbench draft"]


def test_the_sites_carry_over_chart_draws_each_repeat_range_as_whiskers():
    from sdbench.reporting.site.charts import carry_bars

    spread = Carried("a", "sdbench", 2, 2, 1, 0, 0, 1.8, 1.8, 1.75, measured_low=1.5, measured_high=2.0)
    alone = Carried("b", "sdbench", 2, 2, 1, 0, 0, 1.8, 1.8, 1.75)
    measured = carry_bars([spread, alone])["data"][-1]
    assert measured["name"] == "measured" and measured["y"] == [1.75, 1.75]
    assert measured["error_y"]["array"] == [pytest.approx(0.25), None]
    assert measured["error_y"]["arrayminus"] == [pytest.approx(0.25), None]
    assert "error_y" not in carry_bars([alone])["data"][-1]
