"""Polybasic chains: lossless for 2, 3 and 4 levels, middle levels hand up their own distribution, per-level
records add up, the chain formulas on hand-computed values, the int8 copy, and the insertion test command."""

from __future__ import annotations

import json

import pytest
import torch

from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate
from sdbench.errors import SdbenchError
from sdbench.models.forward.runner import ModelRunner
from sdbench.models.loading.variants import quantise_int8, split_variant
from sdbench.engine.sampling import probs_from_logits
from sdbench.strategies import BuildContext, build_proposer
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.engine.state import DecodeState
from sdbench.strategies.chain_levels import ModelLevel
from sdbench.strategies.polybasic import Polybasic, PolybasicStrategy, parse_mu
from sdbench.analysis.theory import ChainCosts, insertion_times
from tests.conftest import VOCAB, second_token_chi_square, tiny_model
from tests.references import hf_generate, perturbed, tiny_pair

GREEDY = SamplingConfig()
NEW = 24


@pytest.fixture(scope="module")
def other_draft():
    return ModelRunner(tiny_model(2, layers=1, hidden=32, heads=2, kv=1), "tiny-draft-2")


def reference(target, prompts, eos=(), new=NEW):
    return generate(target, Autoregressive(), prompts, max_new_tokens=new, sampling=GREEDY, eos_ids=eos).output_ids


CHAINS = {  # name: (levels under the target, top down, (gamma, mu) settings to try)
    "2: small": (["small"], [(1, ""), (4, "")]),
    "2: ngram": (["ngram"], [(3, "")]),
    "3: target, small": (["target", "small"], [(1, ""), (3, "2"), (2, "5")]),
    "3: small, other": (["small", "other"], [(2, "2"), (4, "1")]),
    "3: small, ngram": (["small", "ngram"], [(3, ""), (1, "4")]),
    "4: target, small, ngram": (["target", "small", "ngram"], [(2, "5,2"), (3, "2")]),
    "4: other, small, ngram": (["other", "small", "ngram"], [(1, "3,2"), (2, "1")]),
    "4: target, other, small": (["target", "other", "small"], [(2, "4,2")]),
}


@pytest.fixture(scope="module")
def library_greedy(target, prompts):
    """transformers' greedy `generate` on the target, each repetitive prompt alone (the chains' reference)."""
    ps = [(p * 3)[:20] for p in prompts]  # repetitive prompts give an ngram bottom something to find
    return ps, [hf_generate(target.model, p, NEW) for p in ps]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", list(CHAINS))
def test_chains_match_greedy(target, small_draft, other_draft, library_greedy, batch, name):
    """Every chain's greedy output is transformers' `generate` on the target, token for token."""
    ps, ref = library_greedy[0][:batch], library_greedy[1][:batch]
    models = {"target": target, "small": small_draft, "other": other_draft, "ngram": "ngram"}
    levels, settings = CHAINS[name]
    for gamma, mu in settings:
        out = generate(target, Polybasic([models[m] for m in levels], gamma, mu), ps, max_new_tokens=NEW,
                       sampling=GREEDY)
        assert out.output_ids == ref, (gamma, mu)


@pytest.mark.parametrize("arch", ["qwen2"])
def test_chains_of_perturbed_families_match_the_library(arch, prompts):
    """Chains of 2, 3 and 4 levels over a family whose norms and biases are perturbed: each prompt's greedy
    output is transformers' `generate` on the target, in a batch of rows of different lengths."""
    target, draft = tiny_pair(arch, seed=3)
    third = perturbed(tiny_model(6, arch=arch, layers=1, hidden=32, heads=2, kv=1), 106)
    ps = [(p * 3)[:n] for p, n in zip(prompts, (20, 14, 9, 17))]
    ref = [hf_generate(target, p, NEW) for p in ps]
    runners = [ModelRunner(m, name) for m, name in ((target, "t"), (draft, "d"), (third, "e"))]
    for chain, gamma, mu in (([runners[1]], 3, ""), ([runners[1], "ngram"], 2, "3"),
                             ([runners[2], runners[1], "ngram"], 2, "4,2")):
        out = generate(runners[0], Polybasic(chain, gamma, mu), ps, max_new_tokens=NEW, sampling=GREEDY)
        assert out.output_ids == ref, len(chain)


