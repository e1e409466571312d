"""DFlash against its two independent implementations and against plain decoding.

References: the `speculators` package's `DFlashDraftModel` (whose checkpoints vLLM loads) and z-lab's own `dflash`
package (`DFlashDraftModel`, `dflash_generate`), each given random weights and saving its own folder, which
sdbench reads: the block's logits equal theirs at every slot, and z-lab's whole generation (its target-layer
numbering, its context and anchor) is sdbench's round for round. Then lossless decoding on three families
(greedy: the library's generate; sampled: chi-square against the exact marginals), and one line for each bad
folder or setting. The references are installed by `make setup` (requirements-reference.txt); in CI a missing
one fails the test instead of skipping it."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import Qwen3Config

try:
    import dflash.model  # noqa: F401
    import speculators.models.dflash  # noqa: F401
except ImportError:
    from tests.conftest import skip_unless_ci

    skip_unless_ci("the speculators or dflash package is not installed (make setup installs them)")

from sdbench.config import SamplingConfig  # noqa: E402
from sdbench.engine.loop import generate  # noqa: E402
from sdbench.errors import SdbenchError  # noqa: E402
from sdbench.models.forward.runner import ModelRunner  # noqa: E402
from sdbench.models.heads.dflash import DFlashHead  # noqa: E402
from sdbench.models.heads.load import load_head  # noqa: E402
from sdbench.strategies.dflash import DFlashStrategy  # noqa: E402
from tests.conftest import run_cli  # noqa: E402
from tests.heads import dflash_dir, small_vocab_target  # noqa: E402
from tests.references import hf_generate, tiny_cli_files  # noqa: E402
from tests.test_tree_loop import POINTS, sampled, sampled_checks, warped_checks  # noqa: E402,F401

H, V, BLOCK = 32, 16, 4
GREEDY = SamplingConfig()


def _randomise(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.dim() == 1 else 0.3 * torch.randn(p.shape,
                                                                                                      generator=g))


def _layer(vocab: int = V) -> Qwen3Config:
    return Qwen3Config(vocab_size=vocab, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                       max_position_embeddings=256)


def _speculators_head(target, folder, draft_vocab: int | None, anchor: bool, kind: str = "dflash", extra: dict = {}):
    """speculators' model of `kind` (dflash, or dflash2 with its settings in `extra`) with random weights, the
    target's embedding (and head, over a full vocabulary), saved to `folder` by speculators' own code."""
    import importlib

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    module = importlib.import_module(f"speculators.models.{kind}")
    name = "DFlash2" if kind == "dflash2" else "DFlash"
    layer = _layer()
    layer._attn_implementation = "eager"
    cfg = getattr(module, f"{name}SpeculatorConfig")(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab or V, block_size=BLOCK,
        aux_hidden_state_layer_ids=[1, 3], mask_token_id=V - 1, sample_from_anchor=anchor, **extra,
        speculators_config=SpeculatorsConfig(algorithm=kind, proposal_methods=[GreedyTokenProposalConfig()],
                                             default_proposal_method="greedy",
                                             verifier=VerifierConfig(name_or_path=None, architectures=[])))
    model = getattr(module, f"{name}DraftModel")(cfg).eval()
    _randomise(model, 3)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        if draft_vocab is None:  # a full vocabulary: the target's own head, as the converter fills it
            model.lm_head.weight.copy_(target.lm_head.weight)
    if draft_vocab is not None:
        ids = torch.arange(draft_vocab) * 2  # every other target token
        model.load_vocab_mappings(torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True),
                                  ids - torch.arange(draft_vocab))
    model.save_pretrained(folder)
    return model


def _context(seed: int = 4, T: int = 10):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, 2 * H, generator=g), torch.randint(0, V - 1, (1, T), generator=g)


def _ours(folder, target, states, ids, anchor_at: int) -> torch.Tensor:
    """sdbench's logits [BLOCK, V] of the block anchored at `anchor_at`, the context written in two pieces."""
    runner = ModelRunner(target)
    head = DFlashHead(load_head(str(folder), runner, ("dflash",)), runner)
    cache = head.new_cache(1, 32)
    cut = anchor_at // 2
    head.context(cache, states[:, :cut], [0])
    head.context(cache, states[:, cut:anchor_at], [cut])
    return head.logits(head.block(cache, ids[:, anchor_at], [anchor_at]))[0]


