"""The command line: thin commands over the engine. Known errors print one line and exit non-zero."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from sdbench import config as C
from sdbench.errors import SdbenchError
from sdbench.options import parse_depths, parse_gammas, parse_rates, parse_sets, probe_mode, split_list

# Each command imports its command module (and what else it runs) inside its own function: those modules load
# torch, transformers or pandas, which `sdbench --help` and a light command (`predict speedup`) need not load.
# Only light modules are imported at the top.

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Benchmark and tune speculative decoding of language models.")
# piped output (CI logs, files) gets room for the full tables instead of rich's 80-column default
console = Console() if sys.stdout.isatty() else Console(width=160)

Target = Annotated[str, typer.Option("--target", "-t", help="target model: alias, Hugging Face id, folder or .gguf")]
Draft = Annotated[Optional[list[str]], typer.Option("--draft", "-d", help="draft model (repeatable)")]
Strategy = Annotated[str, typer.Option("--strategy", "-s", help="strategy or preset name (see `sdbench list strategies`)")]
Dataset = Annotated[str, typer.Option("--dataset", help="task name (see `sdbench list datasets`) or a .jsonl, .json or .csv file of prompts")]
Limit = Annotated[int, typer.Option(help="number of prompts")]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", help="tokens to generate per prompt")]
Batch = Annotated[int, typer.Option("--batch-size", "-b", help="prompts decoded together")]
Temperature = Annotated[float, typer.Option(help="0 = greedy; otherwise lossless speculative sampling")]
TopP = Annotated[float, typer.Option("--top-p", help="nucleus sampling mass")]
Seed = Annotated[int, typer.Option(help="seed for prompt selection and sampling")]
Gamma = Annotated[Optional[str], typer.Option("--gamma", "-g", help=f"draft tokens per step, or a sweep like 1,2,4,8 [default: preset or {C.DEFAULT_GAMMA}]")]
PromptLen = Annotated[Optional[int], typer.Option("--prompt-len", help="long-context prompts of exactly this many tokens (book datasets)")]
Device = Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto")]
Dtype = Annotated[str, typer.Option(help="float32, bfloat16 or float16")]
Repeats = Annotated[int, typer.Option(help="times to run every batch")]
Sets = Annotated[Optional[list[str]], typer.Option("--set", help="strategy setting key=value (repeatable)")]
Head = Annotated[Optional[str], typer.Option("--head", help="trained head for --strategy eagle or medusa: a folder or a hub id")]
Out = Annotated[str, typer.Option(help="folder for the Parquet results")]
Baseline = Annotated[bool, typer.Option("--baseline/--no-baseline", help="also run plain decoding on the same prompts")]
Fast = Annotated[bool, typer.Option("--fast/--no-fast", help="the runner's fast path (CPU: packed projections)")]
Probe = Annotated[str, typer.Option("--probe", help="compare each model's logits with the library's own forward before running (refuse, or fall back to the generic runner, past the tolerance): auto reuses the verdict kept for the same weights, dtype, device and code within the context it covered; always probes again; never skips it")]
NoProbe = Annotated[bool, typer.Option("--no-probe", help="the same as --probe never")]
Resume = Annotated[Optional[str], typer.Option(help="continue an interrupted run: its RUN_ID")]
Turns = Annotated[Optional[int], typer.Option(help="turns of each multi-turn question to decode [default: all; MT-Bench: 2]")]
PromptField = Annotated[Optional[str], typer.Option("--prompt-field", help="--dataset FILE: the field holding the prompt (a string or a list of turns)")]
CategoryField = Annotated[Optional[str], typer.Option("--category-field", help="--dataset FILE: the field holding the category")]
IdField = Annotated[Optional[str], typer.Option("--id-field", help="--dataset FILE: the field holding the prompt's id")]
RequestRate = Annotated[Optional[str], typer.Option("--request-rate", help="serve the prompts as requests arriving at this rate (requests/s, Poisson from --seed; inf = all at once), or a list like 1,2,inf: one load point each; every arrival is admitted unless --concurrency caps it")]
Concurrency = Annotated[Optional[str], typer.Option("--concurrency", help="requests in flight at most (closed loop: one starts as one finishes), or a list like 1,4; with --request-rate, its cap (as vllm bench serve's --max-concurrency)")]
Slo = Annotated[Optional[str], typer.Option("--slo", help="latency bounds for goodput under load, e.g. ttft:500ms,tpot:50ms (ttft, tpot, e2el)")]
Depth = Annotated[Optional[str], typer.Option("--depth", help="retrieval tasks: where the answer hides, 0 (start) to 1 (end), or a list like 0,0.5,1 [default: spread]")]


@app.command()
def run(
    target: Target = C.DEFAULT_TARGET, draft: Draft = None, strategy: Strategy = C.DEFAULT_STRATEGY,
    dataset: Dataset = C.DEFAULT_DATASET, limit: Limit = C.DEFAULT_LIMIT, max_new_tokens: MaxNew = C.DEFAULT_MAX_NEW_TOKENS,
    batch_size: Batch = 1, temperature: Temperature = 0.0, top_p: TopP = 1.0, seed: Seed = 0, gamma: Gamma = None,
    prompt_len: PromptLen = None, device: Device = "auto", dtype: Dtype = "float32", repeats: Repeats = 1,
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
    from sdbench.commands.run import Bench, load_config
    from sdbench.engine.serving import parse_slo
    from sdbench.reporting.report import print_report
    from sdbench.reporting.results import read_results

    own, compared = compare_sets(strategy, compare or [], parse_sets(set_))
    cfg = C.RunConfig(
        target=target, drafts=tuple(draft or ()), strategy=strategy, dataset=dataset, limit=limit,
        max_new_tokens=max_new_tokens, batch_size=batch_size, sampling=C.SamplingConfig(temperature, top_p, seed),
        gammas=parse_gammas(gamma), prompt_len=prompt_len, device=device, dtype=dtype, repeats=repeats,
        options={**own, **({"head": head} if head else {})}, compare=compared,
        out=out, baseline=baseline, resume=resume, fast=fast, turns=turns, depths=parse_depths(depth),
        fields={k: v for k, v in (("prompt", prompt_field), ("category", category_field), ("id", id_field)) if v},
        probe=probe_mode(probe, no_probe), request_rates=parse_rates(request_rate), concurrencies=parse_gammas(concurrency, "--concurrency", 1),
        slo=parse_slo(slo) if slo is not None else {}, engine=engine, engine_url=engine_url, engine_port=engine_port,
    )
    if resume:
        cfg = load_config(out, resume)
    path = Bench(cfg, console).run()
    print_report(read_results([path]), console)
    console.print(f"results: {path}")


@app.command()
def sweep(
    target: Target = C.DEFAULT_TARGET, draft: Draft = None,
    strategy: Annotated[Optional[list[str]], typer.Option("--strategy", "-s", help="strategy or preset measured at every point (repeatable) [default: ngram]")] = None,
    batch: Annotated[Optional[str], typer.Option(help="batch sizes: static batches, as run decodes them [default: 1,2,4,8; --quick: 1,2,4]")] = None,
    concurrency: Annotated[Optional[str], typer.Option(help="requests in flight, instead of --batch: served under load as run --concurrency does (a closed loop)")] = None,
    prompt_len: Annotated[Optional[str], typer.Option("--prompt-len", help="prompt lengths in tokens, token-exact from a book data set [default: 256,1024,2048; --quick: 256,1024]")] = None,
    dataset: Annotated[str, typer.Option(help="a book data set (see `sdbench list datasets`)")] = C.DEFAULT_SWEEP_DATASET,
    limit: Annotated[int, typer.Option(help="prompts per point (at least its batch size or concurrency)")] = C.DEFAULT_LIMIT,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", help=f"tokens to generate per prompt [default: {C.DEFAULT_MAX_NEW_TOKENS}; --quick: {C.QUICK_SWEEP_MAX_NEW_TOKENS}]")] = None,
    gamma: Gamma = None, temperature: Temperature = 0.0, seed: Seed = 0, device: Device = "auto", dtype: Dtype = "float32",
    repeats: Repeats = 1,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="strategy setting key=value for every strategy, or NAME.key=value for one (repeatable)")] = None,
    out: Out = C.DEFAULT_OUT, fast: Fast = True, probe: Probe = "auto", no_probe: NoProbe = False,
    resume: Annotated[Optional[str], typer.Option(help="continue an interrupted sweep: its SWEEP_ID (settings as saved)")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="a small grid and fewer tokens: minutes on a small CPU")] = False,
):
    """Where speculative decoding stops paying: every strategy beside plain decoding at each batch size (or
    concurrency) and prompt length; the best setting's speedup per point, measured and predicted, and the
    break-even frontier as a table, a heat-map and one line. Each point is saved as it finishes (--resume)."""
    from sdbench.commands.sweep import run_sweep

    if batch is not None and concurrency is not None:
        raise SdbenchError("--batch and --concurrency are two axes: give one of them")
    strategies = tuple(strategy or (C.DEFAULT_STRATEGY,))
    axis = "concurrency" if concurrency is not None else "batch"
    sizes = parse_gammas(concurrency if concurrency is not None else batch, f"--{axis}", 1) or (
        C.QUICK_SWEEP_SIZES if quick else C.DEFAULT_SWEEP_SIZES)
    lengths = parse_gammas(prompt_len, "--prompt-len", 1) or (C.QUICK_SWEEP_PROMPT_LENS if quick else C.DEFAULT_SWEEP_PROMPT_LENS)
    shared, scoped = split_sets(parse_sets(set_))
    new = max_new_tokens if max_new_tokens is not None else (C.QUICK_SWEEP_MAX_NEW_TOKENS if quick else C.DEFAULT_MAX_NEW_TOKENS)
    run_cfg = C.RunConfig(
        target=target, drafts=tuple(draft or ()), dataset=dataset, limit=limit, max_new_tokens=new,
        sampling=C.SamplingConfig(temperature, 1.0, seed), gammas=parse_gammas(gamma), device=device, dtype=dtype,
        repeats=repeats, options=shared, out=out, fast=fast, probe=probe_mode(probe, no_probe),
    )
    run_sweep(C.SweepConfig(run_cfg, strategies, axis, sizes, lengths, scoped, resume), console)


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


@app.command()
def check(
    model: Annotated[str, typer.Argument(help="target model: alias, Hugging Face id, folder or .gguf")],
    draft: Draft = None, device: Device = "auto", dtype: Dtype = "float32", fast: Fast = True,
    context: Annotated[int, typer.Option(help="positions the probe reaches: the longest context your benchmark will use")] = 1024,
    tokens: Annotated[int, typer.Option(help="greedy tokens in the short lossless run")] = 16,
    head: Annotated[Optional[list[str]], typer.Option("--head", help="trained head (folder or hub id) to check against the target: the hidden states it reads, and decoding with it (repeatable)")] = None,
):
    """Load the models, probe each against the library's forward, and run a few greedy tokens (the target
    against the library's generate, each draft and head against plain decoding); exit 1 on any failure."""
    from sdbench.commands.check import run_check

    run_check(model, list(draft or ()), device, dtype, fast, context, tokens, console, list(head or ()))