def test_the_target_as_every_level_accepts_everything(target, prompts):
    proposer = Polybasic([target, target, target], 2, "6,3")
    whole = 1 + 3 * 9  # the first token and three target rounds of 9: no block is cut short by the budget
    out = generate(target, proposer, prompts, max_new_tokens=whole, sampling=GREEDY)
    assert out.output_ids == reference(target, prompts, new=whole)
    for b in range(len(prompts)):
        levels = proposer.row_stats(b)["levels"]
        for level in levels[1:]:
            assert level["accepted"] == level["proposed"] > 0
        # level 2 commits the bottom's 2 tokens plus a bonus per round, so one round reaches mu=3; level 1
        # commits those 3 plus a bonus per round and needs two rounds for mu=6: blocks of 8, the target 9
        assert levels[2]["mean_accepted_len"] == 3.0 and levels[1]["mean_accepted_len"] == 4.0
        assert levels[0]["mean_accepted_len"] == 9.0 and levels[1]["proposed"] == 8 * levels[1]["proposals"]


def test_eos_inside_a_draft(target, small_draft, other_draft, prompts):
    ref = reference(target, prompts)
    eos = ref[0][9]
    stopped = reference(target, prompts, eos=(eos,))
    assert stopped[0] == ref[0][: ref[0].index(eos) + 1]
    for chain in ([target, small_draft], [target, small_draft, "ngram"], [small_draft, other_draft, target]):
        out = generate(target, Polybasic(chain, 3, "2"), prompts, max_new_tokens=NEW, sampling=GREEDY,
                       eos_ids=(eos,))
        assert out.output_ids == stopped


def test_level_records_add_up(target, small_draft, prompts):
    ps = [(prompts[1] * 3)[:20]]
    proposer = Polybasic([target, small_draft, "ngram"], 2, "5,3", target_name=target.name)
    out = generate(target, proposer, ps, max_new_tokens=NEW, sampling=GREEDY)
    row = out.rows[0]
    top, first, second, bottom = proposer.row_stats(0)["levels"]
    assert [lv["model"] for lv in (top, first, second, bottom)] == ["tiny-target", "tiny-target", "tiny-draft", "ngram"]
    assert top["rounds"] == top["forwards"] == first["proposals"] == row.steps
    assert first["proposed"] == row.drafted and first["accepted"] == row.accepted
    assert first["accepted"] == first["proposed"]  # the target agrees with itself
    assert top["mean_accepted_len"] == (row.accepted + row.steps) / row.steps
    for upper, lower in ((first, second), (second, bottom)):
        assert upper["rounds"] == upper["forwards"] == lower["proposals"]  # one forward per round, batch 1
        assert upper["committed"] == lower["accepted"] + upper["rounds"]
        assert upper["committed"] == upper["proposed"]  # every token a middle level commits is handed up
        assert upper["proposed"] >= {1: 5, 2: 3}[upper["level"]] * upper["proposals"]
    assert bottom["forwards"] == bottom["blocks"] == second["rounds"]
    json.dumps(proposer.row_stats(0))


def test_middle_level_hands_up_its_own_distribution(target, small_draft, prompts):
    """Under sampling, each handed-up token carries the middle model's q given the tokens before it, also
    after the context changed under the level's cache (the prefix check must drop what no longer holds)."""
    cfg = SamplingConfig(temperature=1.0)
    g = torch.Generator().manual_seed(3)
    middle = ModelLevel(small_draft, below=ModelLevel(target, gamma=2), mu=4)
    rows = [p + [1] for p in prompts[:3]]
    cap = 128
    state = DecodeState.for_prompts(rows, cap, cap, sampling=cfg, generator=g)
    middle.begin(state)
    ctx = state.tokens
    lens = [len(r) for r in rows]
    for attempt in range(3):
        block = middle.produce(ctx, lens, [True] * len(rows), [1 << 30] * len(rows))
        assert block.probs is not None and (block.lengths >= 4).all()
        for b, n in enumerate(lens):
            seq = ctx[b, :n].tolist() + block.tokens[b, : block.lengths[b]].tolist()
            with torch.no_grad():
                q = probs_from_logits(small_draft.model(torch.tensor([seq])).logits[0], cfg)  # [S, V]
            k = int(block.lengths[b])
            assert torch.allclose(block.probs[b, :k], q[n - 1 : n - 1 + k], atol=1e-5)
        # commit part of the block and a token of our own, as a target round would
        for b in range(len(rows)):
            keep = attempt + 1
            new = block.tokens[b, :keep].tolist() + [(block.tokens[b, keep].item() + 1) % VOCAB]
            ctx[b, lens[b] : lens[b] + len(new)] = torch.tensor(new)
            lens[b] += len(new)