def speculators_block(theirs, states, ids, at: int, monkeypatch):
    """speculators' training forward (`_backbone_forward`) over the one block anchored at `at`: (hidden, logits,
    targets, loss mask, block indices)."""
    import speculators.models.dflash.core as core

    T = ids.shape[1]
    monkeypatch.setattr(core, "select_anchors", lambda mask, n, bs: (torch.tensor([at]), torch.tensor([True])))
    with torch.no_grad():
        return theirs._backbone_forward(states, ids, torch.ones(1, T), torch.randn(1, T, H),
                                        torch.zeros(1, T, dtype=torch.long), max_anchors=1)


@pytest.mark.parametrize("draft_vocab", [None, 6])
@pytest.mark.parametrize("anchor", [False, True])
def test_block_logits_equal_speculators(tmp_path, monkeypatch, draft_vocab, anchor):
    target = small_vocab_target("qwen3", vocab=V)
    theirs = _speculators_head(target, tmp_path / "head", draft_vocab, anchor)
    states, ids = _context()
    for at in (3, 6):
        _, logits, *_ = speculators_block(theirs, states, ids, at, monkeypatch)
        ours = _ours(tmp_path / "head", target, states, ids, at)
        if draft_vocab is not None:  # theirs over the draft vocabulary; ours placed at its target ids
            kept = torch.arange(draft_vocab) * 2
            assert torch.isinf(ours).sum() == BLOCK * (V - draft_vocab) and not torch.isinf(ours[:, kept]).any()
            ours = ours[:, kept]
        torch.testing.assert_close(ours, logits[0], atol=1e-5, rtol=1e-5)


def _zlab_head(folder, layers=(0, 2), vocab: int = V, architecture: str = "DFlashDraftModel", extra: dict = {}):
    """z-lab's model of `architecture` (DFlashDraftModel or DFlash2DraftModel, whose settings go in `extra`) with
    random weights, saved to `folder` by z-lab's own code."""
    import dflash.model as zlab

    cfg = _layer(vocab)
    cfg.update({"block_size": BLOCK, "num_target_layers": 4,
                "dflash_config": {"target_layer_ids": list(layers), "mask_token_id": vocab - 1, **extra}})
    cfg.architectures = [architecture]
    model = getattr(zlab, architecture)(cfg).eval()
    _randomise(model, 5)
    model.save_pretrained(folder)
    return model


def zlab_block(theirs, target, states, ids, at: int, scale: float = 1.0):
    """z-lab's block after the anchor ids[at] (the context states before it; its embedding times `scale`, as
    dflash_generate feeds it): the block's tokens [1, BLOCK] and its final-norm output at every slot [1, BLOCK, H]."""
    block = torch.full((1, BLOCK), V - 1)
    block[0, 0] = ids[0, at]
    with torch.no_grad():
        return block, theirs(position_ids=torch.arange(at + BLOCK)[None], target_hidden=states[:, :at],
                             noise_embedding=target.get_input_embeddings()(block) * scale)


@pytest.mark.parametrize("scales", [{}, {"input_embedding_scale": 1.3, "output_multiplier": 0.5,
                                         "final_logit_softcapping": 3.0}])
def test_block_logits_equal_zlab(tmp_path, scales):
    """Every slot's logits, with z-lab's embedding scale, output multiplier and soft cap where its dflash_config
    names them (Gemma's and MiMo's drafts carry them)."""
    target = small_vocab_target("qwen3", vocab=V)
    theirs = _zlab_head(tmp_path / "head", extra=scales)
    states, ids = _context()
    for at in (3, 6):
        _, out = zlab_block(theirs, target, states, ids, at, scales.get("input_embedding_scale", 1.0))
        with torch.no_grad():
            logits = theirs.compute_logits(out, target.lm_head)[0]
        torch.testing.assert_close(_ours(tmp_path / "head", target, states, ids, at), logits, atol=1e-5, rtol=1e-5)


def _recorded(proposer) -> list[int]:
    """The tokens each round of `proposer` commits (accepted drafts plus the target's own), as recorded."""
    seen, observe = [], proposer.observe

    def record(state, proposal, rnd):
        seen.append(rnd.kept[0])
        observe(state, proposal, rnd)
    proposer.observe = record
    return seen


