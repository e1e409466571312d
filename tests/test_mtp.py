"""An MTP module against speculators' `MTPDraftModel` (the reference forward of the module's layer, on the same
weights, saved by the reference and read by sdbench): its first draft at every position; then lossless decoding
(greedy: generate on three families, chains and a token tree; sampled: chi-square against the exact marginals)
and one line for each bad folder. speculators is installed by `make setup` (requirements-reference.txt); in CI a
missing one fails the test instead of skipping it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3Config

try:
    import speculators.models.mtp  # noqa: F401
except ImportError:
    from tests.conftest import skip_unless_ci

    skip_unless_ci("the speculators package is not installed (make setup installs it)")

from sdbench.config import SamplingConfig  # noqa: E402
from sdbench.engine.hidden import FINAL  # noqa: E402
from sdbench.engine.loop import generate  # noqa: E402
from sdbench.errors import SdbenchError  # noqa: E402
from sdbench.models.forward.runner import ModelRunner  # noqa: E402
from sdbench.models.heads.load import load_head  # noqa: E402
from sdbench.models.heads.mtp import MTPHead  # noqa: E402
from sdbench.strategies.mtp import MTPStrategy  # noqa: E402
from tests.conftest import run_cli  # noqa: E402
from tests.heads import mtp_dir, small_vocab_target  # noqa: E402
from tests.references import hf_generate, tiny_cli_files  # noqa: E402
from tests.test_tree_loop import POINTS, sampled, sampled_checks, warped_checks  # noqa: E402,F401

S, V = 9, 8


def _speculators_mtp(target, folder):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    H = target.config.hidden_size
    layer = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                        max_position_embeddings=256)
    cfg = MTPSpeculatorConfig(
        transformer_layer_config=layer,
        speculators_config=SpeculatorsConfig(algorithm="mtp",
                                             proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=2)],
                                             default_proposal_method="greedy",
                                             verifier=VerifierConfig(name_or_path=None, architectures=[])))
    model = MTPDraftModel(cfg).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in model.mtp_layers.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.dim() == 1 else 0.3 * torch.randn(p.shape,
                                                                                                      generator=g))
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)  # the verifier's, filled on load
        model.lm_head.weight.copy_(target.lm_head.weight)
    model.save_pretrained(folder)
    return model


def test_the_first_draft_equals_speculators_at_every_position(tmp_path):
    """The module's step over (token t + 1, the target's state of t) at every position t, through sdbench's cache,
    gives the logits of speculators' own MTP forward (its first step), on the folder speculators saved."""
    target = small_vocab_target("qwen3", vocab=V)
    theirs = _speculators_mtp(target, tmp_path / "head")
    runner = ModelRunner(target)
    loaded = load_head(str(tmp_path / "head"), runner, ("mtp",))
    assert loaded.layers == (FINAL,)
    head = MTPHead(loaded, runner)
    g = torch.Generator().manual_seed(4)
    states, tokens = torch.randn(1, S, 32, generator=g), torch.randint(0, V, (1, S), generator=g)
    with torch.no_grad():
        steps, *_ = theirs(input_ids=tokens, hidden_states=states)
    valid = steps[0].shape[1]
    cache = head.new_cache(1, 32)
    logits, _ = head.forward(cache, tokens[:, 1:valid + 1], states[:, :valid], [0], None)
    torch.testing.assert_close(logits[0], steps[0][0], atol=1e-4, rtol=1e-4)


def _proposer(runner, folder, gamma: int, options: dict | None = None):
    return MTPStrategy.proposer_for(load_head(str(folder), runner, ("mtp",)), runner, gamma, options)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_mtp_decodes_as_generate(tmp_path, arch):
    target = small_vocab_target(arch, vocab=4)
    runner = ModelRunner(target)
    folder = mtp_dir(tmp_path / "h", target, seed=1)
    prompts = [[1, 1, 2, 2, 1, 1, 3], [2, 2, 3, 1, 0, 1, 2, 1, 3, 3, 0, 2]]
    for gamma, options in ((1, {}), (3, {}), (3, {"tree_topk": 2, "tree_nodes": 6})):
        out = generate(runner, _proposer(runner, folder, gamma, options), prompts, max_new_tokens=20,
                       sampling=SamplingConfig())
        assert out.output_ids == [hf_generate(target, p, 20) for p in prompts]
        assert sum(r.accepted for r in out.rows) > 0


def test_sampled_mtp_follows_the_targets_marginals(sampled, tmp_path):  # noqa: F811
    model, marginals = sampled
    runner = ModelRunner(model)
    checks, out = sampled_checks(runner, _proposer(runner, mtp_dir(tmp_path / "h", model, seed=1), 3), marginals)
    assert all(stat < bound for _, stat, bound in checks), checks
    assert sum(sum(r.accepted_per_position[1:]) for r in out.rows) > 0


@pytest.mark.parametrize("point", POINTS)
def test_sampled_mtp_follows_the_warped_marginals(sampled, tmp_path, point):  # noqa: F811
    model, _ = sampled
    runner = ModelRunner(model)
    checks, _ = warped_checks(runner, _proposer(runner, mtp_dir(tmp_path / "h", model, seed=1), 3), model, point)
    assert all(stat < bound for _, stat, bound in checks), checks


