"""PARD (a parallel draft model drafting a chain in one forward over mask tokens) against the library: the
distributions it drafts from are the library's own forward of the context followed by the mask tokens, round
after round as its cache rewinds over the masks; then lossless decoding (greedy: generate on three families;
sampled: chi-square against the exact marginals) and one line for each bad setting."""

from __future__ import annotations

import json

import pytest
import torch

from sdbench.config import SamplingConfig
from sdbench.drafting.model import draft_parallel
from sdbench.drafting.prefix import CachedPrefix
from sdbench.engine.loop import generate
from sdbench.errors import SdbenchError
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies.pard import ParallelDraftModel, PardStrategy
from tests.conftest import run_cli
from tests.references import hf_generate, tiny_cli_files, tiny_pair
from tests.test_tree_loop import POINTS, sampled, sampled_checks, sampling_model, warped_checks  # noqa: F401

MASK = 7


def _library(model, row: list[int], gamma: int) -> torch.Tensor:
    """The library's next-token distributions [gamma, V] after `row` and after each of gamma - 1 masks."""
    ids = torch.tensor([row + [MASK] * (gamma - 1)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(row) - 1:]
    return logits.float().softmax(-1)


def test_drafts_are_drawn_from_the_librarys_forward_over_the_masks():
    """Two rows of different lengths, three rounds: each round's draft distributions equal the library's forward
    of the row's context followed by the masks, though the cache holds the masks of the round before."""
    _, draft = tiny_pair("llama")
    runner = ModelRunner(draft)
    rows = [[1, 2, 3, 4, 5, 6], [9, 8, 7, 6]]
    cache, prefix = runner.new_cache(2, 64), CachedPrefix(2, 64)
    sampling, gen = SamplingConfig(1.0, 1.0, 0), torch.Generator().manual_seed(0)
    for rnd, (gamma, grow) in enumerate(((3, [2, 0]), (4, [1, 3]), (2, [4, 1]))):
        ctx = torch.zeros(2, 32, dtype=torch.long)
        for b, r in enumerate(rows):
            ctx[b, :len(r)] = torch.tensor(r)
        tokens, probs = draft_parallel(runner, cache, prefix, ctx, [len(r) for r in rows], gamma, MASK, sampling,
                                       gen)
        for b, r in enumerate(rows):
            torch.testing.assert_close(probs[b], _library(draft, r, gamma), atol=1e-5, rtol=1e-4)
        rows = [r + tokens[b, :grow[b]].tolist() + [rnd] for b, r in enumerate(rows)]  # accepted drafts + one


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_pard_decodes_as_generate(arch):
    target, draft = tiny_pair(arch, seed=3)
    runner, drafts = ModelRunner(target), ModelRunner(draft)
    prompts = [[1, 1, 2, 2, 1, 1, 3], [2, 2, 3, 1, 0, 1, 2, 1, 3, 3, 0, 2]]  # rows at different positions
    for gamma in (1, 3, 5):
        out = generate(runner, ParallelDraftModel(drafts, gamma, MASK), prompts, max_new_tokens=20,
                       sampling=SamplingConfig())
        assert out.output_ids == [hf_generate(target, p, 20) for p in prompts]
        assert all(r.drafted for r in out.rows)


def _self_draft():
    """The sampling model drafting for itself through masks (its drafts agree with it often enough)."""
    return ModelRunner(sampling_model())


def test_sampled_pard_follows_the_targets_marginals(sampled):  # noqa: F811
    model, marginals = sampled
    checks, out = sampled_checks(ModelRunner(model), ParallelDraftModel(_self_draft(), 3, MASK), marginals)
    assert all(stat < bound for _, stat, bound in checks), checks
    assert sum(r.accepted for r in out.rows) > 0


@pytest.mark.parametrize("point", POINTS)
def test_sampled_pard_follows_the_warped_marginals(sampled, point):  # noqa: F811
    model, _ = sampled
    checks, _ = warped_checks(ModelRunner(model), ParallelDraftModel(_self_draft(), 3, MASK), model, point)
    assert all(stat < bound for _, stat, bound in checks), checks


def test_run_pard_through_the_cli(tmp_path, capsys, monkeypatch):
    """`sdbench run --strategy pard --draft FOLDER`: the mask token from the draft's config (pard_token), lossless
    rows recording it; a draft naming none, and a mask token past its vocabulary, one line each."""
    import pandas as pd

    files = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w4 w1 w2", "w5 w6 w7"])
    folder = tmp_path / "tiny"
    cfg = json.loads((folder / "config.json").read_text())
    args = ["run", *files, "--max-new-tokens", "10", "--device", "cpu", "--strategy", "pard", "--draft", str(folder),
            "--gamma", "3"]
    code, _, err = run_cli(capsys, *args, "--out", str(tmp_path / "o0"))
    assert code == 2 and "its config.json names no pard_token" in err and "Traceback" not in err
    (folder / "config.json").write_text(json.dumps({**cfg, "pard_token": 5}))
    code, _, err = run_cli(capsys, *args, "--out", str(tmp_path / "o"))
    assert code == 0, err
    rows = pd.read_parquet(next((tmp_path / "o").glob("*.parquet")))
    mine = rows[rows.role != "baseline"]
    assert len(mine) == 2 and mine.lossless.all() and (mine.strategy == "pard").all() and (mine.drafted > 0).all()
    assert all('"mask_token": 5' in p for p in mine.params)
    code, _, err = run_cli(capsys, *args, "--set", f"mask_token={cfg['vocab_size']}", "--out", str(tmp_path / "o1"))
    assert code != 0 and f"--set mask_token={cfg['vocab_size']}: not one of the draft's" in err


def test_bad_mask_settings_are_one_line():
    with pytest.raises(SdbenchError, match="--set mask_token=-2: a token id"):
        PardStrategy.check(3, PardStrategy.settings({"mask_token": -2}), ("x",))