def test_a_generation_is_zlabs_round_for_round(tmp_path, monkeypatch):
    """z-lab's dflash_generate on its own folder (target layers counted from the first layer's output) and
    sdbench's loop on the same folder: the same tokens, and the same tokens per round while z-lab's blocks are
    whole (its last blocks shrink to the tokens left; sdbench's stay whole)."""
    import dflash.model as zlab

    target = small_vocab_target("qwen3", vocab=4, seed=1)  # few tokens: random drafts are accepted now and then
    theirs = _zlab_head(tmp_path / "head", layers=(0, 2), vocab=4)
    prompt = torch.tensor([[1, 2, 3, 0, 1, 2, 3, 0, 1]])
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # its stats time CUDA only
    new = 30
    done = zlab.dflash_generate(theirs, target, prompt, new, None, return_stats=True)
    runner = ModelRunner(target)
    proposer = DFlashStrategy.proposer_for(load_head(str(tmp_path / "head"), runner, ("dflash",)), runner, BLOCK - 1)
    kept = _recorded(proposer)
    ours = generate(runner, proposer, prompt.tolist(), max_new_tokens=new, sampling=GREEDY)
    assert ours.output_ids[0] == done.output_ids[0, 9:].tolist() == hf_generate(target, prompt[0].tolist(), new)
    whole = [n for i, n in enumerate(done.acceptance_lengths)
             if 9 + sum(done.acceptance_lengths[:i]) + BLOCK <= 9 + new]
    assert kept[:len(whole)] == whole and max(whole) > 1  # drafts were accepted


D2_GREEDY = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 3}


@pytest.mark.parametrize("arch, made", [("llama", {}), ("qwen2", {}), ("qwen3", {}),  # DFlash 2, both layouts:
                                        ("llama", {"dflash2": D2_GREEDY}), ("qwen2", {"dflash2": D2_GREEDY,
                                                                                      "fmt": "zlab"}),
                                        ("qwen3", {"dflash2": D2_GREEDY})])
def test_greedy_dflash_decodes_as_generate(tmp_path, arch, made):
    target = small_vocab_target(arch, vocab=4)  # few tokens: a random head's drafts are accepted now and then
    runner = ModelRunner(target)
    head = load_head(str(dflash_dir(tmp_path / "h", target, block=5, seed=3, **made)), runner, ("dflash", "dflash2"))
    assert head.kind == ("dflash2" if made else "dflash")
    prompts = [[1, 1, 2, 2, 1, 1, 3], [2, 2, 3, 1, 0, 1, 2, 1, 3, 3, 0, 2]]  # rows at different positions
    for gamma in (2, 4):
        out = generate(runner, DFlashStrategy.proposer_for(head, runner, gamma), prompts, max_new_tokens=24,
                       sampling=GREEDY)
        assert out.output_ids == [hf_generate(target, p, 24) for p in prompts]
        assert sum(r.accepted for r in out.rows) > 0 and all(r.drafted for r in out.rows)


def _sampled_proposer(runner, model, tmp_path, anchor=False):
    head = load_head(str(dflash_dir(tmp_path / "h", model, block=4, layer_ids=(1, 2), mask=0, anchor=anchor)), runner,
                     ("dflash",))
    return DFlashStrategy.proposer_for(head, runner, 3)


@pytest.mark.parametrize("anchor", [False, True])
def test_sampled_dflash_follows_the_targets_marginals(sampled, tmp_path, anchor):  # noqa: F811
    model, marginals = sampled
    runner = ModelRunner(model)
    checks, out = sampled_checks(runner, _sampled_proposer(runner, model, tmp_path, anchor), marginals)
    assert all(stat < bound for _, stat, bound in checks), checks
    assert sum(sum(r.accepted_per_position[1:]) for r in out.rows) > 0  # second drafts accepted too


@pytest.mark.parametrize("point", POINTS)
def test_sampled_dflash_follows_the_warped_marginals(sampled, tmp_path, point):  # noqa: F811
    model, _ = sampled
    runner = ModelRunner(model)
    checks, _ = warped_checks(runner, _sampled_proposer(runner, model, tmp_path), model, point)
    assert all(stat < bound for _, stat, bound in checks), checks


