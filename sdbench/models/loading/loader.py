"""Load a model and its tokenizer from an alias, a local folder, a .gguf file or a hub id.

GGUF files are de-quantised once and kept as safetensors in the cache (`gguf_cache.py`); the hub is never waited
on (`hub.py`); the library's calls and their errors are `library.py`.
A model's config is read before anything else, and what no runner serves is refused before any weight loads.
`MODEL@random` reads the config alone and builds random weights at its shape (`models/loading/random_weights.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sdbench.errors import SdbenchError
from sdbench.models.forward.families import serving
from sdbench.models.loading import embedded, gguf_blocks, gguf_cache, gguf_header, hub, library, memory, random_weights
from sdbench.models.loading.aliases import EmbeddedModel, model_registry, shipped_config
from sdbench.models.loading.names import RANDOM, is_random, split_variant
from sdbench.models.loading.shapes import config_from_dict, parameter_count

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    name: str  # as the user gave it (alias or id/path)
    ref: str  # resolved: hub id, local dir or gguf path
    source: str  # "embedded" | "hub" | "local" | "gguf"
    model: "PreTrainedModel"  # eval mode, on device, in dtype, requires_grad off
    tokenizer: "PreTrainedTokenizerBase"
    weights: str = "real"  # "random" for MODEL@random
    note: str | None = None  # one line to show the user (a @random model's stand-in tokenizer), or None


# --- public interface -------------------------------------------------------------------------------------------


def load_model(name: str, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32) -> LoadedModel:
    """Resolve `name` (alias -> local path -> hub id) and load weights and tokenizer, ready for inference."""
    dtype, device = _as_dtype(dtype), _as_device(device)
    base, variant = split_variant(name)
    if variant == RANDOM:
        return _random_model(name, base, device, dtype)
    source, ref = _resolve(name)
    _refuse_unserved(name, _config(name, source, ref))
    if source == "hub":
        tokenizer = hub.from_hub(name, ref, lambda local: library.auto_tokenizer(ref, local_files_only=local))
        model = hub.from_hub(name, ref, lambda local: library.auto_model(ref, dtype, local_files_only=local))
    else:
        folder = gguf_cache.converted(Path(ref)) if source in ("embedded", "gguf") else Path(ref)
        with library.as_user_error(name, folder):
            tokenizer = library.auto_tokenizer(str(folder))
            model = library.auto_model(str(folder), dtype)
    model.eval().requires_grad_(False)
    return LoadedModel(name=name, ref=ref, source=source, model=model.to(device), tokenizer=tokenizer)


def load_own_blocks(name: str, kind: str) -> tuple[LoadedModel, dict] | None:
    """(the model of the GGUF file `name` is, its matrices left as the file's `kind` blocks, {module: its blocks}:
    `gguf_blocks.read`), where the file's matrices are of that block type; None for any other model."""
    source, ref = _resolve(name)
    if source not in ("embedded", "gguf") or gguf_header.matrix_type(Path(ref)) != kind:
        return None
    header = gguf_cache.header_copy(Path(ref))
    with library.as_user_error(name, header):
        config, tokenizer = library.auto_config(str(header)), library.auto_tokenizer(str(header))
    _refuse_unserved(name, config)
    model, stored = gguf_blocks.read(Path(ref), kind, name, config)
    return LoadedModel(name=name, ref=ref, source=source, model=model, tokenizer=tokenizer), stored


def model_files(name: str) -> tuple[str, str]:
    """(kind, where) of a model's weights on this machine, for an engine that loads them in its own process:
    ("gguf", the .gguf file) for an embedded alias or a .gguf path, ("folder", a safetensors folder) for a local
    folder, ("hub", the repo id) otherwise. A @int8 or @random variant has no files: one line."""
    base, variant = split_variant(name)
    if variant is not None:
        raise SdbenchError(f"model '{name}': a @{variant} model exists only inside sdbench; an engine loads files")
    source, ref = _resolve(name)
    if source in ("embedded", "gguf"):
        return "gguf", ref
    return ("folder", ref) if source == "local" else ("hub", ref)


def safetensors_folder(name: str) -> str:
    """The safetensors folder (or hub id) sdbench itself loads for `name`: a GGUF's de-quantised copy, made once."""
    kind, where = model_files(name)
    return str(gguf_cache.converted(Path(where))) if kind == "gguf" else where


def check_fit(names: list[str], device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32) -> None:
    """Refuse in one line, before any model is built, models whose weights together do not fit in the device's
    free memory (`memory.refuse_beyond_memory`, the check `predict` and `gpu-check` make). Counted from configs
    alone: every MODEL@random, and every model whose config is at hand without loading (an alias's shipped
    config, a folder's config.json); a MODEL@int8 copy counts as its MODEL, each model once."""
    dtype, device = _as_dtype(dtype), _as_device(device)
    counted, weights = weights_at_hand(names, dtype)
    if counted:
        memory.refuse_beyond_memory(counted, weights, memory.free_bytes(device), dtype, device, "nothing was built")


