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


def _rounds(per_prompt: list[tuple], seconds_each: float = 0.5) -> Rounds:
    """A system's Rounds over its prompts, one (tokens after the first, rounds, accepted, widths) per prompt: each
    prompt's drafts read off its widths (a width k verified k - 1 drafts)."""
    r = Rounds()
    for tokens, rounds, accepted, widths in per_prompt:
        assert tokens == accepted + rounds and sum(widths.values()) == rounds  # the example is consistent
        r.add(tokens, seconds_each, rounds, sum((k - 1) * n for k, n in widths.items()), accepted, widths=widths)
    return r


def _measured(system: str, key, rounds: Rounds, source=None, engine=None):
    from types import SimpleNamespace

    return SimpleNamespace(system=system, key=key, engine=engine, failed=None, rounds=rounds,
                           source=source if source is not None else SimpleNamespace(key=key),
                           repeat_tpots=lambda: [])


# sdbench's own systems over three prompts each, as (tokens after the first, rounds, accepted, widths) per prompt:
# three prompts, so that their totals' ratios (R / N above all) are not the mean of each prompt's
DRAFT = [(12, 4, 8, {5: 4}), (7, 5, 2, {5: 1, 2: 4}), (11, 3, 8, {5: 3})]  # 30 tokens, 12 rounds, 36 drafts
BLOCK_HEAD = [(10, 2, 8, {5: 2}), (6, 3, 3, {5: 3}), (14, 5, 9, {5: 2, 4: 3})]  # 30 tokens, 10 rounds, 37 drafts
LOOKUP = [(5, 5, 0, {1: 5}), (8, 4, 4, {3: 4}), (9, 3, 6, {4: 3})]  # 22 tokens, 12 rounds, 17 drafts
UNTIMED = [(6, 3, 3, {3: 3}), (4, 4, 0, {2: 4}), (10, 3, 7, {5: 3})]  # 20 tokens, 10 rounds, 22 drafts