def test_sampling_follows_target_distribution(target, small_draft, other_draft):
    """A 3-level chain under sampling: the token decided by the first verification is distributed as the
    target's (as tests/test_decode.py checks for one draft)."""
    proposer = Polybasic([small_draft, other_draft], 2, "3")
    stat, dof, out = second_token_chi_square(target, proposer, SamplingConfig(1.0, 0.95))
    assert stat < dof + 5 * (2 * dof) ** 0.5, f"chi-square {stat:.1f} with {dof} dof"
    middle = [proposer.row_stats(b)["levels"][1] for b in range(len(out.output_ids))]
    accepted, proposed = sum(m["accepted"] for m in middle), sum(m["proposed"] for m in middle)
    assert 0 < accepted < proposed


def test_settings_and_bad_chains(target, small_draft):
    assert parse_mu("", 2, 3) == [12, 6] and parse_mu("", 1, 4) == [8] and parse_mu("", 0, 4) == []
    assert parse_mu("5", 2, 3) == [5, 5] and parse_mu("9,4", 2, 3) == [9, 4]
    for chain, gamma, mu, expect in (
        ([small_draft], 4, "3", "chain of one draft has none"),
        ([small_draft, target], 4, "1,2", "expected one value >= 1, or 1"),
        ([small_draft, target], 4, "x", "expected whole numbers"),
        ([small_draft, target], 4, "0", "expected one value >= 1"),
        (["ngram", small_draft], 4, "", "only be the last"),
        ([], 4, "", "needs --draft"),
        ([small_draft], 0, "", "--gamma must be at least 1"),
    ):
        with pytest.raises(SdbenchError, match=expect):
            build_proposer("polybasic", BuildContext(target, chain, gamma, {"mu": mu}))
    proposer = build_proposer("polybasic", BuildContext(target, [target, small_draft, "ngram"], 3, {"mu": "10"}))
    assert proposer.params() == {"gamma": 3, "mu": [10, 10], "chain": ["tiny-target", "tiny-draft", "ngram"],
                                 "max_ngram": 3, "min_ngram": 1}
    assert proposer.max_lookahead == 3 + 10 + 10


def test_chain_formula_by_hand():
    # target 10 ms, middle 4 ms, bottom model 1 ms x gamma 3 forwards per block
    costs = ChainCosts((0.010, 0.004, 0.001), (5.0, 2.0), (8.0,), 3.0)
    # C_2 = 3 * 1 = 3 ms; C_1 = 8 / 2 * (4 + 3) = 28 ms; tau = (10 + 28) / 5 = 7.6 ms
    assert costs.block_cost(2) == pytest.approx(0.003) and costs.block_cost(1) == pytest.approx(0.028)
    assert costs.time_per_token() == pytest.approx(0.0076)
    f = costs.forwards_per_token()
    assert f == pytest.approx([0.2, 0.8, 2.4])  # 1/5; 1/5 * 8/2; then 3 bottom forwards per middle round
    assert sum(fi * t for fi, t in zip(f, costs.costs)) == pytest.approx(costs.time_per_token())
    # the simple form: 10/5 + 4/2 + 3 * 1/2 = 5.5 ms
    assert costs.seed_time_per_token() == pytest.approx(0.0055)
    two = ChainCosts((0.010, 0.001), (3.0,), (), 4.0)  # draft-model SD: (T + gamma * T_d) / L
    assert two.time_per_token() == pytest.approx(0.014 / 3) == pytest.approx(two.seed_time_per_token())
    with pytest.raises(ValueError):
        ChainCosts((0.01, 0.001), (3.0, 2.0), (), 4.0)


