"""Commands about models: check, train-head and the REST datastores."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from sdbench import config as C
from sdbench.cli.params import Device, Draft, Dtype, Fast, NoProbe, Probe, Seed, Target, console
from sdbench.options import probe_mode
from sdbench.training.kinds import kind_help, option_help


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


def train_head(
    out: Annotated[str, typer.Option("--out", help="the head's folder (a re-run with the same folder resumes)")],
    target: Target = C.DEFAULT_TARGET,
    kind: Annotated[str, typer.Option(help=kind_help())] = "eagle3",
    data: Annotated[Optional[list[str]], typer.Option("--data", help="training prompts: a data set or a prompt file (repeatable); by default sharegpt, gsm8k and humaneval, never MT-Bench (what heads are measured on)")] = None,
    minutes: Annotated[float, typer.Option(help="wall-clock budget: the training data first (at most 40%), then the fit")] = 20.0,
    prompts: Annotated[int, typer.Option(help="training prompts at most (1 in 16 held out to measure acceptance)")] = 512,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="tokens of the target's answer to each prompt")] = 128,
    answers: Annotated[str, typer.Option(help="what the head learns from: target (the target's own answers, one decoding each), data (the data sets' own replies, read in one forward each, labelled with the target's choices) or both")] = "both",
    draft_vocab: Annotated[Optional[int], typer.Option("--draft-vocab", help=option_help("--draft-vocab"))] = None,
    steps: Annotated[Optional[int], typer.Option(help=option_help("--steps"))] = None,
    device: Device = "auto",
    dtype: Annotated[str, typer.Option(help="the target's dtype while it answers: float32, bfloat16, float16, or auto (bfloat16 on a GPU, float32 on a CPU)")] = "auto",
    seed: Seed = 0, probe: Probe = "auto", no_probe: NoProbe = False,
):
    """Fit a trained head (--kind) on the target's own answers to shipped prompts, written in the format vLLM loads
    (the command ends with the --strategy that runs it: --head OUT)."""
    from sdbench.commands.train_head import train_head as fit_head

    fit_head(C.TrainHeadConfig(target=target, kind=kind, out=out, data=tuple(data or C.DEFAULT_HEAD_DATA),
                               minutes=minutes, prompts=prompts, max_new_tokens=max_new_tokens, answers=answers,
                               draft_vocab=draft_vocab, steps=steps, device=device, dtype=dtype, seed=seed,
                               probe=probe_mode(probe, no_probe)), console)


datastore_app = typer.Typer(no_args_is_help=True, help="REST datastores (`run --strategy rest --set datastore=NAME`): build or list them.")


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
