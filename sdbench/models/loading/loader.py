"""Load a model and its tokenizer from an alias, a local folder, a .gguf file or a hub id.

GGUF files are de-quantised once (26-78 s) and kept as safetensors in the cache (reload ~1 s).
The hub is never waited on: the local HF cache is tried first, and the network only after a short probe.
A model's config is read before anything else, and what no runner serves is refused before any weight loads.
`MODEL@random` reads the config alone and builds random weights at its shape (`models/loading/random_weights.py`).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open

from sdbench.errors import MissingPackageError, SdbenchError
from sdbench.models.loading import embedded, memory, random_weights
from sdbench.models.loading.aliases import EmbeddedModel, HubModel, model_registry, shipped_config
from sdbench.models.forward.families import serving
from sdbench.models.loading.names import RANDOM, is_random, split_variant
from sdbench.models.loading.shapes import config_from_dict, parameter_count
from sdbench.paths import cache_dir

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

_HUB_PROBE_TIMEOUT_S = 3.0
_COMPLETE = "sdbench-complete.json"  # written last into a cache folder; a folder without it is not trusted
_KEY_SPAN = 1 << 20


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
        tokenizer = _from_hub(name, ref, lambda local: _auto_tokenizer(ref, local_files_only=local))
        model = _from_hub(name, ref, lambda local: _auto_model(ref, dtype, local_files_only=local))
    else:
        folder = _converted_gguf(Path(ref)) if source in ("embedded", "gguf") else Path(ref)
        with _as_user_error(name, folder):
            tokenizer = _auto_tokenizer(str(folder))
            model = _auto_model(str(folder), dtype)
    model.eval().requires_grad_(False)
    return LoadedModel(name=name, ref=ref, source=source, model=model.to(device), tokenizer=tokenizer)


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
    return str(_converted_gguf(Path(where))) if kind == "gguf" else where


def check_fit(names: list[str], device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32) -> None:
    """Refuse in one line, before any model is built, models whose weights together do not fit in the device's
    free memory (`memory.refuse_beyond_memory`, the check `predict` and `gpu-check` make). Counted from configs
    alone: every MODEL@random, and every model whose config is at hand without loading (an alias's shipped
    config, a folder's config.json); a MODEL@int8 copy counts as its MODEL, each model once."""
    dtype, device = _as_dtype(dtype), _as_device(device)
    counted, weights = [], 0
    for name in dict.fromkeys(n if is_random(n) else split_variant(n)[0] for n in names):
        config = _config_at_hand(name)
        params = parameter_count(config, cached=True) if config is not None else None
        if params:
            counted.append(name)
            weights += params * memory.element_bytes(dtype)
    if counted:
        memory.refuse_beyond_memory(counted, weights, memory.free_bytes(device), dtype, device, "nothing was built")


def load_config(name: str) -> "PretrainedConfig":
    """The model's config alone, reading no weights: the shipped config.json for an alias, the folder's
    config.json, a GGUF's converted folder or else its metadata, or the hub's (local cache first). MODEL@random:
    the config its random model is built from (MODEL's)."""
    base, variant = split_variant(name)
    if variant == RANDOM:
        return _random_config(base)
    shipped = shipped_config(name)
    if shipped is not None:
        return config_from_dict(shipped)
    return _config(name, *_resolve(name))


def load_tokenizer(name: str) -> "PreTrainedTokenizerBase":
    """The tokenizer alone; reads no weights (a GGUF not yet cached is parsed for its vocabulary only).
    MODEL@random: the tokenizer its random model decodes with."""
    base, variant = split_variant(name)
    if variant == RANDOM:
        return _random_tokenizer(name, base, _random_config(base).vocab_size)[0]
    source, ref = _resolve(name)
    if source == "hub":
        return _from_hub(name, ref, lambda local: _auto_tokenizer(ref, local_files_only=local))
    with _as_user_error(name):
        if source == "local":
            return _auto_tokenizer(ref)
        cached = _gguf_cache_dir(Path(ref))
        return _auto_tokenizer(str(cached)) if _is_complete(cached) else _gguf_tokenizer(Path(ref))


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
        return _hub_available(spec.repo_id)
    path = Path(name).expanduser()
    if path.is_dir():
        ok = (path / "config.json").is_file()
        return ok, f"local folder {path}" if ok else f"folder {path} has no config.json"
    if path.is_file():
        ok = path.suffix == ".gguf"
        return ok, f"GGUF file {path}" if ok else f"{path} is not a .gguf file"
    if _looks_like_path(name):
        return False, f"no such file or folder: {path}"
    return _hub_available(name)


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
        with _as_user_error(name):
            return _auto_config(str(folder))
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
    if source == "hub":
        return _from_hub(name, ref, lambda local: _auto_config(ref, local_files_only=local))
    with _as_user_error(name):
        if source == "local":
            return _auto_config(ref)
        cached = _gguf_cache_dir(Path(ref))
        if _is_complete(cached):
            return _auto_config(str(cached))
        return _auto_config(str(Path(ref).parent), gguf_file=Path(ref).name)  # reads the metadata, not the tensors


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


@contextlib.contextmanager
def _as_user_error(name: str, folder: Path | None = None) -> Iterator[None]:
    """transformers reports unreadable checkpoints as OSError/ValueError/KeyError, and safetensors a corrupt
    weights file as its own SafetensorError (which names no file); make each one user line."""
    try:
        yield
    except SafetensorError as err:
        bad = _unreadable_safetensors(folder) if folder is not None else None
        what = f"{bad} is not a readable safetensors file" if bad else "a safetensors file is unreadable"
        raise SdbenchError(f"model '{name}' could not be loaded: {what} ({_first_line(err)})") from err
    except (OSError, ValueError, KeyError) as err:
        raise SdbenchError(f"model '{name}' could not be loaded: {_first_line(err)}") from err


def _unreadable_safetensors(folder: Path) -> Path | None:
    """The first of the folder's safetensors files whose header does not parse (reads headers only)."""
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError):
            return path
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


