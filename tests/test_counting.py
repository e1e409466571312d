"""Counting that cannot mislead: what the metrics module defines is what every strategy records."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sdbench.commands import run as benchmark
from sdbench.commands.divergence import INT8_STEP, first_difference, judge, tie_tolerance
from sdbench.config import SamplingConfig
from sdbench.engine.counters import RowStats
from sdbench.engine.loop import generate
from sdbench.engine.metrics import row_metrics
from sdbench.reporting.results import read_results
from sdbench.strategies.adaptive import AdaptiveFSM
from sdbench.strategies.adaptive import make_drafters
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.ngram import NGram
from sdbench.strategies.polybasic import Polybasic
from tests.conftest import run_cli

GREEDY = SamplingConfig()


def reference(target, prompts, new, eos=()):
    return generate(target, Autoregressive(), prompts, max_new_tokens=new, sampling=GREEDY, eos_ids=eos).output_ids


def assert_counts_true(out, max_new):
    """The definitions of sdbench.engine.metrics, row by row."""
    for b, (row, ids) in enumerate(zip(out.rows, out.output_ids)):
        m = row_metrics(out, b)
        assert m.mean_accepted_len * row.steps == pytest.approx(len(ids) - 1)  # never more than committed
        assert len(ids) - 1 <= row.accepted + row.steps <= len(ids)  # only a step's own token may be cut
        assert row.accepted <= row.drafted and len(row.drafted_per_position) <= max_new - 1  # no step past it
        assert sum(row.accepted_per_position) == row.accepted
        assert sum(row.drafted_per_position) == row.drafted


@pytest.mark.parametrize("make", [
    lambda t: DraftModel(t, 8), lambda t: NGram(8), lambda t: Polybasic([t, t], 3, "8"),
    lambda t: AdaptiveFSM(make_drafters([t], 3, 1), 6),
])
def test_the_budget_cuts_no_accepted_draft(target, prompts, make):
    """At gamma 8 and 12 new tokens the target drafting for itself commits 9 then 2: the old loop drafted 8
    in the second round and counted all 8 accepted (mean accepted length 9.0 for 11 tokens in 2 steps)."""
    ps = [(p * 3)[:20] for p in prompts]  # repetitive, so that the n-gram lookup drafts too
    proposer = make(target)
    out = generate(target, proposer, ps, max_new_tokens=12, sampling=GREEDY)
    assert out.output_ids == reference(target, ps, 12)
    assert_counts_true(out, 12)
    if not isinstance(proposer, NGram):  # the target drafting for itself: every draft committed, none past
        assert all(row.drafted == row.accepted <= len(ids) - 1 for row, ids in zip(out.rows, out.output_ids))


def test_a_huge_lookahead_drafts_no_more_than_the_budget(target, prompts):
    out = generate(target, DraftModel(target, 1000), prompts[:1], max_new_tokens=8, sampling=GREEDY)
    row = out.rows[0]
    assert out.output_ids == reference(target, prompts[:1], 8)
    assert row.steps == 1 and row.drafted == 7 == row.accepted and row.drafted_per_position == [1] * 7
    assert row_metrics(out, 0).mean_accepted_len == 7.0  # 7 tokens committed in one step, not 1001


def test_drafts_after_an_eos_are_not_accepted(target, small_draft, prompts):
    ref = reference(target, prompts, 24)
    eos = ref[0][5]
    for proposer in (DraftModel(target, 8), DraftModel(small_draft, 4)):
        out = generate(target, proposer, prompts, max_new_tokens=24, sampling=GREEDY, eos_ids=(eos,))
        assert out.output_ids == reference(target, prompts, 24, eos=(eos,))
        assert_counts_true(out, 24)
    self_draft = generate(target, DraftModel(target, 8), prompts[:1], max_new_tokens=24, sampling=GREEDY,
                          eos_ids=(eos,))
    row = self_draft.rows[0]  # one step: drafts 1..5 committed, the EOS the last of them; 3 more thrown away
    assert (row.steps, row.drafted, row.accepted, row.rejections) == (1, 8, 5, 0)


def test_a_cut_step_is_censored_not_rejected():
    row = RowStats()
    row.add_step(4, 2, 0.0, 0.0, rejected=False)  # accepted 4, an EOS after the second
    row.add_step(4, 2, 0.0, 0.0)  # a rejection at the third
    assert (row.accepted, row.rejections, row.accepted_per_position) == (4, 1, [2, 2])


# ---- DSI: a batch's TTFT and decode time ------------------------------------------------------------------

def test_dsi_batch_times_sum_over_its_prompts(monkeypatch, target):
    """DSI decodes a batch one prompt after another: its wall time and its TTFT both sum the prompts', so
    wall - TTFT (the decode phase) means for it what it means for the batched loop."""
    from sdbench.decoders import decoder_for
    from sdbench.dsi import decoder
    from sdbench.dsi.orchestrator import RowOutcome
    from sdbench.strategies.dsi import DSI

    class One:
        def __init__(self, pool, draft, prompt, **kw):
            pass

        def run(self):
            stats = RowStats()
            for _ in range(4):
                stats.add_step(2, 2, 0.0, 0.0)
            return RowOutcome([1] * 13, stats, {}, wall_s=1.0, ttft_s=0.4)

    monkeypatch.setattr(decoder, "RowDecode", One)
    monkeypatch.setattr(decoder, "get_pool", lambda *a, **k: None)
    dsi = DSI(target, 2, workers=1, threads=1)
    results = {n: decoder_for(dsi)(target, dsi, [[1, 2]] * n, max_new_tokens=13, sampling=GREEDY) for n in (1, 3)}
    assert (results[3].wall_s, results[3].ttft_s) == pytest.approx((3.0, 1.2))
    decode_rate = {n: (r.new_tokens - n) / (r.wall_s - r.ttft_s) for n, r in results.items()}
    assert decode_rate[3] == pytest.approx(decode_rate[1])  # the old TTFT (the first prompt's) gave 36/2.6
    assert row_metrics(results[3], 1).mean_accepted_len == 3.0


# ---- ties in low precision ---------------------------------------------------------------------------------

class FixedLogits:
    """A stand-in target whose forward gives the same logits whatever the context."""

    def __init__(self, logits, dtype):
        self.logits, self.dtype = torch.tensor([logits], dtype=dtype), dtype

    def new_cache(self, batch, capacity):
        return None

    def release(self, cache):
        pass

    def prefill(self, cache, prompts):
        return self.logits.float()

    def block_activations(self):
        return None


def test_a_tie_is_told_from_a_real_divergence():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None and first_difference([1, 2, 3], [1, 5, 3]) == 1
    bf16 = FixedLogits([20.0, 19.875, 3.0], torch.bfloat16)  # one unit in the last place apart at 20
    assert judge(bf16, [9], [7, 0, 4], [7, 1, 4]) == ("tie", 0.125)
    assert judge(bf16, [9], [7, 0], [7, 2]) == ("real", 17.0)
    fp32 = FixedLogits([20.0, 19.875, 3.0], torch.float32)  # the same gap is no rounding in float32
    assert judge(fp32, [9], [7, 0], [7, 1]) == ("real", 0.125)
    assert judge(fp32, [9], [7, 0], [7, 0]) is None
    kind, gap = judge(fp32, [9], [7, 0], [7])  # stopped early: no choice between two tokens
    assert kind == "real" and math.isnan(gap)
    bf16_eps, fp32_eps = torch.finfo(torch.bfloat16).eps, torch.finfo(torch.float32).eps
    assert tie_tolerance(20.0, bf16_eps) > 0.125 > tie_tolerance(20.0, fp32_eps)
    # one arithmetic on both sides (width-invariant steps): no tolerance, the bfloat16 tie is a real divergence
    assert judge(bf16, [9], [7, 0, 4], [7, 1, 4], exact=True) == ("real", 0.125)
    # 8-bit activations round at 2^-7 of a block's largest value: the float32 gap is within that arithmetic's tie
    assert judge(fp32, [9], [7, 0], [7, 1], step=INT8_STEP) == ("tie", 0.125)


# ---- before anything loads ---------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, expect", [
    (["--strategy", "ngram", "--gamma", "0"], "--gamma must be at least 1 for strategy 'ngram'"),
    (["--strategy", "ngram", "--set", "min_ngram=3", "--set", "max_ngram=2"], "min_ngram=3"),
    (["--strategy", "magicdec", "--set", "budget=0"], "--set budget=0"),
    (["--strategy", "dsi", "--draft", "smollm2-135m", "--set", "workers=0"], "--set workers=0"),
    (["--strategy", "dsi", "--draft", "smollm2-135m", "--temperature", "0.8"], "decodes greedily only"),
    (["--strategy", "draft", "--draft", "ngram"], "--draft ngram is not one"),
    (["--strategy", "adaptive-fsm", "--draft", "ngram", "--draft", "smollm2-135m"], "drafts with one --draft"),
    (["--strategy", "polybasic", "--draft", "ngram", "--draft", "smollm2-135m"], "can only be the last"),
])
def test_settings_are_checked_before_any_model_loads(capsys, monkeypatch, tmp_path, argv, expect):
    from sdbench.models.loading import loader

    def no_loading(*a, **k):
        raise AssertionError("a model or tokenizer was loaded before the settings were checked")

    monkeypatch.setattr(loader, "load_model", no_loading)
    monkeypatch.setattr(loader, "load_tokenizer", no_loading)
    code, _, err = run_cli(capsys, "run", *argv, "--out", str(tmp_path))
    assert code == 2 and expect in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_tokenizers_are_compared_before_any_weights_load(capsys, monkeypatch, tmp_path):
    from sdbench.models.loading import loader

    class Tok:
        eos_token_id = bos_token_id = 0

        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    monkeypatch.setattr(loader, "load_tokenizer", lambda name: Tok({"a": 0, "b": 1} if name == "t" else {"a": 0}))
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("weights loaded first"))
    code, _, err = run_cli(capsys, "run", "--target", "t", "--strategy", "draft", "--draft", "d", "--out",
                           str(tmp_path))
    assert code == 2 and "'t' and 'd' do not share a tokenizer" in err


def test_predict_names_the_option_typed(capsys):
    code, _, err = run_cli(capsys, "predict", "magicdec", "--context", "abc")
    assert code == 2 and "--context abc" in err and "--gamma" not in err


# ---- through the CLI on the embedded model -----------------------------------------------------------------

@pytest.mark.slow
def test_a_huge_gamma_is_capped_to_the_budget(capsys, tmp_path):
    code, out, err = run_cli(capsys, "run", "--strategy", "draft", "--draft", "smollm2-135m", "--gamma", "1000",
                             "--limit", "1", "--max-new-tokens", "8", "--out", str(tmp_path))
    assert code == 0, err
    assert "note: --gamma 1000 capped to 7" in out
    df = read_results([tmp_path])
    strat = df[df["role"] == "strategy"].iloc[0]
    assert json.loads(strat["params"])["gamma"] == 7 and strat["gamma"] == 7
    assert strat["drafted"] <= 7 and strat["accepted"] <= strat["drafted"]
    assert strat["mean_accepted_len"] * strat["steps"] <= strat["new_tokens"] - 1 + 1e-9
    assert (df["max_new_tokens"] == 8).all() and strat["lossless"]


@pytest.mark.slow
@pytest.mark.parametrize("cut_at, said", [(1, "during warm-up: nothing was saved"),
                                          (3, "before any batch finished: nothing was saved")])
def test_ctrl_c_before_anything_finished_leaves_nothing(capsys, tmp_path, monkeypatch, cut_at, said):
    calls = {"n": 0}
    real = benchmark.decode

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == cut_at:  # warm-up: calls 1 and 2 (baseline, strategy); the first batch: 3 and 4
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(benchmark, "decode", interrupted)
    code, _, err = run_cli(capsys, "run", "--limit", "1", "--max-new-tokens", "4", "--out", str(tmp_path))
    assert code == 130 and said in err and "--resume" not in err
    assert not list(tmp_path.iterdir())  # no RUN.config.json, no parts


@pytest.mark.slow
def test_a_bfloat16_tie_is_recorded_and_passes_the_gate(capsys, tmp_path):
    """In bfloat16 the target drafting for itself can differ from plain decoding where its two best logits
    round to the same value (on the project's CPU, mt-bench/157 of these 6 prompts at its 19th token, gap 0):
    recorded as a tie, it passes compare's lossless gate; a real divergence never may."""
    code, out, err = run_cli(capsys, "run", "--strategy", "draft", "--draft", "smollm2-135m", "--dtype", "bfloat16",
                             "--limit", "6", "--max-new-tokens", "24", "--turns", "1", "--out", str(tmp_path))
    assert code == 0, err
    strat = read_results([tmp_path]).query("role == 'strategy'")
    same = strat["lossless"].astype(bool)
    differing = strat[~same]
    assert (differing["divergence"] == "tie").all() and strat.loc[same, "divergence"].isna().all()
    assert ("tie)" in out) == (len(differing) > 0)  # said exactly when a row differs (the forced tie below: always)
    code, _, err = run_cli(capsys, "compare", str(tmp_path), str(tmp_path))
    assert code == 0, err


# --- a run that really ties, through the CLI --------------------------------------------------------------------


@pytest.fixture
def tied_model(tmp_path, monkeypatch):
    """A tiny model folder whose head row for token b is a copy of token a's, a being what plain decoding picks
    at a known position: there the two best logits are exactly equal, and argmax (the lower id) picks a.
    Returns (run arguments, prompt ids, plain output, position, a, b)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sdbench.data.tasks import encode_prompt, load_prompts
    from tests.references import hf_generate, tiny_model_dir

    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    folder = tiny_model_dir(tmp_path / "tied")
    data = tmp_path / "prompt.csv"
    data.write_text("prompt\n\"w4 w8 w15 w16 w23 w42\"\n")
    model = AutoModelForCausalLM.from_pretrained(folder)
    prompt = encode_prompt(load_prompts(str(data))[0], AutoTokenizer.from_pretrained(folder))
    plain = hf_generate(model, prompt, 16, eos=[2])
    at = next(i for i in range(3, 10) if plain[i] not in plain[:i] and plain[i] < max(set(range(3, 96)) - set(plain)))
    a, b = plain[at], max(set(range(3, 96)) - set(plain))
    with torch.no_grad():
        model.lm_head.weight[b] = model.lm_head.weight[a]
    model.save_pretrained(folder)
    assert hf_generate(model, prompt, 16, eos=[2]) == plain  # the tie changes nothing for plain decoding
    args = ["run", "--target", str(folder), "--strategy", "draft", "--draft", str(folder), "--gamma", "4",
            "--dataset", str(data), "--limit", "1", "--max-new-tokens", "16", "--repeats", "1"]
    return args, prompt, plain, at, a, b


def _nudged(monkeypatch, token: int, by: float | None):
    """Verification forwards (more than one token) round token's logit up: by one unit in the last place (None),
    as a forward of another shape may, or by `by`."""
    from sdbench.models.forward.runner import ModelRunner

    real = ModelRunner.run

    def run(self, cache, step):
        out = real(self, cache, step).clone()
        if step.width > 1:
            col = out[..., token]
            out[..., token] = torch.nextafter(col, torch.full_like(col, math.inf)) if by is None else col + by
        return out
    monkeypatch.setattr(ModelRunner, "run", run)


def test_a_forced_tie_is_recorded_as_a_tie_and_passes_the_gate(capsys, tmp_path, monkeypatch, tied_model):
    """On a path whose products are chosen per width (oneDNN's packed ones), a verification that rounds the tied
    logit up by one unit is a tie: recorded so, and compare lets it pass."""
    args, prompt, plain, at, a, b = tied_model
    monkeypatch.setenv("SDBENCH_CPU_FAST", "packed")
    _nudged(monkeypatch, b, None)
    code, out, err = run_cli(capsys, *args, "--out", str(tmp_path / "tie"))
    assert code == 0, err
    df = read_results([tmp_path / "tie"])
    base, strat = df[df.role == "baseline"].iloc[0], df[df.role == "strategy"].iloc[0]
    assert list(base.output_ids) == plain
    ours = list(strat.output_ids)
    assert first_difference(plain, ours) == at and (plain[at], ours[at]) == (a, b)  # b won the tie there
    assert not strat.lossless and strat.divergence == "tie" and strat.divergence_gap == 0.0
    assert strat.width_invariant == False  # noqa: E712 - numpy's bool
    assert "tie)" in out
    code, _, err = run_cli(capsys, "compare", str(tmp_path / "tie"), str(tmp_path / "tie"))
    assert code == 0, err


def test_no_tie_is_allowed_where_every_step_is_width_invariant(capsys, tmp_path, monkeypatch, tied_model):
    """On sdbench's fused steps over its own products a verification's rows are the bits of their tokens decoded
    alone: the same one-unit rounding, which only a bug can make there, is a real divergence, and compare fails it."""
    args, prompt, plain, at, a, b = tied_model
    code, out, err = run_cli(capsys, *args, "--out", str(tmp_path / "clean"))
    assert code == 0, err
    clean = read_results([tmp_path / "clean"])
    assert clean.width_invariant.all() and clean.lossless.dropna().all() and "✓ exact" in out
    _nudged(monkeypatch, b, None)
    code, out, err = run_cli(capsys, *args, "--out", str(tmp_path / "nudged"))
    assert code == 0, err
    strat = read_results([tmp_path / "nudged"]).query("role == 'strategy'").iloc[0]
    assert strat.width_invariant and not strat.lossless
    assert strat.divergence == "real" and strat.divergence_gap == 0.0  # a tie's gap, and still real: no tolerance
    code, _, err = run_cli(capsys, "compare", str(tmp_path / "nudged"), str(tmp_path / "nudged"))
    assert code == 1 and "Traceback" not in err


def test_a_real_divergence_is_recorded_as_real_and_fails_the_gate(capsys, tmp_path, monkeypatch, tied_model):
    args, prompt, plain, at, a, b = tied_model
    wrong = next(t for t in range(3, 96) if t not in (a, b) and t not in plain)
    _nudged(monkeypatch, wrong, 1e3)  # a verifier that prefers a token the model does not
    # --no-probe: the fidelity probe would catch this verifier and fall back to the generic runner, so no
    # divergence would be left for the gate to judge
    code, out, err = run_cli(capsys, *args, "--no-probe", "--out", str(tmp_path / "real"))
    assert code == 0, err
    strat = read_results([tmp_path / "real"]).query("role == 'strategy'").iloc[0]
    assert not strat.lossless and strat.divergence == "real" and strat.divergence_gap > 1.0
    code, _, err = run_cli(capsys, "compare", str(tmp_path / "real"), str(tmp_path / "real"))
    assert code == 1 and "Traceback" not in err