def weights_at_hand(names: list[str], dtype: torch.dtype | str = torch.float32) -> tuple[list[str], int]:
    """(models counted, bytes of their weights at `dtype`) over the models whose config is at hand without loading
    (`check_fit`'s count), each once."""
    dtype = _as_dtype(dtype)
    counted, weights = [], 0
    for name in dict.fromkeys(n if is_random(n) else split_variant(n)[0] for n in names):
        config = _config_at_hand(name)
        params = parameter_count(config, cached=True) if config is not None else None
        if params:
            counted.append(name)
            weights += params * memory.element_bytes(dtype)
    return counted, weights


def load_config(name: str) -> "PretrainedConfig":
    """The model's config alone, reading no weights: the shipped config.json for an alias, the folder's
    config.json, a GGUF's converted folder or else its metadata, or the hub's (local cache first). MODEL@random:
    the config its random model is built from (MODEL's); a quantised copy's, its model's."""
    base, variant = split_variant(name)
    if variant == RANDOM:
        return _random_config(base)
    name = base
    shipped = shipped_config(name)
    if shipped is not None:
        return config_from_dict(shipped)
    return _config(name, *_resolve(name))


def load_tokenizer(name: str) -> "PreTrainedTokenizerBase":
    """The tokenizer alone; reads no weights (a GGUF not yet cached is parsed for its vocabulary only).
    MODEL@random: the tokenizer its random model decodes with; a quantised copy's, its model's."""
    base, variant = split_variant(name)
    if variant == RANDOM:
        return _random_tokenizer(name, base, _random_config(base).vocab_size)[0]
    name = base
    source, ref = _resolve(name)
    return _read(name, source, ref, library.auto_tokenizer, gguf_cache.gguf_tokenizer)


def model_available(name: str) -> tuple[bool, str]:
    """Whether `name` can be loaded right now with no network, and a one-line how or why."""
    base, variant = split_variant(name)
    if variant == RANDOM:
        try:
            load_config(base)
        except SdbenchError as err:
            return False, str(err)
        return True, f"random weights at {base}'s shape (its config is at hand)"
    if name in model_registry:
        spec = model_registry.get(name)
        if isinstance(spec, EmbeddedModel):
            return _embedded_available(model_registry.entry(name).name, spec)
        return hub.available(spec.repo_id)
    path = Path(name).expanduser()
    if path.is_dir():
        ok = (path / "config.json").is_file()
        return ok, f"local folder {path}" if ok else f"folder {path} has no config.json"
    if path.is_file():
        ok = path.suffix == ".gguf"
        return ok, f"GGUF file {path}" if ok else f"{path} is not a .gguf file"
    if _looks_like_path(name):
        return False, f"no such file or folder: {path}"
    return hub.available(name)


def check_same_tokenizer(a: Any, b: Any, a_name: str, b_name: str) -> None:
    """Raise unless two tokenizers (or LoadedModels) map every token to the same id and agree on bos/eos."""
    ta, tb = (x.tokenizer if isinstance(x, LoadedModel) else x for x in (a, b))
    if ta is tb:
        return
    problem = _tokenizer_difference(ta, tb)
    if problem:
        raise SdbenchError(
            f"'{a_name}' and '{b_name}' do not share a tokenizer ({problem}); "
            "speculative decoding here needs draft and target with the same vocabulary"
        )


def eos_token_ids(loaded: LoadedModel) -> list[int]:
    """Every id that ends generation: the generation config's eos (int or list) and the tokenizer's."""
    return end_ids(getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None), loaded.tokenizer)


