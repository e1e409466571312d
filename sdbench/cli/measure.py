"""Commands that measure: run, sweep, tune, bench and gpu-check."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from sdbench import config as C
from sdbench.cli.params import (
    DTYPE_HELP, Baseline, Batch, CategoryField, Concurrency, Dataset, Depth, Device, Draft, Dtype, Fast, Gamma, Head,
    IdField, Limit, MaxNew, NoProbe, Out, Probe, PromptField, PromptLen, Repeats, RequestRate, Resume, Seed, Sets,
    Slo, Strategy, Target, Temperature, TopP, Turns, console,
)
from sdbench.errors import SdbenchError
from sdbench.options import parse_counts, parse_depths, parse_lengths, parse_rates, parse_sets, probe_mode, split_list


def run(
    target: Target = C.DEFAULT_TARGET, draft: Draft = None, strategy: Strategy = C.DEFAULT_STRATEGY,
    dataset: Dataset = C.DEFAULT_DATASET, limit: Limit = C.DEFAULT_LIMIT, max_new_tokens: MaxNew = C.DEFAULT_MAX_NEW_TOKENS,
    batch_size: Batch = 1, temperature: Temperature = 0.0, top_p: TopP = 1.0, seed: Seed = 0, gamma: Gamma = None,
    prompt_len: PromptLen = None, device: Device = "auto",
    dtype: Annotated[str, typer.Option(help=DTYPE_HELP + "; several, as float32,q4_0: the whole run at each in turn, "
                                       "and a table of what each costs in acceptance")] = "float32",
    repeats: Repeats = 1,
    set_: Sets = None, out: Out = C.DEFAULT_OUT, baseline: Baseline = True, resume: Resume = None, fast: Fast = True,
    turns: Turns = None, prompt_field: PromptField = None, category_field: CategoryField = None, id_field: IdField = None,
    depth: Depth = None, probe: Probe = "auto", no_probe: NoProbe = False, request_rate: RequestRate = None, concurrency: Concurrency = None,
    slo: Slo = None, head: Head = None,
    compare: Annotated[Optional[list[str]], typer.Option("--compare", help="another strategy or preset measured beside --strategy in the same interleaved run, on the same prompts (repeatable, or ngram,suffix); its settings: --set NAME.key=value")] = None,
    engine: Annotated[str, typer.Option(help="decode every role through this engine's own server instead of sdbench's loop: llama.cpp or vllm (`sdbench list engines`); sdbench: its own loop")] = "sdbench",
    engine_url: Annotated[Optional[str], typer.Option(help="the engine's server you already run (http://HOST:PORT): the run's one role, decoding as it was started; else sdbench starts one per role")] = None,
    engine_port: Annotated[Optional[int], typer.Option(help="the first port of the servers sdbench starts [default: free ones]")] = None,
):
    """Run a strategy and the plain-decoding baseline on the same prompts; print tables, write Parquet."""
    from sdbench.commands.run import RunHarness, load_config
    from sdbench.engine.serving import parse_slo
    from sdbench.reporting.report import print_report
    from sdbench.reporting.results import read_results

    own, compared = compare_sets(strategy, compare or [], parse_sets(set_))
    cfg = C.RunConfig(
        target=target, drafts=tuple(draft or ()), strategy=strategy, dataset=dataset, limit=limit,
        max_new_tokens=max_new_tokens, batch_size=batch_size, sampling=C.SamplingConfig(temperature, top_p, seed),
        gammas=parse_counts(gamma), prompt_len=prompt_len, device=device, dtype=dtype, repeats=repeats,
        options={**own, **({"head": head} if head else {})}, compare=compared,
        out=out, baseline=baseline, resume=resume, fast=fast, turns=turns, depths=parse_depths(depth),
        fields={k: v for k, v in (("prompt", prompt_field), ("category", category_field), ("id", id_field)) if v},
        probe=probe_mode(probe, no_probe), request_rates=parse_rates(request_rate), concurrencies=parse_counts(concurrency, "--concurrency", 1),
        slo=parse_slo(slo) if slo is not None else {}, engine=engine, engine_url=engine_url, engine_port=engine_port,
    )
    dtypes = list(dict.fromkeys(d.strip() for d in dtype.split(",") if d.strip())) or ["float32"]
    if resume and len(dtypes) > 1:
        raise SdbenchError("--resume continues one run: give the --dtype it ran at (or none: its saved settings)")
    if resume:
        cfg = load_config(out, resume)
    harnesses = [RunHarness(replace(cfg, dtype=d), console) for d in dtypes]  # every dtype checked before a load
    paths = [h.run() for h in harnesses]
    print_report(read_results(paths), console)
    for path in paths:
        console.print(f"results: {path}")


def sweep(
    target: Target = C.DEFAULT_TARGET, draft: Draft = None,
    strategy: Annotated[Optional[list[str]], typer.Option("--strategy", "-s", help="strategy or preset measured at every point (repeatable) [default: ngram]")] = None,
    batch: Annotated[Optional[str], typer.Option(help="batch sizes: static batches, as run decodes them [default: 1,2,4,8; --quick: 1,2,4]")] = None,
    concurrency: Annotated[Optional[str], typer.Option(help="requests in flight, instead of --batch: served under load as run --concurrency does (a closed loop)")] = None,
    prompt_len: Annotated[Optional[str], typer.Option("--prompt-len", help="prompt lengths in tokens (2k = 2048), token-exact from a book data set, or the input-length buckets of a data set made of them (speed-bench-throughput: 1k,2k,8k,16k,32k) [default: 256,1024,2048; --quick: 256,1024]")] = None,
    dataset: Annotated[str, typer.Option(help="a book data set, or one of input-length buckets (see `sdbench list datasets`)")] = C.DEFAULT_SWEEP_DATASET,
    limit: Annotated[int, typer.Option(help="prompts per point (at least its batch size or concurrency)")] = C.DEFAULT_LIMIT,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", help=f"tokens to generate per prompt [default: {C.DEFAULT_MAX_NEW_TOKENS}; --quick: {C.QUICK_SWEEP_MAX_NEW_TOKENS}]")] = None,
    gamma: Gamma = None, temperature: Temperature = 0.0, seed: Seed = 0, device: Device = "auto", dtype: Dtype = "float32",
    repeats: Repeats = 1,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="strategy setting key=value for every strategy, or NAME.key=value for one (repeatable)")] = None,
    out: Out = C.DEFAULT_OUT, fast: Fast = True, probe: Probe = "auto", no_probe: NoProbe = False,
    resume: Annotated[Optional[str], typer.Option(help="continue an interrupted sweep: its SWEEP_ID (settings as saved)")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="a small grid and fewer tokens: minutes on a small CPU")] = False,
    ray: Annotated[Optional[str], typer.Option("--ray", help="measure each point as a task on a Ray cluster: auto (the cluster `ray start` began on this machine) or its ADDRESS; each task alone on its node's CPUs, or on one GPU")] = None,
):
    """Where speculative decoding stops paying: every strategy beside plain decoding at each batch size (or
    concurrency) and prompt length; the best setting's speedup per point, measured and predicted, and the
    break-even frontier as a table, a heat-map and one line. Each point is saved as it finishes (--resume)."""
    from sdbench.commands.sweep import run_sweep

    if batch is not None and concurrency is not None:
        raise SdbenchError("--batch and --concurrency are two axes: give one of them")
    strategies = tuple(strategy or (C.DEFAULT_STRATEGY,))
    axis = "concurrency" if concurrency is not None else "batch"
    sizes = parse_counts(concurrency if concurrency is not None else batch, f"--{axis}", 1) or (
        C.QUICK_SWEEP_SIZES if quick else C.DEFAULT_SWEEP_SIZES)
    lengths = parse_lengths(prompt_len) or (C.QUICK_SWEEP_PROMPT_LENS if quick else C.DEFAULT_SWEEP_PROMPT_LENS)
    shared, scoped = split_sets(parse_sets(set_))
    new = max_new_tokens if max_new_tokens is not None else (C.QUICK_SWEEP_MAX_NEW_TOKENS if quick else C.DEFAULT_MAX_NEW_TOKENS)
    run_cfg = C.RunConfig(
        target=target, drafts=tuple(draft or ()), dataset=dataset, limit=limit, max_new_tokens=new,
        sampling=C.SamplingConfig(temperature, 1.0, seed), gammas=parse_counts(gamma), device=device, dtype=dtype,
        repeats=repeats, options=shared, out=out, fast=fast, probe=probe_mode(probe, no_probe),
    )
    remote = None
    if ray is not None:  # each point a Ray task (the cluster reached, or refused in one line, before any writing)
        from functools import partial

        from sdbench.commands.sweep_ray import RayPoints

        remote = partial(RayPoints, address=ray)
    run_sweep(C.SweepConfig(run_cfg, strategies, axis, sizes, lengths, scoped, resume), console, remote)


def compare_sets(strategy: str, compare: list[str], options: dict) -> tuple[dict, dict]:
    """`run`: the strategy's settings (--set key=value and STRATEGY.key=value) and, per --compare NAME in order,
    its own (NAME.key=value); a NAME.key for neither is refused."""
    names = list(dict.fromkeys(n for given in compare for n in split_list(given, "--compare")))
    shared, scoped = split_sets(options)
    for name in scoped:
        if name != strategy and name not in names:
            raise SdbenchError(f"--set {name}.{next(iter(scoped[name]))}: '{name}' is neither --strategy nor a "
                               f"--compare of this run")
    return {**shared, **scoped.get(strategy, {})}, {n: scoped.get(n, {}) for n in names}


def split_sets(options: dict) -> tuple[dict, dict]:
    """--set values for every strategy, and NAME.key=value ones per strategy NAME."""
    shared, scoped = {}, {}
    for key, value in options.items():
        name, dot, own = key.partition(".")
        if dot and own:
            scoped.setdefault(name, {})[own] = value
        else:
            shared[key] = value
    return shared, scoped


def tune(
    target: Target = C.DEFAULT_TARGET,
    draft: Annotated[Optional[list[str]], typer.Option("--draft", "-d", help="draft candidate (repeatable; the tuner picks one per trial)")] = None,
    strategy: Annotated[Optional[list[str]], typer.Option("--strategy", "-s", help="strategy or preset to tune; several (repeated, or draft,eagle,ngram): one study chooses among them and their settings [default: ngram]")] = None,
    dataset: Dataset = C.DEFAULT_DATASET, limit: Limit = C.DEFAULT_LIMIT,
    max_new_tokens: MaxNew = C.DEFAULT_MAX_NEW_TOKENS, batch_size: Batch = 1, seed: Seed = 0,
    prompt_len: Annotated[Optional[str], typer.Option("--prompt-len", help="prompts of exactly this many tokens (book datasets; 2k = 2048), or an input-length bucket; several (512,4096): a schedule per context length too")] = None,
    batch: Annotated[Optional[str], typer.Option("--batch", help="batch sizes, e.g. 1,4: one study each, written as a schedule that run looks up per batch size")] = None,
    per_bucket: Annotated[Optional[str], typer.Option("--per-bucket", help="with --batch: what the larger sizes tune, gamma (the rest held as the smallest chose them: the drafted tokens per batch size engines load) or all [default: gamma]")] = None,
    device: Device = "auto", dtype: Dtype = "float32", repeats: Repeats = 1, out: Out = C.DEFAULT_OUT,
    trials: Annotated[int, typer.Option(help="finished trials the study should reach (a re-run resumes toward it)")] = C.DEFAULT_TRIALS,
    timeout: Annotated[Optional[float], typer.Option(help="seconds; no new trial starts after this")] = None,
    objective: Annotated[str, typer.Option(help="speedup (vs plain decoding beside each trial) or tokens (strategy tokens/s)")] = "speedup",
    storage: Annotated[Optional[str], typer.Option(help="Optuna storage URL, e.g. postgresql://... [default: sqlite:///OUT/tune.db]")] = None,
    study: Annotated[Optional[str], typer.Option(help="study name [default: sdbench-TARGET-STRATEGY-DATASET-HARDWARE]")] = None,
    preset: Annotated[Optional[str], typer.Option(help="preset for the best settings [default: tuned-STRATEGY-TARGET]")] = None,
    probe: Probe = "auto", no_probe: NoProbe = False,
    head: Annotated[Optional[list[str]], typer.Option("--head", help="trained-head candidate for --strategy eagle, peagle, medusa, mtp, dflash or dspark (repeatable; the tuner picks one per trial) [default: the target's heads that train-head recorded]")] = None,
    trees: Annotated[bool, typer.Option("--trees", help="also search the token tree's shape where a strategy grows trees (draft: the chain or top-k 2-4 with 4-32 nodes; ngram: the chain or 2-4 branches); a study of its own")] = False,
    fast: Fast = True,
):
    """Search a strategy's settings with Optuna on a fixed prompt subset; write the best as a preset (with
    several --batch sizes or --prompt-len lengths: the best per bucket, as a schedule preset; with several
    --strategy: the best strategy and its settings, e.g. among draft models, trained heads and n-gram; with
    --trees: the token tree's shape too)."""
    from sdbench.commands.schedule import tune_schedule
    from sdbench.commands.tune import tune as run_tune

    batches, lengths = parse_counts(batch, "--batch", 1), parse_lengths(prompt_len)
    if batches and batch_size != 1:
        raise SdbenchError("give either --batch (sizes to tune a schedule over) or --batch-size, not both")
    schedule = len(batches) > 1 or len(lengths) > 1
    if per_bucket is not None and not schedule:
        raise SdbenchError("--per-bucket applies to a schedule: give several --batch sizes (or --prompt-len lengths)")
    strategies = tuple(n for given in strategy or (C.DEFAULT_STRATEGY,) for n in split_list(given, "--strategy"))
    if not strategies:
        raise SdbenchError("--strategy: name a strategy or preset (see `sdbench list strategies`)")
    run_cfg = C.RunConfig(
        target=target, drafts=tuple(draft or ()), strategy=strategies[0], dataset=dataset, limit=limit,
        max_new_tokens=max_new_tokens, batch_size=batch_size, sampling=C.SamplingConfig(0.0, 1.0, seed),
        device=device, dtype=dtype, repeats=repeats, out=out, probe=probe_mode(probe, no_probe), fast=fast,
    )
    cfg = C.TuneConfig(run_cfg, trials, timeout, objective, storage, study, preset, batches, lengths, tuple(head or ()),
                       strategies, trees, per_bucket or "gamma")
    (tune_schedule if schedule else run_tune)(cfg, console)


