"""`sdbench train-head --kind dflash` and `--kind dspark`: the training forward against the drafting forward (every
root's block, read back from the folder train-head writes) and against the `speculators` package's own model, which
loads that folder as vLLM does; then the command end to end on a tiny model (and `--kind peagle`'s): the head is
written in speculators' format, runs lossless under its strategy, and a second run with more minutes resumes the
fit."""

from __future__ import annotations

import json

import pytest
import torch

from sdbench.models.forward.runner import ModelRunner
from sdbench.models.heads.dflash import DFlashHead
from sdbench.models.heads.load import load_head
from sdbench.training.data import Sequence
from sdbench.training.heads import build, write_head
from tests.conftest import run_cli, skip_unless_ci
from tests.heads import one_thread, small_vocab_target  # noqa: F401  (one_thread: a fixture)
from tests.test_train_head import _perturb, _train, fitted  # noqa: F401  (fitted: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

S, DRAFTS = 9, 4


def _dflash(target, draft_vocab: int):
    """A DFlash trainee (blocks of DRAFTS + 1) with weights off their start, over a draft vocabulary."""
    seq = Sequence("x", "x/0", torch.arange(8), torch.zeros(8, 96), torch.tensor([0, 1, 1, 3, 3, 3, 5, 6]))
    return _perturb(build("dflash", target, [seq], DRAFTS, draft_vocab)).eval()


def _inputs(seed: int = 2, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 8, (batch, S), generator=g), torch.randn(batch, S, 96, generator=g)


def test_the_training_forward_is_the_drafting_forward(tmp_path):
    """Every root's block in the training forward equals the head drafting that block through its cache, read
    back from the files train-head writes (a draft vocabulary of 6 of the target's 8 tokens)."""
    target = small_vocab_target("llama")
    trainee = _dflash(target, 6)
    write_head(tmp_path, "dflash", trainee, target, "tiny", torch.float32)
    runner = ModelRunner(target)
    head = DFlashHead(load_head(str(tmp_path), runner, ("dflash",)), runner)
    assert head.block_size == DRAFTS + 1
    tokens, states = _inputs()
    with torch.no_grad():
        steps = trainee.steps(tokens, states, DRAFTS)
    roots = torch.tensor([[0, 2], [1, 5], [1, 0]])  # a fit's sample of roots: the same blocks
    with torch.no_grad():
        sampled = trainee.steps(tokens, states, DRAFTS, roots)
    for k in range(DRAFTS):
        torch.testing.assert_close(sampled[k], steps[k][roots[:, 0], roots[:, 1]], atol=1e-5, rtol=1e-5)
    for b in range(2):
        for q in range(S - 1):
            cache = head.new_cache(1, 32)
            head.context(cache, states[b:b + 1, :q + 1], [0])
            out = head.block(cache, tokens[b:b + 1, q + 1], [q + 1])
            torch.testing.assert_close(head.draft_logits(out)[0, 1:], torch.stack([s[b, q] for s in steps]),
                                       atol=1e-5, rtol=1e-5)


def test_the_training_forward_equals_speculators_which_loads_the_written_head(tmp_path, monkeypatch):
    """The independent reference: speculators' DFlashDraftModel, loaded from the folder train-head writes (its
    draft vocabulary's head and d2t with it), gives each anchor's block the logits sdbench's training forward
    gives that root."""
    try:
        import speculators.models.dflash.core as core
    except ImportError:
        skip_unless_ci("the speculators package is not installed (make setup installs it)")
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    target = small_vocab_target("llama")
    trainee = _dflash(target, 6)
    write_head(tmp_path / "head", "dflash", trainee, target, None, torch.float32)
    config = DFlashSpeculatorConfig.from_pretrained(str(tmp_path / "head"))
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = DFlashDraftModel.from_pretrained(str(tmp_path / "head"), config=config).eval()
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(target.get_input_embeddings().weight)  # the verifier's, filled on load
    tokens, states = _inputs(batch=1)
    with torch.no_grad():
        ours = trainee.steps(tokens, states, DRAFTS)
    for q in (0, 2, 3):  # blocks inside the sequence (speculators reads the verifier states there)
        monkeypatch.setattr(core, "select_anchors", lambda mask, n, bs, a=q + 1: (torch.tensor([a]),
                                                                                   torch.tensor([True])))
        with torch.no_grad():
            _, logits, *_ = theirs._backbone_forward(states, tokens, torch.ones(1, S), torch.randn(1, S, 32),
                                                     torch.zeros(1, S, dtype=torch.long), max_anchors=1)
        torch.testing.assert_close(logits[0, 1:], torch.stack([s[0, q] for s in ours]), atol=1e-4, rtol=1e-4)