@app.command("list")
def list_(what: Annotated[str, typer.Argument(help="strategies, datasets, models or engines")]):
    """What is registered, and whether each model/dataset/engine is available offline right now."""
    from sdbench.commands.listing import show

    show(what, console)


@app.command()
def report(
    paths: Annotated[list[str], typer.Argument(help="Parquet files, .parts folders or result folders")],
    plots: Annotated[Optional[str], typer.Option(help="also write PNG plots into this folder")] = None,
    html: Annotated[Optional[str], typer.Option(help="also write one self-contained HTML page: tables and plots")] = None,
    by: Annotated[Optional[list[str]], typer.Option("--by", help="split the summary by these columns (repeatable), e.g. --by turn [default: category]")] = None,
    explain: Annotated[bool, typer.Option("--explain", help="also break each speedup into the factors that multiply to it, and show other tools' definitions")] = False,
):
    """Print the tables of earlier runs; optionally PNG plots and an HTML page."""
    from sdbench.reporting.carry import bench_files, print_bench
    from sdbench.reporting.report import marked_partial, print_report
    from sdbench.reporting.results import read_results
    from sdbench.reporting.sweep import print_frontier

    benches = bench_files(paths)
    for path in benches:  # `bench --out`'s files: their carry-over tables
        print_bench(path, console)
    paths = [p for p in paths if p not in benches]
    if benches and not paths:
        return
    df = marked_partial(read_results(paths))
    print_report(df, console, by=tuple(by or ()))
    print_frontier(df, console)  # rows of a sweep: its best setting per point and where SD stops paying
    if explain:
        from sdbench.analysis.tree_explain import explain_trees
        from sdbench.reporting.explain import print_explain

        print_explain(df, console, explain_trees(df))
    if plots or html:
        from sdbench.reporting.html import export

        for path in export(df, plots, html):
            console.print(f"wrote {path}", highlight=False)


