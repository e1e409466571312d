"""DSpark against speculators' `DSparkDraftModel` (its Markov head of each kind and its confidence head, on the
same weights, saved by the reference and read by sdbench), then lossless decoding (greedy: the library's
generate on three families; sampled: chi-square against the exact marginals, with and without the confidence
cut), the confidence cut by hand, and one line for each bad folder or setting. speculators is installed by
`make setup` (requirements-reference.txt); in CI a missing one fails the test instead of skipping it."""

from __future__ import annotations

import pytest
import torch

try:
    import speculators.models.dspark  # noqa: F401
except ImportError:
    from tests.conftest import skip_unless_ci

    skip_unless_ci("the speculators package is not installed (make setup installs it)")

from sdbench.drafting.block import verified  # noqa: E402
from sdbench.engine.loop import generate  # noqa: E402
from sdbench.errors import SdbenchError  # noqa: E402
from sdbench.models.forward.runner import ModelRunner  # noqa: E402
from sdbench.models.heads.dspark import DSparkHead  # noqa: E402
from sdbench.models.heads.load import load_head  # noqa: E402
from sdbench.strategies.dspark import DSparkStrategy  # noqa: E402
from tests.conftest import run_cli  # noqa: E402
from tests.heads import dflash_dir, small_vocab_target  # noqa: E402
from tests.references import hf_generate, tiny_cli_files  # noqa: E402
from tests.test_dflash import BLOCK, GREEDY, H, V, _context, _layer, _randomise  # noqa: E402
from tests.test_tree_loop import POINTS, sampled, sampled_checks, warped_checks  # noqa: E402,F401


def _speculators_dspark(target, folder, kind: str, anchor: bool, draft_vocab: int | None, rank: int = 4):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = _layer()
    layer._attn_implementation = "eager"
    cfg = DSparkSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab or V, block_size=BLOCK,
        aux_hidden_state_layer_ids=[1, 3], mask_token_id=V - 1, sample_from_anchor=anchor, markov_rank=rank,
        markov_head_type=kind, enable_confidence_head=True, confidence_head_with_markov=True,
        speculators_config=SpeculatorsConfig(algorithm="dspark", proposal_methods=[GreedyTokenProposalConfig()],
                                             default_proposal_method="greedy",
                                             verifier=VerifierConfig(name_or_path=None, architectures=[])))
    model = DSparkDraftModel(cfg).eval()
    _randomise(model, 7)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        if draft_vocab is None:
            model.lm_head.weight.copy_(target.lm_head.weight)
    if draft_vocab is not None:
        ids = torch.arange(draft_vocab) * 2
        model.load_vocab_mappings(torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True),
                                  ids - torch.arange(draft_vocab))
    model.save_pretrained(folder)
    return model


def _theirs(model, states, ids, at: int, monkeypatch):
    """speculators' Markov-biased logits [BLOCK, Vd] and confidences [BLOCK] of the block anchored at `at`, each
    slot's previous token the data's (their forward's teacher forcing)."""
    import speculators.models.dflash.core as core

    T = ids.shape[1]
    monkeypatch.setattr(core, "select_anchors", lambda mask, n, bs: (torch.tensor([at]), torch.tensor([True])))
    with torch.no_grad():
        hidden, logits, *_ = model._backbone_forward(states, ids, torch.ones(1, T), torch.randn(1, T, H),
                                                     torch.zeros(1, T, dtype=torch.long), max_anchors=1)
        block = ids[:, at:at + BLOCK]
        prev = block if model.config.sample_from_anchor else torch.cat((block[:, :1], block[:, :-1]), 1)
        emb = model.markov_head.prev_embeddings(prev)
        hidden = hidden.view(1, BLOCK, -1)
        logits = logits.view(1, BLOCK, -1) + model.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden,
                                                                          prev_emb=emb)
        sure = model.confidence_head(torch.cat((hidden, emb), -1)).sigmoid()
    return logits[0], sure[0], prev[0]


def _ours(folder, target, states, ids, at: int, prev: torch.Tensor):
    runner = ModelRunner(target)
    head = DSparkHead(load_head(str(folder), runner, ("dspark",)), runner)
    cache = head.new_cache(1, 32)
    head.context(cache, states[:, :at], [0])
    out = head.block(cache, ids[:, at], [at])[0]
    state = out.new_zeros(1, head.rank) if head.kind == "rnn" else None
    rows = []
    for s in range(BLOCK):
        logits, sure, state = head.slot(out[s:s + 1], prev[s:s + 1], state)
        rows.append((logits[0], sure[0]))
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


