"""`bench --engine`: the engines named, what each is refused for in one line before any model loads (its types, its
install, the memory its servers would take beside sdbench's own models), and their servers while bench measures."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from sdbench.commands.bench_carry import replayed_acceptance
from sdbench.config import BenchConfig
from sdbench.errors import SdbenchError
from sdbench.models.loading.loader import weights_at_hand
from sdbench.models.loading.names import BLOCK_TYPES, ENGINE_TYPES, split_variant, with_weights
from sdbench.models.loading.pair import resolve_device
from sdbench.options import split_list
from sdbench.paths import cache_dir
from sdbench.servers.engines import SDBENCH, Engine
from sdbench.servers.footprint import BITS, PROMPT_ROOM, check_servers_fit
from sdbench.servers.known import engine
from sdbench.servers.systems import check_engine_options, engine_roles, engine_systems

def engine_names(spec: str) -> list[str]:
    """--engine's value ("sdbench", one engine, or a comma list of them) as the engines to start, in order."""
    names = [n for n in split_list(spec, "--engine") if n != SDBENCH]
    return list(dict.fromkeys(names))


def check_engines(cfg: BenchConfig) -> None:
    """Refuse in one line what the engines named cannot do here: options, roles, types, an engine not installed,
    and servers that would not fit in memory beside sdbench's own models."""
    names = engine_names(cfg.engine)
    if not names:
        check_engine_options(None, cfg.engine_url, cfg.engine_port)
        return
    if cfg.engine_url and len(names) > 1:
        raise SdbenchError("--engine-url names one server: give one --engine with it")
    planned = []
    for name in names:
        eng = engine(name)
        if cfg.engine_url is not None:
            check_engine_options(eng, cfg.engine_url, cfg.engine_port)
            continue
        roles = _roles(eng, cfg)
        check_engine_options(eng, None, cfg.engine_port, len(roles))
        eng.check_dtype(cfg.dtype)
        _check_own_types(eng, cfg)
        eng.check_installed()
        capacity = cfg.max_new_tokens + PROMPT_ROOM
        planned.append((eng.name, [eng.footprint(cfg.target, r, cfg.dtype, capacity) for r in roles]))
    if planned:
        fewer = (f"measure one engine at a time (--engine {names[0]})" if len(planned) > 1 else
                 "add --autoregressive-only for its plain decoding alone, or give a smaller model")
        check_servers_fit(planned, fewer, own_bytes(cfg))


def _roles(eng: Engine, cfg: BenchConfig, replayed: dict | None = None) -> list:
    """The engine's roles in this bench; replayed None: with every replay it may add (sdbench's acceptance is not
    known before the models load), for the memory check."""
    roles = engine_roles(eng, cfg.gamma, cfg.draft_model, cfg.autoregressive_only, cfg.heads, cfg.target, replayed)
    if replayed is None:
        every = {(r.strategy, r.draft): (1.0,) for r in roles if r.speculative}
        roles = engine_roles(eng, cfg.gamma, cfg.draft_model, cfg.autoregressive_only, cfg.heads, cfg.target, every)
    return roles


def own_bytes(cfg: BenchConfig) -> int:
    """Bytes of sdbench's own copies of the models bench loads, from their configs: at --dtype, or at float32 beside a
    block type's copy (transformers' rows run the float32 model), or at float32 alone for a K-quant mix (its file
    de-quantised: sdbench holds no blocks of it)."""
    block = cfg.dtype in BLOCK_TYPES or cfg.dtype in ENGINE_TYPES
    weights = weights_at_hand([m for m in (cfg.target, cfg.draft_model) if m], "float32" if block else cfg.dtype)[1]
    return int(weights * (1 + BITS[cfg.dtype] / 32)) if cfg.dtype in BLOCK_TYPES else weights


def _check_own_types(eng: Engine, cfg: BenchConfig) -> None:
    """One line where a model is a GGUF file of a block type (sdbench runs its blocks) that the engine does not
    serve at that type: the two would decode different arithmetic over the same values."""
    for model in dict.fromkeys(m for m in (cfg.target, cfg.draft_model) if m):
        own = split_variant(with_weights(model, cfg.dtype, resolve_device(cfg.device).type == "cpu"))[1]
        if own in BLOCK_TYPES and own not in eng.dtypes:
            raise SdbenchError(f"--engine {eng.name}: {model} holds {own.upper()} blocks, which sdbench runs as they "
                               f"are and {eng.name} does not serve here (it runs --dtype {', '.join(eng.dtypes)})")


def replayed(cfg: BenchConfig, systems: list, prompts: list[list[int]], console, weights) -> dict:
    """sdbench's per-position acceptance of each drafter an engine can replay it for (`replayed_acceptance`), where
    one of the engines started can (none for a server the user runs)."""
    if cfg.engine_url is not None or not any(engine(name).synthetic for name in engine_names(cfg.engine)):
        return {}
    with console.status("sdbench's acceptance, for the engines to replay (one untimed pass)"):
        weights(True)
        return replayed_acceptance([fn for _, fn, fast in systems if fast], prompts, cfg.gamma)


@contextlib.contextmanager
def bench_engine_systems(cfg: BenchConfig, capacity: int, status, replayed_: dict | None = None):
    """The engines' systems (none for --engine sdbench), their servers running until the block ends; replayed_:
    sdbench's acceptance of each drafter an engine runs it again at (`engine_roles`)."""
    logs = Path(cfg.out) / "engine-logs" if cfg.out else cache_dir("engines", "logs")
    port = cfg.engine_port
    with contextlib.ExitStack() as stack:
        systems = []
        for name in engine_names(cfg.engine):
            eng = engine(name)
            roles = _roles(eng, cfg, replayed_ or {})
            systems += stack.enter_context(engine_systems(eng, roles, cfg.target, cfg.dtype, capacity,
                                                          torch.get_num_threads(), cfg.max_new_tokens, logs,
                                                          cfg.engine_url, port, status))
            port = None if port is None else port + len(roles)
        yield systems


def engine_hint(cfg: BenchConfig, device: str) -> str | None:
    """On a CPU run with no engine: how to put llama.cpp (the engine CPU users run) beside sdbench at the same
    weights, and whether it is installed."""
    if cfg.engine != SDBENCH or not str(device).startswith("cpu"):
        return None
    eng = engine("llama.cpp")
    if eng.installed():
        return "llama.cpp at the same weights and dtype beside these: add --engine llama.cpp (installed)"
    return (f"llama.cpp at the same weights and dtype beside these: `{eng.install}` in sdbench's checkout installs "
            "it, then add --engine llama.cpp")
