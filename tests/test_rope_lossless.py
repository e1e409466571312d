"""Speculative decoding gives transformers `generate`'s tokens (its dynamic cache: step-by-step decoding) for
every rope type the library has, past the original context, including the types the library rescales per
call (dynamic; longrope, Llama's and Phi-3's with its partial rotary). For those this holds only because each
token is rotated as plain decoding rotates it (models/forward/rotary.py): with the library's own per-call rule, a
5-token verification that crosses the original context differs from `generate`
(`test_the_per_call_rule_would_not_be_lossless`, the control). `sdbench bench`, the command a user checks this
with, is run on the rescaled types: its sdbench rows (plain, fast, generic runner, `draft`, `ngram`) equal
`generate`. transformers' own assisted generation and prompt lookup do not, on the dynamic rope: the library's
k-token verification rescales per call. Phi-3's `generate` also computes the whole sequence again with the
long factors when it first passes the original context (models/forward/recompute.py): the Phi-3 case crosses there
inside verifications, and rejected ones rewind below it."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from sdbench.config import SamplingConfig
from sdbench.engine.loop import generate
from sdbench.models.forward import cpufast
from sdbench.models.forward.generic import GenericRunner
from sdbench.models.forward.rotary import Rotary
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.ngram import NGram
from tests.conftest import VOCAB, run_cli
from tests.references import tiny_model_dir
from tests.test_families import family_config
from tests.test_runner_fidelity import ORIGINAL, ROPES, library_greedy, perturbed_model, tiny_config

PROMPT = 10  # the prompt ends below ORIGINAL; the decoded tokens cross it
NEW = 24
PHI3 = dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
            original_max_position_embeddings=ORIGINAL, short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            long_factor=[1.0, 2, 4, 8, 12, 16])
CASES = {
    **{f"llama-{name}": lambda rp=rp, name=name: tiny_config(
        "llama", rope_parameters=dict(rp, rope_theta=10000.0),
        max_position_embeddings=ORIGINAL if name == "dynamic" else 64) for name, rp in ROPES.items()},
    "phi3-longrope": lambda: family_config("phi3", max_position_embeddings=64,
                                           original_max_position_embeddings=ORIGINAL, rope_parameters=PHI3),
}
RESCALED = ["llama-dynamic", "llama-longrope", "phi3-longrope"]



def _model(name: str):
    model = perturbed_model(CASES[name](), seed=3)
    with torch.no_grad():  # the end-of-sequence logit stays 0, under the top one: every prompt decodes NEW tokens
        model.lm_head.weight[2] = 0.0
    return model


def _prompts(length: int = PROMPT) -> list[list[int]]:
    return [[3 + (k * i) % 40 for i in range(length)] for k in (3, 7)]


RUNNERS = {"fast": lambda m: ModelRunner(m, fast=True), "static": lambda m: ModelRunner(m, static=True),
           "generic": lambda m: GenericRunner(m)}


def _decoded(model, strategy, prompts=None, kind: str = "fast") -> list[list[int]]:
    runner = RUNNERS[kind](model)
    return [generate(runner, strategy(runner), [p], max_new_tokens=NEW, sampling=SamplingConfig()).output_ids[0]
            for p in prompts or _prompts()]


STRATEGIES = {"draft": lambda r: DraftModel(r, 4), "ngram": lambda r: NGram(4)}


@pytest.mark.parametrize("name", list(CASES))
def test_draft_and_ngram_equal_generate_past_the_original_context(name):
    model = _model(name)
    want = [library_greedy(model, p, NEW) for p in _prompts()]
    assert all(len(w) == NEW for w in want) and PROMPT < ORIGINAL < PROMPT + NEW
    for kind in RUNNERS:
        for label, strategy in STRATEGIES.items():
            assert _decoded(model, strategy, kind=kind) == want, f"{name} {kind} {label}"
    cpufast.disable(model)


def test_phi3_equals_generate_with_a_prompt_past_the_original_context():
    """A Phi-3 prompt already past original_max_position_embeddings: generate never recomputes, every token
    rotates with the long factors, and speculative decoding equals it."""
    model, prompts = _model("phi3-longrope"), _prompts(ORIGINAL + 4)
    want = [library_greedy(model, p, NEW) for p in prompts]
    for label, strategy in STRATEGIES.items():
        assert _decoded(model, strategy, prompts) == want, label


@pytest.mark.parametrize("name", RESCALED[:2])
def test_the_per_call_rule_would_not_be_lossless(name, monkeypatch):
    """The control: every token of a forward rotated for the forward's widest position (the library's per-call
    rule) makes speculative decoding differ from `generate` on these models, so the test above can fail."""
    def per_call(self, start, width, prompt_len, positions=None):
        if not self.length_dependent:
            return None
        floor = 0 if prompt_len is None else int(prompt_len.max())
        return torch.full((len(start), width), max(max(start) + width, floor), dtype=torch.long)

    model = _model(name)
    want = [library_greedy(model, p, NEW) for p in _prompts()]
    monkeypatch.setattr(Rotary, "scaling_lengths", per_call)
    assert _decoded(model, STRATEGIES["draft"]) != want


@pytest.mark.parametrize("name", RESCALED)
def test_bench_equals_generate_on_the_rescaled_ropes(name, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    folder = tiny_model_dir(tmp_path / "tiny", model=_model(name))
    assert _model(name).config.vocab_size == VOCAB
    data = tmp_path / "prompts.csv"
    data.write_text("prompt\n" + "".join(f"\"{' '.join(f'w{t - 3}' for t in p)}\"\n" for p in _prompts()))
    code, _, err = run_cli(capsys, "bench", "--target", str(folder), "--dataset", str(data), "--limit", "2",
                           "--max-new-tokens", str(NEW), "--repeats", "1", "--out", str(tmp_path / "b"))
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "b" / "bench.parquet")
    ours = df[df.system.str.startswith("sdbench")]
    assert len(ours) == 5 and ours.same_output.all() and (ours.tokens == 2 * NEW).all()


def test_phi3_without_its_recomputation_would_not_be_lossless(monkeypatch):
    """The control for Phi-3: rotating each token right but keeping the short-rope keys past the crossing (no
    recomputation) differs from its `generate`."""
    from sdbench.models.forward import recompute

    model = _model("phi3-longrope")
    want = [library_greedy(model, p, NEW) for p in _prompts()]
    monkeypatch.setattr(recompute, "switches", lambda *a: False)
    assert _decoded(model, STRATEGIES["draft"]) != want


@pytest.mark.parametrize("kind", list(RUNNERS))
def test_phi3_rewound_below_the_crossing_equals_generate(kind, monkeypatch):
    """A draft of other weights is rejected across the crossing, so rows cross, rewind below it (their keys
    computed again with the short factors) and cross again; the output stays generate's."""
    from sdbench.models.forward import generic, recompute

    model, other = _model("phi3-longrope"), perturbed_model(CASES["phi3-longrope"](), seed=11)
    switched = []
    real_native, real_generic = recompute._recompute, generic.GenericRunner._switch

    def native(runner, view, upto, crossed):
        switched.append(crossed)
        return real_native(runner, view, upto, crossed)

    def generic_switch(self, cache, b, start, width):
        before = bool(cache.crossed[b])
        out = real_generic(self, cache, b, start, width)
        if bool(cache.crossed[b]) != before:
            switched.append(bool(cache.crossed[b]))
        return out

    monkeypatch.setattr(recompute, "_recompute", native)
    monkeypatch.setattr(generic.GenericRunner, "_switch", generic_switch)
    want = [library_greedy(model, p, NEW) for p in _prompts()]
    drafter = ModelRunner(other)
    assert _decoded(model, lambda r: DraftModel(drafter, 4), kind=kind) == want
    assert True in switched and False in switched, switched  # crossed, and rewound below the crossing


@pytest.mark.parametrize("original", [26, 30])  # the probe's 32 positions cross there in its steps / verification
def test_the_probe_holds_phi3_to_its_generate_across_the_crossing(original, monkeypatch):
    from sdbench.models.probing import probe as probe_module
    from sdbench.models.forward import recompute

    config = family_config("phi3", max_position_embeddings=64, original_max_position_embeddings=original,
                           rope_parameters=dict(PHI3, original_max_position_embeddings=original))
    model = perturbed_model(config, seed=3)
    for runner in RUNNERS.values():
        assert probe_module.probe(runner(model), 32).passed
    cpufast.disable(model)
    monkeypatch.setattr(recompute, "switches", lambda *a: False)  # the control: no recomputation
    assert not probe_module.probe(ModelRunner(model), 32).passed