@pytest.mark.parametrize("change, says", [
    (lambda c: c["transformer_layer_config"].update(model_type="qwen3_next"),
     "an MTP module of a qwen3_next decoder layer is not supported yet"),
    (lambda c: c.update(num_nextn_predict_layers=2), "num_nextn_predict_layers is 2"),
    (lambda c: c["transformer_layer_config"].update(hidden_size=64), "has hidden size 64, but the target's is 32"),
])
def test_bad_mtp_folders_are_one_line(tmp_path, change, says):
    target = small_vocab_target("qwen3", vocab=8)
    folder = mtp_dir(tmp_path / "h", target)
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SdbenchError, match=says):
        load_head(str(folder), ModelRunner(target), ("mtp",))


def test_a_missing_weight_is_one_line(tmp_path):
    target = small_vocab_target("qwen3", vocab=8)
    folder = mtp_dir(tmp_path / "h", target, drop=("input_proj.weight",))
    with pytest.raises(SdbenchError, match="no input_proj.weight in its weights"):
        load_head(str(folder), ModelRunner(target), ("mtp",))


def test_run_mtp_through_the_cli(tmp_path, capsys, monkeypatch):
    """`sdbench run --strategy mtp --head DIR`: lossless rows; an MTP module to eagle is one line."""
    import pandas as pd
    from transformers import AutoModelForCausalLM

    files = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w4 w1 w2", "w5 w6 w7"])
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    head = mtp_dir(tmp_path / "m", target)
    args = ["run", *files, "--max-new-tokens", "12", "--device", "cpu", "--gamma", "3", "--head", str(head)]
    code, _, err = run_cli(capsys, *args, "--strategy", "mtp", "--out", str(tmp_path / "o"))
    assert code == 0, err
    rows = pd.read_parquet(next((tmp_path / "o").glob("*.parquet")))
    mine = rows[rows.role != "baseline"]
    assert len(mine) == 2 and mine.lossless.all() and (mine.strategy == "mtp").all() and (mine.drafted > 0).all()
    code, _, err = run_cli(capsys, *args, "--strategy", "eagle", "--out", str(tmp_path / "o1"))
    assert code != 0 and "is a mtp head, which --strategy eagle does not draft with: use --strategy mtp" in err


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_training_is_drafting_and_speculators_loads_it(tmp_path, monkeypatch, arch):
    """train-head's MTP forward (a chain of K steps from every root, the module's output fed back) against the
    drafting forward on the folder it writes, root by root, step by step; then speculators' `MTPDraftModel` loads
    that folder (with the target as its verifier, whose embedding and head it reads) and its own forward gives the
    same first-step logits at every position (its later steps are fitted teacher-forced over whole sequences, not
    as chains, so only the first step is common to both)."""
    from speculators.models.mtp import MTPDraftModel

    from sdbench.training.data import Sequence
    from sdbench.training.heads import build, write_head
    from tests.test_train_head import _perturb, _verifier_for

    K = 3
    target = small_vocab_target(arch, vocab=V)
    seq = Sequence("x", "x/0", torch.arange(8), torch.zeros(8, 32), torch.tensor([0, 1, 1, 3, 3, 3, 5, 6]))
    trainee = _perturb(build("mtp", target, [seq], K, None)).eval()
    verifier = _verifier_for("folder", target, tmp_path, monkeypatch)
    write_head(tmp_path / "head", "mtp", trainee, target, verifier, torch.float32)
    runner = ModelRunner(target)
    head = MTPHead(load_head(str(tmp_path / "head"), runner, ("mtp",)), runner)
    g = torch.Generator().manual_seed(5)
    states, tokens = torch.randn(1, S, 32, generator=g), torch.randint(0, V, (1, S), generator=g)
    with torch.no_grad():
        steps = trainee.steps(tokens, states, K)
        roots = torch.tensor([[0, 1], [0, 4]])  # a fitting step's logits at the roots it fits alone: the same
        for k, part in enumerate(trainee.steps(tokens, states, K, roots)):
            torch.testing.assert_close(part, steps[k][0, roots[:, 1]])
    for q in range(S - K):  # every root whose chain's tokens lie in the sequence
        cache = head.new_cache(1, 32)
        logits, out = head.forward(cache, tokens[:, 1:q + 2], states[:, :q + 1], [0], torch.tensor([q]))
        for k in range(K):
            torch.testing.assert_close(logits[0], steps[k][0, q], atol=1e-4, rtol=1e-4)
            if k + 1 < K:
                logits, out = head.forward(cache, tokens[:, q + k + 2:q + k + 3], out[:, None], [q + k + 1],
                                           torch.tensor([0]))
    theirs = MTPDraftModel.from_pretrained(str(tmp_path / "head")).eval()
    with torch.no_grad():
        ref, *_ = theirs(input_ids=tokens, hidden_states=states)
    valid = ref[0].shape[1]
    torch.testing.assert_close(ref[0][0], steps[0][0, :valid], atol=1e-4, rtol=1e-4)