def test_sdbench_own_rows_and_an_engines_carry_their_own_host_and_setup_terms_by_hand(monkeypatch):
    """`carry_over` over four of sdbench's systems and one engine's, every number computed here from the counts
    above and the costs given (v(k): 1, 1.1, 1.2, 1.4, 1.5 for k = 1..5; the draft model's c 0.4; sdbench's h 0.05):

    draft d (a chain, c 0.3, s 2.0): L = 30 / 12 = 2.5, g = 36 / 12 = 3, v = (8 v(5) + 4 v(2)) / 12 = 16.4 / 12,
      drafting 3 (0.3) = 0.9, o = 0.05 + 2.0 x 3 / 12 = 0.55
    dflash h (a block, its whole round c 1.7, s 5.0): L = 3, g = 3.7, v = (7 v(5) + 3 v(4)) / 10 = 1.47,
      drafting 1.7 (one forward), o = 0.05 + 5.0 x 3 / 10 = 1.55
    ngram (c 0.02, no setup timed): L = 22 / 12, g = 17 / 12, v = (5 v(1) + 4 v(3) + 3 v(4)) / 12 = 14 / 12,
      drafting 17 / 12 x 0.02, o = h = 0.05
    draft x (no own costs: the draft model's c, no overhead): L = 2, g = 2.2, v = (3 v(3) + 4 v(2) + 3 v(5)) / 10
      = 1.25, drafting 2.2 x 0.4 = 0.88, o = 0
    each predicted = L / (drafting + v + o), carried = own (sdbench's acceptance is its own). The engine's draft
    system (its own counters: 30 tokens in 15 rounds of 3 drafts, L 2, g 3), llama.cpp's drafter mirroring the
    verification batch (w(4) = 1.75 between its own w(1) = 1 and w(5) = 2: 4.75 draft forwards at c 0.25), its v
    v(4) = 1.2 of its own v(k) 1, 1.05, 1.1, 1.2, 1.3, and no overhead (o = 0: its timings hold its host work):
    own = 2 / (4.75 x 0.25 + 1.2); carried, with sdbench's draft d's rounds: v = (8 (1.3) + 4 (1.05)) / 12,
    2.5 / (4.75 x 0.25 + 14.6 / 12)."""
    from types import SimpleNamespace

    import sdbench.commands.bench_carry as bench_carry
    from sdbench.commands.bench_costs import OwnCosts, StepCosts
    from sdbench.servers.engines import EngineRole
    from sdbench.servers.systems import EngineSystem

    d, h, n, x = ("draft", "d"), ("dflash", "h"), ("ngram", None), ("draft", "x")
    own = OwnCosts(draft={d: 0.3, h: 1.7, n: 0.02}, setup={d: 2.0, h: 5.0}, host=0.05, blocks=frozenset({h}))
    costs = StepCosts({1: 1.0, 2: 1.1, 3: 1.2, 4: 1.4, 5: 1.5}, 0.4, own)
    plain = _measured("sdbench plain", ("autoregressive", None), Rounds(tokens=40, seconds=2.0, rounds=40))
    ours = [_measured("sdbench d", d, _rounds(DRAFT)), _measured("sdbench h", h, _rounds(BLOCK_HEAD)),
            _measured("sdbench ngram", n, _rounds(LOOKUP)), _measured("sdbench x", x, _rounds(UNTIMED)), plain]

    eng = SimpleNamespace(name="llama.cpp", draft_round=MIRROR)
    base = EngineSystem(eng, EngineRole("autoregressive"), "llama.cpp plain", "u0", 8)
    spec = EngineSystem(eng, EngineRole("draft", 4, "d"), "llama.cpp d", "u1", 8)
    drafts = EngineSystem(eng, EngineRole("autoregressive", 0, "d"), "llama.cpp draft alone", "u2", 8)
    theirs = [_measured("llama.cpp plain", base.key, Rounds(tokens=40, seconds=4.0, rounds=40), base, engine=eng),
              _measured("llama.cpp d", spec.key, Rounds(tokens=30, seconds=2.0, rounds=15, drafted=45, accepted=15,
                                                          requests=3), spec, engine=eng)]
    monkeypatch.setattr(bench_carry, "target_costs",
                        lambda *a: ({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.2, 5: 1.3}, 0.01))
    monkeypatch.setattr(bench_carry, "draft_costs", lambda *a: (0.25, {1: 1.0, 5: 2.0}))
    rows, unknown = bench_carry.carry_over(ours + theirs, plain, [base, spec, drafts], [[1, 2]], 4, costs)
    assert unknown == []
    got = {r.system: r for r in rows}
    assert list(got) == ["sdbench d", "sdbench h", "sdbench ngram", "sdbench x", "llama.cpp d"]
    expected = {  # L, g, v, c, drafting, o, h, s, predicted
        "sdbench d": (2.5, 3.0, 16.4 / 12, 0.3, 0.9, 0.55, 0.05, 2.0, 2.5 / (0.9 + 16.4 / 12 + 0.55)),
        "sdbench h": (3.0, 3.7, 1.47, 1.7, 1.7, 1.55, 0.05, 5.0, 3.0 / (1.7 + 1.47 + 1.55)),
        "sdbench ngram": (22 / 12, 17 / 12, 14 / 12, 0.02, 17 / 12 * 0.02, 0.05, 0.05, 0.0,
                          22 / (0.34 + 14 + 0.6)),
        "sdbench x": (2.0, 2.2, 1.25, 0.4, 0.88, 0.0, 0.0, 0.0, 2.0 / 2.13),
    }
    for system, (big_l, g, v, c, drafting, o, host, setup, speedup) in expected.items():
        row = got[system]
        assert (row.tokens_per_round, row.drafts_per_round) == (pytest.approx(big_l), pytest.approx(g)), system
        assert (row.verify, row.draft, row.draft_round) == (pytest.approx(v), pytest.approx(c),
                                                            pytest.approx(drafting)), system
        assert (row.overhead, row.host_cost, row.setup_cost) == (pytest.approx(o), pytest.approx(host),
                                                                 pytest.approx(setup)), system
        assert (row.carried, row.own) == (pytest.approx(speedup), pytest.approx(speedup)), system
    # measured: tokens after the first per second (each prompt took 0.5 s) over plain decoding's 40 / 2 s
    for system, tokens in (("sdbench d", 30), ("sdbench h", 30), ("sdbench ngram", 22), ("sdbench x", 20)):
        assert got[system].measured == pytest.approx(tokens / 1.5 / 20.0), system
    engine = got["llama.cpp d"]
    assert (engine.tokens_per_round, engine.drafts_per_round, engine.verify) == (2.0, 3.0, pytest.approx(1.2))
    assert (engine.draft, engine.draft_round) == (0.25, pytest.approx(4.75 * 0.25))
    assert (engine.overhead, engine.host_cost, engine.setup_cost) == (0.0, 0.0, 0.0)
    assert engine.own == pytest.approx(2.0 / (4.75 * 0.25 + 1.2))
    assert engine.carried == pytest.approx(2.5 / (4.75 * 0.25 + 14.6 / 12))
    assert engine.measured == pytest.approx(15.0 / 10.0)


