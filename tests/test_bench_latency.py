"""`bench`'s time to first token and per output token, on systems whose times are known: a clock that only the
systems advance, each call taking a known time of which a known part comes after its first token. TTFT, TPOT and
the ratios over an engine's row of the same decoding by hand; a one-token answer has no TPOT."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from sdbench.commands import bench_measure
from sdbench.commands.bench_measure import measure_systems
from sdbench.commands.bench_table import SystemMeasurement, write_bench
from sdbench.reporting.latency import Call, from_frame, latencies, repeat_tpot
from sdbench.servers.engines import EngineTotals, Reply


class _Status:
    def update(self, text: str) -> None:
        pass


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self, device=None) -> float:
        return self.t


class InProcess:
    """A system in sdbench's process: each measured call takes `total` seconds, `after` of them after its first
    token, and returns `tokens` tokens (its own clock says `after`, as sdbench's loop and the streamer do)."""

    def __init__(self, clock: Clock, total: list[float], after: list[float], tokens: int, decoding):
        self.clock, self.total, self.after = clock, list(total), list(after)
        self.tokens, self.decoding = tokens, decoding
        self.after_first = math.nan

    def __call__(self, prompt, budget):
        if budget is not None:  # the warm-up: untimed
            return [1] * budget
        self.clock.t += self.total.pop(0)
        self.after_first = self.after.pop(0)
        return [1] * self.tokens


class Served:
    """An engine's system: its stream says when the first token came after the request was sent and when it ended;
    the client's reading of the reply takes `overhead` more seconds that the loop sees and the stream does not."""

    def __init__(self, clock: Clock, replies: list[tuple[float, float]], tokens: int, key, overhead: float = 0.001):
        self.clock, self.replies, self.tokens, self.key, self.overhead = clock, list(replies), tokens, key, overhead
        self.totals = EngineTotals(engine="eng")

    def __call__(self, prompt, budget):
        if budget is not None:
            return [1] * budget
        ttft, seconds = self.replies.pop(0)
        self.clock.t += seconds + self.overhead
        self.totals.add(Reply([1] * self.tokens, seconds, ttft, []))
        return [1] * self.tokens


def test_ttft_tpot_and_the_ratios_over_an_engine_by_hand(monkeypatch, tmp_path):
    clock = Clock()
    monkeypatch.setattr(bench_measure, "now", clock)
    plain = ("autoregressive", None)
    ours = InProcess(clock, [0.30, 0.50], [0.20, 0.44], 12, plain)  # 11 tokens after the first per prompt
    one = InProcess(clock, [0.10, 0.12], [0.0, 0.0], 1, ("ngram", None))  # one token per answer
    theirs = Served(clock, [(0.05, 0.27), (0.07, 0.40)], 12, plain)
    other = Served(clock, [(0.02, 0.10), (0.02, 0.10)], 12, ("draft", "d"))  # no sdbench row of its decoding
    systems = [("sdbench autoregressive", ours, False), ("sdbench ngram", one, False), ("eng plain", theirs, False),
               ("eng draft", other, False)]
    results = measure_systems(systems, [[5, 6], [7, 8]], 1, "cpu", _Status(), lambda fast: None)
    by = {m.system: m for m in results}

    # the loop's own times: each call from its start to its end, its first token `after` before the end; the
    # second prompt's turn starts after the four systems' first calls (0.3 + 0.1 + 0.271 + 0.101 s)
    calls = by["sdbench autoregressive"].calls
    assert [(c.start, c.first, c.end, c.tokens) for c in calls] == [
        (pytest.approx(100.0), pytest.approx(100.1), pytest.approx(100.3), 12),
        (pytest.approx(100.772), pytest.approx(100.832), pytest.approx(101.272), 12)]
    # sdbench: TTFT 0.10 and 0.06 (median 0.08); TPOT (0.20 + 0.44) / 22
    # the engine: TTFT from the loop's start to its first token: the call less its stream's time after the first
    # token, 0.271 - 0.22 and 0.401 - 0.33 (the client's overhead counts before the first token, as it does in its
    # end-to-end time); TPOT (0.22 + 0.33) / 22
    expected = {"sdbench autoregressive": (0.08, 0.64 / 22), "sdbench ngram": (pytest.approx(0.11), math.nan),
                "eng plain": (0.061, 0.55 / 22), "eng draft": (0.021, 0.16 / 22)}
    rows = {r.system: r for r in latencies([m.timed() for m in results])}
    for name, (ttft, tpot) in expected.items():
        assert rows[name].ttft == pytest.approx(ttft)
        assert (math.isnan(rows[name].tpot) and math.isnan(tpot)) or rows[name].tpot == pytest.approx(tpot), name
    # sdbench's plain decoding over the engine's: 24 tokens in 0.8 s against 24 in 0.672 s; 22 tokens after the
    # first in 0.64 s against 0.55 s
    assert rows["sdbench autoregressive"].vs["eng"] == (pytest.approx((24 / 0.8) / (24 / 0.672)),
                                                        pytest.approx(0.55 / 0.64))
    for name in ("sdbench ngram", "eng plain", "eng draft"):  # no engine row of its decoding, or the row itself
        assert all(math.isnan(v) for v in rows[name].vs["eng"]), name

    path = write_bench(results, str(tmp_path), {"model": "m", "draft": "d", "dataset": "x", "device": "cpu",
                                                "dtype": "float32", "verify_cost": 1.2, "draft_cost": 0.3})
    df = pd.read_parquet(path).set_index("system")
    assert df.loc["sdbench autoregressive", "ttft_s"] == pytest.approx(0.08)
    assert df.loc["eng plain", "tpot_s"] == pytest.approx(0.55 / 22)
    assert math.isnan(df.loc["sdbench ngram", "tpot_s"])  # not 0: a one-token answer has no time per token
    assert df.loc["sdbench autoregressive", "vs_eng_decode"] == pytest.approx(0.55 / 0.64)
    assert math.isnan(df.loc["eng plain", "vs_eng_end_to_end"])
    # `report` reads the same rows back
    again = {r.system: r for r in from_frame(pd.read_parquet(path))}
    assert again["sdbench autoregressive"].vs["eng"] == pytest.approx(rows["sdbench autoregressive"].vs["eng"])
    assert again["eng draft"].tpot == pytest.approx(0.16 / 22) and math.isnan(again["sdbench ngram"].tpot)


def test_tpot_counts_the_tokens_after_the_first_over_several_answers():
    # 4 s after the first token for 4 tokens after it, and 1 s for 1; a one-token answer adds nothing
    calls = [Call(0, 0.0, 1.0, 5.0, 5), Call(0, 5.0, 6.0, 7.0, 2), Call(0, 7.0, 7.5, 7.5, 1)]
    assert repeat_tpot(calls) == pytest.approx(5.0 / 5)
    assert math.isnan(repeat_tpot(calls[2:])) and math.isnan(repeat_tpot([]))
    # a system that keeps no time after its first token has none either
    one = SystemMeasurement("x", False, [5], [1.0], [[1]], calls=[Call(0, 0.0, math.nan, 1.0, 5)])
    assert math.isnan(one.timed().tpot)
