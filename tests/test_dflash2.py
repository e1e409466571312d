"""DFlash 2 (convolutions along the block, a candidate selector drafting each slot given the one before it) against
its two independent implementations and against plain decoding.

References: the `speculators` package's `DFlash2DraftModel` and z-lab's `dflash` package's `DFlash2DraftModel`,
each given random weights and saving its own folder, which sdbench reads: speculators' selector scores of every
slot's candidates (its training forward, each slot given the true token before it) and z-lab's block output, greedy
proposal and per-slot draft distribution equal sdbench's. Then lossless sampled decoding (chi-square against the exact
marginals); greedy decoding on three families and bad folders are test_dflash.py's. The references
are installed by `make setup` (requirements-reference.txt); in CI a missing one fails the test instead of skipping
it."""

from __future__ import annotations


import pytest
import torch

try:
    import dflash.model  # noqa: F401
    import speculators.models.dflash2  # noqa: F401
except ImportError:
    from tests.conftest import skip_unless_ci

    skip_unless_ci("the speculators or dflash package is not installed (make setup installs them)")

from sdbench.models.forward.runner import ModelRunner  # noqa: E402
from sdbench.models.heads.dflash2 import DFlash2Head  # noqa: E402
from sdbench.models.heads.load import load_head  # noqa: E402
from sdbench.strategies.dflash import DFlashStrategy  # noqa: E402
from tests.conftest import run_cli  # noqa: E402
from tests.heads import dflash_dir, small_vocab_target  # noqa: E402
from tests.references import tiny_cli_files  # noqa: E402
from tests.test_dflash import BLOCK, V, _context, _speculators_head, _zlab_head, speculators_block, zlab_block  # noqa: E402
from tests.test_tree_loop import POINTS, sampled, sampled_checks, warped_checks  # noqa: E402,F401

SETTINGS = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 5}


def _ours(folder, target, states, ids, at: int):
    """sdbench's head on the folder, the context before `at` written, and its block's outputs [1, BLOCK, H]."""
    runner = ModelRunner(target)
    head = DFlash2Head(load_head(str(folder), runner, ("dflash2",)), runner)
    cache = head.new_cache(1, 32)
    head.context(cache, states[:, :at], [0])
    return head, head.block(cache, ids[:, at], [at])


def test_selector_scores_equal_speculators(tmp_path, monkeypatch):
    """Every drafting slot's candidates (the unary top-k) rescored by the selector, the true token before the slot
    as its predecessor (speculators' training forward), through the convolved layers: sdbench's scores at those
    candidates equal speculators' within 1e-5, and every other token is out."""
    target = small_vocab_target("qwen3", vocab=V)
    theirs = _speculators_head(target, tmp_path / "head", None, False, "dflash2", SETTINGS)
    states, ids = _context()
    for at in (3, 6):
        hidden, unary, _, _, where = speculators_block(theirs, states, ids, at, monkeypatch)
        with torch.no_grad():
            before = theirs._predecessor_ids(ids, where).reshape(1, -1)
            candidates = unary.topk(SETTINGS["selector_top_k"], dim=-1).indices
            scores = theirs.candidate_selector.score_candidates(unary, hidden, before, candidates)[0]
        head, out = _ours(tmp_path / "head", target, states, ids, at)
        for s in range(1, BLOCK):
            ours = head.scores(out[:, s], ids[:, at + s - 1])[0]
            torch.testing.assert_close(ours.gather(0, candidates[0, s]), scores[s], atol=1e-5, rtol=1e-5)
            assert torch.isinf(ours).sum() == V - SETTINGS["selector_top_k"]


