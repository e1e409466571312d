"""P-EAGLE against speculators' `PEagleDraftModel` (the parallel positions of one forward, on the same weights,
saved by the reference and read by sdbench), then lossless decoding (greedy: the library's generate on three
families; sampled: chi-square against the exact marginals) and one line for each bad folder. speculators is
installed by `make setup` (requirements-reference.txt); in CI a missing one fails the test instead of skipping."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

try:
    import speculators.models.peagle  # noqa: F401
except ImportError:
    from tests.conftest import skip_unless_ci

    skip_unless_ci("the speculators package is not installed (make setup installs it)")

from sdbench.config import SamplingConfig  # noqa: E402
from sdbench.engine.loop import generate  # noqa: E402
from sdbench.errors import SdbenchError  # noqa: E402
from sdbench.models.forward.runner import ModelRunner  # noqa: E402
from sdbench.models.heads.eagle import EagleHead  # noqa: E402
from sdbench.models.heads.load import load_head  # noqa: E402
from sdbench.strategies.peagle import PEagleStrategy  # noqa: E402
from tests.conftest import run_cli  # noqa: E402
from tests.heads import eagle3_dir, small_vocab_target  # noqa: E402
from tests.references import hf_generate, tiny_cli_files  # noqa: E402
from tests.test_tree_loop import POINTS, sampled, sampled_checks, warped_checks  # noqa: E402,F401

S, K, V = 7, 4, 8


def _speculators_peagle(target, folder):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    H = target.config.hidden_size
    layer = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=H // 2, rms_norm_eps=1e-6,
                        max_position_embeddings=256)
    layer._attn_implementation = "eager"
    cfg = PEagleSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=6, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        mask_token_id=V - 1,
        speculators_config=SpeculatorsConfig(algorithm="peagle", proposal_methods=[GreedyTokenProposalConfig()],
                                             default_proposal_method="greedy",
                                             verifier=VerifierConfig(name_or_path=None, architectures=[])))
    model = PEagleDraftModel(cfg).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.dim() == 1 else 0.3 * torch.randn(p.shape,
                                                                                                      generator=g))
    ids = torch.tensor([0, 1, 3, 4, 6, 7])
    model.load_vocab_mappings(torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True), ids - torch.arange(6))
    model.save_pretrained(folder)
    return model


def _theirs(model, states, tokens, anchor: int, monkeypatch) -> torch.Tensor:
    """speculators' draft logits [K, Vd]: the depth-0 position at `anchor` (the context 0..anchor before it) and its
    K - 1 parallel positions after it."""
    import speculators.models.peagle.core as core

    anchors = torch.cat((torch.arange(S), torch.full((K - 1,), anchor)))
    depth = torch.cat((torch.zeros(S, dtype=torch.long), torch.arange(1, K)))
    monkeypatch.setattr(core, "generate_cod_sample_indices", lambda **kw: (anchors, depth))
    seen = []
    monkeypatch.setattr(core, "compute_metrics", lambda logits, **kw: seen.append(logits) or (torch.zeros(()), {}))
    with torch.no_grad():
        model(hidden_states=states, input_ids=tokens, document_ids=torch.zeros(1, S, dtype=torch.long),
              loss_mask=torch.ones(1, S), verifier_last_hidden_states=torch.randn(1, S, states.shape[-1] // 3))
    return torch.cat((seen[0][0, anchor:anchor + 1], seen[0][0, S:]))


def test_parallel_positions_equal_speculators(tmp_path, monkeypatch):
    """One sdbench forward over the context, the anchor's pair and K - 1 mask positions (each with the head's
    mask_hidden) gives, at the anchor and each mask position, the draft logits speculators' P-EAGLE gives them."""
    target = small_vocab_target("llama")
    theirs = _speculators_peagle(target, tmp_path / "head")
    runner = ModelRunner(target)
    loaded = load_head(str(tmp_path / "head"), runner, ("peagle",))
    head = EagleHead(loaded, runner)
    g = torch.Generator().manual_seed(4)
    states, tokens = torch.randn(1, S, 96, generator=g), torch.randint(0, V, (1, S), generator=g)
    with torch.no_grad():  # speculators' own embedding (trained with P-EAGLE), as the folder holds it
        assert torch.equal(head.w["embed_tokens.weight"], theirs.embed_tokens.weight)
    for anchor in (1, 3):  # speculators reads the data at anchor + depth: inside the sequence
        mask = loaded.weights["mask_hidden"].reshape(1, 1, -1).expand(1, K - 1, -1)
        fed_states = torch.cat((states[:, :anchor + 1], mask), 1)
        fed_tokens = torch.cat((tokens[:, :anchor + 1], torch.full((1, K - 1), V - 1)), 1)
        cache = head.new_cache(1, 32)
        _, out = head.forward(cache, fed_tokens, fed_states, [0], torch.arange(anchor, anchor + K)[None])
        torch.testing.assert_close(head.draft_logits(out)[0], _theirs(theirs, states, tokens, anchor, monkeypatch),
                                   atol=1e-4, rtol=1e-4)