@pytest.mark.parametrize("kind, anchor, draft_vocab", [("vanilla", True, None), ("vanilla", False, 6),
                                                       ("gated", True, 6), ("rnn", False, None), ("rnn", True, None)])
def test_slots_equal_speculators(tmp_path, monkeypatch, kind, anchor, draft_vocab):
    """Every slot's Markov-biased draft logits and confidence equal speculators' on the same weights and the same
    previous tokens."""
    target = small_vocab_target("qwen3", vocab=V)
    theirs = _speculators_dspark(target, tmp_path / "head", kind, anchor, draft_vocab)
    states, ids = _context()
    for at in (3, 6):
        logits, sure, prev = _theirs(theirs, states, ids, at, monkeypatch)
        ours, ours_sure = _ours(tmp_path / "head", target, states, ids, at, prev)
        torch.testing.assert_close(ours, logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours_sure, sure, atol=1e-6, rtol=1e-5)


def test_the_confidence_cut_by_hand():
    sure = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.5, 0.9, 0.9, 0.9], [0.05, 1.0, 1.0, 1.0]])
    # reach: 0.9 0.81 0.729 0.656 | 0.5 0.45 0.405 0.365 | 0.05 ...
    assert verified(sure, 0.7).tolist() == [3, 0, 0]
    assert verified(sure, 0.4).tolist() == [4, 3, 0]
    assert verified(sure, 0.0).tolist() == [4, 4, 4]


def _proposer(runner, folder, gamma: int, confidence: float):
    head = load_head(str(folder), runner, ("dspark",))
    return DSparkStrategy.proposer_for(head, runner, gamma, {"confidence": confidence})


@pytest.mark.parametrize("arch, kind", [("llama", "vanilla"), ("qwen2", "gated"), ("qwen3", "rnn")])
def test_greedy_dspark_decodes_as_generate(tmp_path, arch, kind):
    target = small_vocab_target(arch, vocab=4)
    runner = ModelRunner(target)
    folder = dflash_dir(tmp_path / "h", target, block=5, seed=2, anchor=True, dspark={"type": kind})
    prompts = [[1, 1, 2, 2, 1, 1, 3], [2, 2, 3, 1, 0, 1, 2, 1, 3, 3, 0, 2]]
    drafted = {}
    for gamma, confidence in ((5, 0.0), (5, 0.3), (2, 0.1)):
        out = generate(runner, _proposer(runner, folder, gamma, confidence), prompts, max_new_tokens=24,
                       sampling=GREEDY)
        assert out.output_ids == [hf_generate(target, p, 24) for p in prompts]
        assert sum(r.accepted for r in out.rows) > 0
        drafted[(gamma, confidence)] = sum(r.drafted for r in out.rows)
    assert 0 < drafted[(5, 0.3)] < drafted[(5, 0.0)]  # the cut verifies fewer drafts


def _sampled_proposer(runner, model, tmp_path, confidence: float = 0.0, kind: str = "vanilla"):
    folder = dflash_dir(tmp_path / "h", model, block=4, layer_ids=(1, 2), mask=0, anchor=True,
                        dspark={"type": kind})
    return _proposer(runner, folder, 3, confidence)


@pytest.mark.parametrize("confidence, kind", [(0.0, "vanilla"), (0.3, "rnn")])
def test_sampled_dspark_follows_the_targets_marginals(sampled, tmp_path, confidence, kind):  # noqa: F811
    model, marginals = sampled
    runner = ModelRunner(model)
    checks, out = sampled_checks(runner, _sampled_proposer(runner, model, tmp_path, confidence, kind), marginals)
    assert all(stat < bound for _, stat, bound in checks), checks
    assert sum(sum(r.accepted_per_position[1:]) for r in out.rows) > 0


@pytest.mark.parametrize("point", POINTS)
def test_sampled_dspark_follows_the_warped_marginals(sampled, tmp_path, point):  # noqa: F811
    model, _ = sampled
    runner = ModelRunner(model)
    checks, _ = warped_checks(runner, _sampled_proposer(runner, model, tmp_path, 0.2), model, point)
    assert all(stat < bound for _, stat, bound in checks), checks


