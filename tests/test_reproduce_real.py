"""`sdbench reproduce dsi | magicdec | adaptive` through the CLI with their real measuring code (the models
loaded, every run decoded, the profile timed), on tiny random models whose tokenizer reads real text one
character at a time; only the plan is shrunk (each paper's QUICK plan replaced by a smaller one).

What the output means is checked against what the test computes itself: every planned run left its result
rows, each row's token count is the length of its token ids and every system's output equals transformers'
greedy `generate` on the same prompt (a later MT-Bench turn built from generate's own earlier answer), the
report's measured values are recomputed from those rows, and the verdicts follow from them."""

from __future__ import annotations

import json
import math
import re

import pandas as pd
import pytest

from sdbench.commands.reproduce import adaptive as adaptive_paper
from sdbench.commands.reproduce import dsi as dsi_paper
from sdbench.commands.reproduce import magicdec as magicdec_paper
from sdbench.commands.reproduce.common import FAILS, HOLDS, UNTESTABLE
from sdbench.reporting.results import read_results
from tests.conftest import reproduce_quick
from tests.references import hf_generate, tiny_text_model_dir

EOS = [2]  # the folders' end of sequence (generation config and tokenizer)
DSI_PLAN = dsi_paper.DsiPlan(limit=1, max_new_tokens=8, workers=2, repeats=2, tokens=60, grid=4, kmax=12)
# runs at batch 2 only (the profile has batch 1 too): each configuration decodes a real batch
MAGICDEC_PLAN = magicdec_paper.MagicDecPlan(batches=(1, 2), contexts=(96,), budgets=(32,), gammas=(1, 2),
                                            run_batches=(2,), prompt_lens=(64,), max_new_tokens=6, budget=32, gamma=2, reps=1)
ADAPTIVE_PLAN = adaptive_paper.AdaptivePlan(("gsm8k",), limit=2, max_new_tokens=8, compare=(1,))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(target, smaller draft) folders sharing one character-level tokenizer."""
    root = tmp_path_factory.mktemp("text-models")
    return (str(tiny_text_model_dir(root / "target")),
            str(tiny_text_model_dir(root / "draft", seed=1, layers=1, hidden=32, heads=2, kv=1)))


@pytest.fixture(scope="module")
def reference(folders):
    """outputs(dataset, limit, max_new, prompt_len=None, turns=None) -> {(prompt id, turn): new token ids} of
    transformers' greedy `generate` with the target folder, on the prompts a run of that data set picks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sdbench.data.tasks import encode_prompt, load_prompts

    model = AutoModelForCausalLM.from_pretrained(folders[0]).eval()
    tokenizer = AutoTokenizer.from_pretrained(folders[0])
    done: dict = {}

    def outputs(dataset: str, limit: int, max_new: int, prompt_len: int | None = None, turns: int | None = None):
        out = {}
        for p in load_prompts(dataset, limit=limit, seed=0, prompt_len=prompt_len, tokenizer=tokenizer):
            answers = []
            for turn in range(len(p.turns) if turns is None else min(turns, len(p.turns))):
                ids = encode_prompt(p, tokenizer, answers)
                key = (tuple(ids), max_new)
                if key not in done:
                    done[key] = hf_generate(model, ids, max_new, EOS)
                out[p.id, turn + 1] = done[key]
                answers.append(tokenizer.decode(done[key], skip_special_tokens=True).strip())
        return out

    return outputs


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))


def check_rows(df: pd.DataFrame, expected: dict) -> None:
    """Every role decoded every (prompt, turn) of `expected` once; each row's output is transformers' and its
    token count the length of its ids (so all systems count the same tokens)."""
    assert len(expected) and df["lossless"].all()
    for role, rows in df.groupby("role"):
        assert sorted(zip(rows["prompt_id"], rows["turn"].astype(int))) == sorted(expected), role
    for row in df.itertuples():
        ids = [int(t) for t in row.output_ids]
        assert row.new_tokens == len(ids) and ids == expected[row.prompt_id, int(row.turn)], (row.role, row.prompt_id)


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def claim(claims: pd.DataFrame, words: str) -> pd.Series:
    (row,) = [r for _, r in claims.iterrows() if words in r["claim"]]
    return row


