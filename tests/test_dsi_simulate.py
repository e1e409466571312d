"""The DSI simulator: closed forms, the paper's claims on a grid, online against offline, the command's files."""

import json
import math
import random

import pandas as pd
import pytest

from sdbench.cli import main
from sdbench.errors import SdbenchError
from sdbench.analysis.dsi_heatmap import heatmap
from sdbench.analysis.dsi_sim import Setting, offline, online, profile_from_results, simulate_dsi, simulate_si
from sdbench.reporting.schema import rows_to_table
from tests.test_random_weights import small  # noqa: F401 (fixture)
from sdbench.analysis.theory import (alpha_from_tokens_per_step, dsi_latency_per_token, dsi_workers_needed,
                                     si_latency_per_token)
from sdbench.engine.iid_model import expected_tokens_per_step

WORKER_TOLERANCE = 0.06  # the worker-limited count against the preemptive online simulation
GRID = [(c, a) for c in (0.01, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0) for a in (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)]


def test_closed_forms_at_the_extremes():
    for c, k in ((0.1, 4), (0.5, 1), (1.0, 3)):
        # every draft rejected: SI pays for its drafts, DSI falls back to plain decoding
        assert si_latency_per_token(0.0, c, k) == pytest.approx(k * c + 1)
        assert dsi_latency_per_token(0.0, c, k) == 1.0
        # every draft accepted: SI commits k + 1 per iteration, DSI runs at the drafter's pace
        assert si_latency_per_token(1.0, c, k) == pytest.approx((k * c + 1) / (k + 1))
        assert dsi_latency_per_token(1.0, c, k) == pytest.approx(c)
    # in between: the renewal sum written out, J accepted drafts costing min(ceil(J/k)·k·c + 1, J + 1)
    a, c, k = 0.5, 0.2, 1
    cost = sum((1 - a) * a**j * min(math.ceil(j / k) * k * c + 1, j + 1) for j in range(200))
    assert dsi_latency_per_token(a, c, k) == pytest.approx(cost * (1 - a))
    assert dsi_latency_per_token(a, c, k) == pytest.approx(0.6)


def test_workers_needed_is_the_papers_bound():
    assert dsi_workers_needed(0.1, 4) == 3
    assert dsi_workers_needed(0.01, 15) == 7
    assert dsi_workers_needed(0.01, 14) == 8
    assert dsi_workers_needed(1.0, 1) == 1
    assert dsi_workers_needed(0.25, 4) == 1


def test_alpha_from_tokens_per_step_inverts_omega():
    for a in (0.0, 0.3, 0.8, 0.99):
        assert alpha_from_tokens_per_step(expected_tokens_per_step(a, 4), 4) == pytest.approx(a, abs=1e-9)


@pytest.mark.parametrize("c, a", GRID)
def test_dsi_never_slower_than_si_or_plain(c, a):
    for k in (1, 2, 4, 8, 16):
        dsi = dsi_latency_per_token(a, c, k)
        assert dsi <= min(si_latency_per_token(a, c, k), 1.0) + 1e-12
        assert dsi <= dsi_latency_per_token(a, c, k, bonus=False) + 1e-12  # the bonus token only helps


def test_heatmap_claims_and_shape():
    frame = heatmap(workers=7, grid=10, kmax=20)
    assert len(frame) == 11 * 11
    assert (frame["speedup_dsi_vs_si"] >= 1 - 1e-9).all()
    assert (frame["speedup_dsi_vs_plain"] >= 1 - 1e-9).all()
    ok = frame.apply(lambda r: dsi_workers_needed(r["c"], int(r["k_dsi"])) <= 7, axis=1)
    assert ok.all()
    # the paper's picture: over plain decoding DSI gains most with a fast, accurate drafter; nothing with a = 0.01
    best = frame.loc[frame["speedup_dsi_vs_plain"].idxmax()]
    assert (best["c"], best["a"]) == (0.01, 0.99)
    assert frame[frame["a"] == 0.01]["speedup_dsi_vs_plain"].max() < 1.02
    # over SI the gain is largest where SI loses most: slow and inaccurate drafters
    slow_bad = frame[(frame["c"] == 1.0) & (frame["a"] == 0.01)]["speedup_dsi_vs_si"].iloc[0]
    assert slow_bad > 1.9


