"""What the GPU check measures and at which sizes, the state one call carries, and what every step returns.

Two sizes: GPU, the real shapes in bfloat16 (what the issue asks an H100 to measure), and TINY, the same steps
on the same models shrunk by `random_weights.RESHAPE` to two layers of 64 (float32, short contexts, few points)
so that the whole check runs on a CPU in seconds: the rehearsal the tests run.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import random
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Iterator

from sdbench.commands.reproduce.common import UNTESTABLE, verdict
from sdbench.data.books import as_id_list
from sdbench.errors import SdbenchError

LLAMA_1B, LLAMA_3B, LLAMA_8B = "llama-1b@random", "llama-3b@random", "llama-8b@random"
TINY_VOCAB = 512  # the tiny models' vocabulary: the byte tokenizer's 258 ids fit unfolded
# what the check imports beside sdbench, and the wheel that brings each (module -> distribution)
NEEDS = {"torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers", "pandas": "pandas",
         "pyarrow": "pyarrow", "matplotlib": "matplotlib", "rich": "rich", "typer": "typer", "yaml": "pyyaml",
         "safetensors": "safetensors", "pytest": "pytest"}


@dataclass(frozen=True)
class Sizes:
    dtype: str
    tiny: bool
    # bench: batch 1, plain decoding (transformers' configuration, sdbench eager and fast) per model
    bench_prompts: int
    bench_prompt_chars: int
    bench_tokens: int
    bench_repeats: int
    gamma: int  # bench: the verification width is gamma + 1
    generate: str  # transformers generate's configuration (hf_generate.MODES)
    # step costs at LLAMA_8B's shape through the graphs
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    gammas: tuple[int, ...]
    budgets: tuple[int, ...]
    reps: int  # each step time the median of this many calls
    alpha: float  # the acceptance rate predictions assume
    # tree costs at LLAMA_8B's shape: verification of 1..max budget + 1 tokens, a LLAMA_1B draft step
    tree_batches: tuple[int, ...]
    tree_context: int
    tree_budgets: tuple[int, ...]  # node budgets of the trees chosen per shipped acceptance table
    # one MagicDec run at LLAMA_8B's shape, then its prediction at the same point
    run_batch: int
    run_context: int
    run_tokens: int
    run_gamma: int
    run_budget: int
    # DSI at LLAMA_1B's shape, the target drafting for itself
    dsi_workers: tuple[int, ...]
    dsi_prompts: int
    dsi_tokens: int
    dsi_gamma: int


GPU = Sizes(dtype="bfloat16", tiny=False, bench_prompts=2, bench_prompt_chars=512, bench_tokens=128,
            bench_repeats=2, gamma=4, generate="fastest",
            batches=(1, 2, 4, 8, 16, 32, 64), contexts=(1024, 2048, 4096, 8192, 16384, 32768), gammas=(1, 2, 3, 4),
            budgets=(256, 512, 1024, 2048), reps=5, alpha=0.8,
            tree_batches=(1, 4), tree_context=1024, tree_budgets=(4, 8, 16, 32),
            run_batch=32, run_context=8192, run_tokens=64, run_gamma=3, run_budget=512,
            dsi_workers=(2, 4), dsi_prompts=2, dsi_tokens=64, dsi_gamma=4)
TINY = Sizes(dtype="float32", tiny=True, bench_prompts=1, bench_prompt_chars=32, bench_tokens=6, bench_repeats=1,
             gamma=4, generate="dynamic",
             batches=(1, 2), contexts=(32, 64), gammas=(1, 2), budgets=(16, 32), reps=1, alpha=0.8,
             tree_batches=(1, 2), tree_context=32, tree_budgets=(4, 8, 16, 32),
             run_batch=2, run_context=64, run_tokens=6, run_gamma=2, run_budget=32,
             dsi_workers=(2, 4), dsi_prompts=1, dsi_tokens=4, dsi_gamma=2)


@dataclass
class Section:
    """What one step measured: rows (one Parquet section), the checks it judged, and what must fail the call."""

    name: str  # cuda-tests, bench, tree-costs, trees, step-costs, predict, magicdec, dsi
    frame: object  # pandas DataFrame
    checks: list = field(default_factory=list)  # reproduce.common.Claim
    failures: list[str] = field(default_factory=list)  # one line each; any fails the call (exit 1)
    notes: list[str] = field(default_factory=list)


@dataclass
class Ctx:
    """One call of the check: its sizes, device, console, scratch folder and deadline."""

    sizes: Sizes
    device: str  # cpu, cuda or cuda:N
    console: object
    work: Path  # scratch: prompt files, run results, the test report (not part of the output folder)
    deadline: float  # time.perf_counter() after which no new measurement starts

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    @property
    def torch_device(self):
        from sdbench.models.loading.pair import resolve_device  # loads torch: not before the preflight

        return resolve_device(self.device)

    @property
    def torch_dtype(self):
        from sdbench.models.loading.pair import resolve_dtype  # loads torch: not before the preflight

        return resolve_dtype(self.sizes.dtype, self.torch_device)

    def verdict_or_untestable(self, ok: bool) -> tuple[str, str]:
        """(verdict, why) of a speed target: judged on a GPU at real shapes, untestable in a CPU rehearsal."""
        if self.sizes.tiny or self.torch_device.type != "cuda":
            return UNTESTABLE, "tiny shapes or no GPU: the targets are for an H100 at the real shape"
        return verdict(ok), ""


WORDS = ("the", "model", "reads", "every", "token", "of", "a", "long", "context", "and", "writes", "one", "more",
         "step", "cache", "keys", "values", "speculation", "draft", "verify", "batch", "layer", "attention")


def write_prompts(path: Path, count: int, chars: int, seed: int = 0) -> Path:
    """A prompt file (.jsonl) of `count` texts of about `chars` characters each, words drawn with `seed`: with
    random weights the text only sets the prompt's length, and a file needs no data wheel."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for i in range(count):
            words: list[str] = []
            while sum(len(w) + 1 for w in words) < chars:
                words.append(rng.choice(WORDS))
            f.write(json.dumps({"id": f"p{i}", "prompt": " ".join(words)[:chars]}) + "\n")
    return path


