"""What a GGUF file's header says about its matrices, read without loading it (nothing of sdbench is imported here,
so that names can ask it): whether its decoder and output matrices are all of one type the library reads unchanged
but for their rows' order (`matrix_type`), the file's tensors as they are stored (`reader`), and the library's tensor
processor for it.

`reader` reads the header itself (the layout of GGUF version 2 and 3, little-endian: the key-value pairs skipped but
for the architecture, the alignment and the file type, then each tensor's name, dimensions, type and offset) and maps the file:
the `gguf` package's reader decodes every value of the header into arrays, seconds for a tokenizer of 150,000 tokens,
where this takes a fraction of one."""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # GGUF's order: the innermost (input) dimension first
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray  # the stored bytes, uint8 [rows, bytes per row], mapped from the file


@dataclass(frozen=True)
class Header:
    architecture: str
    tensors: list[Tensor]
    file_type: int | None = None  # `general.file_type` (llama.cpp's LlamaFileType), where the file says


def matrix_type(path: Path) -> str | None:
    """The one type (lower case: "q4_0", "q8_0", "f16"...) of every decoder matrix (`blk.*`, two dimensions) and of
    the output matrix (`output.weight`, else the tied embedding table) where they share one, none is a stack of
    experts, and the library changes the architecture's matrices by their rows' order at most; None otherwise or for
    no GGUF file."""
    if path.suffix != ".gguf" or not path.is_file():
        return None
    try:
        file = reader(path)
    except (ValueError, struct.error):
        return None
    tensors = {t.name: t for t in file.tensors}
    decoder = [t for t in file.tensors if t.name.startswith("blk.") and len(t.shape) >= 2]
    output = tensors.get("output.weight", tensors.get("token_embd.weight"))
    kinds = {t.tensor_type.name.lower() for t in (*decoder, output) if t is not None}
    experts = any(len(t.shape) > 2 for t in decoder)  # stacked experts: not the plain products blocks are read by
    if not decoder or output is None or experts or len(kinds) != 1 or processor_class(file) is None:
        return None
    return kinds.pop()


class _Cursor:
    """Little-endian values read one after another from a buffer."""

    def __init__(self, buf):
        self.buf, self.at = buf, 0

    def take(self, fmt: str):
        got = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize("<" + fmt)
        return got[0] if len(got) == 1 else got

    def text(self) -> str:
        n = self.take("Q")
        self.at += n
        return bytes(self.buf[self.at - n:self.at]).decode("utf-8", "replace")

    def skip(self, kind: int) -> None:
        """Past one value of type `kind` (an array's elements one by one only where they are strings)."""
        if kind == STRING:
            n = self.take("Q")
            self.at += n
        elif kind == ARRAY:
            inner, count = self.take("IQ")
            if inner in SCALARS:
                self.at += SCALARS[inner] * count
            else:
                for _ in range(count):
                    self.skip(inner)
        else:
            self.at += SCALARS[kind]


@functools.lru_cache(maxsize=2)
def reader(path: Path) -> Header:
    """The file's architecture and tensors, its data mapped (the last two files' kept until `forget`)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # gguf: only a GGUF file's header needs it

    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(buf)
    magic, version, n_tensors, n_values = c.take("4sIQQ")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"{path.name} is not a GGUF file of version 2 or 3")
    arch, align, file_type = "", 32, None
    for _ in range(n_values):
        key, kind = c.text(), c.take("I")
        if key == "general.architecture" and kind == STRING:
            arch = c.text()
        elif key == "general.alignment" and kind == 4:
            align = c.take("I")
        elif key == "general.file_type" and kind == 4:
            file_type = c.take("I")
        else:
            c.skip(kind)
    infos = []
    for _ in range(n_tensors):
        name, dims = c.text(), c.take("I")
        shape = tuple(c.take("Q") for _ in range(dims))
        infos.append((name, shape, GGMLQuantizationType(c.take("I")), c.take("Q")))
    start = -(-c.at // align) * align
    data = np.frombuffer(buf, dtype=np.uint8)
    tensors = []
    for name, shape, kind, offset in infos:
        block, size = GGML_QUANT_SIZES[kind]
        rows, row = int(np.prod(shape[1:], dtype=np.int64)), shape[0] // block * size
        tensors.append(Tensor(name, shape, kind, data[start + offset:start + offset + rows * row].reshape(rows, row)))
    return Header(arch, tensors, file_type)


def forget() -> None:
    """Drop the kept headers and their mappings of the files."""
    reader.cache_clear()


def processor_class(file: Header):
    """The library's tensor processor for the file's architecture where it changes a matrix by its rows' order at
    most (none, or Llama's q/k), else None."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, LlamaTensorProcessor, TensorProcessor

    found = TENSOR_PROCESSORS.get(file.architecture, TensorProcessor)
    return found if found in (TensorProcessor, LlamaTensorProcessor) else None
