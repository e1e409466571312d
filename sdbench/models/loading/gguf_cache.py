"""A GGUF file de-quantised once into a safetensors folder in the cache, kept by content (not by mtime, so
that reinstalling the same wheel keeps it), built under a temporary name and renamed into place."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from sdbench.errors import MissingPackageError
from sdbench.models.loading import library
from sdbench.paths import cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

COMPLETE = "sdbench-complete.json"  # written last into a cache folder; a folder without it is not trusted
KEY_SPAN = 1 << 20  # the bytes hashed at each end of a GGUF file for its cache key

def cache_folder(gguf: Path) -> Path:
    """Cache folder for one GGUF file: named by stem, size and a hash of its first and last MiB.

    Content rather than mtime, so that reinstalling the same wheel keeps the cache valid.
    """
    size = gguf.stat().st_size
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        digest.update(f.read(KEY_SPAN))
        f.seek(max(0, size - KEY_SPAN))
        digest.update(f.read(KEY_SPAN))
    return cache_dir("models") / f"{gguf.stem}-{size}-{digest.hexdigest()[:12]}"


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE).is_file() and (folder / "config.json").is_file()


def converted(gguf: Path) -> Path:
    """The de-quantised safetensors copy of `gguf`, made on first use."""
    folder = cache_folder(gguf)
    if not is_complete(folder):
        with atomic_dir(folder) as tmp:
            convert(gguf, tmp)
    return folder


def header_copy(gguf: Path) -> Path:
    """The file's config and tokenizer as the library reads them from its header, saved once into a small folder of
    the cache (the library takes seconds to read a tokenizer from a header; a file read as its own blocks has no
    de-quantised copy to take them from)."""
    folder = cache_folder(gguf)
    folder = folder.with_name(folder.name + "-header")
    if not is_complete(folder):
        with atomic_dir(folder) as tmp, library.as_user_error(str(gguf)):
            library.auto_config(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
            gguf_tokenizer(gguf).save_pretrained(tmp)
            (tmp / COMPLETE).write_text(json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size,
                                                    "transformers": _transformers_version()}, indent=1))
    return folder


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Build a folder under a temporary name and rename it into place, so an interrupted build leaves no cache."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        if final.exists() and not is_complete(final):
            shutil.rmtree(final)
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_complete(final):  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert(gguf: Path, out: Path) -> None:
    """De-quantise to float32 (lossless for every later dtype) and save model + tokenizer as a plain HF folder."""
    from transformers import AutoModelForCausalLM  # transformers: slow to import, and only loading needs it

    for package in ("gguf", "accelerate"):  # transformers needs both to read a GGUF
        if importlib.util.find_spec(package) is None:
            raise MissingPackageError(package, f"reading the GGUF file {gguf.name}")
    kwargs: dict[str, Any] = {}
    with contextlib.suppress(ImportError):
        from transformers import GgufConfig  # transformers: slow to import, and older versions lack it

        # Explicit: with the `kernels` package present, transformers would otherwise keep weights packed.
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    with library.as_user_error(str(gguf)):
        tokenizer = gguf_tokenizer(gguf)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, **kwargs
        )
    _drop_quantizer_marker(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = {"gguf": str(gguf), "size": gguf.stat().st_size, "transformers": _transformers_version()}
    (out / COMPLETE).write_text(json.dumps(record, indent=1))


def _drop_quantizer_marker(model: "PreTrainedModel") -> None:
    """The weights are already dense; without this, save_pretrained refuses ('quantized with gguf').

    transformers clears these itself only when asked for `GgufConfig(dequantize=True)`; its fallback to
    de-quantising (no `kernels` package) keeps them.
    """
    for attr in ("hf_quantizer", "quantization_method"):
        model.__dict__.pop(attr, None)
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None:
            config.__dict__.pop("quantization_config", None)
            config.__dict__.pop("_is_quantized", None)
    model.is_quantized = False


def gguf_tokenizer(gguf: Path) -> "PreTrainedTokenizerBase":
    tokenizer = library.auto_tokenizer(str(gguf.parent), gguf_file=gguf.name)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = _chat_template(gguf)
    return tokenizer


def _chat_template(gguf: Path) -> str | None:
    from gguf import GGUFReader  # gguf: only a GGUF file's chat template needs it

    field = GGUFReader(str(gguf)).fields.get("tokenizer.chat_template")
    return field.contents() if field is not None else None


def _transformers_version() -> str:
    import transformers  # slow to import, and only a GGUF conversion needs it

    return transformers.__version__