@app.command()
def tune(
    target: Target = C.DEFAULT_TARGET,
    draft: Annotated[Optional[list[str]], typer.Option("--draft", "-d", help="draft candidate (repeatable; the tuner picks one per trial)")] = None,
    strategy: Annotated[Optional[list[str]], typer.Option("--strategy", "-s", help="strategy or preset to tune; several (repeated, or draft,eagle,ngram): one study chooses among them and their settings [default: ngram]")] = None,
    dataset: Dataset = C.DEFAULT_DATASET, limit: Limit = C.DEFAULT_LIMIT,
    max_new_tokens: MaxNew = C.DEFAULT_MAX_NEW_TOKENS, batch_size: Batch = 1, seed: Seed = 0,
    prompt_len: Annotated[Optional[str], typer.Option("--prompt-len", help="prompts of exactly this many tokens (book datasets); several (512,4096): a schedule per context length too")] = None,
    batch: Annotated[Optional[str], typer.Option("--batch", help="batch sizes, e.g. 1,4: one study each, written as a schedule that run looks up per batch size")] = None,
    device: Device = "auto", dtype: Dtype = "float32", repeats: Repeats = 1, out: Out = C.DEFAULT_OUT,
    trials: Annotated[int, typer.Option(help="finished trials the study should reach (a re-run resumes toward it)")] = C.DEFAULT_TRIALS,
    timeout: Annotated[Optional[float], typer.Option(help="seconds; no new trial starts after this")] = None,
    objective: Annotated[str, typer.Option(help="speedup (vs plain decoding beside each trial) or tokens (strategy tokens/s)")] = "speedup",
    storage: Annotated[Optional[str], typer.Option(help="Optuna storage URL, e.g. postgresql://... [default: sqlite:///OUT/tune.db]")] = None,
    study: Annotated[Optional[str], typer.Option(help="study name [default: sdbench-TARGET-STRATEGY-DATASET-HARDWARE]")] = None,
    preset: Annotated[Optional[str], typer.Option(help="preset for the best settings [default: tuned-STRATEGY-TARGET]")] = None,
    probe: Probe = "auto", no_probe: NoProbe = False,
    head: Annotated[Optional[list[str]], typer.Option("--head", help="trained-head candidate for --strategy eagle or medusa (repeatable; the tuner picks one per trial) [default: the target's heads that train-head recorded]")] = None,
    trees: Annotated[bool, typer.Option("--trees", help="also search the token tree's shape where a strategy grows trees (draft: the chain or top-k 2-4 with 4-32 nodes; ngram: the chain or 2-4 branches); a study of its own")] = False,
    fast: Fast = True,
):
    """Search a strategy's settings with Optuna on a fixed prompt subset; write the best as a preset (with
    several --batch sizes or --prompt-len lengths: the best per bucket, as a schedule preset; with several
    --strategy: the best strategy and its settings, e.g. among draft models, trained heads and n-gram; with
    --trees: the token tree's shape too)."""
    from sdbench.commands.schedule import tune_schedule
    from sdbench.commands.tune import tune as run_tune

    batches, lengths = parse_gammas(batch, "--batch", 1), parse_gammas(prompt_len, "--prompt-len", 1)
    if batches and batch_size != 1:
        raise SdbenchError("give either --batch (sizes to tune a schedule over) or --batch-size, not both")
    strategies = tuple(n for given in strategy or (C.DEFAULT_STRATEGY,) for n in split_list(given, "--strategy"))
    if not strategies:
        raise SdbenchError("--strategy: name a strategy or preset (see `sdbench list strategies`)")
    run_cfg = C.RunConfig(
        target=target, drafts=tuple(draft or ()), strategy=strategies[0], dataset=dataset, limit=limit,
        max_new_tokens=max_new_tokens, batch_size=batch_size, sampling=C.SamplingConfig(0.0, 1.0, seed),
        device=device, dtype=dtype, repeats=repeats, out=out, probe=probe_mode(probe, no_probe), fast=fast,
    )
    cfg = C.TuneConfig(run_cfg, trials, timeout, objective, storage, study, preset, batches, lengths, tuple(head or ()),
                       strategies, trees)
    (tune_schedule if len(batches) > 1 or len(lengths) > 1 else run_tune)(cfg, console)


