"""`sdbench bench`: sdbench's decoding against transformers in one process, on the same prompts.

Peers are measured back to back with the same greedy settings and token budget; every system's tokens
are counted from the ids it returns, and outputs are compared token for token. One loop times every call, of every
system alike: its start, when its first new token was available and its end (`reporting/latency.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from sdbench.analysis.bandwidth import Bandwidth, measure_bandwidth
from sdbench.commands.bench_carry import carry_over
from sdbench.commands.bench_engines import (bench_engine_systems, check_engines, engine_hint, engine_names,
                                            replayed)
from sdbench.commands.bench_costs import is_block, roofline_read, step_costs
from sdbench.commands.bench_measure import measure_systems
from sdbench.commands.bench_system import SdbenchSystem
from sdbench.commands.bench_judge import Held, fail_on_real, held_lines, hold
from sdbench.commands.bench_table import (GENERIC_ROW, SystemMeasurement, _table, engine_lines, fast_row,
                                          first_difference, write_bench)
from sdbench.commands.hf_generate import MODES, TransformersSystem, generator, kwargs_for, pick
from sdbench.config import BenchConfig
from sdbench.data.tasks import encode_prompt, load_prompts
from sdbench.drafting.ngram import DRAFT_NAME
from sdbench.engine.state import needed_capacity
from sdbench.errors import SdbenchError
from sdbench.models.forward.generic import GenericRunner, runner_kind
from sdbench.models.heads.load import check_folder
from sdbench.models.loading.loader import check_same_tokenizer, eos_token_ids
from sdbench.models.loading.names import ENGINE_TYPES, with_weights
from sdbench.models.loading.pair import device_and_dtype, load_models, pick_runner, resolve_device
from sdbench.options import split_list
from sdbench.reporting.carry import Carried, carry_table
from sdbench.reporting.latency import latencies, latency_table
from sdbench.servers.costs import probe_capacity
from sdbench.servers.llamacpp import LlamaCpp
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.strategies.base import TrainedHead
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.ngram import NGram
from sdbench.strategies.spec import head_strategy, need_gamma
from sdbench.strategies.trees import tree_setting



def memory_bandwidth(device: torch.device) -> Bandwidth:
    """The best streaming read this machine delivers (`analysis/bandwidth.py`): bench probes it before and after
    its measurement and keeps the faster."""
    return measure_bandwidth(device)


def _systems(tgt, drf, runner, plain, d_runner, max_new: int, eos: list[int], room: int, gamma: int,
             generic=None, autoregressive_only: bool = False, draft: str | None = None) -> list:
    """(name, fn, on the fast path's weights) for every system, each transformers one before its sdbench peer.
    generic: the generic runner over the target, measured beside the native one (None: the target has only it).
    autoregressive_only: plain decoding alone (transformers, sdbench eager, sdbench fast, generic)."""
    fast = _fast_label(runner)
    on = runner.cpu_fast
    beside = [] if generic is None else [
        (GENERIC_ROW, SdbenchSystem(generic, Autoregressive, max_new, eos, room), False)]
    plain_decoding = [
        ("transformers generate", TransformersSystem(tgt.model, max_new, eos), False),
        ("sdbench autoregressive (no fast path)", SdbenchSystem(plain, Autoregressive, max_new, eos, room), False),
        (f"sdbench autoregressive{fast}", SdbenchSystem(runner, Autoregressive, max_new, eos, room), on),
        *beside,
    ]
    if autoregressive_only:
        return plain_decoding
    return [
        *plain_decoding,
        (f"transformers assisted (γ={gamma})",
         TransformersSystem(tgt.model, max_new, eos, dict(assistant_model=drf.model, num_assistant_tokens=gamma,
                                          num_assistant_tokens_schedule="constant"), ("draft", draft)), False),
        (f"sdbench draft (γ={gamma}){fast}",
         SdbenchSystem(runner, lambda: DraftModel(d_runner, gamma), max_new, eos, room, ("draft", draft)), on),
        (f"transformers prompt lookup (γ={gamma})",
         TransformersSystem(tgt.model, max_new, eos, dict(prompt_lookup_num_tokens=gamma), ("ngram", None)), False),
        (f"sdbench ngram (γ={gamma}){fast}",
         SdbenchSystem(runner, lambda: NGram(gamma), max_new, eos, room, ("ngram", None)), on),
    ]


def _fast_label(runner) -> str:
    """What a system's name says of the runner's fast path."""
    if not runner.fast:
        return ""
    return " (CUDA graphs)" if runner.graphs else " (fast, compiled steps)" if runner.path.compiled else " (fast)"


def _head_systems(runner, heads: tuple[str, ...], max_new: int, eos: list[int], room: int, gamma: int) -> list:
    """(name, fn, on the fast path's weights) for each trained head drafting for the fast runner."""
    from sdbench.models.heads.load import load_head  # reads weights: only a bench given --head

    fast = _fast_label(runner)
    rows = []
    for source in heads:
        head = load_head(source, runner)
        declared = head_strategy(head.kind)
        g = min(gamma, declared.max_gamma((source,)))  # a Medusa head or a block: no more drafts than it has
        drafter = declared.drafter(head, runner, g)  # reused: each generation begins it afresh
        kind = "" if head.kind == declared.name else f" {head.kind}"  # eagle's kind says which EAGLE
        rows.append((f"sdbench {declared.name}{kind} {Path(source).name} (γ={g}){fast}",
                     SdbenchSystem(runner, lambda d=drafter, src=source, g=g: TrainedHead(d, g, src), max_new, eos,
                                   room, (declared.name, source), block=is_block(drafter)),
                     runner.cpu_fast))
    return rows


def tree_spec(cfg: BenchConfig) -> tuple[int, int] | None:
    """--tree K,NODES as (K, NODES), checked as the draft strategy checks its tree (None: no --tree)."""
    if not cfg.tree:
        return None
    parts = split_list(cfg.tree, "--tree")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SdbenchError(f"--tree {cfg.tree}: give the top-K and the node budget as K,NODES, e.g. 2,8")
    topk, nodes = map(int, parts)
    tree_setting("draft", cfg.gamma, topk, nodes, "")  # refuses what the strategy would
    return topk, nodes


def _tree_systems(runner, d_runner, cfg: BenchConfig, eos: list[int], room: int) -> list:
    """[(name, fn, on the fast path's weights)] for the draft model's top-k tree (`--tree`); [] without one."""
    spec, gamma = tree_spec(cfg), cfg.gamma
    if spec is None:
        return []
    topk, nodes = spec
    return [(f"sdbench draft tree (top-{topk}, {nodes} nodes, γ={gamma}){_fast_label(runner)}",
             SdbenchSystem(runner, lambda: DraftModel(d_runner, gamma, tree_topk=topk, tree_nodes=nodes),
                           cfg.max_new_tokens, eos, room, ("draft tree", f"{cfg.draft_model} top-{topk}/{nodes}")),
             runner.cpu_fast)]


@dataclass
class Peers:
    """What `measure_peers` measured: the systems, and what the table's caption and the lines under it say."""

    results: list[SystemMeasurement]
    bandwidth: Bandwidth  # the best streaming read on the device
    weight_bytes: int  # the target's plain weights
    verify_cost: float  # T(gamma + 1 tokens) / T(1 token) of the target, fast path
    draft_cost: float  # c = T_draft / T_target, fast path
    picked: object  # hf_generate.Picked: transformers generate's configuration
    reference: list[list[int]]  # per prompt, generate's tokens with its dynamic cache: what outputs must equal
    disagreement: str | None  # one line where the measured configuration's tokens differ from the reference
    fast_line: str | None  # which CPU forward the fast path uses, or None
    graphs_asked: bool  # the target's fast runner was to replay CUDA graphs
    graphs: bool  # ... and still did at the end (False after a capture failed or disagreed: eager fallback)
    prompts: int  # prompts measured
    device: str
    carried: list[Carried] = field(default_factory=list)  # the carry-over table's rows (bench_carry.py)
    unknown: list[str] = field(default_factory=list)  # why a speculative system has no carry-over row
    held: dict[str, Held] = field(default_factory=dict)  # each system's outputs against what they must equal

    @property
    def roofline(self) -> float:
        """Tokens/s if every token read the weights once at the measured bandwidth."""
        return self.bandwidth.bytes_per_s / self.weight_bytes


def _own_weights(cfg: BenchConfig) -> tuple[str, str, str]:
    """(target, draft, dtype) sdbench's own systems load: the models as --dtype names them (a block type's copies,
    MODEL@q8_0), or for a K-quant mix llama.cpp alone runs, the very GGUF files llama.cpp serves, de-quantised, in
    float32: the same weights on both sides."""
    if cfg.dtype not in ENGINE_TYPES:
        cpu = resolve_device(cfg.device).type == "cpu"
        return with_weights(cfg.target, cfg.dtype, cpu), with_weights(cfg.draft_model, cfg.dtype, cpu), cfg.dtype
    served = LlamaCpp()
    return str(served.gguf(cfg.target, cfg.dtype)), str(served.gguf(cfg.draft_model, cfg.dtype)), "float32"


def check_bench(cfg: BenchConfig) -> None:
    """Refuse impossible settings before any model loads."""
    if cfg.draft == DRAFT_NAME:
        raise SdbenchError(f"bench --draft takes a draft model; prompt lookup ({DRAFT_NAME}) is always measured "
                           "against transformers' prompt_lookup_num_tokens")
    if cfg.repeats < 1 or cfg.limit < 1 or cfg.max_new_tokens < 1:
        raise SdbenchError("bench: --repeats, --limit and --max-new-tokens must be at least 1")
    need_gamma("draft", cfg.gamma, "bench --gamma")
    if tree_spec(cfg) and cfg.autoregressive_only:
        raise SdbenchError("bench --tree is a speculative row: drop --autoregressive-only")
    if cfg.generate not in MODES:
        raise SdbenchError(f"--generate {cfg.generate}: use one of {', '.join(MODES)}")
    if cfg.dtype in ENGINE_TYPES and LlamaCpp.name not in engine_names(cfg.engine):
        raise SdbenchError(f"bench --dtype {cfg.dtype}: llama.cpp's K-quant mix; add --engine llama.cpp (sdbench's "
                           "own systems then run over the weights it serves, de-quantised)")
    for head in cfg.heads:
        check_folder(head)
    check_engines(cfg)


def run_peers(cfg: BenchConfig, console: Console) -> list[SystemMeasurement]:
    """Measure, print the table and the cost ratios, write OUT/bench.parquet when asked, then fail if an sdbench
    system's output really differs from what it is held to (`bench_judge.py`)."""
    check_bench(cfg)
    target, draft, gamma = cfg.target, cfg.draft_model, cfg.gamma
    peers = measure_peers(cfg, console)
    console.print(_table(peers.results, peers.roofline, peers.held,
                         f"{target} / draft {draft}, {cfg.dataset} x{peers.prompts} "
                         f"x{cfg.repeats} repeats, {cfg.max_new_tokens} new tokens, "
                         f"greedy, {peers.device} {cfg.dtype}, {torch.get_num_threads()} threads"))
    console.print(f"verification cost T({gamma + 1} tokens) / T(1 token), {target}: {peers.verify_cost:.2f}; draft "
                  f"cost c = T_draft / T_target ({draft}): {peers.draft_cost:.2f} (fast path, medians over the "
                  "prompts)", highlight=False)
    for line in (f"memory bandwidth: {peers.bandwidth.describe()}", peers.picked.line(), peers.disagreement,
                 peers.fast_line, *engine_lines(peers.results), *held_lines(peers.held),
                 engine_hint(cfg, peers.device)):
        if line:
            console.print(line, highlight=False, soft_wrap=True)
    if peers.carried:
        console.print(carry_table(peers.carried))
    for line in peers.unknown:
        console.print(line, highlight=False, soft_wrap=True)
    console.print(latency_table(latencies([m.timed() for m in peers.results])))
    if cfg.out:
        path = write_bench(peers.results, cfg.out, dict(model=target, draft=draft, dataset=cfg.dataset,
                                                    device=peers.device, dtype=cfg.dtype,
                                                    verify_cost=peers.verify_cost, draft_cost=peers.draft_cost),
                           peers.carried, peers.held)
        console.print(f"results: {path}", highlight=False)
    fail_on_real(peers.held)
    return peers.results


def _layouts(*runners):
    """weights(fast): each model in the layout the next system runs on, the fast runners' own or the library's."""
    unique = list({id(r): r for r in runners}.values())

    def weights(fast: bool) -> None:
        for r in unique:
            if fast:
                r.own_layout()
            else:
                r.share_plain()

    return weights


def measure_peers(cfg: BenchConfig, console: Console) -> Peers:
    """Load the models, measure every system (`_systems`) on the same prompts, then the cost ratios and the
    memory bandwidth; prints nothing but progress and a @random model's note."""
    target, draft, own_dtype = _own_weights(cfg)
    max_new, gamma = cfg.max_new_tokens, cfg.gamma
    dev, dt = device_and_dtype(cfg.device, own_dtype)
    models = load_models([target, draft], dev, dt, console)  # an @int8 draft: run by sdbench and by assisted generation
    tgt, drf = models[target].loaded, models[draft].loaded
    if drf is not tgt:
        check_same_tokenizer(tgt.tokenizer, drf.tokenizer, target, draft)
    eos = eos_token_ids(tgt)
    prompts = [encode_prompt(p, tgt.tokenizer) for p in load_prompts(cfg.dataset, limit=cfg.limit, seed=cfg.seed)]
    plain_bytes = models[target].weight_bytes
    runner, d_runner = models[target].runner, models[draft].runner
    graphs_asked = bool(getattr(runner, "graphs", False))
    generic = GenericRunner(tgt.model, target) if runner_kind(runner) == "native" else None

    weights = _layouts(runner, d_runner)
    room = needed_capacity(max(len(p) for p in prompts), max_new, gamma)
    # the drafter named as the engines name it (a block type's copy, MODEL@q4_0, is their re-typed MODEL)
    systems = _systems(tgt, drf, runner, pick_runner(tgt.model, target, False), d_runner, max_new, eos, room, gamma,
                       generic, cfg.autoregressive_only, cfg.draft_model)
    systems += [*_head_systems(runner, cfg.heads, max_new, eos, room, gamma),
                *_tree_systems(runner, d_runner, cfg, eos, room)]
    # the engines' servers hold the step costs' probes too: a cached prefix and γ + 1 tokens after it
    served = max(room, probe_capacity(gamma))
    replayed_ = replayed(cfg, systems, prompts, console, weights)
    bandwidth = memory_bandwidth(dev)
    with console.status("measuring") as status, bench_engine_systems(cfg, served, status, replayed_) as engines:
        systems += [(s.name, s, False) for s in engines if s.measured]
        picked = _pick_generate(tgt.model, prompts[0], eos, cfg.generate, dev, status, weights, room)
        systems[0] = (f"transformers generate ({picked.label})",
                      TransformersSystem(tgt.model, max_new, eos, kwargs_for(picked.name, dev, room)), False)
        results = measure_systems(systems, prompts, cfg.repeats, dev, status, weights)
        reference, disagreement = _reference(tgt.model, prompts, eos, max_new, picked, results[0], status, weights)
        status.update("holding each system's outputs to what they must equal")
        held = hold(results, reference, prompts, runner.block_activations() == "int8", weights, cfg.dtype)
        status.update("measuring the step costs: forwards, verdicts and rounds, interleaved")
        weights(True)
        costs = step_costs(runner, d_runner, [fn for _, fn, _ in systems], prompts, gamma,
                           (tree_spec(cfg) or (0, 0))[1] + 1)
        weights(False)
        carried, unknown = carry_over(results, fast_row(results), engines, prompts, gamma, costs, status)
    read = roofline_read(bandwidth.best(memory_bandwidth(dev)), results, plain_bytes, cfg.dtype in ENGINE_TYPES)
    return Peers(results, read, plain_bytes, costs.at(gamma + 1), costs.draft, picked, reference, disagreement,
                 runner.fast_path_note(), graphs_asked, bool(getattr(runner, "graphs", False)), len(prompts),
                 str(dev), carried, unknown, held)


def _pick_generate(model, prompt: list[int], eos: list[int], mode: str, device, status, weights, room: int):
    """transformers' generate configuration to measure (hf_generate.pick), on the plain weights it runs on."""
    status.update("choosing transformers generate's fastest configuration" if mode == "fastest" else "measuring")
    weights(False)
    return pick(model, prompt, eos, mode, device, room)


def _reference(model, prompts, eos, max_new: int, picked, measured: SystemMeasurement, status, weights):
    """(generate's tokens per prompt with its dynamic cache, a line where the measured configuration's differ).

    The dynamic cache is the library's own step-by-step decoding, the model the user named; a static or
    compiled cache may compute another rotation or rounding (a rope rescaled per call, a fused kernel). When
    the fastest configuration measured is not it, it runs once more, untimed, for the reference."""
    if picked.name == "dynamic":
        return measured.outputs, None
    status.update("transformers generate with its dynamic cache: the reference outputs (untimed)")
    weights(False)
    run = generator(model, eos, {})
    reference = [run(p, max_new) for p in prompts]
    first = first_difference(measured.outputs, reference)
    if first is None:
        return reference, None
    i, at = first
    return reference, (f"transformers generate's configurations disagree on this model: its {picked.label} differs "
                       f"from its dynamic cache on prompt {i + 1} (first at new token {at + 1}); outputs are "
                       "compared with the dynamic cache (the library's step-by-step decoding)")
