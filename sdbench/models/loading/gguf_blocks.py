"""A GGUF file whose matrices are llama.cpp's Q8_0 or Q4_0 blocks, read as it is: its decoder projections and its
output matrix stay the file's own blocks (no float32 copy of them is made at load, none is cached on disk), and the
model is built around them, ready for sdbench's block products (`models/forward/quants.py`).

Which file: every decoder matrix (`blk.*`, two dimensions or more) and the output matrix (`output.weight`, or the
embedding table where the head is tied to it) of one block type; the norms and biases float, and an untied
embedding table of any type (the lookup reads it de-quantised). `names.own_block_type` says so from the header; any
other file (a K-quant mix, Q4_1, a head kept at Q6_K) is de-quantised as before (`gguf_cache.py`).

How: the library reads the file's metadata into a config and names every tensor (transformers' own GGUF mapping and
its tensor processor, whose only change to a matrix here is Llama's q/k row order, undone on the blocks' rows
exactly as on the values: a row of blocks moves as a whole). The model is built without weights, then each tensor
the forward reads as a float (norms, biases, the embedding table) is de-quantised into it, and each projection
holds an empty weight until the fast path adopts the file's blocks (`cpufast.adopt_blocks`). The library's own
forward (the probe's reference: `cpufast.library_forward`) de-quantises the blocks while it runs, one fused product
at a time where the whole float copy would crowd the memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from sdbench.errors import SdbenchError
from sdbench.models.loading import library
from sdbench.models.loading.gguf_header import forget, processor_class, reader
from sdbench.models.loading.names import FILE_ATTR

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def read(path: Path, kind: str, name: str, config=None) -> tuple["PreTrainedModel", dict]:
    """(the model of a GGUF file of block type `kind`, {projection module: its blocks [out, n / 32 * bytes] uint8,
    rows in the library's order}). Float32, on the CPU; a tensor the model needs and the file lacks, one line.
    config: the file's config where already read (`gguf_cache.header_copy`), else read from its header."""
    model, processor, names = _skeleton(path, reader(path), name, config)
    modules = dict(model.named_modules())
    stored: dict = {}
    for tensor in reader(path).tensors:
        hf = names.get(tensor.name)
        if hf is None:
            continue
        owner, _, attr = hf.rpartition(".")
        module = modules[owner]
        if tensor.tensor_type.name.lower() == kind and attr == "weight" and isinstance(module, torch.nn.Linear):
            stored[module] = _blocks(tensor, processor)
            value = torch.empty(0)
        else:
            value = torch.from_numpy(np.array(  # a copy: the file's mapping is not kept
                processor.process(weights=_values(tensor), name=tensor.name).weights,
                dtype=np.float32))
        module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.get_input_embeddings().weight
    setattr(model, FILE_ATTR, str(path.resolve()))  # its weights' files: the probe's verdicts key on this one
    forget()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise SdbenchError(f"model '{name}': {path.name} holds no tensor for {missing[0]}"
                           + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return model.eval().requires_grad_(False), stored


def _skeleton(path: Path, file, name: str, config=None):
    """(the model built from the file's config with no weights, the library's tensor processor for the file's
    architecture, {GGUF tensor name: the model's parameter name})."""
    from accelerate import init_empty_weights  # the library's weightless construction
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    from sdbench.models.loading.shapes import quiet_library

    found = processor_class(file)
    if found is None:  # gguf_header.matrix_type said no
        raise SdbenchError(f"model '{name}': {path.name}'s blocks cannot be read as they are")
    with library.as_user_error(name), quiet_library():
        config = config or library.auto_config(str(path.parent), gguf_file=path.name)
        processor = found(config=config.to_dict())  # Llama's: the head counts
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model, processor, get_gguf_hf_weights_map(model, processor)


def _values(tensor) -> np.ndarray:
    """A tensor the forward reads as floats, de-quantised, in the library's shape (GGUF's dimensions reversed)."""
    from gguf import dequantize  # gguf: only a GGUF file's own blocks need it

    return dequantize(tensor.data, tensor.tensor_type).reshape(tensor.shape[::-1])


def _blocks(tensor, processor) -> torch.Tensor:
    """A block matrix's stored rows [out, n / 32 * bytes] in the library's row order: the processor's reordering
    (Llama's q/k) found by passing it the rows' indices."""
    rows = tensor.data.reshape(tensor.data.shape[0], -1)
    order = processor.process(weights=np.arange(rows.shape[0]).reshape(-1, 1), name=tensor.name).weights
    return torch.from_numpy(np.ascontiguousarray(rows[order.reshape(-1)]))