def bench(
    target: Annotated[Optional[list[str]], typer.Option("--target", "-t", help="target model: alias, Hugging Face id, folder or .gguf; repeatable: the same bench for each, --draft once per target in order [default: smollm2-135m]")] = None,
    draft: Draft = None, dataset: Dataset = C.DEFAULT_DATASET,
    limit: Limit = C.DEFAULT_LIMIT, max_new_tokens: MaxNew = 96, gamma: Annotated[int, typer.Option("--gamma", "-g")] = 4,
    device: Device = "auto", dtype: Dtype = "float32", seed: Seed = 0, repeats: Repeats = 2,
    out: Annotated[Optional[str], typer.Option(help="also write DIR/bench.parquet: one row per system and repeat")] = None,
    generate: Annotated[str, typer.Option(envvar="SDBENCH_GENERATE", help="transformers generate's configuration: "
                                          "fastest (tried and picked here), dynamic, static or compiled")] = "fastest",
    head: Annotated[Optional[list[str]], typer.Option("--head", help="a trained head (EAGLE, Medusa, P-EAGLE, MTP, DFlash or DSpark: a folder or hub id) measured beside the others (repeatable)")] = None,
    tree: Annotated[str, typer.Option("--tree", help="also the draft model's top-K token tree of NODES nodes, γ levels deep, as K,NODES (e.g. 2,8): sdbench's loop alone, no peer grows trees")] = "",
    engine: Annotated[str, typer.Option(help="also measure engines users deploy, each through its own server: "
                                        "llama.cpp, vllm or both as llama.cpp,vllm (`sdbench list engines`); "
                                        "sdbench: none")] = "sdbench",
    engine_url: Annotated[Optional[str], typer.Option(help="the engine's server you already run (http://HOST:PORT), "
                                                      "measured as it runs; else sdbench starts its own")] = None,
    engine_port: Annotated[Optional[int], typer.Option(help="the first port of the servers sdbench starts "
                                                       "[default: free ones]")] = None,
    ray: Annotated[Optional[str], typer.Option("--ray", help="each target's bench as a task on a Ray cluster: auto (the cluster `ray start` began on this machine) or its ADDRESS; each alone on its node's CPUs, or on one GPU")] = None,
):
    """Speed against peers: transformers generate and assisted generation vs sdbench in one process, and with
    --engine the same prompts through llama.cpp's or vLLM's own server. Several --target: the same bench for each
    (with --out DIR, each in DIR/NAME/), one after another or as Ray tasks on a cluster (--ray)."""
    from sdbench.commands.bench import run_peers
    from sdbench.commands.bench_matrix import run_matrix, target_configs

    base = C.BenchConfig(C.DEFAULT_TARGET, "", dataset, limit, max_new_tokens, gamma, device, dtype, seed, repeats, out,
                         generate, heads=tuple(head or ()), tree=tree, engine=engine, engine_url=engine_url,
                         engine_port=engine_port)
    cfgs = target_configs(base, list(target or [C.DEFAULT_TARGET]), list(draft or []))
    if len(cfgs) == 1 and ray is None:
        run_peers(cfgs[0], console)
    else:
        run_matrix(cfgs, console, ray)


