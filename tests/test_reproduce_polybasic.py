"""`sdbench reproduce polybasic`: the claims on synthetic chain runs (holding and failing), the report folder with
the measuring replaced by synthetic runs, and one run end to end on a tiny random model."""

from __future__ import annotations

import pandas as pd
import pytest

from sdbench.analysis.chain import ChainRun, LevelSpread
from sdbench.commands.reproduce import polybasic as poly
from sdbench.commands.reproduce.common import FAILS, HOLDS, UNTESTABLE, ReproduceConfig
from sdbench.analysis.theory import ChainCosts
from tests.conftest import reproduce_quick, run_cli

TOKENS = 100
OUT = [[1, 2, 3, 4]]


def _spread(model: str, mean: float, var: float, iid: float) -> LevelSpread:
    return LevelSpread(model, 40, mean, var, iid)


def synthetic_runs(three_ms: float = 19.0, sampling_var: float = 0.5, outputs=None) -> dict[str, ChainRun]:
    """Target 40 ms per token plain. Predicted ms per token (sdbench's form / the paper's): target <- ngram
    38.8 / 38.8, target <- M 25.0 / 25.0, target <- M <- ngram 18.67 / 16.58; measured 40, 26 and three_ms."""
    def run(key, chain, costs, ms, spread=None):
        r = ChainRun(key, chain, costs=costs, seconds=ms / 1e3 * TOKENS, tokens=TOKENS, outputs=outputs or OUT)
        r.spread = spread or {}
        return r

    plain = run("plain", [], None, 40.0)
    plain.profile_forward_s, plain.outputs = 0.040, OUT
    level0 = {"greedy": [_spread("t", 1.3, 0.8, 0.3)], "sampling": [_spread("t", 1.3, 0.6, 0.3)]}
    middle = {"greedy": [_spread("t", 4.0, 2.0, 1.5)], "sampling": [_spread("t", 3.5, 1.0, 1.4)]}
    three = {"greedy": [_spread("t", 6.0, 9.0, 8.0), _spread("m", 2.0, 0.9, 0.5)],
             "sampling": [_spread("t", 5.0, 4.0, 5.0), _spread("m", 1.8, sampling_var, 0.4)]}
    return {
        "plain": plain,
        "ngram": run("ngram", ["ngram"], ChainCosts((0.050, 0.0005), (1.3,), (), 1.0), 40.0, level0),
        "middle": run("middle", ["m"], ChainCosts((0.060, 0.010), (4.0,), (), 4.0), 26.0, middle),
        "three": run("three", ["m", "ngram"], ChainCosts((0.062, 0.012, 0.0005), (6.0, 2.0), (8.0,), 1.0), three_ms,
                     three),
    }


def claims_for(runs) -> dict[str, object]:
    cfg = ReproduceConfig(target="t", draft="m")
    chains = poly.chains_frame(runs, "t")
    claims = poly.judge(chains, poly.insertions_frame(runs, poly.insertions(cfg)), poly.spread_frame(runs))
    names = ["formula", "insert M", "insert ngram", "stability", "three beats two", "lossless", "speedup"]
    assert len(claims) == len(names)
    return dict(zip(names, claims))


def test_the_frames_carry_both_forms_and_the_measurements():
    runs = synthetic_runs()
    chains = poly.chains_frame(runs, "t").set_index("system")
    assert chains.loc["three", "levels"] == "t <- m <- ngram" and chains.loc["three", "N"] == [8.0]
    assert chains.loc["three", "predicted_ms"] == pytest.approx(112 / 6)  # (62 + 8 / 2 * 12.5) / 6
    assert chains.loc["three", "simple_ms"] == pytest.approx(62 / 6 + 12 / 2 + 0.5 / 2)
    assert chains.loc["middle", "speedup"] == pytest.approx(40 / 26) and chains.loc["plain", "T_ms"] == [40.0]
    assert chains.loc["three", "simple_error"] == pytest.approx((62 / 6 + 6.25) / 19 - 1)
    inserted = poly.insertions_frame(runs, poly.insertions(ReproduceConfig(target="t", draft="m"))).set_index("at")
    assert inserted.loc[0, "insertion"] == "m under t" and inserted.loc[1, "insertion"] == "ngram under m"
    # under the target: the paper's T_j / L'_j + T_c / L_c + b T_k / L_c against (T_j + b T_k) / L_j
    assert inserted.loc[0, "paper_new_ms"] == pytest.approx(50 / 6 + 12.5 / 2)
    # under M, the old bottom, which turns verifier: the target's token is compared (the chains' times here)
    assert inserted.loc[1, "sdbench_old_ms"] == pytest.approx(25.0)
    assert inserted.loc[1, "sdbench_new_ms"] == pytest.approx(112 / 6)
    assert inserted.loc[1, "paper_new_ms"] == pytest.approx(60 / 6 + 12.5 / 2)
    spread = poly.spread_frame(runs)
    assert len(spread) == 2 * 4 and set(spread["mode"]) == {"greedy", "sampling"}
    row = spread[(spread["system"] == "three") & (spread["level"] == 1) & (spread["mode"] == "greedy")].iloc[0]
    assert (row["model"], row["below"]) == ("m", "ngram") and row["var_over_iid"] == pytest.approx(1.8)
    # every draft accepted: independent acceptances would give (almost) no variance, so no ratio is taken
    runs["middle"].spread["greedy"] = [_spread("t", 5.0, 0.4, 1e-8)]
    spread = poly.spread_frame(runs)
    assert spread[(spread["system"] == "middle") & (spread["mode"] == "greedy")]["var_over_iid"].isna().all()
    stability = claims_for(runs)["stability"]
    assert "var / independent -, " in stability.measured