@app.command("train-head")
def train_head(
    out: Annotated[str, typer.Option("--out", help="the head's folder (a re-run with the same folder resumes)")],
    target: Target = C.DEFAULT_TARGET,
    kind: Annotated[str, typer.Option(help="eagle3 or medusa")] = "eagle3",
    data: Annotated[Optional[list[str]], typer.Option("--data", help="training prompts: a data set or a prompt file (repeatable); by default sharegpt, gsm8k and humaneval, never MT-Bench (what heads are measured on)")] = None,
    minutes: Annotated[float, typer.Option(help="wall-clock budget: the training data first (at most 40%), then the fit")] = 20.0,
    prompts: Annotated[int, typer.Option(help="training prompts at most (1 in 16 held out to measure acceptance)")] = 512,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="tokens of the target's answer to each prompt")] = 128,
    answers: Annotated[str, typer.Option(help="what the head learns from: target (the target's own answers, one decoding each), data (the data sets' own replies, read in one forward each, labelled with the target's choices) or both")] = "both",
    draft_vocab: Annotated[Optional[int], typer.Option("--draft-vocab", help="EAGLE-3: tokens the head drafts over, the target's most chosen (0: all); by default 8192")] = None,
    steps: Annotated[Optional[int], typer.Option(help="EAGLE-3: unrolled training steps (default 3); Medusa: heads (default 4)")] = None,
    device: Device = "auto",
    dtype: Annotated[str, typer.Option(help="the target's dtype while it answers: float32, bfloat16, float16, or auto (bfloat16 on a GPU, float32 on a CPU)")] = "auto",
    seed: Seed = 0, probe: Probe = "auto", no_probe: NoProbe = False,
):
    """Fit an EAGLE-3 or Medusa head on the target's own answers to shipped prompts, written in the format
    vLLM loads (run it with --strategy eagle|medusa --head OUT)."""
    from sdbench.commands.train_head import train_head as fit_head

    fit_head(C.TrainHeadConfig(target=target, kind=kind, out=out, data=tuple(data or C.DEFAULT_HEAD_DATA),
                               minutes=minutes, prompts=prompts, max_new_tokens=max_new_tokens, answers=answers,
                               draft_vocab=draft_vocab, steps=steps, device=device, dtype=dtype, seed=seed,
                               probe=probe_mode(probe, no_probe)), console)


