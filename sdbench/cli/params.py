"""What the commands share: the console they print to and the Annotated option aliases."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer
from rich.console import Console

from sdbench import config as C
from sdbench.options import parse_tokens

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
PromptLen = Annotated[Optional[int], typer.Option("--prompt-len", parser=parse_tokens, metavar="TOKENS", help="long-context prompts of exactly this many tokens (book datasets; 2k = 2048), or the input-length bucket of a data set made of them (see `sdbench list datasets`)")]
Device = Annotated[str, typer.Option(help="cpu, cuda, cuda:N or auto")]
DTYPE_HELP = ("float32, bfloat16 or float16; or q8_0 / q4_0: every model as its copy in llama.cpp's block type, read by "
              "sdbench's CPU products (a model naming its own @q8_0 or @q4_0 keeps it, as does a GGUF file of Q8_0 or "
              "Q4_0 blocks: its own, read as they are)")
Dtype = Annotated[str, typer.Option(help=DTYPE_HELP)]
Repeats = Annotated[int, typer.Option(help="times to run every batch")]
Sets = Annotated[Optional[list[str]], typer.Option("--set", help="strategy setting key=value (repeatable)")]
Head = Annotated[Optional[str], typer.Option("--head", help="trained head for --strategy eagle, peagle, medusa, mtp, dflash or dspark: a folder or a hub id")]
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
