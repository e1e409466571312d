"""What a GGUF file's header says about its matrices, read without loading it (nothing of sdbench is imported here,
so that names can ask it): whether its decoder and output matrices are all of one type the library reads unchanged
but for their rows' order (`matrix_type`), the file's reader, and the library's tensor processor for it."""

from __future__ import annotations

import functools
from pathlib import Path


def matrix_type(path: Path) -> str | None:
    """The one type (lower case: "q4_0", "q8_0", "f16"...) of every decoder matrix (`blk.*`, two dimensions or more)
    and of the output matrix (`output.weight`, else the tied embedding table) where they share one and the library
    changes the architecture's matrices by their rows' order at most; None otherwise or for no GGUF file."""
    if path.suffix != ".gguf" or not path.is_file():
        return None
    file = reader(path)
    tensors = {t.name: t for t in file.tensors}
    decoder = [t for t in file.tensors if t.name.startswith("blk.") and len(t.shape) >= 2]
    output = tensors.get("output.weight", tensors.get("token_embd.weight"))
    kinds = {t.tensor_type.name.lower() for t in (*decoder, output) if t is not None}
    if not decoder or output is None or len(kinds) != 1 or processor_class(file) is None:
        return None
    return kinds.pop()


@functools.lru_cache(maxsize=2)
def reader(path: Path):
    """The file's reader, memory-mapped (parsing a header takes seconds: the last two files' are kept until
    `forget`)."""
    from gguf import GGUFReader  # gguf: only a GGUF file's header needs it

    return GGUFReader(str(path))


def forget() -> None:
    """Drop the kept readers and their mappings of the files."""
    reader.cache_clear()


def processor_class(file):
    """The library's tensor processor for the file's architecture where it changes a matrix by its rows' order at
    most (none, or Llama's q/k), else None."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, LlamaTensorProcessor, TensorProcessor

    found = TENSOR_PROCESSORS.get(file.fields["general.architecture"].contents(), TensorProcessor)
    return found if found in (TensorProcessor, LlamaTensorProcessor) else None