# --- transformers calls -------------------------------------------------------------------------------------


def _auto_tokenizer(ref: str, **kwargs) -> "PreTrainedTokenizerBase":
    from transformers import AutoTokenizer  # transformers: slow to import, and only loading needs it

    return AutoTokenizer.from_pretrained(ref, **kwargs)


def _auto_config(ref: str, **kwargs) -> "PretrainedConfig":
    from transformers import AutoConfig  # transformers: slow to import, and only loading needs it

    return AutoConfig.from_pretrained(ref, **kwargs)


def _auto_model(ref: str, dtype: torch.dtype, **kwargs) -> "PreTrainedModel":
    # transformers: slow to import, and only loading needs it
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # sdbench shows its own status while loading; the library's per-tensor bars would interleave with it
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, **kwargs)


# --- GGUF -> safetensors cache ------------------------------------------------------------------------------


def _gguf_cache_dir(gguf: Path) -> Path:
    """Cache folder for one GGUF file: named by stem, size and a hash of its first and last MiB.

    Content rather than mtime, so that reinstalling the same wheel keeps the cache valid.
    """
    size = gguf.stat().st_size
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        digest.update(f.read(_KEY_SPAN))
        f.seek(max(0, size - _KEY_SPAN))
        digest.update(f.read(_KEY_SPAN))
    return cache_dir("models") / f"{gguf.stem}-{size}-{digest.hexdigest()[:12]}"


def _is_complete(folder: Path) -> bool:
    return (folder / _COMPLETE).is_file() and (folder / "config.json").is_file()


def _converted_gguf(gguf: Path) -> Path:
    """The de-quantised safetensors copy of `gguf`, made on first use."""
    folder = _gguf_cache_dir(gguf)
    if not _is_complete(folder):
        with _atomic_dir(folder) as tmp:
            _convert_gguf(gguf, tmp)
    return folder


