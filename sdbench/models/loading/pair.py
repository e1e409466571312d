"""Devices, dtypes and the loaded target/draft pair every command decodes with."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console

from sdbench.config import DEFAULT_GAMMA, RunConfig
from sdbench.data.prompts import run_positions
from sdbench.drafting.ngram import DRAFT_NAME as NGRAM_DRAFT
from sdbench.engine.runner import Runner
from sdbench.errors import SdbenchError
from sdbench.models.loading import loader  # the module, not its names: tests replace loader.load_model and load_tokenizer
from sdbench.models.loading.aliases import shipped_config
from sdbench.models.forward.families import serving
from sdbench.models.forward.generic import make_runner, runner_kind
from sdbench.models.loading.names import BLOCK_TYPES, ENGINE_TYPES, tokenizer_name, with_weights
from sdbench.models.probing.probe import probe_pair
from sdbench.models.probing.probe_cache import ProbeCache
from sdbench.models.forward.cpufast import weight_bytes
from sdbench.models.loading.shapes import config_from_dict
from sdbench.models.loading.variants import split_variant, variant_model

if TYPE_CHECKING:  # transformers' tokenizer base is a slow import, and only a type here
    from transformers import PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --dtype q8_0|q4_0: every model of the run as its block copy (MODEL@TYPE, `with_weights`), computing in float32
BLOCK_DTYPES = dict.fromkeys(BLOCK_TYPES, torch.float32)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise SdbenchError(f"--device {name}: use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SdbenchError("--device cuda was asked for, but torch sees no CUDA device on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise SdbenchError(f"--device {name}: use cpu, cuda or auto")
    return dev


def resolve_dtype(name: str, device: torch.device, engine: bool = False) -> torch.dtype:
    """The torch dtype sdbench computes in for --dtype NAME; an engine-only type (`ENGINE_TYPES`) only where an
    engine decodes (`engine`): its own server takes it."""
    if name in ENGINE_TYPES:
        if not engine:
            raise SdbenchError(f"--dtype {name}: llama.cpp's K-quant mix, which sdbench's own runner does not read (it "
                               f"reads {' and '.join(BLOCK_TYPES)}); run it through --engine llama.cpp, or "
                               f"`bench --engine llama.cpp --dtype {name}` for llama.cpp beside sdbench over the "
                               "same weights")
        return torch.float32
    if name in BLOCK_DTYPES:
        if device.type != "cpu":
            raise SdbenchError(f"--dtype {name}: sdbench's products for quantised blocks run on a CPU; use --device cpu")
        return BLOCK_DTYPES[name]
    if name not in DTYPES:
        raise SdbenchError(f"--dtype {name}: use one of {', '.join([*DTYPES, *BLOCK_DTYPES])} (or, through "
                           f"--engine llama.cpp, {', '.join(ENGINE_TYPES)})")
    if name == "float16" and device.type == "cpu":
        raise SdbenchError("--dtype float16 is not supported on CPU; use float32 or bfloat16")
    return DTYPES[name]


@dataclass
class Pair:
    """The loaded target and drafts, ready to decode."""

    target: Runner  # ModelRunner or GenericRunner
    tokenizer: PreTrainedTokenizerBase
    drafts: list[Runner | str]  # a model-free draft by its name (ngram)
    eos: list[int]
    max_positions: int
    probes: list = field(default_factory=list)  # ProbeResult of each probed model; empty: the probe was skipped

    def fidelity(self) -> dict:
        """What every result row records of the models: the target's runner, the probe's outcome ("passed",
        "fallback": a native runner failed and the generic one passed, "skipped"), its largest gap and whether
        a kept verdict was reused for some model (None when skipped)."""
        outcome = "skipped"
        if self.probes:
            outcome = "fallback" if any(p.fallback for p in self.probes) else "passed"
        gaps = [p.gap for p in self.probes if p.gap is not None]
        reused = any(p.reused for p in self.probes) if self.probes else None
        return {"runner": runner_kind(self.target), "probe": outcome, "probe_gap": max(gaps, default=None),
                "probe_reused": reused}


def device_and_dtype(device: str, dtype: str, engine: bool = False) -> tuple[torch.device, torch.dtype]:
    """The torch device and dtype a run's --device and --dtype name, refused in one line where unusable (engine:
    an engine's server decodes, so its own types are taken too)."""
    dev = resolve_device(device)
    return dev, resolve_dtype(dtype, dev, engine)


@dataclass(frozen=True)
class Loaded:
    """One model as the load sequence gives it: the library's model with its tokenizer, the runner its config
    calls for, and the bytes of its weights as loaded (a packing runner later empties the modules' own)."""

    loaded: loader.LoadedModel
    runner: Runner
    weight_bytes: int


def at_weights(cfg: RunConfig) -> RunConfig:
    """The run with every model named as the copy its --dtype decodes with (MODEL@q8_0 for --dtype q8_0, a model
    naming its own variant kept, a GGUF file of a block type as its own blocks on a CPU): what plans and loads
    read."""
    cpu = resolve_device(cfg.device).type == "cpu"
    drafts = tuple(d if d == NGRAM_DRAFT else with_weights(d, cfg.dtype, cpu) for d in cfg.drafts)
    return replace(cfg, target=with_weights(cfg.target, cfg.dtype, cpu), drafts=drafts)


