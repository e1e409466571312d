"""`sdbench profile`: acceptance by draft position, conditional and marginal, and the two means of the accepted
length, against hand computations on rows whose counts are chosen so that every pair of figures differs; the vLLM
and llama.cpp forms checked against the rules their own parsers apply; every refusal one line, before any work."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rich.console import Console

from sdbench.reporting.positions import PositionAcceptance
from sdbench.reporting.profile import speculation_profiles
from sdbench.reporting.profile_formats import profile_formats
from sdbench.reporting.results import read_results
from sdbench.reporting.writer import RunWriter
from tests.conftest import run_cli

# Two kinds of answer, every round drafting 3 tokens. a: 4 rounds, drafts 1/2/3 committed in 4/2/1 of them (12
# tokens); b: 11 steps, 10 of them drafting (one drafted nothing), drafts committed in 5/1/0 (18 tokens). A row's
# tokens: its first, then per step its committed drafts and the target's own token.
KINDS = {"a": {"steps": 4, "drafted": [4, 4, 4], "accepted": [4, 2, 1]},
         "b": {"steps": 11, "drafted": [10, 10, 10], "accepted": [5, 1, 0]}}
# Six prompts a, b, a, b, a, b: rounds 42, accepted by position 27 / 9 / 3
CONDITIONAL = [27 / 42, 9 / 27, 3 / 9]
MARGINAL = [27 / 42, 9 / 42, 3 / 42]
PER_STEP = (3 * 12 + 3 * 18 - 6) / (3 * 4 + 3 * 11)  # 84 / 45: tokens after each row's first over every step
PER_REQUEST = (11 / 4 + 17 / 11) / 2  # each answer's own, averaged
IMPLIED = 1 + (27 + 9 + 3) / 42  # vLLM's: over the 42 rounds that drafted


def rows(kinds: str = "ababab", strategy: str = "draft", gamma: int = 3) -> list[dict]:
    """Baseline and strategy rows, one prompt per kind in `kinds`; the counts cut to `gamma` positions."""
    out = []
    for i, kind in enumerate(kinds):
        k = KINDS[kind]
        drafted, accepted = k["drafted"][:gamma], k["accepted"][:gamma]
        tokens = 1 + sum(accepted) + k["steps"]
        common = {"prompt_id": f"p{i}", "repeat": 0, "batch_id": i, "batch_size": 1, "dataset": "mt-bench",
                  "category": "writing", "target": "smollm2-135m", "wall_s": 1.0}
        out.append({**common, "role": "baseline", "strategy": "autoregressive", "params": "{}", "draft": "",
                    "new_tokens": tokens, "steps": tokens - 1, "drafted": 0, "accepted": 0})
        out.append({**common, "role": "strategy", "strategy": strategy, "gamma": gamma, "draft": "smollm2-135m",
                    "params": json.dumps({"gamma": gamma}), "new_tokens": tokens, "steps": k["steps"],
                    "drafted": sum(drafted), "accepted": sum(accepted), "drafted_per_position": drafted,
                    "accepted_per_position": accepted})
    return out


def write(folder, run_rows: list[dict], run_id: str = "r1"):
    with RunWriter(folder, run_id) as writer:
        writer.append(run_rows)
    return folder


def one_line_error(code: int, out: str, err: str, says: str) -> None:
    assert code == 2 and not out.strip()
    assert err.strip().count("\n") == 0 and err.startswith("error:") and says in err, err
    assert "Traceback" not in err


# --- the one definition, on sums ---------------------------------------------------------------------------


def test_conditional_and_marginal_by_hand():
    found = PositionAcceptance(np.array([27, 9, 3]), np.array([42, 42, 42]))
    assert found.rounds == 42 and list(found.reached) == [42, 27, 9]
    assert list(found.conditional) == pytest.approx(CONDITIONAL)
    assert list(found.marginal) == pytest.approx(MARGINAL)
    assert list(found.per_drafted) == pytest.approx(MARGINAL)  # every round drafts every position
    # the marginal is the product of the conditionals up to each position
    assert list(np.cumprod(found.conditional)) == pytest.approx(list(found.marginal))


def test_rounds_that_draft_fewer_positions():
    """Rounds of 1, 3 and 2 drafts committing 1, 2 and 0: a round that committed all its drafts reaches the next
    position and is not accepted there; the report's per-position rate counts only the rounds that drafted it."""
    found = PositionAcceptance(np.array([2, 1, 0]), np.array([3, 2, 1]))
    assert list(found.reached) == [3, 2, 1]
    assert list(found.conditional) == pytest.approx([2 / 3, 1 / 2, 0])
    assert list(found.marginal) == pytest.approx([2 / 3, 1 / 3, 0])
    assert list(found.per_drafted) == pytest.approx([2 / 3, 1 / 2, 0])