schedule_app = typer.Typer(no_args_is_help=True, help="Schedules that `tune --batch` wrote: show or export them.")
app.add_typer(schedule_app, name="schedule")
ScheduleName = Annotated[str, typer.Argument(help="the schedule preset's name")]


@schedule_app.command("show")
def schedule_show(name: ScheduleName):
    """The schedule's entries: batch size (and prompt length), settings, tuned value."""
    from sdbench.commands.schedule import show_schedule

    show_schedule(name, console)


@schedule_app.command("export")
def schedule_export(
    name: ScheduleName,
    format: Annotated[str, typer.Option("--format", help="vllm (a --speculative-config per batch-size bucket) or json")] = "vllm",
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="file to write [default: print it]")] = None,
):
    """The schedule in the form an engine takes: vLLM's --speculative-config per batch-size bucket, or json."""
    from sdbench.commands.schedule import export_schedule

    export_schedule(name, format, out, console)


datastore_app = typer.Typer(no_args_is_help=True, help="REST datastores (`run --strategy rest --set datastore=NAME`): build or list them.")
app.add_typer(datastore_app, name="datastore")


@datastore_app.command("build")
def datastore_build(
    name: Annotated[str, typer.Argument(help="the datastore's name (letters, digits, '.', '_', '-')")],
    from_: Annotated[str, typer.Option("--from", help="the corpus: a data set (its prompts and their replies), a prompt file (.jsonl, .json, .csv) or a text file")],
    target: Target = C.DEFAULT_TARGET,
    limit: Annotated[Optional[int], typer.Option(help="prompts (or text-file documents) to take (default: all; a book data set: its default number of excerpts)")] = None,
):
    """Tokenize a corpus with the target's tokenizer and index it for suffix search, under the cache."""
    from sdbench.commands.datastore import build

    build(name, from_, target, limit, console)


@datastore_app.command("list")
def datastore_list():
    """The datastores built: target, corpus, size, prompts held."""
    from sdbench.commands.datastore import show

    show(console)


@app.command()
def compare(
    baseline: Annotated[str, typer.Argument(help="baseline results: Parquet file or folder")],
    current: Annotated[str, typer.Argument(help="current results: Parquet file or folder")],
    max_regression: Annotated[float, typer.Option(help="percent drop of a median that fails the gate")] = 5.0,
    across: Annotated[str, typer.Option(help="settings the two sides may differ in, e.g. max-new-tokens,dtype "
                                             "(max-new-tokens, temperature, top-p, seed, dtype, fast)")] = "",
):
    """Regression gate: tokens/s and speedup deltas per matched prompt; exit 1 on a regression or lossy output,
    2 on bad input or on results run with different settings (unless --across names them)."""
    from sdbench.reporting.compare import run_compare

    run_compare([baseline], [current], max_regression, console, across)