def test_train_head_dflash_writes_a_head_that_runs_lossless_and_resumes(fitted, capsys):  # noqa: F811
    out = fitted / "dflash"
    code, text, err = _train(capsys, fitted, out, "0.4", "--kind", "dflash", "--steps", "3")
    assert code == 0, err
    assert f"run it: --strategy dflash --head {out}" in text.replace("\n", "")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 3] and config["transformer_layer_config"]["model_type"] == \
        "qwen3"
    record = json.loads((out / "sdbench_head.json").read_text())
    assert record["kind"] == "dflash" and record["steps"] > 0
    code, text, err = run_cli(capsys, "run", "--target", str(fitted / "target"), "--strategy", "dflash", "--head",
                              str(out), "--gamma", "3", "--dataset", str(fitted / "p.csv"), "--limit", "3",
                              "--max-new-tokens", "8", "--device", "cpu", "--out", str(fitted / "dflash-runs"))
    assert code == 0, err
    from sdbench.reporting.results import read_results

    rows = read_results([str(fitted / "dflash-runs")])
    mine = rows[rows["strategy"] == "dflash"]
    assert len(mine) == 3 and bool(mine["lossless"].all()) and (mine["drafted"] > 0).all()
    code, text, err = _train(capsys, fitted, out, "0.6", "--kind", "dflash", "--steps", "3")
    assert code == 0, err
    assert json.loads((out / "sdbench_head.json").read_text())["steps"] > record["steps"]


def _dspark_slots(head, states, tokens, b: int, q: int):
    """The drafting head's slots of root q of row b, each fed the data's previous token: (logits, confidence)."""
    from sdbench.models.heads.dspark import DSparkHead

    assert isinstance(head, DSparkHead)
    cache = head.new_cache(1, 32)
    head.context(cache, states[b:b + 1, :q + 1], [0])
    out = head.block(cache, tokens[b:b + 1, q + 1], [q + 1])[0]
    rows = [head.slot(out[s:s + 1], tokens[b, q + s:q + s + 1], None) for s in range(1, DRAFTS + 1)]
    return torch.stack([r[0][0] for r in rows]), torch.stack([r[1][0] for r in rows])