def prompts_of_tokens(path: Path, model: str, count: int, tokens: int) -> Path:
    """A prompt file whose texts encode to about `tokens` tokens with `model`'s tokenizer (its characters per
    token measured on a sample first; the byte tokenizer's is exact: one id per byte, after the BOS)."""
    from sdbench.models.loading.loader import load_tokenizer  # loads torch: not before the preflight

    tokenizer = load_tokenizer(model)
    sample = write_prompts(path, 1, 4096).read_text(encoding="utf-8")
    text = json.loads(sample)["prompt"]
    per_char = len(as_id_list(tokenizer(text, add_special_tokens=False)["input_ids"])) / len(text)
    return write_prompts(path, count, max(1, round((tokens - 1) / per_char)))


def missing_packages(parts) -> list[str]:
    """The distributions the check needs that are not installed (pytest only for part 1, the CUDA tests)."""
    return [dist for module, dist in NEEDS.items()
            if (module != "pytest" or 1 in parts) and importlib.util.find_spec(module) is None]


def preflight(parts, device: str) -> None:
    """One line and a non-zero exit for what would fail later: a missing package, no CUDA when it is asked."""
    missing = missing_packages(parts)
    if missing:
        raise SdbenchError(f"gpu-check needs {', '.join(missing)}, not installed here: bring the wheel(s) and "
                           "install them with `pip install --no-index --no-deps WHEELS` (docs/gpu.md)")
    from sdbench.models.loading.pair import resolve_device  # loads torch: only once the check has passed

    resolve_device(device)


@contextlib.contextmanager
def settings(tiny: bool) -> Iterator[None]:
    """For one call: no hub is ever asked (HF_HUB_OFFLINE; every model is MODEL@random), and with `tiny` the
    @random models shrunk to two layers of 64 with TINY_VOCAB ids. Both restored afterwards."""
    from sdbench.models.loading import random_weights  # these load torch: not before the preflight
    from sdbench.models.loading.shapes import shrink

    before = os.environ.get("HF_HUB_OFFLINE"), random_weights.RESHAPE
    os.environ["HF_HUB_OFFLINE"] = "1"
    if tiny:
        random_weights.RESHAPE = partial(shrink, vocab=TINY_VOCAB)
    try:
        yield
    finally:
        if before[0] is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before[0]
        random_weights.RESHAPE = before[1]


def free(device) -> None:
    """Hand back what the last step's models, caches and graphs held (caches and their graphs refer to each
    other, so only the cycle collector frees them; transformers' compiled generate is dropped with the
    compiler's caches), before the next step plans its memory."""
    import torch  # not before the preflight

    torch.compiler.reset()
    gc.collect()
    if getattr(device, "type", device) != "cpu":
        torch.cuda.empty_cache()