@app.command()
def bench(
    target: Target = C.DEFAULT_TARGET, draft: Draft = None, dataset: Dataset = C.DEFAULT_DATASET,
    limit: Limit = C.DEFAULT_LIMIT, max_new_tokens: MaxNew = 96, gamma: Annotated[int, typer.Option("--gamma", "-g")] = 4,
    device: Device = "auto", dtype: Dtype = "float32", seed: Seed = 0, repeats: Repeats = 2,
    out: Annotated[Optional[str], typer.Option(help="also write DIR/bench.parquet: one row per system and repeat")] = None,
    generate: Annotated[str, typer.Option(envvar="SDBENCH_GENERATE", help="transformers generate's configuration: "
                                          "fastest (tried and picked here), dynamic, static or compiled")] = "fastest",
    head: Annotated[Optional[list[str]], typer.Option("--head", help="a trained head (EAGLE or Medusa folder or hub id) measured beside the others (repeatable)")] = None,
    engine: Annotated[str, typer.Option(help="also measure engines users deploy, each through its own server: "
                                        "llama.cpp, vllm or both as llama.cpp,vllm (`sdbench list engines`); "
                                        "sdbench: none")] = "sdbench",
    engine_url: Annotated[Optional[str], typer.Option(help="the engine's server you already run (http://HOST:PORT), "
                                                      "measured as it runs; else sdbench starts its own")] = None,
    engine_port: Annotated[Optional[int], typer.Option(help="the first port of the servers sdbench starts "
                                                       "[default: free ones]")] = None,
):
    """Speed against peers: transformers generate and assisted generation vs sdbench in one process, and with
    --engine the same prompts through llama.cpp's or vLLM's own server."""
    from sdbench.commands.bench import run_peers

    run_peers(C.BenchConfig(target, (draft or [""])[0], dataset, limit, max_new_tokens, gamma, device, dtype, seed,
                            repeats, out, generate, heads=tuple(head or ()), engine=engine, engine_url=engine_url,
                            engine_port=engine_port), console)


@app.command("gpu-check")
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


predict_app = typer.Typer(no_args_is_help=True, help="What the cost models predict, from given or profiled costs.")
app.add_typer(predict_app, name="predict")


@predict_app.command("speedup")
def predict_speedup(
    alpha: Annotated[float, typer.Option(help="per-token acceptance rate, 0..1")],
    gamma: Annotated[str, typer.Option("--gamma", "-g", help="lookahead, or a list like 1,2,4,8")] = "1,2,3,4,6,8",
    draft_cost: Annotated[float, typer.Option(help="one draft forward / one target forward")] = 0.1,
    verify_cost: Annotated[float, typer.Option(help="one verification of gamma+1 tokens / one target forward")] = 1.0,
    target: Annotated[Optional[str], typer.Option("--target", "-t", help="measure the costs at this model's shape "
                                                  "instead (MODEL@random works): --draft-cost/--verify-cost ignored")] = None,
    draft: Annotated[Optional[str], typer.Option("--draft", "-d", help="with --target: the draft model [default: the target]")] = None,
    context: Annotated[int, typer.Option(help="with --target: the prompt length the costs are measured at")] = 256,
    device: Device = "auto", dtype: Dtype = "float32",
):
    """Expected tokens per step and speedup of draft-model SD under the i.i.d. acceptance model."""
    from sdbench.commands.predict_speedup import run_speedup

    run_speedup(alpha, parse_gammas(gamma, low=1), draft_cost, verify_cost, console, target=target, draft=draft,
                context=context, device=device, dtype=dtype)


@predict_app.command("magicdec")
def predict_magicdec(
    target: Target = C.DEFAULT_TARGET,
    batch: Annotated[str, typer.Option(help="batch sizes to profile")] = "1,4,8",
    context: Annotated[str, typer.Option(help="context lengths (tokens) to profile")] = "256,1024,4096",
    gamma: Annotated[str, typer.Option("--gamma", "-g", help="lookaheads to consider")] = "1,2,3,4,6",
    budget: Annotated[str, typer.Option(help="draft KV budgets to consider")] = "64,256,512",
    alpha: Annotated[float, typer.Option(help="acceptance rate to assume where no run measured it")] = 0.8,
    from_results: Annotated[Optional[list[str]], typer.Option("--from", help="magicdec results: fit alpha per budget")] = None,
    device: Device = "auto", dtype: Dtype = "float32",
    out: Annotated[Optional[str], typer.Option(help="folder for the profile as Parquet")] = None,
    fast: Fast = True,
):
    """Profile target, sparse-draft and verify step times; predict the best gamma and budget per batch and
    context, and the critical sequence length above which self-speculation beats plain decoding."""
    from sdbench.commands.predict import run_predict

    if not 0.0 <= alpha <= 1.0:
        raise SdbenchError(f"--alpha {alpha}: expected a rate between 0 and 1")
    cfg = C.PredictMagicdecConfig(target, parse_gammas(batch, "--batch", 1), parse_gammas(context, "--context", 1),
                                  parse_gammas(gamma, low=1), parse_gammas(budget, "--budget", 1), alpha,
                                  tuple(from_results or ()), device, dtype, out, fast)
    run_predict(cfg, console)