def test_dspark_training_is_drafting_and_speculators_loads_it(tmp_path, monkeypatch):
    """train-head's DSpark (a DFlash block, the Markov head's bias from the data's previous token and the
    confidence head) against the drafting forward on the folder it writes, root by root; then speculators'
    DSparkDraftModel loads that folder and gives the same biased logits and confidences."""
    from sdbench.models.heads.dspark import DSparkHead

    target = small_vocab_target("llama")
    seq = Sequence("x", "x/0", torch.arange(8), torch.zeros(8, 96), torch.tensor([0, 1, 1, 3, 3, 3, 5, 6]))
    trainee = _perturb(build("dspark", target, [seq], DRAFTS, 6)).eval()
    with torch.no_grad():
        trainee.markov_w1.weight.normal_(0, 0.5)  # off its near-zero start, so that the bias shows
    write_head(tmp_path / "head", "dspark", trainee, target, None, torch.float32)
    runner = ModelRunner(target)
    head = DSparkHead(load_head(str(tmp_path / "head"), runner, ("dspark",)), runner)
    tokens, states = _inputs(batch=1)
    with torch.no_grad():
        steps = trainee.steps(tokens, states, DRAFTS)
    sure = trainee.confidence_logits
    for q in (0, 2, 3):
        logits, confidence = _dspark_slots(head, states, tokens, 0, q)
        torch.testing.assert_close(logits, torch.stack([s[0, q] for s in steps]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(confidence, torch.stack([s[0, q] for s in sure]).sigmoid(), atol=1e-5, rtol=1e-5)
    try:
        import speculators.models.dflash.core as core
        from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    except ImportError:
        skip_unless_ci("the speculators package is not installed (make setup installs it)")
    config = DSparkSpeculatorConfig.from_pretrained(str(tmp_path / "head"))
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = DSparkDraftModel.from_pretrained(str(tmp_path / "head"), config=config).eval()
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    for q in (0, 2, 3):
        monkeypatch.setattr(core, "select_anchors", lambda mask, n, bs, a=q + 1: (torch.tensor([a]),
                                                                                   torch.tensor([True])))
        with torch.no_grad():
            hidden, logits, *_ = theirs._backbone_forward(states, tokens, torch.ones(1, S), torch.randn(1, S, 32),
                                                          torch.zeros(1, S, dtype=torch.long), max_anchors=1)
            block = tokens[:, q + 1:q + 1 + DRAFTS + 1]
            prev = torch.cat((block[:, :1], block[:, :-1]), 1)  # not sampling from the anchor: shifted
            emb = theirs.markov_head.prev_embeddings(prev)
            biased = logits + theirs.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden, prev_emb=emb)
            conf = theirs.confidence_head(torch.cat((hidden, emb), -1)).sigmoid()
        ours, ours_sure = _dspark_slots(head, states, tokens, 0, q)
        torch.testing.assert_close(biased[0, 1:], ours, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(conf[0, 1:], ours_sure, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["dspark", "peagle", "mtp"])
def test_train_head_writes_a_dspark_peagle_or_mtp_head_that_runs_lossless(fitted, capsys, kind):  # noqa: F811
    from safetensors.torch import load_file

    out = fitted / kind
    code, text, err = _train(capsys, fitted, out, "0.3", "--kind", kind, "--steps", "3")
    assert code == 0, err
    assert f"run it: --strategy {kind} --head {out}" in text.replace("\n", "")
    config = json.loads((out / "config.json").read_text())
    vocab = config["transformer_layer_config"]["vocab_size"]
    assert config["speculators_model_type"] == kind
    if kind == "mtp":  # the target's embedding and head are read, not written; its full vocabulary drafted
        names = set(load_file(str(out / "model.safetensors")))
        assert config["architectures"] == ["MTPDraftModel"] and config["num_nextn_predict_layers"] == 1
        assert "mtp_layers.0.input_proj.weight" in names and not any("embed" in n or "lm_head" in n for n in names)
        assert "draft_vocab_size" not in config
    else:
        assert config["mask_token_id"] == vocab - 1
    if kind == "dspark":
        assert config["block_size"] == 4 and config["markov_rank"] == 256 and config["enable_confidence_head"]
    elif kind == "peagle":
        mask = load_file(str(out / "model.safetensors"))["mask_hidden"]
        assert config["architectures"] == ["PEagleSpeculator"] and mask.shape == (1, 1, 3 * config[
            "transformer_layer_config"]["hidden_size"])
    code, text, err = run_cli(capsys, "run", "--target", str(fitted / "target"), "--strategy", kind, "--head",
                              str(out), "--gamma", "3", "--dataset", str(fitted / "p.csv"), "--limit", "3",
                              "--max-new-tokens", "8", "--device", "cpu", "--out", str(fitted / f"{kind}-runs"))
    assert code == 0, err
    from sdbench.reporting.results import read_results

    rows = read_results([str(fitted / f"{kind}-runs")])
    mine = rows[rows["strategy"] == kind]
    assert len(mine) == 3 and bool(mine["lossless"].all())
