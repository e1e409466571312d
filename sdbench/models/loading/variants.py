"""Cheaper copies of a model made at load time, named MODEL@VARIANT (e.g. `--draft smollm2-135m@int8`).

`int8`: PyTorch dynamic int8 quantisation of every linear layer in the decoder blocks (weights stored as
int8 with one scale per output channel, activations quantised on the fly per forward; CPU only, from
float32 weights). Per-channel scales keep a small model's greedy choices much closer to the original than
one scale per matrix (on SmolLM2-135M as a 4-token draft: 3.6 against 3.2 tokens per verification). The vocabulary
projection and the embeddings stay in float32: the runner reads the head's weight matrix, and the head is
what the acceptance test compares. The copy is a different model from the original (its greedy choices can
differ), so as a draft or a middle level of a chain its acceptance is high but not 100%.

`q8_0`, `q4_0`: llama.cpp's block types (`models/forward/quants.py`). Every decoder projection, the vocabulary head
and the embeddings are snapped onto the type's grid (each weight becomes the value its block holds, what a GGUF file of
that type de-quantises to), and the CPU fast path reads the projections and the head as those blocks with sdbench's
own products (`models/forward/kernels/quants.c`): a quarter (Q8_0) or an eighth (Q4_0) of float32's bytes per step.
The library's forward over the snapped float32 weights is the reference the probe compares with. CPU, float32
compute, Llama-style layers on the native runner.

`random`: random weights at the model's shape, made by the loader (`models/loading/random_weights.py`), not here.
"""

from __future__ import annotations

import copy
import warnings

import torch

from sdbench.errors import SdbenchError
from sdbench.models.forward import cpufast, cpukernel, cpupacked, quants
from sdbench.models.loading import loader  # loader as a module: tests replace loader.load_model
from sdbench.models.forward.families import serving
from sdbench.models.loading.names import RANDOM, VARIANTS, split_variant, weights_of  # noqa: F401 (re-exported)


def quantise_int8(model) -> object:
    """A copy of `model` with the decoder blocks' linear layers dynamically quantised to int8."""
    p = next(model.parameters())
    if p.device.type != "cpu":
        raise SdbenchError("@int8 uses PyTorch dynamic quantisation, which runs on CPU only: use --device cpu")
    if p.dtype != torch.float32:
        raise SdbenchError(f"@int8 quantises float32 weights, and the model is loaded as {p.dtype}: use "
                           "--dtype float32")
    quantization = getattr(torch.ao, "quantization", None)
    quantize_dynamic = getattr(quantization, "quantize_dynamic", None)
    qconfig = getattr(quantization, "per_channel_dynamic_qconfig", None)
    if quantize_dynamic is None or qconfig is None:
        raise SdbenchError(f"@int8 needs torch.ao.quantization.quantize_dynamic, which torch {torch.__version__} "
                           "no longer has")
    with cpufast.plain(model):  # a packed model's own weights are empty
        copied = copy.deepcopy(model)
    with warnings.catch_warnings():  # torch announces the API's move to torchao on every call
        warnings.simplefilter("ignore")
        for layer in copied.model.layers:
            quantize_dynamic(layer, {torch.nn.Linear: qconfig}, inplace=True)
    return copied.eval().requires_grad_(False)


def _refuse_unpacked_layers(model, kind: str) -> None:
    """One line where a layer's MLP is one the block products cannot read (a mixture of experts)."""
    for i, layer in enumerate(model.model.layers):
        if cpupacked.mlp_parts(layer.mlp) is None:
            raise SdbenchError(f"@{kind}: layer {i}'s MLP is neither a plain nor a gated one (a mixture of experts?), "
                               "and sdbench's block products read plain linear layers only")


def _snapped_weights(model, kind: str) -> list:
    """The weights a block copy snaps (each tensor once: a tied head is the embedding table); refused in one line
    where a product cannot be quantised."""
    _refuse_unpacked_layers(model, kind)
    found = {}
    for layer in model.model.layers:
        for m in cpupacked.projection_modules(layer):
            found[id(m.weight)] = m.weight
    for m in (model.lm_head, model.get_input_embeddings()):
        found[id(m.weight)] = m.weight
    for w in found.values():
        if not quants.fits(w.shape[1]):
            raise SdbenchError(f"@{kind}: a weight of shape {tuple(w.shape)} has rows of {w.shape[1]} inputs, and the "
                               f"block types quantise whole blocks of {quants.BLOCK}")
    return list(found.values())


def _refuse_without_products(kind: str) -> None:
    if not cpukernel.available():
        raise SdbenchError(f"@{kind} reads its blocks with sdbench's CPU products, which are not available here: "
                           f"{cpukernel.why_not()}")


def quantise_blocks(model, kind: str, copy_first: bool) -> object:
    """The model with its projections, head and embeddings snapped onto `kind`'s grid, marked for the fast path
    to read them as blocks (a copy where `copy_first`: the float model stays in use)."""
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise SdbenchError(f"@{kind} reads its blocks with sdbench's CPU products and computes in float32: use "
                           "--device cpu --dtype float32 (or --dtype " + kind + ")")
    _refuse_without_products(kind)
    if copy_first:
        with cpufast.plain(model):  # a packed model's own weights are empty
            model = copy.deepcopy(model)
    with cpufast.plain(model):
        for w in _snapped_weights(model, kind):
            w.data = quants.snap(w.data, kind)
    cpufast.quantised(model, kind)
    return model


def own_blocks(base: str, kind: str | None, device):
    """The LoadedModel of a GGUF file whose matrices are `kind`'s blocks, read as they are and packed for sdbench's
    products (`models/loading/gguf_blocks.py`); None for any other model (its copy is made from its float weights)."""
    if kind not in quants.TYPES:
        return None
    if torch.device(device).type != "cpu":
        raise SdbenchError(f"@{kind} reads its blocks with sdbench's CPU products: use --device cpu")
    found = loader.load_own_blocks(base, kind)
    if found is None:
        return None
    loaded, stored = found
    _refuse_without_products(kind)
    _refuse_unpacked_layers(loaded.model, kind)
    cpufast.adopt_blocks(loaded.model, kind, stored)
    return loaded


def variant_model(name: str, target_name: str, target, device, dtype):
    """The LoadedModel of MODEL@VARIANT: the quantised copy of MODEL (of the loaded target's weights when MODEL
    is the target itself rather than loaded a second time), with MODEL's tokenizer. target: the loaded target,
    or None when the variant is loaded first."""
    from dataclasses import replace

    base, variant = split_variant(name)
    own = None
    if target is not None and base == target_name:
        loaded = target
    else:
        own = own_blocks(base, variant, device)
        loaded = own or loader.load_model(base, device, dtype)
        if target is not None:
            loader.check_same_tokenizer(target.tokenizer, loaded.tokenizer, target_name, base)
    if serving(loaded.model.config).runner != "native":
        raise SdbenchError(f"model '{name}': @{variant} quantises the decoder layers the native runner computes, and "
                           f"'{base}' runs on the generic runner")
    if own is not None:
        return replace(own, name=name)
    if variant == "int8":
        return replace(loaded, name=name, model=quantise_int8(loaded.model))
    return replace(loaded, name=name, model=quantise_blocks(loaded.model, variant, copy_first=loaded is target))