def test_the_check_catches_drafts_verified_without_the_markov_bias(sampled, tmp_path, monkeypatch):  # noqa: F811
    """Drafts drawn with the Markov bias but verified against the unbiased distribution: the chi-square fails."""
    import sdbench.models.heads.dspark as dspark

    model, marginals = sampled
    runner = ModelRunner(model)
    real = DSparkHead.chain

    def chain(self, out, anchors, k, pick, stop=0.0):
        tokens, _, sure = real(self, out, anchors, k, pick, stop)
        unbiased = [pick(self.logits(out[:, self.first + i]))[1] for i in range(len(tokens))]  # the block's own
        return tokens, unbiased, sure
    monkeypatch.setattr(dspark.DSparkHead, "chain", chain)
    checks, _ = sampled_checks(runner, _sampled_proposer(runner, model, tmp_path), marginals)
    assert any(stat > bound for _, stat, bound in checks), checks


@pytest.mark.parametrize("change, says", [
    (lambda c: c.update(markov_head_type="lstm"), "markov_head_type 'lstm' is not one of vanilla, gated, rnn"),
    (lambda c: c.update(markov_rank=-1), "markov_rank in its config.json is -1"),
    (lambda c: c.update(markov_rank=0), "its confidence head reads the Markov head's embedding, but markov_rank is 0"),
    (lambda c: c.update(markov_rank=8), "markov_head.markov_w1.weight has shape"),
])
def test_bad_dspark_folders_are_one_line(tmp_path, change, says):
    import json

    target = small_vocab_target("qwen3", vocab=8)
    folder = dflash_dir(tmp_path / "h", target, dspark={})
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SdbenchError, match=says):
        load_head(str(folder), ModelRunner(target), ("dspark",))


def test_run_dspark_through_the_cli(tmp_path, capsys, monkeypatch):
    """`sdbench run --strategy dspark --head DIR`: lossless rows; a confidence out of range, a gamma past the block
    and a DFlash head are one line each."""
    import pandas as pd
    from transformers import AutoModelForCausalLM

    files = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w4 w1 w2", "w5 w6 w7"])
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    head = dflash_dir(tmp_path / "dspark", target, block=4, layer_ids=(1, 2), anchor=True, dspark={"type": "gated"})
    args = ["run", *files, "--max-new-tokens", "12", "--device", "cpu", "--strategy", "dspark", "--head", str(head)]
    code, out, err = run_cli(capsys, *args, "--gamma", "4", "--out", str(tmp_path / "out"))
    assert code == 0, err
    rows = pd.read_parquet(next((tmp_path / "out").glob("*.parquet")))
    mine = rows[rows.role != "baseline"]
    assert len(mine) == 2 and mine.lossless.all() and (mine.strategy == "dspark").all()
    for extra, says in ((["--gamma", "5"], f"--gamma 5: --head {head} drafts 4 tokens per block"),
                        (["--set", "confidence=1.5"], "--set confidence=1.5: must be at least 0 and below 1")):
        code, _, err = run_cli(capsys, *args, *extra, "--out", str(tmp_path / "o1"))
        assert code == 2 and says in err and "Traceback" not in err
    dflash = dflash_dir(tmp_path / "dflash", target, block=4, layer_ids=(1, 2))
    code, _, err = run_cli(capsys, *args[:-2], "--head", str(dflash), "--gamma", "3", "--out", str(tmp_path / "o2"))
    assert code != 0 and "is a dflash head, which --strategy dspark does not draft with: use --strategy dflash" in err


def _counted_drafter(tmp_path, monkeypatch, kind: str, anchor: bool, sure: list[float], confidence: float):
    """DSpark's drafter (`DSparkStrategy.drafter`, its cut at `confidence`) over a tiny head whose confidence head
    says `sure[b]` for row b at every slot, and a tally of its work: block forwards, slot reads (draft logits),
    confidences read and tokens picked."""
    import sdbench.drafting.block as block
    from types import SimpleNamespace

    target = small_vocab_target("qwen3", vocab=8)
    runner = ModelRunner(target)
    folder = dflash_dir(tmp_path / f"h-{kind}-{anchor}", target, block=5, anchor=anchor, dspark={"type": kind})
    drafter = DSparkStrategy.drafter(load_head(str(folder), runner, ("dspark",)), runner, 4,
                                     options={"confidence": confidence})
    head, work = drafter.head, {"block": 0, "slot reads": 0, "confidences": 0, "picks": 0}

    def counting(name, fn):
        def counted(*a, **k):
            work[name] += 1
            return fn(*a, **k)
        return counted

    monkeypatch.setattr(head, "block", counting("block", head.block))
    monkeypatch.setattr(head, "draft_logits", counting("slot reads", head.draft_logits))
    monkeypatch.setattr(head, "confidence", counting("confidences", lambda h, e: torch.tensor(sure)))
    monkeypatch.setattr(block, "choose", counting("picks", block.choose))
    drafter.begin(SimpleNamespace(sampling=GREEDY, generator=None, batch=len(sure), capacity=32))
    ctx = torch.tensor([[1, 2, 3, 4, 5, 6] + [0] * 26] * len(sure))
    return drafter, ctx, work