@contextlib.contextmanager
def _atomic_dir(final: Path) -> Iterator[Path]:
    """Build a folder under a temporary name and rename it into place, so an interrupted build leaves no cache."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        if final.exists() and not _is_complete(final):
            shutil.rmtree(final)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(gguf: Path, out: Path) -> None:
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
    with _as_user_error(str(gguf)):
        tokenizer = _gguf_tokenizer(gguf)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, **kwargs
        )
    _drop_quantizer_marker(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = {"gguf": str(gguf), "size": gguf.stat().st_size, "transformers": _transformers_version()}
    (out / _COMPLETE).write_text(json.dumps(record, indent=1))


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


def _gguf_tokenizer(gguf: Path) -> "PreTrainedTokenizerBase":
    tokenizer = _auto_tokenizer(str(gguf.parent), gguf_file=gguf.name)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = _gguf_chat_template(gguf)
    return tokenizer


def _gguf_chat_template(gguf: Path) -> str | None:
    from gguf import GGUFReader  # gguf: only a GGUF file's chat template needs it

    field = GGUFReader(str(gguf)).fields.get("tokenizer.chat_template")
    return field.contents() if field is not None else None


def _transformers_version() -> str:
    import transformers  # slow to import, and only a GGUF conversion needs it

    return transformers.__version__


# --- hub ------------------------------------------------------------------------------------------------------


def _from_hub(name: str, repo_id: str, load: Callable[[bool], Any]) -> Any:
    """`load(local_files_only)`: the local HF cache first, the network only if allowed and reachable."""
    label = f"'{name}'" if name == repo_id else f"'{name}' ({repo_id})"
    try:
        return load(True)
    except OSError:
        pass  # not in the local cache
    except (ValueError, KeyError, SafetensorError) as err:
        raise SdbenchError(f"model {label} could not be loaded: {_first_line(err)}") from err
    if _hub_offline():
        _raise_unavailable(name, label, repo_id, "HF_HUB_OFFLINE is set")
    if not _hub_reachable(_hub_endpoint()):
        _raise_unavailable(name, label, repo_id, "the hub is unreachable")
    try:
        return load(False)
    except (OSError, ValueError, KeyError, SafetensorError) as err:
        raise SdbenchError(f"model {label} could not be fetched from the hub: {_first_line(err)}") from err


def hub_snapshot(repo_id: str) -> Path:
    """The folder of a hub repository's newest snapshot (a trained head's): the local cache first."""
    from huggingface_hub import snapshot_download  # slow to import; only a hub head needs it

    return Path(_from_hub(repo_id, repo_id, lambda local: snapshot_download(repo_id, local_files_only=local)))


def _raise_unavailable(name: str, label: str, repo_id: str, why: str) -> None:
    hint = ""
    if name not in model_registry and "/" not in name:
        close = _close_alias(name)
        hint = f" (did you mean '{close}'?)" if close else ""
    raise SdbenchError(
        f"model {label} is not available{hint}: not in the local Hugging Face cache and {why}; "
        f"on a machine with access run `hf download {repo_id}`, or pass a local folder"
    )


def _close_alias(name: str) -> str | None:
    close = difflib.get_close_matches(name.lower(), model_registry.names(), n=1)
    return close[0] if close else None


def _hub_offline() -> bool:
    # Read at call time: huggingface_hub reads HF_HUB_OFFLINE once, at import.
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(f.strip().lower() in ("1", "true", "yes", "on") for f in flags)


def _hub_endpoint() -> str:
    from huggingface_hub import constants  # huggingface_hub: slow to import, and only the hub path needs it

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


@functools.lru_cache(maxsize=8)
def _hub_reachable(endpoint: str) -> bool:
    """One short probe: a failing hub download otherwise retries for ~25-45 s before giving up."""
    request = urllib.request.Request(endpoint, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=_HUB_PROBE_TIMEOUT_S):
            return True
    except urllib.error.HTTPError:
        return True  # it answered
    except (OSError, ValueError):
        return False


def _hub_available(repo_id: str) -> tuple[bool, str]:
    from huggingface_hub import try_to_load_from_cache  # huggingface_hub: slow to import; only a hub model needs it

    config = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(config, str):
        snapshot = Path(config).parent
        if any(snapshot.glob("*.safetensors")) or any(snapshot.glob("*.bin")):
            return True, f"in the Hugging Face cache ({repo_id})"
    return False, f"not in the Hugging Face cache: `hf download {repo_id}`"


def _embedded_available(name: str, spec: EmbeddedModel) -> tuple[bool, str]:
    missing = embedded.missing_packages(spec)
    if missing:
        hint = spec.install_hint() if len(missing) == len(spec.packages) else spec.install_command(missing)
        return False, f"not installed: `{hint}`"
    gguf = embedded.existing_gguf(name, spec)
    if gguf is not None and _is_complete(_gguf_cache_dir(gguf)):
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