def load_models(names: list[str], device: torch.device, dtype: torch.dtype, console: Console, *,
                fast: bool = True, native: dict[str, str] | None = None, static: bool | None = None,
                fit: bool = True, given: dict[str, Loaded] | None = None) -> dict[str, Loaded]:
    """The one load sequence: every model's fit checked from its config before anything loads (`fit`), then each
    distinct model loaded (progress shown), given the runner its config calls for (`pick_runner`; refused in one
    line where `native` says what needs the native runner), and its note said. MODEL@int8 is the quantised copy
    of MODEL (`variants.py`), made of the first model's weights when MODEL is the first (the target). given: models
    already loaded by this sequence, used as they are."""
    native = native or {}
    if fit:
        loader.check_fit(list(names), device, dtype)
    out: dict[str, Loaded] = dict(given or {})
    for name in (n for n in dict.fromkeys(names) if n not in out):
        with console.status(f"loading {name}"):
            variant = split_variant(name)[1]
            if variant in ("int8", *BLOCK_TYPES):
                first = out.get(names[0])
                loaded = variant_model(name, names[0], first and first.loaded, device, dtype)
                weights = weight_bytes(loaded.model)
                if variant == "int8":  # a dynamically quantised copy: the modules' own products
                    runner = make_runner(loaded.model, name)
                else:  # blocks: read by the fast path
                    runner = pick_runner(loaded.model, name, fast, native.get(name), static)
            else:
                loaded = loader.load_model(name, device, dtype)
                weights = weight_bytes(loaded.model)
                runner = pick_runner(loaded.model, name, fast, native.get(name), static)
        say_note(loaded, console)
        out[name] = Loaded(loaded, runner, weights)
    return out


def load_pair(cfg: RunConfig, device: torch.device, dtype: torch.dtype, console: Console,
              native: dict[str, str] | None = None) -> Pair:
    """Load the target and drafts (`load_models`), then probe every runner against the library's forward
    (unless cfg.probe is off), falling back to the generic runner where a native one fails and the run allows
    it. native: model name -> what of the run needs it on the native runner (`commands.plan.RunPlan.native()`; a
    model the generic runner serves is then refused before loading)."""
    native = native or {}
    cfg = at_weights(cfg)
    refuse_early(cfg, native)
    check_tokenizers(cfg)
    models = load_models([cfg.target, *(n for n in cfg.drafts if n != NGRAM_DRAFT)], device, dtype, console,
                         fast=cfg.fast, native=native)
    target = models[cfg.target]
    # prompt lookup as a draft candidate: no model; the target drafting for itself: its runner, its own cache
    drafts = [name if name == NGRAM_DRAFT else models[name].runner for name in cfg.drafts]
    limit = getattr(target.loaded.model.config, "max_position_embeddings", None) or 1 << 30
    pair = Pair(target.runner, target.loaded.tokenizer, drafts, loader.eos_token_ids(target.loaded), limit)
    if cfg.probe == "never":
        console.print("note: --probe never: the runners' logits are not compared with the library's forward "
                      "(rows record the probe as skipped)", style="yellow", highlight=False)
        return pair
    probe_pair(pair, run_positions(cfg, pair, cfg.gamma or DEFAULT_GAMMA), native, console, ProbeCache(cfg.probe))
    return pair


def pick_runner(model, name: str, fast: bool, needs_native: str | None = None, static: bool | None = None):
    """The runner `serving(config)` names for a loaded model; refused in one line where it cannot serve."""
    serves = serving(model.config)
    _refuse(name, serves, needs_native)
    return make_runner(model, name, serves.runner, fast, static)


def refuse_early(cfg: RunConfig, native: dict[str, str]) -> None:
    """Refuse, from configs alone (before any weight loads), a model no runner serves, or one that would run on
    the generic runner where the run needs the native one. A config not readable without the weights (an
    embedded GGUF, a hub model not cached) is judged after loading instead."""
    for name in dict.fromkeys((cfg.target, *cfg.drafts)):
        if name == NGRAM_DRAFT:
            continue
        config = _config_only(split_variant(name)[0])
        if config is not None:
            _refuse(name, serving(config), native.get(name))


def _refuse(name: str, serves, needs_native: str | None) -> None:
    if serves.runner == "refused":
        raise SdbenchError(f"model '{name}' cannot be run: {serves.reason}")
    if serves.runner == "generic" and needs_native:
        raise SdbenchError(f"model '{name}' runs on the generic runner ({serves.reason}), and {needs_native} "
                           "needs the native runner")


def _config_only(name: str):
    """The model's transformers config read without its weights: an alias's shipped config, a local folder, or
    a hub model in the local cache; None where that is not possible cheaply (a GGUF file before conversion, a
    hub model not cached: judged after loading instead)."""
    shipped = shipped_config(name)
    if shipped is not None:
        return config_from_dict(shipped)
    local = Path(name).expanduser()
    if local.is_file():
        return None
    try:
        from transformers import AutoConfig  # slow to import, and only a model with no shipped config needs it

        return AutoConfig.from_pretrained(str(local) if local.is_dir() else name, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return None


def check_tokenizers(cfg: RunConfig) -> None:
    """Refuse a draft model whose tokenizer differs from the target's, loading tokenizers only (no weights)."""
    bases = {tokenizer_name(name) for name in cfg.drafts if name != NGRAM_DRAFT} - {cfg.target}
    if not bases:
        return
    target = loader.load_tokenizer(cfg.target)
    for name in sorted(bases):
        loader.check_same_tokenizer(target, loader.load_tokenizer(name), cfg.target, name)


def say_note(loaded, console: Console) -> None:
    """A loaded model's one-line note (a @random model's stand-in tokenizer), if it has one."""
    if getattr(loaded, "note", None):
        console.print(f"note: {loaded.note}", style="yellow", highlight=False, soft_wrap=True)