def test_sdbench_own_costs_over_three_prompts_by_hand(monkeypatch, target):
    """`step_costs` over three prompts whose per-prompt ratios differ, so that a median and a mean disagree: per
    prompt (its one-token forward 10, 20, 40 ms) v(5) 1.3, 1.5, 2.0 (median 1.5); the draft's c 0.2, 0.3, 0.5
    (0.3); h, the verdict on 4 drafts less one on none, 0.2, 0.3, 0.8 (median 0.3, where the mean is 0.43); the
    draft system's drafting per draft 0.75, 1.0, 2.0 (median 1.0) and its setup 2.0, 2.5, 10.0 (s: the mean, 14.5 / 3,
    as a request's setup adds up; the median would be 2.5); the block head's whole round 3.0, 1.5, 5.0 (median 3.0,
    not per draft) and its setup 5.0, 1.0, 0.0 (mean 2.0)."""
    from sdbench.commands import bench_costs

    d, h = ("draft", "d"), ("dflash", "h")

    def prompt(target, v5, draft, verdict, d_drafting, d_drafts, d_setup, h_drafting, h_setup) -> dict:
        return {"target": target, **{("verify", k): target for k in (2, 3, 4)}, ("verify", 5): v5, "draft": draft,
                ("verdict", 4): verdict, ("verdict", 0): 0.001, (d, "drafting"): d_drafting, (d, "drafts"): d_drafts,
                (d, "setup"): d_setup, (h, "drafting"): h_drafting, (h, "drafts"): 4, (h, "setup"): h_setup}

    each = iter([prompt(0.010, 0.013, 0.002, 0.003, 0.03, 4, 0.02, 0.03, 0.05),
                 prompt(0.020, 0.030, 0.006, 0.007, 0.06, 3, 0.05, 0.03, 0.02),
                 prompt(0.040, 0.080, 0.020, 0.033, 0.40, 5, 0.40, 0.20, 0.0)])
    monkeypatch.setattr(bench_costs, "median_times", lambda fns, device, reps: next(each))

    class System:
        def __init__(self, key, block=False):
            self.key, self.block = key, block

        def round_probe(self, prompt):
            raise AssertionError("median_times is given, not run")

    costs = bench_costs.step_costs(target, target, [System(d), System(h, block=True)], [[5, 6], [7], [8, 9]], 4)
    assert costs.verify == pytest.approx({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.5})
    assert costs.draft == pytest.approx(0.3)
    assert costs.own.host == pytest.approx(0.3)
    assert costs.own.draft == {d: pytest.approx(1.0), h: pytest.approx(3.0)}
    assert costs.own.setup == {d: pytest.approx(14.5 / 3), h: pytest.approx(2.0)}
    assert costs.own.blocks == frozenset({h})