@predict_app.command("chain")
def predict_chain(
    candidate: Annotated[str, typer.Option(help="model to insert into the chain, e.g. smollm2-135m@int8")],
    target: Target = C.DEFAULT_TARGET,
    draft: Annotated[Optional[list[str]], typer.Option("--draft", "-d", help="the chain as it is: one level per --draft, top down (ngram allowed last)")] = None,
    at: Annotated[int, typer.Option(help="insert under the target (0) or under the N-th --draft")] = 0,
    gamma: Annotated[int, typer.Option("--gamma", "-g", help="the bottom drafter's tokens per block")] = C.DEFAULT_GAMMA,
    mu: Annotated[str, typer.Option(help="tokens each middle level gathers before handing up (one value; default 2*gamma, doubling upwards)")] = "",
    dataset: Dataset = C.DEFAULT_DATASET, limit: Limit = C.DEFAULT_LIMIT, max_new_tokens: MaxNew = 48,
    profile_prompts: Annotated[int, typer.Option(help="prompts in the profiling pass")] = 2,
    profile_tokens: Annotated[int, typer.Option(help="tokens per prompt in the profiling pass")] = 16,
    device: Device = "cpu", dtype: Dtype = "float32", seed: Seed = 0,
    temperature: Annotated[float, typer.Option(help="the profiling pass again under sampling at this temperature, "
                                                    "for the accepted-length variance per level (0: greedy only)")] = 1.0,
):
    """Polybasic insertion test: predict from a short profiling pass whether inserting --candidate into the
    chain lowers the time per token, then measure both chains (and plain decoding) on the same prompts."""
    from sdbench.commands.predict_chain import run_chain_prediction

    run_chain_prediction(C.PredictChainConfig(target, tuple(draft or ()), candidate, at, gamma, mu, dataset, limit,
                                              max_new_tokens, profile_prompts, profile_tokens, device, dtype, seed,
                                              temperature), console)


@predict_app.command("tree")
def predict_tree(
    results: Annotated[Optional[list[str]], typer.Argument(help="a run's results (files or folders) that measured a tree")] = None,
    acceptance: Annotated[Optional[str], typer.Option(help="a shipped acceptance table instead of results (needs --target and --draft-cost; an unknown NAME lists the known)")] = None,
    budget: Annotated[str, typer.Option(help="node budgets: the most drafted nodes a tree may have")] = "4,8,16,32",
    batch: Annotated[Optional[str], typer.Option(help="batch sizes to profile [default: the run's; with --acceptance 1]")] = None,
    by_depth: Annotated[bool, typer.Option("--by-depth", help="acceptance per depth and rank (default: per rank, pooled over depths)")] = False,
    draft_cost: Annotated[Optional[float], typer.Option(help="one draft level / one target step [default: measured by the run against its baseline]")] = None,
    target: Annotated[Optional[str], typer.Option("--target", "-t", help="the model whose verification is profiled [default: the run's target]")] = None,
    context: Annotated[Optional[int], typer.Option(help="context length the costs are profiled at [default: the run's mean prompt + half its new tokens; with --acceptance 1024]")] = None,
    device: Device = "auto",
    dtype: Annotated[Optional[str], typer.Option(help="float32, bfloat16 or float16 [default: the run's]")] = None,
    fast: Fast = True,
    strategy: Annotated[Optional[str], typer.Option("--strategy", "-s", help="the rows of this strategy or preset only (a run with --compare holds several)")] = None,
):
    """The token tree with the most predicted tokens/s per batch size and node budget, from the run's acceptance by
    depth and sibling rank (or a shipped table's) and the cost of verifying N tokens profiled on this machine
    (Sequoia's programme)."""
    from sdbench.commands.predict_tree import run_predict_tree

    if draft_cost is not None and not draft_cost >= 0:
        raise SdbenchError(f"--draft-cost {draft_cost}: expected 0 or more")
    cfg = C.PredictTreeConfig(tuple(results or ()), parse_gammas(budget, "--budget", 1),
                              parse_gammas(batch, "--batch", 1) if batch else (), by_depth, draft_cost, target,
                              context, device, dtype, fast, strategy, acceptance)
    run_predict_tree(cfg, console)


simulate_app = typer.Typer(no_args_is_help=True, help="Simulated latency of decoding algorithms (no models run).")
app.add_typer(simulate_app, name="simulate")


