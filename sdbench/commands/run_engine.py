"""`run --engine llama.cpp|vllm`: every role of the run decoded by the engine's own server instead of sdbench's loop.
What the engine cannot run is refused in one line before anything loads; the run loads the target's tokenizer and
config alone (the chat template and the prompts are sdbench's, the weights are the server's); the roles' servers
start once for the run and stop at its end, on an error or on Ctrl-C."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from rich.console import Console

from sdbench.commands.roles import BASELINE, Role
from sdbench.config import RunConfig
from sdbench.engine.tree import is_tree_setting
from sdbench.errors import SdbenchError
from sdbench.models.loading import loader
from sdbench.models.loading.pair import Pair
from sdbench.servers.engines import SDBENCH, Engine, EngineRole
from sdbench.servers.footprint import PROMPT_ROOM, check_servers_fit
from sdbench.servers.known import engine
from sdbench.servers.runs import EngineDecoding
from sdbench.servers.systems import check_engine_options, engine_systems

def run_engine(cfg: RunConfig) -> Engine | None:
    """The engine that decodes the run, None for sdbench's own loop."""
    name = cfg.engine.strip()
    return None if name in ("", SDBENCH) else engine(name)


def check_engine_run(cfg: RunConfig, base: str) -> None:
    """Refuse, in one line and before anything loads, what the engine cannot run (cfg as `plan` settled it; base:
    the registered strategy)."""
    if "," in cfg.engine:
        raise SdbenchError(f"run --engine {cfg.engine}: a run decodes through one engine (bench compares several)")
    eng = run_engine(cfg)
    if eng is None:
        check_engine_options(None, cfg.engine_url, cfg.engine_port)
        return
    said = f"--engine {eng.name}"
    if cfg.batch_size > 1:
        raise SdbenchError(f"{said}: the engine's server decodes one prompt at a time (batch size 1); "
                           f"--batch-size {cfg.batch_size} runs in sdbench's own loop only")
    if cfg.under_load or cfg.slo:
        raise SdbenchError(f"{said}: serving under load (--request-rate, --concurrency, --slo) runs in sdbench's own "
                           "loop only")
    if cfg.compare:
        raise SdbenchError(f"{said}: --compare runs in sdbench's own loop only; give each strategy a run of its own")
    trees = sorted(k for k in cfg.options if is_tree_setting(k))
    if trees:
        raise SdbenchError(f"{said}: the engine verifies chains; token trees (--set {trees[0]}=...) run in sdbench's "
                           "own loop only")
    if cfg.engine_url is not None:
        check_engine_options(eng, cfg.engine_url, cfg.engine_port)
        return
    roles = [EngineRole("autoregressive")] * cfg.baseline + engine_roles_of(eng, base, cfg)
    check_engine_options(eng, None, cfg.engine_port, len(roles))
    eng.check_dtype(cfg.dtype)
    eng.check_installed()
    capacity = cfg.max_new_tokens * (cfg.turns or 2) + PROMPT_ROOM
    check_servers_fit([(eng.name, [eng.footprint(cfg.target, r, cfg.dtype, capacity) for r in roles])],
                      "give fewer --gamma values, or a smaller model")


def engine_roles_of(eng: Engine, base: str, cfg: RunConfig) -> list[EngineRole]:
    """The strategy's roles as the engine's own decoding, one per --gamma; refused in one line where the engine
    lacks the strategy or would ignore one of its settings."""
    head = cfg.options.get("head")
    ignored = sorted(set(cfg.options) - {"head"})
    if ignored:
        raise SdbenchError(f"--engine {eng.name}: --set {ignored[0]}=... is a setting of sdbench's own {base}; the "
                           "engine's decoding takes only the lookahead (--gamma), the draft model and a head")
    if base == "autoregressive":
        roles = [EngineRole("autoregressive")]
    elif base == "draft":
        if len(cfg.drafts) != 1:
            raise SdbenchError(f"--engine {eng.name}: the draft strategy takes one --draft model")
        roles = [EngineRole("draft", g, cfg.drafts[0]) for g in cfg.gammas]
    elif head is not None or base == "mtp":  # a trained head's strategy: the engine's drafter of that kind, with the
        # same head (mtp with none: the module the target's own checkpoint ships)
        roles = [EngineRole(base, g, head or cfg.target) for g in cfg.gammas]
    else:
        roles = [EngineRole(base, g) for g in cfg.gammas]
    for role in roles:
        why = eng.refuse(role, cfg.target)
        if why is not None:
            raise SdbenchError(f"--engine {eng.name}: {why}")
    return roles


class EnginePair(Pair):
    """What a run through an engine loads of the target: its tokenizer (the chat template and the prompts' ids) and
    its config (its positions and end-of-sequence ids), no weights: there is no runner, and no probe of one."""

    def fidelity(self) -> dict:
        return {"runner": None, "probe": None, "probe_gap": None, "probe_reused": None}


def engine_pair(cfg: RunConfig, console: Console) -> EnginePair:
    with console.status(f"loading the tokenizer of {cfg.target}"):
        tokenizer = loader.load_tokenizer(cfg.target)
        config = loader.load_config(cfg.target)
    limit = getattr(config, "max_position_embeddings", None) or 1 << 30
    return EnginePair(None, tokenizer, [], loader.end_ids(config.eos_token_id, tokenizer), limit)


def run_roles(cfg: RunConfig, eng: Engine, base: str, console: Console) -> list[Role]:
    """The run's roles through the engine: the baseline (its plain decoding) and the strategy at each --gamma; with
    --engine-url, the user's server alone, as it runs."""
    if cfg.engine_url is not None:
        url = cfg.engine_url.rstrip("/")
        console.print(f"note: --engine-url: the server at {url} decodes as it was started, the run's one role; no "
                      "baseline runs beside it", style="yellow", highlight=False)
        return [Role("strategy", EngineDecoding(eng, EngineRole("autoregressive"), url), f"{eng.name} at {url}")]
    roles = [Role(BASELINE, EngineDecoding(eng, EngineRole("autoregressive")), "autoregressive")] * cfg.baseline
    own = engine_roles_of(eng, base, cfg)
    names = ["strategy"] if len(own) == 1 else [f"strategy-{i + 1}" for i in range(len(own))]
    drafts = tuple(cfg.drafts) if base == "draft" else ()
    return roles + [Role(n, EngineDecoding(eng, r), cfg.strategy, drafts) for n, r in zip(names, own)]


@contextlib.contextmanager
def engine_servers(cfg: RunConfig, roles: list[Role], capacity: int, console: Console):
    """Every role's server running (the user's at --engine-url) until the block ends, then stopped whatever
    happened; each role's decoding holds its server's system meanwhile."""
    decodings = [r.proposer for r in roles]
    eng = decodings[0].engine
    logs = Path(cfg.out) / "engine-logs"
    with contextlib.ExitStack() as stack:
        with console.status(f"starting {eng.name}") as status:
            systems = stack.enter_context(engine_systems(
                eng, [d.role for d in decodings], cfg.target, cfg.dtype, capacity, torch.get_num_threads(),
                cfg.max_new_tokens, logs, cfg.engine_url, cfg.engine_port, status))
        try:
            for d, s in zip(decodings, systems):
                d.system = s
            yield
        finally:
            for d in decodings:
                d.system = None