@pytest.mark.parametrize("kind, anchor", [("vanilla", True), ("rnn", False)])
def test_the_confidence_cut_saves_the_slots_it_skips_by_hand(tmp_path, monkeypatch, kind, anchor):
    """Two rows whose confidence head says 0.8 and 0.5 at every slot, 4 drafts asked, cut at 0.6: the reach is 0.8,
    0.64, 0.512 and 0.5, 0.25, 0.125, so row 0 verifies 2 drafts and row 1 none, and at the third slot both rows are
    below the cut: the chain stops there, having read 3 confidences and picked 2 tokens (the rnn head, whose anchor
    does not draft, reads the anchor's slot too, to step its state: one more slot read, no pick). One block
    forward whatever the cut. Without a cut: 4 slots picked, every draft verified."""
    extra = 1 if kind == "rnn" and not anchor else 0
    drafter, ctx, work = _counted_drafter(tmp_path, monkeypatch, kind, anchor, [0.8, 0.5], 0.6)
    proposal = drafter.draft(ctx, [6, 6], [4, 4])
    assert proposal.lengths.tolist() == [2, 0] and proposal.tokens.shape == (2, 2)
    assert work == {"block": 1, "slot reads": 2 + extra, "confidences": 3, "picks": 2}

    drafter, ctx, work = _counted_drafter(tmp_path, monkeypatch, kind, anchor, [0.8, 0.5], 0.0)
    proposal = drafter.draft(ctx, [6, 6], [4, 4])
    assert proposal.lengths.tolist() == [4, 4] and proposal.tokens.shape == (2, 4)
    assert work == {"block": 1, "slot reads": 4 + extra, "confidences": 4, "picks": 4}


def test_the_cut_stops_the_chain_only_where_every_row_is_below_it_by_hand(tmp_path, monkeypatch):
    """Row 0 at 0.95 a slot (reach 0.95, 0.9025, 0.857, 0.815) stays above a cut of 0.6 while row 1 (0.5) is below
    it from its first draft: the chain drafts all 4 slots for row 0, which verifies 4, and row 1 verifies none. A
    reach exactly at the cut is verified: at 0.5 a slot both rows reach 0.5, then 0.25, then 0.125, so a cut at
    0.25 verifies 2 drafts each and stops the chain at the third slot; a row's limit below its reach holds it.
    Rows below the cut from their first slot still draft that one (a proposal of no column is no block's), verify
    none, and stop at the second."""
    drafter, ctx, work = _counted_drafter(tmp_path, monkeypatch, "vanilla", True, [0.95, 0.5], 0.6)
    proposal = drafter.draft(ctx, [6, 6], [4, 4])
    assert proposal.lengths.tolist() == [4, 0]
    assert work == {"block": 1, "slot reads": 4, "confidences": 4, "picks": 4}

    drafter, ctx, work = _counted_drafter(tmp_path, monkeypatch, "vanilla", True, [0.5, 0.5], 0.25)
    proposal = drafter.draft(ctx, [6, 6], [4, 1])
    assert proposal.lengths.tolist() == [2, 1]
    assert work == {"block": 1, "slot reads": 2, "confidences": 3, "picks": 2}

    drafter, ctx, work = _counted_drafter(tmp_path, monkeypatch, "vanilla", True, [0.3, 0.2], 0.6)
    proposal = drafter.draft(ctx, [6, 6], [4, 4])
    assert proposal.lengths.tolist() == [0, 0] and proposal.tokens.shape == (2, 1)
    assert work == {"block": 1, "slot reads": 1, "confidences": 2, "picks": 1}