def test_insertion_condition_by_hand():
    # target 10 ms; the old chain below it costs 2 ms per block and gets L = 2. With the candidate the target
    # verifies longer blocks (12 ms); the candidate costs 3 ms per forward, commits 1.5 tokens per round over
    # the old blocks, hands up 6 tokens, and the target then accepts L' = 5.
    # old = (10 + 2) / 2 = 6 ms; new = (12 + 6 / 1.5 * (3 + 2)) / 5 = 6.4 ms: it does not pay
    old, new = insertion_times(0.010, 0.002, 2.0, 0.012, 0.003, 1.5, 6.0, 5.0)
    assert old == pytest.approx(0.006) and new == pytest.approx(0.0064)
    assert insertion_times(0.010, 0.002, 2.0, 0.012, 0.003, 1.5, 6.0, 5.5)[1] < old  # with L' = 5.5 it pays
    # for an insertion under the target, the condition is the comparison of the two chains' formulas
    before = ChainCosts((0.010, 0.001), (2.0,), (), 2.0)
    after = ChainCosts((0.012, 0.003, 0.001), (5.0, 1.5), (6.0,), 2.0)
    assert (old, new) == pytest.approx((before.time_per_token(), after.time_per_token()))
    from sdbench.analysis.chain import insertion_verdict

    assert insertion_verdict(before, after, 0) == pytest.approx((old, new))


def test_paper_insertion_condition_by_hand():
    from sdbench.analysis.chain import paper_verdict
    from sdbench.analysis.theory import paper_insertion_times

    # under the target, above an n-gram bottom (1 lookup of 0.1 ms per block): T_j = 10 ms, L_j = 2;
    # the candidate: T_c = 3 ms, L_c = 1.5, and the target then accepts L'_j = 5
    # old = (10 + 0.1) / 2 = 5.05 ms; new = 10 / 5 + (3 + 0.1) / 1.5 = 4.0667 ms
    old, new = paper_insertion_times(0.010, 2.0, 5.0, 0.003, 1.5, bottom_cost=0.0001)
    assert old == pytest.approx(0.00505) and new == pytest.approx(0.002 + 0.0031 / 1.5)
    # with T'_j = T_j the paper's condition is the comparison of the two chains' simple forms, whether the
    # candidate lands above the bottom (terms with b_k T_k) or higher up (where the bottom's term cancels)
    before = ChainCosts((0.010, 0.0001), (2.0,), (), 1.0)
    after = ChainCosts((0.010, 0.003, 0.0001), (5.0, 1.5), (6.0,), 1.0)
    assert paper_verdict(before, after, 0) == pytest.approx((before.seed_time_per_token(),
                                                             after.seed_time_per_token()))
    deep = ChainCosts((0.010, 0.004, 0.001), (4.0, 2.0), (6.0,), 3.0)
    deeper = ChainCosts((0.010, 0.003, 0.004, 0.001), (4.0, 3.0, 2.0), (9.0, 6.0), 3.0)  # c under level 0
    p_old, p_new = paper_verdict(deep, deeper, 0)
    assert p_new - p_old == pytest.approx(deeper.seed_time_per_token() - deep.seed_time_per_token())
    assert (p_old, p_new) == pytest.approx((0.010 / 4.0, 0.010 / 4.0 + 0.003 / 3.0))


def test_insertion_under_the_bottom_by_hand():
    from sdbench.analysis.chain import insertion_verdict, paper_verdict
    from sdbench.commands.predict_chain import check_insertion

    # target 10 ms over a model bottom of 2 ms drafting 4 per block (L = 3); with an n-gram of 0.1 ms under it
    # the bottom verifies (3 ms per forward, L' = 2, blocks of 8) and the target accepts L' = 5
    before = ChainCosts((0.010, 0.002), (3.0,), (), 4.0)
    after = ChainCosts((0.011, 0.003, 0.0001), (5.0, 2.0), (8.0,), 1.0)
    # sdbench's form: the two chains' times per token (the level above the old bottom is the target)
    assert insertion_verdict(before, after, 1) == pytest.approx((before.time_per_token(), after.time_per_token()))
    assert before.time_per_token() == pytest.approx(0.018 / 3)  # (10 + 4 * 2) / 3
    assert after.time_per_token() == pytest.approx((0.011 + 8 / 2 * 0.0031) / 5)
    # the paper's: (T_j + b_k T_k) / L_j against T_j / L'_j + (T'_b + b_c T_c) / L'_b, T_j the old 10 ms
    assert paper_verdict(before, after, 1) == pytest.approx((0.018 / 3, 0.010 / 5 + 0.0031 / 2))
    # deeper: under the bottom of target <- A <- B the level compared is A's
    deep = ChainCosts((0.010, 0.004, 0.001), (4.0, 2.0), (6.0,), 3.0)
    deeper = ChainCosts((0.010, 0.004, 0.002, 0.0001), (4.5, 2.5, 1.5), (6.0, 5.0), 1.0)
    old, new = insertion_verdict(deep, deeper, 2)
    assert old == pytest.approx((0.004 + 0.003) / 2.0) == pytest.approx(deep.level_token_cost(1))
    assert new == pytest.approx((0.004 + 5.0 / 1.5 * (0.002 + 0.0001)) / 2.5)
    assert check_insertion(["a", "b"], 2) == ["a", "b", None] and check_insertion(["ngram"], 0) == [None, "ngram"]
    with pytest.raises(SdbenchError, match="--at 1"):
        check_insertion(["ngram"], 1)