def test_block_and_proposals_equal_zlab(tmp_path):
    """z-lab's DFlash2DraftModel on its own folder: its block output, its greedy proposal and, at temperature 1, the
    distribution each slot's draft is drawn from (given its own draws before it) are sdbench's."""
    target = small_vocab_target("qwen3", vocab=V)
    theirs = _zlab_head(tmp_path / "head", architecture="DFlash2DraftModel", extra=SETTINGS)
    states, ids = _context()
    for at in (3, 6):
        block, full = zlab_block(theirs, target, states, ids, at)
        with torch.no_grad():
            greedy, _, _ = theirs.propose(full[:, 1:], block[:, 0], target.lm_head, 0.0)
            torch.manual_seed(at)
            path, candidates, q = theirs.propose(full[:, 1:], block[:, 0], target.lm_head, 1.0)
        head, out = _ours(tmp_path / "head", target, states, ids, at)
        torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)
        tokens, _, _ = head.chain(out, block[:, 0], BLOCK - 1, lambda lg: (lg.argmax(-1), None))
        assert torch.stack(tokens, 1).tolist() == greedy.tolist()
        given = iter(path[0])
        _, probs, _ = head.chain(out, block[:, 0], BLOCK - 1,
                                 lambda lg: (next(given)[None], torch.softmax(lg, -1)))
        for s, p in enumerate(probs):
            torch.testing.assert_close(p[0].gather(0, candidates[0, s]), q[0, s], atol=1e-5, rtol=1e-5)


def _sampled_proposer(runner, model, tmp_path):
    folder = dflash_dir(tmp_path / "h", model, block=4, layer_ids=(1, 2), mask=0,
                        dflash2={**SETTINGS, "conv_group_size": 16, "selector_top_k": 3})
    return DFlashStrategy.proposer_for(load_head(str(folder), runner, ("dflash2",)), runner, 3)


@pytest.mark.parametrize("point", [None, *POINTS])
def test_sampled_dflash2_follows_the_exact_marginals(sampled, tmp_path, point):  # noqa: F811
    """At T = 1 (point None) and two warped settings: every position's tokens against the target's own marginals."""
    model, marginals = sampled
    runner = ModelRunner(model)
    proposer = _sampled_proposer(runner, model, tmp_path)
    checks, out = (sampled_checks(runner, proposer, marginals) if point is None
                   else warped_checks(runner, proposer, model, point))
    assert all(stat < bound for _, stat, bound in checks), checks
    assert point is not None or sum(sum(r.accepted_per_position[1:]) for r in out.rows) > 0  # second drafts too


def test_the_check_catches_drafts_verified_without_the_selector(sampled, tmp_path, monkeypatch):  # noqa: F811
    """Drafts drawn from the selector's scores but verified against the plain unary distribution: the chi-square
    fails (so the test above would catch a selector left out of the probabilities verification is given)."""
    model, marginals = sampled
    runner = ModelRunner(model)
    real = DFlash2Head.scores
    monkeypatch.setattr(DFlash2Head, "chain", lambda self, out, anchors, k, pick, stop=0.0: _unary_probs(
        self, out, anchors, k, pick, real))
    checks, _ = sampled_checks(runner, _sampled_proposer(runner, model, tmp_path), marginals)
    assert any(stat > bound for _, stat, bound in checks), checks


def _unary_probs(head, out, anchors, k, pick, scores):
    prev, tokens, probs = anchors, [], []
    for s in range(head.first, head.first + k):
        token, _ = pick(scores(head, out[:, s], prev))
        _, p = pick(head.logits(out[:, s]))
        tokens.append(token)
        probs.append(p)
        prev = token
    return tokens, probs, None


def test_run_dflash2_through_the_cli(tmp_path, capsys, monkeypatch):
    """`sdbench run --strategy dflash --head DIR` with a DFlash 2 head (z-lab's layout): lossless rows; the head to
    --strategy dspark is one line naming dflash."""
    import pandas as pd
    from transformers import AutoModelForCausalLM

    files = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w4 w1 w2", "w5 w6 w7"])
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    head = dflash_dir(tmp_path / "d2", target, fmt="zlab", block=4, layer_ids=(1, 2),
                      dflash2={**SETTINGS, "conv_group_size": target.config.hidden_size // 2})
    args = ["run", *files, "--max-new-tokens", "12", "--device", "cpu", "--gamma", "3", "--head", str(head)]
    code, _, err = run_cli(capsys, *args, "--strategy", "dflash", "--out", str(tmp_path / "out"))
    assert code == 0, err
    rows = pd.read_parquet(next((tmp_path / "out").glob("*.parquet")))
    mine = rows[rows.role != "baseline"]
    assert len(mine) == 2 and mine.lossless.all() and (mine.drafted > 0).all()
    code, _, err = run_cli(capsys, *args, "--strategy", "dspark", "--out", str(tmp_path / "o1"))
    assert code != 0 and "is a dflash2 head, which --strategy dspark does not draft with: use --strategy dflash" in err