# --- the profile --------------------------------------------------------------------------------------------


def test_json_profile_by_hand(tmp_path, capsys):
    write(tmp_path / "results", rows())
    code, out, err = run_cli(capsys, "profile", str(tmp_path / "results"), "--out", str(tmp_path / "p.json"))
    assert code == 0, err
    assert out.strip() == f"wrote {tmp_path / 'p.json'} (json, 1 configuration)"
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["schema"] == "sdbench-profile/1"
    [p] = doc["profiles"]
    assert (p["run_id"], p["strategy"], p["method"], p["params"]) == ("r1", "draft", "draft", {"gamma": 3})
    assert (p["num_speculative_tokens"], p["prompts"], p["rows"], p["steps"], p["rounds"]) == (3, 6, 6, 45, 42)
    assert [(q["position"], q["drafted"], q["reached"], q["accepted"]) for q in p["positions"]] == [
        (1, 42, 42, 27), (2, 42, 27, 9), (3, 42, 9, 3)]
    assert p["conditional_accept_rates"] == [round(x, 6) for x in CONDITIONAL]
    assert p["marginal_accept_rates"] == [round(x, 6) for x in MARGINAL]
    assert [q["conditional"] for q in p["positions"]] == p["conditional_accept_rates"]
    assert [q["marginal"] for q in p["positions"]] == p["marginal_accept_rates"]
    assert p["mean_accept_length_per_step"] == round(PER_STEP, 6)
    assert p["mean_accept_length_per_request"] == round(PER_REQUEST, 6)
    assert p["implied_mean_accept_length"] == round(IMPLIED, 6)
    assert len({PER_STEP, PER_REQUEST, IMPLIED}) == 3  # three different numbers, each under its own name


def test_intervals_are_the_prompts_bootstrap(tmp_path):
    """Resampling prompts of two kinds can give no share beyond the pure kinds' own: marginal 2 lies between b's
    1/10 and a's 2/4, the means between b's 17/11 and a's 11/4; each interval holds its figure."""
    [p] = speculation_profiles(read_results([write(tmp_path, rows())]))
    second = p["positions"][1]
    low, high = second["marginal_interval"]
    assert 1 / 10 <= low < MARGINAL[1] < high <= 2 / 4
    low, high = second["conditional_interval"]
    assert 1 / 5 <= low < CONDITIONAL[1] < high <= 2 / 4  # b: 1 of 5 reached, a: 2 of 4
    for name, value in (("per_step", PER_STEP), ("per_request", PER_REQUEST)):
        low, high = p[f"mean_accept_length_{name}_interval"]
        assert 17 / 11 <= low < value < high <= 11 / 4


def test_no_interval_below_five_prompts(tmp_path):
    [p] = speculation_profiles(read_results([write(tmp_path, rows("abab"))]))
    assert p["prompts"] == 4 and p["positions"][0]["marginal"] is not None
    assert all(q["marginal_interval"] is None and q["conditional_interval"] is None for q in p["positions"])
    assert p["mean_accept_length_per_step_interval"] is None


def test_positions_padded_to_gamma(tmp_path):
    """An n-gram run at gamma 4 whose rounds drafted 1, 3 and 2 tokens: four rates for the engine, the fourth
    position never reached (no conditional share), its marginal 0."""
    KINDS["n"] = {"steps": 3, "drafted": [3, 2, 1], "accepted": [2, 1, 0]}
    try:
        [p] = speculation_profiles(read_results([write(tmp_path, rows("n", strategy="ngram", gamma=4))]))
    finally:
        del KINDS["n"]
    assert p["num_speculative_tokens"] == 4
    assert p["conditional_accept_rates"] == [round(2 / 3, 6), 0.5, 0.0, None]
    assert p["marginal_accept_rates"] == [round(2 / 3, 6), round(1 / 3, 6), 0.0, 0.0]


# --- the engines' forms ---------------------------------------------------------------------------------------


def test_vllm_form(tmp_path, capsys):
    code, out, err = run_cli(capsys, "profile", str(write(tmp_path, rows())), "--format", "vllm")
    assert code == 0, err
    assert out.strip() == ('{"num_speculative_tokens": 3, "rejection_sample_method": "synthetic", '
                           '"synthetic_acceptance_rates": [0.642857, 0.214286, 0.071429]}')
    spec = json.loads(out)  # vLLM's own checks of the list (vllm/config/speculative.py)
    rates = spec["synthetic_acceptance_rates"]
    assert len(rates) == spec["num_speculative_tokens"] and all(0 <= r <= 1 for r in rates)
    assert all(b <= a for a, b in zip(rates, rates[1:]))