def test_accepted_length_variance_by_hand():
    from sdbench.strategies.chain_levels import length_variance
    from sdbench.analysis.theory import accepted_length_variance

    assert accepted_length_variance(0.5, 1) == pytest.approx(0.25)  # 1 or 2 tokens, evenly
    # gamma 2, alpha 0.5: 1, 2, 3 tokens with 1/2, 1/4, 1/4: mean 1.75, E[L^2] = 0.5 + 1 + 2.25
    assert accepted_length_variance(0.5, 2) == pytest.approx(3.75 - 1.75 ** 2)
    assert accepted_length_variance(0.0, 4) == 0.0 == accepted_length_variance(1.0, 4)
    assert length_variance(1 + 3 + 3 + 1, 1 + 9 + 9 + 1, 4) == pytest.approx(1.0)
    assert length_variance(0, 0, 0) != length_variance(0, 0, 0)  # NaN without a round


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(1.0)])
def test_level_records_carry_the_accepted_length_variance(target, small_draft, other_draft, prompts, sampling):
    from sdbench.analysis.chain import spread_from_records

    proposer = Polybasic([small_draft, other_draft], 2, "3", target_name=target.name)
    out = generate(target, proposer, prompts[:2], max_new_tokens=NEW, sampling=sampling,
                   generator=torch.Generator().manual_seed(0))
    records = [stats["levels"] for stats in out.extras]
    for levels in records:
        for lv in levels[:-1]:  # every verifying level: E[L^2] - E[L]^2 from its own sums
            n, total, sq = lv["rounds"], lv["committed"], lv["committed_sq"]
            assert n > 0 and sq >= total and lv["accepted_len_var"] == pytest.approx(sq / n - (total / n) ** 2)
        assert levels[-1]["accepted_len_var"] is None  # the bottom verifies nothing
    spread = spread_from_records(records)
    assert [s.model for s in spread] == [target.name, "tiny-draft"]
    top = spread[0]
    assert top.rounds == sum(r.steps for r in out.rows) and top.var >= 0 and top.iid_var >= 0
    json.dumps(out.extras)


def test_int8_copy_is_a_lossless_middle_level(target, prompts):
    quantised = ModelRunner(quantise_int8(target.model), "tiny-target@int8")
    layer = quantised.layers[0].self_attn.q_proj
    assert "quantized" in type(layer).__module__ and target.layers[0].self_attn.q_proj is not layer
    with torch.no_grad():
        x = torch.tensor([prompts[1]])
        a, b = target.model(x).logits, quantised.model(x).logits
    assert not torch.equal(a, b)  # a different model, but a close one
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.5
    ref = reference(target, prompts)
    proposer = Polybasic([quantised, "ngram"], 3, "4")
    out = generate(target, proposer, prompts, max_new_tokens=NEW, sampling=GREEDY)
    assert out.output_ids == ref
    assert sum(proposer.row_stats(b)["levels"][1]["accepted"] for b in range(len(prompts))) > 0


def test_variant_names():
    assert split_variant("smollm2-135m@int8") == ("smollm2-135m", "int8")
    assert split_variant("smollm2-135m") == ("smollm2-135m", None)
    assert split_variant("./models/x@y.z") == ("./models/x@y.z", None)
    with pytest.raises(SdbenchError, match="unknown variant '@int3'"):
        split_variant("smollm2-135m@int3")
    with pytest.raises(SdbenchError, match="--dtype float32"):
        quantise_int8(tiny_model(0).to(torch.bfloat16))