def test_claims_hold_on_a_chain_that_behaves_as_the_paper_says():
    claims = claims_for(synthetic_runs())
    for name in ("formula", "insert M", "insert ngram", "stability", "three beats two", "lossless"):
        assert claims[name].verdict == HOLDS, (name, claims[name])
    speedup = claims["speedup"]
    assert speedup.verdict == UNTESTABLE and speedup.value == pytest.approx(40 / 19) and "2.11x" in speedup.measured
    assert "sdbench's form called it right" in claims["insert ngram"].why
    assert "4 of 4" in claims["stability"].why and "m over ngram (three)" in claims["stability"].measured


def test_claims_fail_where_the_measurements_disagree():
    # the three-model chain measured at 30 ms: slower than target <- M (26 ms), far from both forms
    claims = claims_for(synthetic_runs(three_ms=30.0, sampling_var=1.2, outputs=[[1, 2, 3, 5]]))
    assert claims["formula"].verdict == FAILS and claims["formula"].value == pytest.approx(1 - 16.5833 / 30, 1e-3)
    assert claims["insert M"].verdict == HOLDS  # 40 -> 30 ms: it still helped, as both forms said
    assert claims["insert ngram"].verdict == FAILS  # 26 -> 30 ms: it hurt, both forms said it would help
    assert "sdbench's form got it wrong" in claims["insert ngram"].why
    assert claims["stability"].verdict == FAILS and "3 of 4" in claims["stability"].why
    assert claims["three beats two"].verdict == FAILS and claims["three beats two"].value == pytest.approx(26 / 30)
    assert claims["lossless"].verdict == FAILS and "t <- m <- ngram" in claims["lossless"].measured


def test_a_close_measured_outcome_is_flagged():
    claims = claims_for(synthetic_runs(three_ms=25.5))  # 26 -> 25.5 ms under M: within 5%
    assert "close to one run's noise" in claims["insert ngram"].why
    assert "close to one run's noise" not in claims["insert M"].why


def test_no_sampling_pass_cannot_be_judged():
    runs = synthetic_runs()
    for run in runs.values():
        run.spread.pop("sampling", None)
    assert claims_for(runs)["stability"].verdict == UNTESTABLE


@pytest.fixture
def fake_measuring(monkeypatch):
    asked = {}

    def measure_systems(cfg, plan, console):
        asked.update(cfg=cfg, plan=plan, systems=poly.systems(cfg))
        return synthetic_runs(), {"mt-bench": 3}

    monkeypatch.setattr(poly, "measure_systems", measure_systems)
    return asked


def test_reproduce_polybasic_quick_writes_the_report_folder(capsys, tmp_path, fake_measuring):
    out = tmp_path / "report"
    claims, text, stdout = reproduce_quick(capsys, "polybasic", out, (
        "polybasic-chains.parquet", "polybasic-insertions.parquet", "polybasic-spread.parquet", "polybasic-times.png",
        "polybasic-spread.png"), 2)
    assert fake_measuring["plan"] == poly.QUICK and fake_measuring["cfg"].quick
    assert fake_measuring["systems"] == {"plain": [], "ngram": ["ngram"], "middle": ["smollm2-135m@int8"],
                                         "three": ["smollm2-135m@int8", "ngram"]}
    assert len(claims) == 7 and claims["verdict"].tolist() == [HOLDS] * 6 + [UNTESTABLE]
    chains = pd.read_parquet(out / "polybasic-chains.parquet")
    assert list(chains["system"]) == ["plain", "ngram", "middle", "three"] and list(chains["L"].iloc[3]) == [6.0, 2.0]
    assert "middle model" in text
    assert "Theorem 3.2" in stdout and "report:" in stdout


def test_draft_replaces_the_middle_level(capsys, tmp_path, fake_measuring):
    code, _, err = run_cli(capsys, "reproduce", "polybasic", "--quick", "--draft", "other", "--out", str(tmp_path))
    assert code == 0, err
    assert fake_measuring["systems"]["three"] == ["other", "ngram"]
    claims = pd.read_parquet(tmp_path / "claims.parquet")
    assert claims["claim"].str.contains("other under smollm2-135m").any()


def test_reproduce_polybasic_end_to_end_on_a_tiny_model(capsys, tmp_path, monkeypatch):
    """The real measuring on a tiny random Llama saved as a local folder (its int8 copy as the middle level)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.test_models_loading import tiny_tokenizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2)
    folder = tmp_path / "tiny"
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(poly, "QUICK", poly.PolybasicPlan(("mt-bench",), limit=2, max_new_tokens=10, profile_prompts=1,
                                                 profile_tokens=8, gamma=2))
    out = tmp_path / "report"
    code, stdout, err = run_cli(capsys, "reproduce", "polybasic", "--quick", "--target", str(folder), "--device",
                                "cpu", "--out", str(out))
    assert code == 0, err
    chains = pd.read_parquet(out / "polybasic-chains.parquet").set_index("system")
    assert chains["same_tokens"].all() and (chains["measured_ms"] > 0).all()
    assert (chains.loc["three", "tokens"] == chains["tokens"]).all()
    assert list(pd.read_parquet(out / "claims.parquet")["verdict"].iloc[-1:]) == [UNTESTABLE]
    spread = pd.read_parquet(out / "polybasic-spread.parquet")
    assert set(spread["mode"]) == {"greedy", "sampling"} and (spread["rounds"] > 0).all()