def test_llamacpp_form(tmp_path, capsys):
    code, out, err = run_cli(capsys, "profile", str(write(tmp_path / "r", rows())), "--format", "llama.cpp",
                             "--out", str(tmp_path / "synth.txt"))
    assert code == 0, err
    text = (tmp_path / "synth.txt").read_text()
    assert text == "--spec-draft-n-max 3 --spec-synth-rates 0.642857,0.214286,0.071429\n"
    words = text.split()  # llama-server's checks: as many rates as --spec-draft-n-max, in [0, 1], non-increasing
    rates = [float(r) for r in words[3].split(",")]
    assert len(rates) == int(words[1]) and all(0 <= r <= 1 for r in rates)
    assert all(b <= a for a, b in zip(rates, rates[1:]))


def test_an_engine_form_takes_one_configuration(tmp_path, capsys):
    shorter = [{**r, "batch_id": 9} for r in rows("ab", gamma=2) if r["role"] == "strategy"]
    folder = write(tmp_path / "r", rows() + shorter)
    code, out, err = run_cli(capsys, "profile", str(folder), "--format", "vllm")
    one_line_error(code, out, err, "--format vllm takes one configuration and 2 match")
    assert "'draft gamma=2' of r1" in err and "'draft gamma=3' of r1" in err
    code, out, err = run_cli(capsys, "profile", str(folder), "--format", "vllm", "--strategy", "draft gamma=2")
    assert code == 0 and json.loads(out)["synthetic_acceptance_rates"] == [round(9 / 14, 6), round(3 / 14, 6)]
    code, out, err = run_cli(capsys, "profile", str(folder), "--run", "r1")
    assert code == 0 and len(json.loads(out)["profiles"]) == 2


# --- refusals, before any work --------------------------------------------------------------------------------


def test_refusals_are_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    plain = write(tmp_path / "plain", [r for r in rows() if r["role"] == "baseline"])
    results = write(tmp_path / "results", rows())
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("the user's")
    missing = str(tmp_path / "nowhere")
    cases = [
        ([str(tmp_path / "empty")], "no .parquet results in folder"),
        ([missing], "results path not found"),
        ([str(plain)], "no speculative rows"),
        ([missing, "--format", "vlm"], "unknown profile format 'vlm' (did you mean 'vllm'?)"),
        ([missing, "--out", str(tmp_path / "mine")], "is a folder"),
        ([str(results), "--strategy", "ngram"], "no configuration matches --run/--strategy"),
    ]
    for args, says in cases:
        one_line_error(*run_cli(capsys, "profile", *args), says)
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["keep.txt"]
    assert (tmp_path / "mine" / "keep.txt").read_text() == "the user's"


def test_a_file_is_replaced_whole(tmp_path, capsys):
    folder, out = write(tmp_path / "r", rows()), tmp_path / "o" / "profile.json"
    for form in ("llama.cpp", "json"):
        assert run_cli(capsys, "profile", str(folder), "--format", form, "--out", str(out))[0] == 0
    assert json.loads(out.read_text())["profiles"][0]["rounds"] == 42
    assert [p.name for p in out.parent.iterdir()] == ["profile.json"]  # no temporary file left


def test_a_registered_form_is_dispatched_and_named(tmp_path, capsys):
    profile_formats.add("toy", lambda profiles: f"toy {len(profiles)} {profiles[0]['rounds']}", "a test's", one=False)
    try:
        code, out, err = run_cli(capsys, "profile", str(write(tmp_path, rows())), "--format", "toy")
        assert code == 0 and out.strip() == "toy 1 42", err
        code, out, err = run_cli(capsys, "profile", str(tmp_path / "none"), "--format", "nope")
        one_line_error(code, out, err, "known: json, llama.cpp, toy, vllm")
    finally:
        profile_formats.remove("toy")


# --- the tables say which mean -----------------------------------------------------------------------------


def test_the_summary_table_says_its_mean_is_per_step(tmp_path):
    from sdbench.reporting.summary import summarize
    from sdbench.reporting.tables import summary_table

    console = Console(record=True, width=200)
    console.print(summary_table(summarize(read_results([write(tmp_path, rows())]))))
    text = " ".join(console.export_text().split())
    assert "acc.len: the mean accepted length per step" in text
    assert f"{PER_STEP:.2f}" in text  # the column is that mean