def test_online_extremes_are_exact():
    rng = random.Random(0)
    never = Setting(target_s=1.0, c=0.1, a=0.0, k=4, workers=5, tokens=200)
    assert simulate_dsi(never, rng).latency == pytest.approx(200.0)  # one target forward per token
    always = Setting(target_s=1.0, c=0.1, a=1.0, k=4, workers=5, tokens=200)
    assert simulate_dsi(always, rng).latency == pytest.approx(200 * 0.1 + 1.0)  # drafting, then one verification
    assert simulate_dsi(always, rng).cancelled == 0
    assert simulate_si(always, rng) == pytest.approx(40 * (4 * 0.1 + 1.0))  # 40 iterations of 5 tokens


@pytest.mark.parametrize("c, a, k", [(0.1, 0.8, 4), (0.2, 0.5, 2), (0.3, 0.7, 3), (0.5, 0.9, 1), (0.05, 0.6, 8)])
def test_online_matches_offline_with_enough_workers(c, a, k):
    s = Setting(target_s=0.02, c=c, a=a, k=k, workers=dsi_workers_needed(c, k) + 2, tokens=400)
    off = offline(s)
    ideal = online(s, repeats=12, seed=1, preemptive=True)
    assert ideal["si"] == pytest.approx(off["si"], rel=0.06)
    # preemptive: the offline formula's idealisation; finite-length and sampling noise only
    assert abs(ideal["dsi"] - off["dsi"]) <= 4 * ideal["dsi_sem"] + 0.03 * off["dsi"]
    real = online(s, repeats=12, seed=1)
    assert real["dsi"] < min(real["si"], real["plain"])
    assert real["cancelled"] > 0 and len(real["busy"]) == s.workers
    assert all(0.0 <= b <= 1.0 for b in real["busy"])