def test_the_check_catches_drafts_verified_with_the_wrong_distribution(sampled, tmp_path, monkeypatch):  # noqa: F811
    """Drafts drawn from one block slot but verified against the next slot's distribution: the chi-square fails."""
    from sdbench.drafting.block import BlockDrafter

    model, marginals = sampled
    runner = ModelRunner(model)
    real = BlockDrafter.draft

    def shifted(self, ctx, lengths, limits):
        p = real(self, ctx, lengths, limits)
        if p.probs is not None:
            p.probs[:] = p.probs.roll(1, dims=1)
        return p
    monkeypatch.setattr(BlockDrafter, "draft", shifted)
    checks, _ = sampled_checks(runner, _sampled_proposer(runner, model, tmp_path), marginals)
    assert any(stat > bound for _, stat, bound in checks), checks


D2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 5}  # DFlash 2's settings


@pytest.mark.parametrize("made, change, says", [
    ({}, lambda c: c.pop("mask_token_id"), "names no mask_token_id"),
    ({}, lambda c: c.update(block_size=1), "block_size in its config.json is 1"),
    ({}, lambda c: c["transformer_layer_config"].update(hidden_size=64), "has hidden size 64, but the target's is 32"),
    ({}, lambda c: c.update(aux_hidden_state_layer_ids=[1, 9]), "reads target layer 9, but the target has 4 layers"),
    ({}, lambda c: c["transformer_layer_config"].update(attention_value_scale=0.5), "with attention_value_scale is "
     "not supported"),
    ({"dflash2": D2}, lambda c: c.update(draft_vocab_size=8), "drafts over the target's whole vocabulary"),
    ({"dflash2": D2}, lambda c: c.update(conv_group_size=5), "conv_group_size 5 must divide the hidden size 32"),
    ({"dflash2": D2}, lambda c: c.update(selector_top_k=0), "selector_top_k in its config.json is 0"),
])
def test_bad_dflash_folders_are_one_line(tmp_path, made, change, says):
    import json

    target = small_vocab_target("qwen3", vocab=16)
    folder = dflash_dir(tmp_path / "h", target, **made)
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SdbenchError, match=says):
        load_head(str(folder), ModelRunner(target), ("dflash", "dflash2"))


@pytest.mark.parametrize("made, missing", [({}, "layers.1.self_attn.k_norm.weight"),
                                           ({"dflash2": D2}, "candidate_selector.successor_codebook")])
def test_a_missing_weight_is_one_line(tmp_path, made, missing):
    target = small_vocab_target("qwen3", vocab=16)
    folder = dflash_dir(tmp_path / "h", target, drop=(missing,), **made)
    with pytest.raises(SdbenchError, match=f"no {missing} in its weights"):
        load_head(str(folder), ModelRunner(target), ("dflash", "dflash2"))


def test_run_dflash_through_the_cli(tmp_path, capsys, monkeypatch):
    """`sdbench run --strategy dflash --head DIR` on a model folder: lossless rows recording the head; a gamma
    past the block and an EAGLE head are one line each."""
    import pandas as pd
    from transformers import AutoModelForCausalLM

    from tests.heads import eagle3_dir

    files = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w4 w1 w2", "w5 w6 w7"])
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    head = dflash_dir(tmp_path / "dflash", target, fmt="zlab", block=4, layer_ids=(1, 2))
    args = ["run", *files, "--max-new-tokens", "12", "--device", "cpu", "--strategy", "dflash", "--head", str(head)]
    code, out, err = run_cli(capsys, *args, "--gamma", "3", "--out", str(tmp_path / "out"))
    assert code == 0, err
    rows = pd.read_parquet(next((tmp_path / "out").glob("*.parquet")))
    mine = rows[rows.role != "baseline"]
    assert len(mine) == 2 and mine.lossless.all() and (mine.strategy == "dflash").all() and (mine.drafted > 0).all()
    assert all(f'"head": "{head}"' in p for p in mine.params)
    code, _, err = run_cli(capsys, *args, "--gamma", "4", "--out", str(tmp_path / "o1"))
    assert code == 2 and f"--gamma 4: --head {head} drafts 3 tokens per block" in err and "Traceback" not in err
    eagle = eagle3_dir(tmp_path / "eagle", target)
    code, _, err = run_cli(capsys, *args[:-2], "--head", str(eagle), "--out", str(tmp_path / "o2"))
    assert code != 0 and "is a eagle3 head, which --strategy dflash does not draft with" in err