@simulate_app.command("dsi")
def simulate_dsi(
    target_latency: Annotated[float, typer.Option(help="one target forward (seconds; 1 = count forwards)")] = 1.0,
    c: Annotated[float, typer.Option("--c", help="drafter latency: one draft forward / one target forward")] = 0.1,
    a: Annotated[Optional[float], typer.Option("--a", help="per-token acceptance rate, 0..1 [default: 0.8; with "
                                               "--from the run's measured one, unless its weights are random]")] = None,
    k: Annotated[int, typer.Option("--k", help="lookahead: drafted tokens per verification")] = 4,
    workers: Annotated[int, typer.Option(help="DSI target workers")] = 7,
    tokens: Annotated[int, typer.Option(help="tokens to generate")] = 1000,
    repeats: Annotated[int, typer.Option(help="simulated generations averaged online")] = 20,
    grid: Annotated[int, typer.Option(help="heat-map resolution: grid+1 values of c and of a")] = 20,
    kmax: Annotated[int, typer.Option(help="largest lookahead the heat-map tries per cell")] = 200,
    seed: Seed = 0,
    from_results: Annotated[Optional[list[str]], typer.Option("--from", help="an sdbench run: take target latency, c, a, k and workers from it")] = None,
    target: Annotated[Optional[str], typer.Option("--target", "-t", help="measure the target latency and c at this "
                                                  "model's shape instead (MODEL@random works)")] = None,
    draft: Annotated[Optional[str], typer.Option("--draft", "-d", help="with --target: the drafter [default: the target]")] = None,
    context: Annotated[int, typer.Option(help="with --target: the prompt length the latencies are measured at")] = 256,
    device: Device = "auto", dtype: Dtype = "float32",
    out: Annotated[str, typer.Option(help="folder for dsi-heatmap.parquet and dsi-heatmap.png")] = C.DEFAULT_OUT,
):
    """Expected latency of plain decoding, SI and DSI (offline by counting, online by a timed simulation),
    and the DSI paper's four heat-map panels across drafter latency and acceptance."""
    from sdbench.commands.simulate import run_simulation

    run_simulation(C.SimulateDSIConfig(target_latency, c, a, k, workers, tokens, repeats, grid, kmax, seed,
                                       tuple(from_results or ()), target, draft, context, device, dtype, out), console)


@app.command()
def reproduce(
    paper: Annotated[str, typer.Argument(help="dsi, magicdec, adaptive or polybasic")],
    target: Target = C.DEFAULT_TARGET,
    draft: Annotated[Optional[str], typer.Option(
        "--draft", "-d", help="draft model [default: dsi the target itself; magicdec's small draft, adaptive's model "
        "candidate and polybasic's middle level the target's int8 copy on a float32 CPU]")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="fewer prompts and tokens: a few minutes on a small CPU")] = False,
    out: Annotated[Optional[str], typer.Option(help="report folder [default: results/reproduce-PAPER]")] = None,
    device: Device = "auto", dtype: Dtype = "float32",
):
    """A paper's experiment on this machine: its claims beside the measurements, each with a verdict, and a
    report folder (Parquet, PNGs, one self-contained HTML page with the claims first)."""
    from sdbench.commands.reproduce import ReproduceConfig, run_paper

    run_paper(paper, ReproduceConfig(target, draft, quick, out, device, dtype), console)


INTERRUPTED = 130  # the exit status of an interrupted command (128 + SIGINT)


def _terminated(signum, frame) -> None:
    """SIGTERM (a `timeout`, a CI job cancelled) as Ctrl-C: finished results kept, servers sdbench started stopped."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    err = Console(stderr=True)
    main_thread = threading.current_thread() is threading.main_thread()  # only there can a handler be set
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        code = typer.main.get_command(app).main(args=argv, prog_name="sdbench", standalone_mode=False)
    except SdbenchError as e:  # escaped: a message may hold brackets, e.g. pip install 'sdbench[ray]'
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        err.print("[red]error:[/red] interrupted", highlight=False)
        sys.exit(INTERRUPTED)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.TyperException as e:  # usage errors: unknown option, bad value, missing argument
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        if message:  # empty when help was shown for a bare command
            err.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)
        sys.exit(getattr(e, "exit_code", 2) or 2)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if code == INTERRUPTED:  # Ctrl-C (or SIGTERM) in a command: typer answers it with a silent Exit(130)
        err.print("[red]error:[/red] interrupted", highlight=False)
    if isinstance(code, int) and code:  # a command's typer.Exit(code) comes back as the return value here
        sys.exit(code)