def test_simulate_command_writes_parquet_and_png(tmp_path, capsys):
    main(["simulate", "dsi", "--c", "0.1", "--a", "0.8", "--k", "4", "--workers", "4", "--tokens", "200",
          "--repeats", "3", "--grid", "4", "--kmax", "8", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "DSI (k=4)" in out and "holds" in out
    frame = pd.read_parquet(tmp_path / "dsi-heatmap.parquet")
    assert len(frame) == 25 and {"c", "a", "k_dsi", "speedup_dsi_vs_si", "speedup_dsi_vs_plain"} <= set(frame)
    png = (tmp_path / "dsi-heatmap.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_simulate_command_bad_input_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulate", "dsi", "--a", "1.5"])
    assert e.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--a" in err[0]


def dsi_run_rows() -> list[dict]:
    """A DSI run's rows: its plain baseline (32 steps, 0.64 s of target forwards) and the strategy (60 drafted
    tokens in 0.12 s, 20 accepted, 10 rejections, gamma 4, 2 workers)."""
    stats = json.dumps({"rejections": 10, "drafted_total": 60})
    return [{"role": "baseline", "strategy": "autoregressive", "steps": 32, "verify_s": 0.64, "wall_s": 0.7,
             "new_tokens": 32, "drafted": 0, "accepted": 0, "draft_s": 0.0, "params": "{}"},
            {"role": "strategy", "strategy": "dsi", "steps": 12, "verify_s": 0.3, "wall_s": 0.5, "new_tokens": 32,
             "drafted": 40, "accepted": 20, "draft_s": 0.12, "strategy_stats": stats,
             "params": json.dumps({"gamma": 4, "workers": 2, "backend": "process"})}]


def test_profile_from_a_run(tmp_path):
    rows = dsi_run_rows()
    path = tmp_path / "run.parquet"
    import pyarrow.parquet as pq

    pq.write_table(rows_to_table(rows), path)
    s, measured = profile_from_results([str(path)])
    assert s.target_s == pytest.approx(0.02)
    assert s.c == pytest.approx(0.12 / 60 / 0.02)
    assert s.a == pytest.approx(20 / 30)
    assert (s.k, s.workers, s.tokens) == (4, 2, 32)
    assert measured == pytest.approx({"plain": 0.7, "dsi": 0.5, "forward_baseline": 0.02, "forward_workers": 0.02})
    # with the workers' own verification latency recorded, that is the target forward DSI got
    rows[1]["strategy_stats"] = json.dumps({"rejections": 10, "drafted_total": 60, "verify_s_per_job": 0.05})
    pq.write_table(rows_to_table(rows), path)
    s, measured = profile_from_results([str(path)])
    assert s.target_s == pytest.approx(0.05) and s.c == pytest.approx(0.12 / 60 / 0.05)
    assert measured["forward_baseline"] == pytest.approx(0.02)


# ---- the worker count, the paper's four panels and its lookahead rule ------------------------------------------


@pytest.mark.parametrize("c, a, k, workers", [(0.1, 0.8, 2, 1), (0.1, 0.8, 2, 3), (0.05, 0.9, 2, 2),
                                              (0.02, 0.95, 5, 3), (0.3, 0.9, 1, 2), (0.05, 0.6, 4, 1)])
def test_worker_limited_offline_agrees_with_online(c, a, k, workers):
    s = Setting(target_s=1.0, c=c, a=a, k=k, workers=workers, tokens=1500)
    assert workers < dsi_workers_needed(c, k)
    off = offline(s)
    ideal = online(s, repeats=6, seed=2, preemptive=True)
    assert off["dsi"] > off["dsi_enough"] * 1.02  # too few workers: the count no longer promises the paper's pace
    assert abs(off["dsi"] - ideal["dsi"]) <= 4 * ideal["dsi_sem"] + WORKER_TOLERANCE * ideal["dsi"]
    # what matters most: the offline row never promises a speedup the online simulation cannot reach
    assert off["plain"] / off["dsi"] <= ideal["plain"] / ideal["dsi"] * (1 + WORKER_TOLERANCE)


def test_worker_limited_count_is_the_papers_with_enough_workers():
    for c, a, k in ((0.1, 0.8, 4), (0.01, 0.99, 20), (0.5, 0.3, 1), (0.2, 1.0, 3)):
        need = dsi_workers_needed(c, k)
        paper = dsi_latency_per_token(a, c, k)
        for workers in (need, need + 3):
            assert dsi_latency_per_token(a, c, k, workers=workers) == pytest.approx(paper, rel=1e-12)
        lat = [dsi_latency_per_token(a, c, k, workers=n) for n in range(1, need + 1)]
        assert all(x >= y - 1e-12 for x, y in zip(lat, lat[1:]))  # more workers never cost time
        assert lat[0] <= 1.0 + 1e-12  # one worker still keeps plain decoding's pace
    assert dsi_latency_per_token(1.0, 0.1, 2, workers=1) == pytest.approx(0.5)  # one window of 2 per forward


def test_warning_when_fewer_workers_than_the_bound(tmp_path, capsys):
    main(["simulate", "dsi", "--c", "0.05", "--a", "0.8", "--k", "2", "--workers", "3", "--tokens", "100",
          "--repeats", "1", "--grid", "2", "--kmax", "4", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.count("warning:") == 1 and "fewer than the paper's bound ceil(1/(k·c)) = 10" in out
    assert "DSI, 10 workers (the paper's bound)" in out and "table rule picks k=10" in out
    main(["simulate", "dsi", "--c", "0.05", "--a", "0.8", "--k", "2", "--workers", "10", "--tokens", "100",
          "--repeats", "1", "--grid", "2", "--kmax", "4", "--out", str(tmp_path)])
    assert "warning:" not in capsys.readouterr().out


def test_grid_sums_are_the_scalar_formulas():
    from sdbench.analysis.dsi_heatmap import dsi_latencies, si_latencies

    a, ks = [0.01, 0.3, 0.8, 0.99, 1.0], [1, 3, 7, 40]
    for c, workers in ((0.05, None), (0.05, 2), (0.4, 1), (1.0, None)):
        dsi, si = dsi_latencies(a, c, ks, workers), si_latencies(a, c, ks)
        paper = dsi_latencies(a, c, ks, workers, bonus=False)
        for i, av in enumerate(a):
            for j, k in enumerate(ks):
                assert dsi[i, j] == pytest.approx(dsi_latency_per_token(av, c, k, workers=workers), rel=1e-9)
                assert paper[i, j] == pytest.approx(
                    dsi_latency_per_token(av, c, k, bonus=False, workers=workers), rel=1e-9)
                assert si[i, j] == pytest.approx(si_latency_per_token(av, c, k), rel=1e-12)


def test_heatmap_has_the_papers_four_panels_and_lookaheads_past_20(tmp_path):
    from sdbench.analysis.dsi_heatmap import PANELS, plot_heatmap

    frame = heatmap(workers=7, grid=4)  # k up to 200 by default
    assert [p[1] for p in PANELS] == ["DSI / SI", "DSI / non-SI (plain decoding)", "SI / non-SI (plain decoding)",
                                      "DSI / min(SI, non-SI)"]
    for column, *_ in PANELS:
        assert frame[column].notna().all()
    assert frame["speedup_si_vs_plain"].min() < 1  # SI loses somewhere ...
    assert frame["speedup_dsi_vs_best"].min() >= 1 - 1e-9  # ... DSI never does
    best = frame["speedup_dsi_vs_best"].to_numpy()
    expect = (frame[["si", "plain"]].min(axis=1) / frame["dsi"]).to_numpy()
    assert best == pytest.approx(expect)
    # SI with a fast, accurate drafter wants lookaheads past 20; DSI's best is the smallest the workers sustain
    assert frame["k_si"].max() > 20
    assert (frame["k_dsi"] == frame["c"].map(lambda c: next(k for k in range(1, 201)
                                                                 if dsi_workers_needed(c, k) <= 7))).all()
    titles = plot_heatmap(frame, tmp_path / "h.png", mark=(0.5, 0.5))
    assert [t.rsplit(" (min ", 1)[0] for t in titles] == [p[1] for p in PANELS]
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"


def test_the_papers_table_lookahead_rule():
    from sdbench.analysis.dsi_heatmap import table_lookahead

    assert table_lookahead(0.3, 7) == 1  # ceil(1/0.3) = 4 <= 7
    assert table_lookahead(0.1, 7) == 5  # k = 1 needs 10 workers, k = 5 needs 2
    assert table_lookahead(0.02, 7) == 10  # k = 5 needs 10, k = 10 needs 5
    assert table_lookahead(0.01, 7) is None  # even k = 10 needs 10
    assert table_lookahead(1.0, 1) == 1
    for c in (0.01, 0.03, 0.1, 0.2, 0.5, 1.0):
        for workers in (1, 2, 7):
            k = table_lookahead(c, workers)
            if k is not None:
                assert dsi_workers_needed(c, k) <= workers
                assert all(dsi_workers_needed(c, smaller) > workers for smaller in (1, 5, 10) if smaller < k)


def test_acceptance_close_to_one_needs_no_endless_sum():
    import numpy as np

    # a run whose drafts were all accepted fits a = 1 - 1e-8: the sum's tail, not billions of terms
    for c, k, workers in ((0.1, 4, None), (0.75, 1, 2), (1.9, 1, 1), (0.05, 2, 3)):
        limit = dsi_latency_per_token(1.0, c, k, workers=workers)
        assert dsi_latency_per_token(1 - 1e-8, c, k, workers=workers) == pytest.approx(limit, rel=1e-5)
    # past the explicit terms, the tail agrees with the sum written out
    a, c, k = 0.9995, 0.1, 4
    j = np.arange(300_000)
    brute = float(((1 - a) ** 2 * a**j * np.minimum(np.ceil(j / k) * k * c + 1, j + 1)).sum())
    assert dsi_latency_per_token(a, c, k) == pytest.approx(brute, rel=1e-6)


def test_profile_leaves_the_prefills_out_where_the_run_recorded_them(tmp_path):
    import pyarrow.parquet as pq

    stats = {"rejections": 10, "drafted_total": 61, "verify_s_per_job": 0.05, "verify_s_per_decode_job": 0.03,
             "draft_s_per_decode_token": 0.0015}
    rows = [{"role": "baseline", "strategy": "autoregressive", "steps": 32, "verify_s": 0.64, "wall_s": 0.7,
             "ttft_s": 0.08, "tpot_s": 0.02, "new_tokens": 32, "drafted": 0, "accepted": 0, "draft_s": 0.0,
             "params": "{}"},
            {"role": "strategy", "strategy": "dsi", "steps": 12, "verify_s": 0.3, "wall_s": 0.5, "ttft_s": 0.1,
             "tpot_s": 0.0125, "new_tokens": 32, "drafted": 40, "accepted": 20, "draft_s": 0.12,
             "strategy_stats": json.dumps(stats), "params": json.dumps({"gamma": 4, "workers": 2})}]
    path = tmp_path / "run.parquet"
    pq.write_table(rows_to_table(rows), path)
    s, measured = profile_from_results([str(path)])
    assert s.target_s == pytest.approx(0.03) and s.c == pytest.approx(0.0015 / 0.03)
    assert measured["plain"] == pytest.approx(0.02 * 32) and measured["dsi"] == pytest.approx(0.0125 * 32)


def test_a_run_that_judged_no_draft_measured_no_acceptance(tmp_path):
    import pyarrow.parquet as pq

    stats = {"rejections": 0, "drafted_total": 20, "verify_s_per_job": 0.05}
    rows = [{"role": "baseline", "strategy": "autoregressive", "steps": 32, "verify_s": 0.64, "wall_s": 0.7,
             "new_tokens": 32, "drafted": 0, "accepted": 0, "draft_s": 0.0, "params": "{}"},
            {"role": "strategy", "strategy": "dsi", "steps": 31, "verify_s": 1.5, "wall_s": 1.6, "new_tokens": 32,
             "drafted": 0, "accepted": 0, "draft_s": 1.2, "strategy_stats": json.dumps(stats),
             "params": json.dumps({"gamma": 1, "workers": 2})}]
    path = tmp_path / "run.parquet"
    pq.write_table(rows_to_table(rows), path)
    with pytest.raises(SdbenchError, match="judged no draft"):
        profile_from_results([str(path)])
    s, _ = profile_from_results([str(path)], a=0.9)
    assert s.a == 0.9 and s.c == pytest.approx(1.2 / 20 / 0.05)


def test_simulate_from_a_run_through_the_cli(tmp_path, capsys):
    """`simulate dsi --from RUN.parquet`: the run's measurements replace --c and --a, and the offline rows are the
    closed forms at them, worked out by hand: target forward 0.64 s / 32 steps = 0.02 s, c = 0.12 s / 60 drafted
    / 0.02 s = 0.1, a = 20 accepted / (20 + 10 rejections) = 2/3, k = 4, 32 tokens."""
    import re

    from tests.conftest import run_cli

    rows = dsi_run_rows()
    import pyarrow.parquet as pq

    pq.write_table(rows_to_table(rows), tmp_path / "run.parquet")
    code, out, err = run_cli(capsys, "simulate", "dsi", "--from", str(tmp_path / "run.parquet"), "--c", "0.5", "--a",
                             "0.3", "--repeats", "3", "--grid", "2", "--kmax", "4", "--out", str(tmp_path / "sim"))
    assert code == 0, err
    flat = re.sub(r"\s+", " ", out)
    omega = (1 - (2 / 3) ** 5) / (1 - 2 / 3)  # expected tokens per verification at k = 4
    si = (4 * 0.1 + 1) / omega * 32 * 0.02
    assert re.search(r"plain decoding │ 0\.64 │", flat) and re.search(rf"SI \(k=4\) │ {si:.3f} │", flat), flat
    assert "measured target forward: 0.02 s in the baseline, 0.02 s per verification" in flat
    assert "2 workers is fewer than the paper's bound ceil(1/(k·c)) = 3" in flat  # c = 0.1 from the run, not 0.5
    assert (tmp_path / "sim" / "dsi-heatmap.parquet").stat().st_size > 0
    # a file that is no drafting run: one line
    pq.write_table(rows_to_table(rows[:1]), tmp_path / "plain.parquet")
    code, _, err = run_cli(capsys, "simulate", "dsi", "--from", str(tmp_path / "plain.parquet"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--from needs a run with baseline rows" in err


# ---- latencies measured at a model's shape (MODEL@random) ------------------------------------------------------


def test_simulate_at_a_models_shape_measures_the_latencies_and_keeps_the_given_rate(small, capsys, tmp_path,  # noqa: F811
                                                                                    monkeypatch):
    """`simulate dsi --target llama-1b@random` (shrunk here): the target latency and c are the forwards measured by
    `costs.measured_costs`; a, k and workers are the given ones. A model drafting for itself has c = 1 exactly
    (one runner, one measured forward)."""
    from sdbench.analysis import costs as profiling
    from sdbench.commands import simulate
    from tests.conftest import run_cli

    seen, costs = {}, []
    real = profiling.measured_costs
    monkeypatch.setattr(profiling, "measured_costs", lambda *args: costs.append(real(*args)) or costs[-1])
    monkeypatch.setattr(simulate, "offline", lambda s: seen.setdefault("s", s) and offline(s))
    code, out, err = run_cli(capsys, "simulate", "dsi", "--target", "llama-1b@random", "--a", "0.7", "--k", "3",
                             "--workers", "2", "--context", "12", "--tokens", "20", "--repeats", "2", "--grid", "2",
                             "--kmax", "4", "--out", str(tmp_path))
    assert code == 0, err
    s = seen["s"]
    assert s.target_s == costs[0].target_s > 0 and s.c == 1.0
    assert (s.a, s.k, s.workers, s.tokens) == (0.7, 3, 2, 20)
    flat = " ".join(out.split())
    assert "measured at 12 tokens of context" in flat and "acceptance rate a = 0.7 as given" in flat
    code, _, err = run_cli(capsys, "simulate", "dsi", "--target", "llama-1b@random", "--from", "x.parquet")
    assert code == 2 and "give one of them" in err and len(err.strip().splitlines()) == 1


def test_a_run_with_random_weights_gives_its_latencies_but_needs_the_rate(tmp_path, capsys):
    import pyarrow.parquet as pq

    from tests.conftest import run_cli

    rows = [{**r, "weights": "random"} for r in dsi_run_rows()]
    path = tmp_path / "random.parquet"
    pq.write_table(rows_to_table(rows), path)
    code, _, err = run_cli(capsys, "simulate", "dsi", "--from", str(path), "--out", str(tmp_path / "sim"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "random weights (MODEL@random)" in err
    s, _ = profile_from_results([str(path)], random_a=0.4)
    assert s.a == 0.4 and s.target_s == pytest.approx(0.02) and s.c == pytest.approx(0.1)  # latencies: the run's
    s, _ = profile_from_results([str(path)], a=0.6, random_a=0.4)
    assert s.a == 0.6
    real = tmp_path / "real.parquet"
    pq.write_table(rows_to_table(dsi_run_rows()), real)
    assert profile_from_results([str(real)], random_a=0.4)[0].a == pytest.approx(20 / 30)  # real: its own rate