def gpu_check(
    part: Annotated[str, typer.Option(help="1, 2, 3, a list like 1,3, or all: the parts this call runs")] = "all",
    device: Device = "cuda",
    tiny: Annotated[bool, typer.Option("--tiny", help="the same steps on the models shrunk to two layers: a "
                                                      "rehearsal (with --device cpu, the tests' own)")] = False,
    out: Annotated[str, typer.Option(help="each part writes OUT/part-N/: one Parquet, PNGs, index.html")] = "results/gpu-check",
    merge: Annotated[bool, typer.Option("--merge", help="measure nothing: join OUT/part-*/ into OUT/index.html")] = False,
    budget: Annotated[float, typer.Option(help="seconds into a part after which it starts no new measurement")] = 510.0,
):
    """Measure a GPU that reaches no network, every model MODEL@random: the CUDA tests, bench, step costs
    through the CUDA graphs, a MagicDec run with its prediction and DSI, in three parts of under 9 minutes."""
    from sdbench.commands.gpucheck import parse_parts, run_check
    from sdbench.commands.gpucheck.page import merge as merge_parts

    if merge:
        console.print(f"page: {merge_parts(Path(out))}", highlight=False)
        return
    for page in run_check(parse_parts(part), device, tiny, out, console, budget):
        console.print(f"page: {page}", highlight=False)
