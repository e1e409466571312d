"""Trained heads as drafters, greedy: every chain each head drafts in a real generation equals the hand reference's
chain (tests/head_references.py: the target's states from transformers' own forward, the head recomputed from
its equations over the whole committed sequence, no cache), so the head's cache, its rewinding and the states
the loop hands over are right; and the output equals transformers' `generate` (lossless), on tiny random
targets of several families, on the eager, static-shape and generic runners."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from sdbench.config import SamplingConfig
from sdbench.engine.hidden import eagle3_layers
from sdbench.engine.loop import generate
from sdbench.models.forward.generic import GenericRunner
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies import BuildContext, build_proposer
from tests import head_references as ref
from tests.heads import eagle1_dir, eagle3_dir, medusa_dir, one_thread, small_vocab_target  # noqa: F401
from tests.references import hf_generate

pytestmark = pytest.mark.usefixtures("one_thread")

GAMMA = 3
NEW = 20
PROMPTS = [[5, 6, 7, 1, 2, 4, 3], [1, 2, 3], [3, 3, 1, 0, 7, 7, 7, 1, 2, 6, 4]]


def _run(runner, strategy: str, folder, gamma: int = GAMMA):
    """(outputs, [(context, drafted chain)] of every row of every round)."""
    proposer = build_proposer(strategy, BuildContext(runner, [], gamma, {"head": str(folder)}))
    chains, propose = [], proposer.propose

    def spy(state):
        p = propose(state)
        for b in range(state.batch):
            if int(p.lengths[b]):
                chains.append((state.row(b).tolist(), p.tokens[b, : int(p.lengths[b])].tolist()))
        return p

    proposer.propose = spy
    out = generate(runner, proposer, PROMPTS, max_new_tokens=NEW, sampling=SamplingConfig())
    return out, chains


def _check(target, out, chains, reference) -> None:
    assert out.output_ids == [hf_generate(target, p, NEW) for p in PROMPTS]  # lossless
    assert len(chains) > 3 * len(PROMPTS)
    for ctx, chain in chains:
        assert chain == reference(ctx, len(chain)), ctx
    accepted, drafted = sum(r.accepted for r in out.rows), sum(r.drafted for r in out.rows)
    assert 0 < accepted < drafted  # both acceptance and rejection (a rewind) happen


def _cfg(folder) -> dict:
    import json

    cfg = json.loads((folder / "config.json").read_text())
    return cfg.get("transformer_layer_config", cfg)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_eagle3_speculators_format_drafts_the_reference_chain(tmp_path, arch):
    target = small_vocab_target(arch)
    folder = eagle3_dir(tmp_path / "head", target, draft_vocab=6, seed=1)
    w = load_file(str(folder / "model.safetensors"))
    out, chains = _run(ModelRunner(target), "eagle", folder)
    _check(target, out, chains, lambda ctx, n: ref.eagle3_chain(target, w, _cfg(folder), ctx, n, eagle3_layers(4)))


@pytest.mark.parametrize("path", ["eagle format, static shapes", "named layers, generic runner"])
def test_eagle3_other_format_layers_and_runners(tmp_path, path):
    target = small_vocab_target("llama")
    layers = (0, 1, 3) if "named" in path else eagle3_layers(4)
    folder = eagle3_dir(tmp_path / "head", target, fmt="eagle" if "eagle" in path else "speculators",
                        layer_ids=layers if "named" in path else None, seed=2)
    w = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(str(folder / "model.safetensors")).items()}
    runner = GenericRunner(target) if "generic" in path else ModelRunner(target, static=True)
    out, chains = _run(runner, "eagle", folder)
    _check(target, out, chains, lambda ctx, n: ref.eagle3_chain(target, w, _cfg(folder), ctx, n, layers))


def test_eagle1_drafts_the_reference_chain(tmp_path):
    target = small_vocab_target("llama")
    folder = eagle1_dir(tmp_path / "head", target)
    w = torch.load(folder / "pytorch_model.bin", weights_only=True)
    out, chains = _run(ModelRunner(target), "eagle", folder)
    _check(target, out, chains, lambda ctx, n: ref.eagle1_chain(target, w, _cfg(folder), ctx, n))


def test_medusa_drafts_the_reference_chain(tmp_path):
    target = small_vocab_target("qwen2")
    folder = medusa_dir(tmp_path / "head", target, heads=3, layers=2)
    w = load_file(str(folder / "medusa_lm_head.safetensors"))
    out, chains = _run(ModelRunner(target), "medusa", folder)
    _check(target, out, chains, lambda ctx, n: ref.medusa_chain(target, w, 2, ctx, n))