def test_predict_chain_passes_settings(capsys, monkeypatch):
    import sdbench.commands.predict_chain as cp
    from sdbench.cli import main
    from sdbench.config import PredictChainConfig

    seen = {}
    monkeypatch.setattr(cp, "run_chain_prediction", lambda *args: seen.setdefault("args", args))
    main(["predict", "chain", "--target", "m", "--draft", "a", "--draft", "ngram", "--candidate", "c@int8", "--at",
          "1", "--gamma", "3", "--mu", "6", "--limit", "2", "--max-new-tokens", "20", "--profile-prompts", "1",
          "--profile-tokens", "5", "--dataset", "gsm8k", "--seed", "4", "--temperature", "0.5"])
    assert seen["args"][0] == PredictChainConfig("m", ("a", "ngram"), "c@int8", 1, 3, "6", "gsm8k", 2, 20, 1, 5, "cpu",
                                                 "float32", 4, 0.5)


@pytest.mark.parametrize("argv, expect", [
    ([], "needs the chain as it is"),
    (["--draft", "ngram", "--at", "1"], "--at 1"),
    (["--draft", "ngram", "--draft", "x"], "only be the last"),
    (["--draft", "x", "--mu", "0"], "mu=0: expected one value >= 1"),
    (["--draft", "ngram", "--profile-tokens", "0"], "--profile-tokens must be at least 1"),
    (["--draft", "ngram", "--gamma", "0"], "--gamma must be at least 1"),
    (["--draft", "ngram", "--temperature", "-1"], "--temperature -1.0: expected 0"),
])
def test_predict_chain_bad_input_is_one_line(capsys, argv, expect):
    from sdbench.cli import main

    with pytest.raises(SystemExit) as e:
        main(["predict", "chain", "--candidate", "smollm2-135m@int8", *argv])
    assert e.value.code != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and expect in err and len(err.splitlines()) == 1


def assert_verdicts_follow_the_printed_times(out: str) -> dict:
    """Each verdict of `predict chain` recomputed from the times it prints: predicted to help when the new time
    is below the old one, helped when the measured time with the candidate is, right when the two agree."""
    import re

    lines = out.splitlines()
    ours = re.search(r"costs ([\d.]+) ms now, ([\d.]+) ms with it -> predicted to (help|hurt)$",
                     next(line for line in lines if line.startswith("insertion test,")))
    measured = re.search(r"^measured: ([\d.]+) -> ([\d.]+) ms/token, it (helped|hurt): the test (.+)$",
                         next(line for line in lines if line.startswith("measured:")))
    paper = re.search(r": ([\d.]+) vs ([\d.]+) ms -> predicted to (help|hurt): it (called it right|got it wrong)"
                      r"( \(sdbench test and paper disagree\))?$",
                      next(line for line in lines if line.startswith("Theorem 3.2")))
    t_old, t_new, p_new, p_old, m_old, m_new = (float(x) for x in (*ours.group(1, 2), *paper.group(1, 2),
                                                                   *measured.group(1, 2)))
    helps, paper_helps, helped = ours.group(3) == "help", paper.group(3) == "help", measured.group(3) == "helped"
    for new, old, said in ((t_new, t_old, helps), (p_new, p_old, paper_helps), (m_new, m_old, helped)):
        assert new != old and said == (new < old)  # printed to 0.1 ms: a tie there would be undecidable
    assert measured.group(4) == ("called it right" if helps == helped else "got it wrong")
    assert paper.group(4) == ("called it right" if paper_helps == helped else "got it wrong")
    assert bool(paper.group(5)) == (paper_helps != helps)
    return {"ours": (t_old, t_new), "paper": (p_old, p_new), "measured": (m_old, m_new)}


@pytest.mark.parametrize("with_candidate_ms, ours, paper", [(7.0, "called it right", "got it wrong"),
                                                            (5.0, "got it wrong", "called it right")])