def pngs(out, names) -> None:
    for name in names:
        assert (out / f"{name}.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), name


# ---- DSI ---------------------------------------------------------------------------------------------------


def decode_per_token(rows: pd.DataFrame) -> float:
    """Mean seconds per token after the first: (wall - first token) / (new tokens - 1), one prompt per batch."""
    n = rows["new_tokens"].astype(float)
    return float(((rows["wall_s"] - rows["ttft_s"]) / (n - 1)).where(n > 1).mean())


def paper_lookahead(c: float, workers: int) -> int:
    """The DSI paper's table rule: the smallest of 1, 5, 10 with ceil(1 / (k c)) <= workers, else 10."""
    return next((k for k in (1, 5, 10) if math.ceil(1 / (k * c)) <= workers), 10)


def test_reproduce_dsi_runs_si_and_dsi_and_judges_what_they_measured(capsys, tmp_path, monkeypatch, folders,
                                                                     reference, own_cache):
    from sdbench.dsi.pools import shutdown_pools

    monkeypatch.setattr(dsi_paper, "QUICK", DSI_PLAN)
    out = tmp_path / "report"
    figures = ("dsi-heatmap", "dsi-sim-vs-real", "dsi-workers")
    try:
        claims, _, stdout = reproduce_quick(capsys, "dsi", out, (
            "dsi-latency-table.parquet", "dsi-heatmap.parquet", "dsi-sim-vs-real.parquet", "dsi-workers.parquet",
            *(f"{f}.png" for f in figures)), 3, "--target", folders[0], "--draft", folders[1], "--device", "cpu")
    finally:
        shutdown_pools()
    pngs(out, figures)
    runs = {}
    for path in (out / "runs").glob("*.parquet"):
        df = read_results([str(path)])
        runs[df.loc[df["role"] == "strategy", "strategy"].iloc[0]] = df
    assert set(runs) == {"draft", "dsi"}  # SI and DSI, each beside plain decoding
    expected = reference("mt-bench", DSI_PLAN.limit, DSI_PLAN.max_new_tokens)
    assert len(expected) == 2 * DSI_PLAN.limit  # both MT-Bench turns
    for df in runs.values():
        check_rows(df, expected)
    # both runs at the lookahead the paper's rule picks for the c timed before them
    c, k = re.search(r"c = (\S+) timed here; .*? k = (\d+)", flat(stdout)).groups()
    assert int(k) in {paper_lookahead(float(c) * f, DSI_PLAN.workers) for f in (0.995, 1.005)}
    for name, df in runs.items():
        params = [json.loads(p) for p in df.loc[df["role"] == "strategy", "params"]]
        assert all(p["gamma"] == int(k) for p in params) and (df.loc[df["role"] == "strategy", "gamma"] == int(k)).all()
        assert name == "draft" or all(p["workers"] == DSI_PLAN.workers for p in params)
    _check_dsi_judged_on_the_rows(claims, pd.read_parquet(out / "dsi-sim-vs-real.parquet"), runs)


def _check_dsi_judged_on_the_rows(claims, versus, runs) -> None:
    real = {"plain": decode_per_token(runs["draft"][runs["draft"]["role"] == "baseline"]),
            "si": decode_per_token(runs["draft"][runs["draft"]["role"] == "strategy"]),
            "dsi": decode_per_token(runs["dsi"][runs["dsi"]["role"] == "strategy"]),
            "plain_dsi": decode_per_token(runs["dsi"][runs["dsi"]["role"] == "baseline"])}
    versus = versus.set_index("algorithm")
    for name in ("plain", "si", "dsi"):
        assert versus.loc[name, "measured_s"] == pytest.approx(real[name], rel=1e-9), name
        assert versus.loc[name, "online_error"] == pytest.approx(versus.loc[name, "online_s"] / real[name] - 1)
    worst = versus["online_error"].abs().max()
    predicts = claim(claims, "Latency is predicted")
    assert predicts["value"] == pytest.approx(worst) and predicts["verdict"] == (HOLDS if worst <= 0.25 else FAILS)
    vs_plain = real["plain_dsi"] / real["dsi"]  # each over the plain decoding of its own run
    lowest = min(vs_plain, vs_plain / (real["plain"] / real["si"]))
    slowed = versus.loc["dsi", "target_forward_s"] > 1.25 * versus.loc["plain", "target_forward_s"]
    here = claim(claims, "on the real run here")
    assert here["value"] == pytest.approx(lowest, rel=1e-9)
    assert here["verdict"] == (HOLDS if lowest >= 0.98 else UNTESTABLE if slowed else FAILS)


# ---- MagicDec ----------------------------------------------------------------------------------------------


def decode_rates(rows: pd.DataFrame) -> tuple[float, float]:
    """(mean seconds per token after the first, batch tokens per second) of one batch's rows, without the
    drafter's setup: the batch's wall - first token - setup over each row's tokens after its first."""
    first = rows.iloc[0]
    decode = first["wall_s"] - first["ttft_s"] - (0.0 if pd.isna(first["setup_s"]) else first["setup_s"])
    after = rows["new_tokens"] - 1
    return float((decode / after[after > 0]).mean()), float(after.sum() / decode)


def test_reproduce_magicdec_profiles_runs_and_judges_what_they_measured(capsys, tmp_path, monkeypatch, folders,
                                                                        reference, own_cache):
    plan = MAGICDEC_PLAN
    monkeypatch.setattr(magicdec_paper, "QUICK", plan)
    out = tmp_path / "report"
    figures = ("magicdec-speedup", "magicdec-tradeoff", "magicdec-step-cost")
    claims, _, stdout = reproduce_quick(capsys, "magicdec", out, (
        "magicdec-profile.parquet", "magicdec-predictions.parquet", "magicdec-runs.parquet",
        "magicdec-critical.parquet", *(f"{f}.png" for f in figures)), 3, "--target", folders[0], "--device", "cpu")
    pngs(out, figures)
    gamma = int(re.search(r"the runs' lookahead gamma = (\d+)", flat(stdout)).group(1))
    summary = pd.read_parquet(out / "magicdec-runs.parquet")
    assert sorted(zip(summary["batch"], summary["prompt_len"], summary["strategy"], summary["selector"])) == sorted(
        (b, n, s, k) for b in plan.run_batches for n in plan.prompt_lens for s, k in magicdec_paper.CONFIGS)
    plain, spec = {}, {}
    for run in summary.itertuples():
        df = read_results([run.path])
        check_rows(df, reference("pg19", run.batch, plan.max_new_tokens, prompt_len=run.prompt_len))
        assert (df["prompt_tokens"] == run.prompt_len).all() and df["batch_id"].nunique() == 1  # one whole batch
        rows = df[df["role"] == "strategy"]
        params = json.loads(rows["params"].iloc[0])
        assert (params["gamma"], int(params["budget"]), params.get("kv", params.get("draft_kv"))) == (
            gamma, plan.budget, run.selector)
        assert set(rows["draft"]) == ({f"{folders[0]}@int8"} if run.strategy == "draft" else {""})
        plain[run.Index], spec[run.Index] = decode_rates(df[df["role"] == "baseline"]), decode_rates(rows)
    _check_magicdec_judged_on_the_rows(claims, summary, plain, spec)
    profile = pd.read_parquet(out / "magicdec-profile.parquet")
    assert set(profile["step"]) == {"dense", "verify", "sparse"} and (profile["ms"] > 0).all()
    assert set(profile["context"]) == {*plan.contexts, *plan.prompt_lens}


def _check_magicdec_judged_on_the_rows(claims, summary, plain: dict, spec: dict) -> None:
    for i, run in summary.iterrows():
        assert run["latency_ms"] == pytest.approx(1e3 * spec[i][0], rel=1e-9)
        assert run["run_plain_latency_ms"] == pytest.approx(1e3 * plain[i][0], rel=1e-9)
        assert run["throughput"] == pytest.approx(spec[i][1], rel=1e-9)
        point = summary.index[(summary["batch"] == run["batch"]) & (summary["prompt_len"] == run["prompt_len"])]
        median = 1e3 * float(pd.Series([plain[j][0] for j in point]).median())  # plain decoding at the point
        assert run["measured_speedup"] == pytest.approx(median / (1e3 * spec[i][0]), rel=1e-9)
    assert claim(claims, "Up to 2x")["value"] == pytest.approx(summary["measured_speedup"].max())
    longest = summary[(summary["strategy"] == "magicdec") & (summary["prompt_len"] == summary["prompt_len"].max())]
    best = longest.loc[longest.groupby("batch")["measured_speedup"].idxmax()]
    both = ((best["throughput"] > best["plain_throughput"]) & (best["latency_ms"] < best["plain_latency_ms"])).all()
    tradeoff = claim(claims, "throughput and latency together")
    assert tradeoff["value"] == pytest.approx(best["measured_speedup"].min())
    assert tradeoff["verdict"] == (HOLDS if both else FAILS)
    right = [g.loc[g["predicted_speedup"].idxmax(), "measured_speedup"] >= 0.95 * g["measured_speedup"].max()
             for _, g in summary.dropna(subset=["predicted_speedup"]).groupby(["batch", "prompt_len"]) if len(g) > 1]
    picks = claim(claims, "cost model picks")
    if not right:  # no point with two predicted configurations
        assert picks["verdict"] == UNTESTABLE
        return
    assert picks["value"] == pytest.approx(sum(right) / len(right))
    assert picks["verdict"] == (HOLDS if all(right) else FAILS)


# ---- adaptation --------------------------------------------------------------------------------------------


def run_name(df: pd.DataFrame, model: str) -> str:
    """Which run of the plan a result file holds, from what its strategy rows say."""
    rows = df[df["role"] == "strategy"]
    params, strategy, draft = json.loads(rows["params"].iloc[0]), rows["strategy"].iloc[0], rows["draft"].iloc[0]
    if strategy == "adaptive-fsm":
        return f"fsm-{params['schedule']}"
    if (df["role"].str.startswith("compare-")).any():
        return "sweep"
    return "paper" if params.get("select") == "prompt" else f"alone:{draft}"


def tokens_per_s(rows: pd.DataFrame) -> float:
    return float(rows["new_tokens"].sum() / rows.groupby("batch_id")["wall_s"].first().sum())


def test_reproduce_adaptive_runs_every_system_and_judges_what_they_measured(capsys, tmp_path, monkeypatch, folders,
                                                                            reference, own_cache):
    plan = ADAPTIVE_PLAN
    monkeypatch.setattr(adaptive_paper, "QUICK", plan)
    out = tmp_path / "report"
    figures = ("adaptive-speedup", "adaptive-gamma")
    claims, _, stdout = reproduce_quick(capsys, "adaptive", out, (
        "adaptive-systems.parquet", "adaptive-selection.parquet", "adaptive-gamma.parquet",
        *(f"{f}.png" for f in figures)), 2, "--target", folders[0], "--draft", folders[1], "--device", "cpu")
    pngs(out, figures)
    model = folders[1]  # the model candidate (the int8 copy by default, which the MagicDec test drafts with)
    expected = reference("gsm8k", plan.limit, plan.max_new_tokens, turns=1)
    runs = {}
    for path in (out / "runs" / "gsm8k").glob("*.parquet"):
        df = read_results([str(path)])
        check_rows(df, expected)
        runs[run_name(df, model)] = df
    assert sorted(runs) == sorted(["sweep", "paper", f"alone:{model}", "alone:ngram", "fsm-step", "fsm-heuristic"])
    fixed = {}  # (draft, gamma) -> (role, tokens/s) of the sweep's fixed-gamma configurations
    for role, rows in runs["sweep"].groupby("role"):
        if role.startswith("compare-"):
            fixed[rows["draft"].iloc[0], int(rows["gamma"].iloc[0])] = (role, tokens_per_s(rows))
    assert {(c, g) for c in (model, "ngram") for g in plan.compare} <= set(fixed)  # both candidates, every gamma
    winner = max(fixed, key=lambda key: fixed[key][1])[0]
    assert f"the FSM schedules draft with {winner}" in flat(stdout)
    assert (runs["fsm-step"].loc[runs["fsm-step"]["role"] == "strategy", "draft"] == winner).all()
    _check_adaptive_judged_on_the_rows(claims, pd.read_parquet(out / "adaptive-systems.parquet"), runs, fixed)


def _check_adaptive_judged_on_the_rows(claims, systems, runs: dict, fixed: dict) -> None:
    """Each system's speedup is its tokens/s over its own run's plain decoding, recomputed from the rows."""
    def speedup(df, role="strategy"):
        return tokens_per_s(df[df["role"] == role]) / tokens_per_s(df[df["role"] == "baseline"])

    for _, row in systems[systems["kind"] != "plain"].iterrows():
        role = fixed[row["draft"], int(row["gamma"])][0] if row["kind"] == "fixed" else "strategy"
        assert row["speedup"] == pytest.approx(speedup(runs[row["run"]], role), rel=1e-9), row["system"]
    paper = speedup(runs["paper"])
    over_plain = claim(claims, "1.2-3.4x faster")
    assert over_plain["value"] == pytest.approx(paper, rel=1e-9)
    assert over_plain["verdict"] == (HOLDS if paper >= 1.2 else FAILS)
    alone = min(paper / speedup(runs[name]) for name in runs if name.startswith("alone:"))
    pays = claim(claims, "as fast as the better single draft")
    assert pays["value"] == pytest.approx(alone, rel=1e-9) and pays["verdict"] == (HOLDS if alone >= 0.95 else FAILS)