def _proposer(runner, folder, gamma: int):
    return PEagleStrategy.proposer_for(load_head(str(folder), runner, ("peagle",)), runner, gamma)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_peagle_decodes_as_generate(tmp_path, arch):
    target = small_vocab_target(arch, vocab=4)
    runner = ModelRunner(target)
    folder = eagle3_dir(tmp_path / "h", target, fmt="peagle", seed=2, layer_ids=(1, 2, 3))
    prompts = [[1, 1, 2, 2, 1, 1, 3], [2, 2, 3, 1, 0, 1, 2, 1, 3, 3, 0, 2]]  # rows at different positions
    for gamma in (1, 3, 5):
        out = generate(runner, _proposer(runner, folder, gamma), prompts, max_new_tokens=24,
                       sampling=SamplingConfig())
        assert out.output_ids == [hf_generate(target, p, 24) for p in prompts]
        assert sum(r.accepted for r in out.rows) > 0 and all(r.drafted for r in out.rows)


def test_sampled_peagle_follows_the_targets_marginals(sampled, tmp_path):  # noqa: F811
    model, marginals = sampled
    runner = ModelRunner(model)
    folder = eagle3_dir(tmp_path / "h", model, fmt="peagle", seed=1, layer_ids=(0, 1, 2))
    checks, out = sampled_checks(runner, _proposer(runner, folder, 3), marginals)
    assert all(stat < bound for _, stat, bound in checks), checks
    assert sum(sum(r.accepted_per_position[1:]) for r in out.rows) > 0


@pytest.mark.parametrize("point", POINTS)
def test_sampled_peagle_follows_the_warped_marginals(sampled, tmp_path, point):  # noqa: F811
    model, _ = sampled
    runner = ModelRunner(model)
    folder = eagle3_dir(tmp_path / "h", model, fmt="peagle", seed=1, layer_ids=(0, 1, 2))
    checks, _ = warped_checks(runner, _proposer(runner, folder, 3), model, point)
    assert all(stat < bound for _, stat, bound in checks), checks


@pytest.mark.parametrize("change, says", [
    (lambda c, w: c.pop("mask_token_id"), "names no mask_token_id"),
    (lambda c, w: w.pop("mask_hidden"), "no mask_hidden in its weights"),
    (lambda c, w: c["transformer_layer_config"].update(num_hidden_layers=2), "P-EAGLE with 2 decoder layers is not"),
])
def test_bad_peagle_folders_are_one_line(tmp_path, change, says):
    from safetensors.torch import load_file, save_file

    target = small_vocab_target("llama")
    folder = eagle3_dir(tmp_path / "h", target, fmt="peagle")
    cfg, w = json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))
    change(cfg, w)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(SdbenchError, match=says):
        load_head(str(folder), ModelRunner(target), ("peagle",))