def end_ids(configured, tokenizer) -> list[int]:
    """A configured eos (an int, a list, or None) with the tokenizer's own, sorted."""
    ids: set[int] = set()
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def _random_model(name: str, base: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    config = _random_config(base)
    _refuse_unserved(name, config)
    check_fit([name], device, dtype)
    model = random_weights.seeded_model(config, device, dtype)
    tokenizer, note = _random_tokenizer(name, base, random_weights.vocabulary(model))
    return LoadedModel(name=name, ref=base, source=RANDOM, model=model, tokenizer=tokenizer, weights=RANDOM, note=note)


def _config_at_hand(name: str) -> "PretrainedConfig | None":
    """A model's config where reading it costs no download, conversion or network: MODEL@random's, an alias's
    shipped one, a local folder's config.json; None otherwise."""
    if is_random(name):
        return load_config(name)
    shipped = shipped_config(name)
    if shipped is not None:
        return config_from_dict(shipped)
    folder = Path(name).expanduser()
    if (folder / "config.json").is_file():
        with library.as_user_error(name):
            return library.auto_config(str(folder))
    return None


def _random_config(base: str) -> "PretrainedConfig":
    config = load_config(base)
    return random_weights.RESHAPE(config) if random_weights.RESHAPE is not None else config


def _random_tokenizer(name: str, base: str, vocab: int) -> tuple[Any, str | None]:
    return random_weights.standin_tokenizer(name, base, vocab, lambda: load_tokenizer(base),
                                            lambda: load_tokenizer(random_weights.STANDIN))


# --- resolution ---------------------------------------------------------------------------------------------


def _resolve(name: str) -> tuple[str, str]:
    """(source, ref). Embedded aliases assemble their GGUF here if needed (once)."""
    if name in model_registry:
        entry = model_registry.entry(name)
        if isinstance(entry.target, EmbeddedModel):
            return "embedded", str(embedded.gguf_path(entry.name, entry.target))
        return "hub", entry.target.repo_id
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SdbenchError(
                f"folder '{name}' has no config.json: pass a folder written by save_pretrained, or a .gguf file"
            )
        return "local", str(path.resolve())
    if path.is_file():
        if path.suffix != ".gguf":
            raise SdbenchError(f"'{name}' is a file but not a .gguf; pass a .gguf file or a model folder")
        return "gguf", str(path.resolve())
    if _looks_like_path(name):
        raise SdbenchError(f"model '{name}': no such file or folder")
    return "hub", name


def _config(name: str, source: str, ref: str) -> "PretrainedConfig":
    shipped = shipped_config(name)
    if shipped is not None:
        return config_from_dict(shipped)
    # a GGUF not yet cached: its metadata read, not its tensors
    return _read(name, source, ref, library.auto_config, lambda gguf: library.auto_config(str(gguf.parent),
                                                                                          gguf_file=gguf.name))


def _read(name: str, source: str, ref: str, auto, from_gguf):
    """What a library Auto call (`auto`: a config's or a tokenizer's) reads of a resolved model: through the hub,
    from a local folder or a GGUF file's cached copy, else from the GGUF file itself (`from_gguf(path)`)."""
    if source == "hub":
        return hub.from_hub(name, ref, lambda local: auto(ref, local_files_only=local))
    with library.as_user_error(name):
        if source == "local":
            return auto(ref)
        cached = gguf_cache.cache_folder(Path(ref))
        return auto(str(cached)) if gguf_cache.is_complete(cached) else from_gguf(Path(ref))


def _refuse_unserved(name: str, config: "PretrainedConfig") -> None:
    """One line for a model no runner serves, decided from its config before any weight is read."""
    decision = serving(config)
    if decision.runner == "refused":
        raise SdbenchError(f"model '{name}' cannot be run: {decision.reason}")


def _looks_like_path(name: str) -> bool:
    # A hub id is `owner/name` (or a bare legacy name); anything else the user typed is meant as a path.
    return name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1 or "\\" in name


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    short = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
    value = getattr(torch, short.get(dtype, dtype), None)
    if not isinstance(value, torch.dtype):
        raise SdbenchError(f"unknown dtype '{dtype}'; use float32, bfloat16 or float16")
    return value


def _as_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _embedded_available(name: str, spec: EmbeddedModel) -> tuple[bool, str]:
    missing = embedded.missing_packages(spec)
    if missing:
        hint = spec.install_hint() if len(missing) == len(spec.packages) else spec.install_command(missing)
        return False, f"not installed: `{hint}`"
    gguf = embedded.existing_gguf(name, spec)
    if gguf is not None and gguf_cache.is_complete(gguf_cache.cache_folder(gguf)):
        return True, "embedded, cached as safetensors"
    return True, "embedded; the first load de-quantises the GGUF once (slow)"


# --- tokenizer comparison -------------------------------------------------------------------------------------


def _tokenizer_difference(ta: Any, tb: Any) -> str | None:
    va, vb = ta.get_vocab(), tb.get_vocab()
    if len(va) != len(vb):
        return f"vocabulary sizes {len(va)} and {len(vb)}"
    if va != vb:
        _, token = min((i, t) for t, i in va.items() if vb.get(t) != i)  # lowest id: a stable report
        return f"token {token!r} has id {va[token]} in one and {vb.get(token)} in the other"
    for special in ("eos_token_id", "bos_token_id"):
        ia, ib = getattr(ta, special, None), getattr(tb, special, None)
        if ia != ib:
            return f"{special} {ia} and {ib}"
    return None