def test_every_column_of_the_printed_carry_over_table_and_its_parquet_columns():
    """What a user reads, cell by cell, each field its own value: sdbench's draft row L 2.75, g 3.5, v 1.35, c 0.22,
    drafting 0.77, o 0.125 (h 0.05, s 1.5), predicted 1.30x carried and 1.20x own, measured 1.56x within repeats of
    1.45x and 1.62x (which the carried 1.30 lies below: no ~), the gap 1.30 / 1.56 - 1 = -17 %, acceptance 1.2 / 1.3 =
    0.92, rest 1.56 / 1.2 = 1.30, forwards x host x setup 1.11 x 0.97 x 1.04. An engine's row: no round parts nor
    repeats (dashes), o 0. The same numbers under bench.parquet's column names, and back from them."""
    import pandas as pd
    from rich.console import Console

    from sdbench.reporting.carry import carry_table, columns, from_frame

    ours = Carried("sdbench draft", "sdbench", 2.75, 3.5, 1.35, 0.22, 0.77, 1.3, 1.2, 1.56, overhead=0.125,
                   host_cost=0.05, setup_cost=1.5, rest_forwards=1.11, rest_host=0.97, rest_setup=1.04,
                   measured_low=1.45, measured_high=1.62)
    theirs = Carried("llama.cpp draft", "llama.cpp", 2.0, 3.0, 1.2, 0.25, 1.1875, 1.04, 0.84, 1.5, overhead=0.0,
                     host_cost=0.0, setup_cost=0.0)
    console = Console(record=True, width=400)
    console.print(carry_table([ours, theirs]))
    text = console.export_text().splitlines()
    [header] = [[c.strip() for c in line.split("┃")[1:-1]] for line in text if "┃ system" in line]
    rows = {row[0]: dict(zip(header, row)) for row in
            ([c.strip() for c in line.split("│")[1:-1]] for line in text if line.startswith("│"))}
    assert rows["sdbench draft"] == {
        "system": "sdbench draft", "L": "2.75", "g": "3.50", "v": "1.35", "c": "0.22", "drafting": "0.77",
        "o": "0.125", "predicted (carried)": "1.30x", "predicted (own)": "1.20x", "measured": "1.56x",
        "per repeat": "1.45-1.62x", "carried / measured": "-17%", "acceptance": "0.92", "rest": "1.30",
        "forwards x host x setup": "1.11 x 0.97 x 1.04"}
    assert rows["llama.cpp draft"] == {
        "system": "llama.cpp draft", "L": "2.00", "g": "3.00", "v": "1.20", "c": "0.25", "drafting": "1.19",
        "o": "0.000", "predicted (carried)": "1.04x", "predicted (own)": "0.84x", "measured": "1.50x",
        "per repeat": "—", "carried / measured": "-31%", "acceptance": "0.81", "rest": "1.79",
        "forwards x host x setup": "—"}
    written = columns(ours)
    assert written == {"tokens_per_round": 2.75, "drafts_per_round": 3.5, "step_verify_cost": 1.35,
                       "step_draft_cost": 0.22, "round_draft_cost": 0.77, "carried_speedup": 1.3,
                       "own_predicted_speedup": 1.2, "decode_speedup": 1.56, "round_overhead_cost": 0.125,
                       "round_host_cost": 0.05, "request_setup_cost": 1.5, "rest_forwards": 1.11, "rest_host": 0.97,
                       "rest_setup": 1.04, "repeat_speedup_low": 1.45, "repeat_speedup_high": 1.62}
    frame = pd.DataFrame([{"system": "sdbench draft", "engine": "sdbench", **written}])
    assert from_frame(frame) == [ours]