def test_run_peagle_through_the_cli(tmp_path, capsys, monkeypatch):
    """`sdbench run --strategy peagle --head DIR`: lossless rows; an EAGLE-3 head to peagle, and a P-EAGLE head to
    eagle, one line each."""
    import pandas as pd
    from transformers import AutoModelForCausalLM

    files = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w4 w1 w2", "w5 w6 w7"])
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    head = eagle3_dir(tmp_path / "p", target, fmt="peagle", layer_ids=(0, 1, 2))
    args = ["run", *files, "--max-new-tokens", "12", "--device", "cpu", "--gamma", "3"]
    code, _, err = run_cli(capsys, *args, "--strategy", "peagle", "--head", str(head), "--out", str(tmp_path / "o"))
    assert code == 0, err
    rows = pd.read_parquet(next((tmp_path / "o").glob("*.parquet")))
    mine = rows[rows.role != "baseline"]
    assert len(mine) == 2 and mine.lossless.all() and (mine.strategy == "peagle").all() and (mine.drafted > 0).all()
    eagle = eagle3_dir(tmp_path / "e", target, layer_ids=(0, 1, 2))
    code, _, err = run_cli(capsys, *args, "--strategy", "peagle", "--head", str(eagle), "--out", str(tmp_path / "o1"))
    assert code != 0 and "is a eagle3 head, which --strategy peagle does not draft with: use --strategy eagle" in err
    code, _, err = run_cli(capsys, *args, "--strategy", "eagle", "--head", str(head), "--out", str(tmp_path / "o2"))
    assert code != 0 and "is a peagle head, which --strategy eagle does not draft with: use --strategy peagle" in err


def test_training_is_drafting_and_speculators_loads_it(tmp_path, monkeypatch):
    """train-head's P-EAGLE forward (step 0 EAGLE-3's, the further steps the mask token with the learned state)
    against the drafting forward on the folder it writes, root by root; then speculators' PEagleDraftModel loads
    that folder and gives the same logits at the same positions."""
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    from sdbench.training.data import Sequence
    from sdbench.training.heads import build, write_head
    from tests.test_train_head import _perturb, _verifier_for

    target = small_vocab_target("llama")
    seq = Sequence("x", "x/0", torch.arange(8), torch.zeros(8, 96), torch.tensor([0, 1, 1, 3, 3, 3, 5, 6]))
    trainee = _perturb(build("peagle", target, [seq], K, 6)).eval()
    verifier = _verifier_for("folder", target, tmp_path, monkeypatch)  # speculators reads its config and head
    write_head(tmp_path / "head", "peagle", trainee, target, verifier, torch.float32)
    runner = ModelRunner(target)
    loaded = load_head(str(tmp_path / "head"), runner, ("peagle",))
    head = EagleHead(loaded, runner)
    g = torch.Generator().manual_seed(5)
    states, tokens = torch.randn(1, S, 96, generator=g), torch.randint(0, V, (1, S), generator=g)
    with torch.no_grad():
        steps = trainee.steps(tokens, states, K)
    config = PEagleSpeculatorConfig.from_pretrained(str(tmp_path / "head"))
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = PEagleDraftModel.from_pretrained(str(tmp_path / "head"), config=config).eval()
    mask = loaded.weights["mask_hidden"].reshape(1, 1, -1).expand(1, K - 1, -1)
    for q in (1, 2):  # roots whose chain lies inside the sequence (speculators reads the data there)
        fed_tokens = torch.cat((tokens[:, 1:q + 2], torch.full((1, K - 1), V - 1)), 1)  # pairs (token p + 1, p)
        cache = head.new_cache(1, 32)
        _, out = head.forward(cache, fed_tokens, torch.cat((states[:, :q + 1], mask), 1), [0],
                              torch.arange(q, q + K)[None])
        ours = head.draft_logits(out)[0]
        torch.testing.assert_close(ours, torch.stack([s[0, q] for s in steps]), atol=1e-5, rtol=1e-5)
        shifted = torch.cat((tokens[:, 1:], tokens[:, :1]), 1)  # speculators pairs input_ids[a] with states[a]
        torch.testing.assert_close(ours, _theirs(theirs, states, shifted, q, monkeypatch), atol=1e-4, rtol=1e-4)

