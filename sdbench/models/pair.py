"""Devices, dtypes and the loaded target/draft pair every command decodes with."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.console import Console

from sdbench.config import RunConfig
from sdbench.drafting.ngram import DRAFT_NAME as NGRAM_DRAFT
from sdbench.errors import SdbenchError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name not in DTYPES:
        raise SdbenchError(f"--dtype {name}: use one of {', '.join(DTYPES)}")
    if name == "float16" and device.type == "cpu":
        raise SdbenchError("--dtype float16 is not supported on CPU; use float32 or bfloat16")
    return DTYPES[name]


@dataclass
class Pair:
    """The loaded target and drafts, ready to decode."""

    target: object  # ModelRunner
    tokenizer: object
    drafts: list  # [ModelRunner]
    eos: list[int]
    max_positions: int


def load_pair(cfg: RunConfig, device: torch.device, dtype: torch.dtype, console: Console) -> Pair:
    from sdbench.models.loader import eos_token_ids, load_model
    from sdbench.models.runner import ModelRunner
    from sdbench.models.variants import split_variant, variant_runner

    check_tokenizers(cfg)
    with console.status(f"loading target {cfg.target}"):
        target = load_model(cfg.target, device, dtype)
        runner = ModelRunner(target.model, cfg.target, fast=cfg.fast)
    say_note(target, console)
    drafts = []
    for name in cfg.drafts:
        if name == NGRAM_DRAFT:  # prompt lookup as a draft candidate: no model, no tokenizer to check
            drafts.append(name)
            continue
        if name == cfg.target:
            drafts.append(runner)  # drafting with the target itself: same weights, its own cache
            continue
        if split_variant(name)[1] == "int8":  # MODEL@int8: a quantised copy made now (of the target's weights if MODEL is it)
            with console.status(f"making draft {name}"):
                drafts.append(variant_runner(name, cfg.target, target, device, dtype))
            continue
        with console.status(f"loading draft {name}"):
            draft = load_model(name, device, dtype)
        say_note(draft, console)
        drafts.append(ModelRunner(draft.model, name, fast=cfg.fast))
    limit = getattr(target.model.config, "max_position_embeddings", None) or 1 << 30
    return Pair(runner, target.tokenizer, drafts, eos_token_ids(target), limit)


def check_tokenizers(cfg: RunConfig) -> None:
    """Refuse a draft model whose tokenizer differs from the target's, loading tokenizers only (no weights)."""
    from sdbench.models.loader import check_same_tokenizer, load_tokenizer
    from sdbench.models.names import tokenizer_name

    bases = {tokenizer_name(name) for name in cfg.drafts if name != NGRAM_DRAFT} - {cfg.target}
    if not bases:
        return
    target = load_tokenizer(cfg.target)
    for name in sorted(bases):
        check_same_tokenizer(target, load_tokenizer(name), cfg.target, name)


def say_note(loaded, console: Console) -> None:
    """A loaded model's one-line note (a @random model's stand-in tokenizer), if it has one."""
    if getattr(loaded, "note", None):
        console.print(f"note: {loaded.note}", style="yellow", highlight=False, soft_wrap=True)
