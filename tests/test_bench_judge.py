"""bench's one judge (`commands/bench_judge.py`): what each system is held to, exactly where both sides' steps were
width-invariant, up to a tie in the path's rounding elsewhere, an engine's agreement said and never failed."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import pytest
import torch

from sdbench.commands.bench_judge import GENERATE, PLAIN_FAST, fail_on_real, held_lines, hold
from sdbench.commands.bench_table import OutputDiffers, SystemMeasurement, write_bench
from sdbench.commands.divergence import INT8_STEP, engine_rounding


class TiedTarget:
    """A target whose logits at every context tie tokens 3 and 4 at the top (gap 0) and put 5 far below."""

    dtype = torch.float32

    def __init__(self, activations=None):
        self.activations = activations

    def new_cache(self, batch, capacity):
        return None

    def release(self, cache):
        pass

    def prefill(self, cache, prompts):
        return torch.tensor([[0.0, 0.0, 0.0, 20.0, 20.0, 1.0]])

    def block_activations(self):
        return self.activations


@dataclass
class Source:
    runner: object
    varied: int | None


@dataclass
class Totals:
    engine: str = "llama.cpp"


def _systems(varied: int | None, ours: list[int], engine: list[int] | None = None) -> list[SystemMeasurement]:
    target = TiedTarget()
    plain, generate = [[3, 3, 3]], [[3, 3, 3]]
    systems = [SystemMeasurement("transformers generate", False, outputs=generate),
               SystemMeasurement("sdbench autoregressive (fast)", True, outputs=plain, source=Source(target, 0)),
               SystemMeasurement("sdbench ngram (γ=4) (fast)", True, outputs=[ours], source=Source(target, varied))]
    if engine is not None:
        systems.append(SystemMeasurement("llama.cpp draft", False, outputs=[engine], engine=Totals()))
    return systems


def test_width_invariant_systems_are_held_bit_for_bit():
    held = hold(_systems(0, [3, 3, 3]), [[3, 3, 3]], [[1, 2]], False, lambda fast: None)
    ngram = held["sdbench ngram (γ=4) (fast)"]
    assert ngram.against == PLAIN_FAST and ngram.exact and ngram.cell(1) == "yes, exact"
    assert held["sdbench autoregressive (fast)"].against == GENERATE
    fail_on_real(held)
    # the same tie taken the other way: real where both sides were width-invariant, a tie where the path varies
    exact = hold(_systems(0, [3, 4, 3]), [[3, 3, 3]], [[1, 2]], False, lambda fast: None)
    assert exact["sdbench ngram (γ=4) (fast)"].real[0].gap == 0.0
    assert exact["sdbench ngram (γ=4) (fast)"].cell(1) == "NO (1/1 prompts)"
    with pytest.raises(OutputDiffers, match="ngram .* differs from sdbench's fast plain decoding on prompt 1 "
                                            "\\(first at new token 2: \\[4\\] vs \\[3\\]\\): a real divergence"):
        fail_on_real(exact)
    varied = hold(_systems(5, [3, 4, 3]), [[3, 3, 3]], [[1, 2]], False, lambda fast: None)
    assert varied["sdbench ngram (γ=4) (fast)"].cell(1) == "yes, 1 tie"
    fail_on_real(varied)
    assert held_lines(varied) == ["sdbench ngram (γ=4) (fast) differs from sdbench's fast plain decoding on prompt 1 "
                                  "(first at new token 2: [4] vs [3]): a tie, logit gap 0"]
    # a token far below the top is real wherever it is chosen
    far = hold(_systems(5, [3, 5, 3]), [[3, 3, 3]], [[1, 2]], False, lambda fast: None)
    assert far["sdbench ngram (γ=4) (fast)"].verdict() == "real"


def test_an_engine_is_judged_in_its_own_arithmetic_and_never_fails(tmp_path):
    held = hold(_systems(0, [3, 3, 3], engine=[3, 4, 3]), [[3, 3, 3]], [[1, 2]], False, lambda fast: None, "q4_0")
    engine = held["llama.cpp draft"]
    assert engine.against == GENERATE and not engine.failing and engine.cell(1) == "0/1, 1 tie"
    far = hold(_systems(0, [3, 3, 3], engine=[5, 3, 3]), [[3, 3, 3]], [[1, 2]], False, lambda fast: None)
    assert far["llama.cpp draft"].cell(1) == "0/1" and far["llama.cpp draft"].verdict() == "real"
    fail_on_real(far)  # said, not failed: an engine's arithmetic is its own
    assert engine_rounding("q4_k_m") == engine_rounding("q8_0") == INT8_STEP
    assert engine_rounding("float32") == torch.finfo(torch.float16).eps  # llama.cpp's KV cache
    # bench.parquet says what each system was held to and how it fared
    systems = _systems(0, [3, 4, 3])
    for m in systems:
        m.tokens, m.seconds = [3], [1.0]
    path = write_bench(systems, str(tmp_path), {"device": "cpu", "dtype": "float32"},
                       held=hold(systems, [[3, 3, 3]], [[1, 2]], False, lambda fast: None))
    df = pd.read_parquet(path).set_index("system")
    assert df.loc["sdbench ngram (γ=4) (fast)", ["held_to", "exact", "divergence", "ties"]].tolist() == [
        PLAIN_FAST, True, "real", 0]
    assert df.loc["sdbench autoregressive (fast)", "held_to"] == GENERATE
    assert pd.isna(df.loc["transformers generate", "held_to"])