def test_the_insertion_verdicts_by_hand(capsys, with_candidate_ms, ours, paper):
    """The chain target <- 1 ms draft (gamma 2, L = 2) measured at 6.5 ms per token; with a 3 ms candidate under
    the target (L_c = 1.5, blocks of 6, the target's forward 12 ms, L' = 5): sdbench's test predicts
    (12 + 6 / 1.5 * (3 + 2)) / 5 = 6.4 ms against (10 + 2) / 2 = 6.0 ms, it hurts; the paper's predicts
    10 / 5 + (3 + 2) / 1.5 = 5.3 ms against 6.0 ms, it helps. Whichever the measurement says, one is right."""
    from rich.console import Console

    from sdbench.analysis.chain import ChainRun
    from sdbench.commands.predict_chain import print_chain_report

    same = [[1, 2, 3]]
    runs = [ChainRun("plain", [], profile_forward_s=0.010, seconds=1.0, tokens=100, outputs=same),
            ChainRun("chain", ["d"], ChainCosts((0.010, 0.001), (2.0,), (), 2.0), seconds=0.65, tokens=100,
                     outputs=same),
            ChainRun("with candidate", ["c", "d"], ChainCosts((0.012, 0.003, 0.001), (5.0, 1.5), (6.0,), 2.0),
                     seconds=with_candidate_ms / 10, tokens=100, outputs=same)]
    print_chain_report(runs, "t", "c", 0, Console(width=400))
    out = capsys.readouterr().out
    assert assert_verdicts_follow_the_printed_times(out) == {"ours": (6.0, 6.4), "paper": (6.0, 5.3),
                                                             "measured": (6.5, with_candidate_ms)}
    assert f"the test {ours}" in out and f"it {paper} (sdbench test and paper disagree)" in out


@pytest.mark.slow
def test_predict_chain_command_on_smollm2(capsys):
    from sdbench.cli import main

    main(["predict", "chain", "--target", "smollm2-135m", "--draft", "ngram", "--candidate", "smollm2-135m@int8",
          "--limit", "1", "--max-new-tokens", "8", "--profile-prompts", "1", "--profile-tokens", "6", "--gamma", "2"])
    out = capsys.readouterr().out
    assert "with candidate" in out and "smollm2-135m@int8" in out
    assert "insertion test, smollm2-135m@int8 under smollm2-135m: a token of smollm2-135m costs" in out
    assert "NO" not in out  # every system produced plain decoding's tokens
    paper_line = next(line for line in out.splitlines() if line.startswith("Theorem 3.2 as sdbench reads the paper"))
    assert "T_j / L'_j + T_c / L_c + b_k T_k / L_c < T_j / L_j + b_k T_k / L_j" in paper_line
    assert_verdicts_follow_the_printed_times(out)
    assert "greedy var" in out and "sampling var" in out


@pytest.mark.slow
def test_run_records_levels_on_smollm2(capsys, tmp_path):
    from sdbench.cli import main
    from sdbench.reporting.results import read_results

    main(["run", "--strategy", "polybasic", "--draft", "smollm2-135m@int8", "--draft", "ngram", "--gamma", "2",
          "--set", "mu=3", "--limit", "1", "--max-new-tokens", "8", "--out", str(tmp_path)])
    rows = read_results([str(tmp_path)])
    strategy = rows[rows["role"] == "strategy"].iloc[0]
    assert bool(strategy["lossless"]) and strategy["draft"] == "smollm2-135m@int8,ngram"
    assert json.loads(strategy["params"]) == {"gamma": 2, "mu": [3], "chain": ["smollm2-135m@int8", "ngram"],
                                              "max_ngram": 3, "min_ngram": 1}
    levels = json.loads(strategy["strategy_stats"])["levels"]
    assert [lv["model"] for lv in levels] == ["smollm2-135m", "smollm2-135m@int8", "ngram"]
    assert levels[1]["proposals"] == strategy["steps"] and levels[1]["accepted"] == strategy["accepted"]


def test_search_space_keeps_the_chain_whole():
    from sdbench.strategies.spec import SearchContext

    class Trial:
        def suggest_int(self, name, low, high):
            return {"gamma": 3, "mu": 7}[name]

    assert PolybasicStrategy.search_space(Trial(), SearchContext(("a", "ngram"))) == (3, {"mu": "7"}, ("a", "ngram"))
    assert PolybasicStrategy.search_space(Trial(), SearchContext(("a",))) == (3, {}, ("a",))
