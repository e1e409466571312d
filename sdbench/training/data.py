"""Self-distillation data for a head: the target answers training prompts (greedy, sdbench's own decoding), then
one forward over each prompt + answer keeps the hidden states the head reads and the target's own choice of
the next token at every position (what verification will compare the head's drafts with).

Where a data set carries its own reply to a prompt (ShareGPT's answers, GSM8K's solutions, HumanEval's
canonical bodies: `Prompt.reference`), that text can stand in for the target's answer (`teacher_forced`): one
forward over prompt + reply gives the states and, at every position, the target's own choice after that
prefix — the labels are still the target's, only the context is the data set's text. It costs one forward
instead of one decoding step per token, so a time budget buys far more positions (EAGLE's heads were fitted on
fixed ShareGPT replies the same way).

Shards land in OUT/data/ as they are made (`shard-NNNNN.pt`: one batch of sequences), so an interrupted
train-head keeps what it generated; `Sequences.load` reads them back."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from sdbench.forward_step import Step
from sdbench.config import SamplingConfig
from sdbench.data import Prompt
from sdbench.data.tasks import encode_prompt, load_prompts
from sdbench.engine.hidden import Taps
from sdbench.engine.loop import generate
from sdbench.errors import SdbenchError
from sdbench.strategies.base import Proposer


@dataclass
class Sequence:
    source: str  # data set
    id: str  # prompt id within it
    tokens: torch.Tensor  # [T] prompt + answer
    states: torch.Tensor  # [T, k*H] the target states the head reads (stored in bfloat16 when the run is in float32)
    pred: torch.Tensor  # [T] the target's argmax after each position
    answer_from: int = 0  # the prompt's length: drafting starts from root answer_from - 1 (0: every position counts)
    answered_by: str = "target"  # "target": its own greedy answer; "data": the data set's reply (teacher_forced)


def training_prompts(datasets: tuple[str, ...], limit: int, seed: int, tokenizer,
                     avoid: dict[str, set[str]] | None = None) -> list[tuple[str, Prompt]]:
    """Up to `limit` prompts drawn evenly from `datasets` (seeded), as (data set, prompt); prompts in `avoid`
    (data set -> ids) left out. `commands/train_head.validate` has refused an empty `datasets`."""
    pools = []
    for name in datasets:
        pool = [p for p in load_prompts(name, tokenizer=tokenizer) if p.id not in (avoid or {}).get(name, ())]
        if not pool:
            raise SdbenchError(f"--data {name}: no prompts to train on")
        random.Random(seed).shuffle(pool)
        pools.append((name, pool))
    picked, i = [], 0
    while len(picked) < limit and any(i < len(p) for _, p in pools):  # round robin over the data sets
        picked += [(name, pool[i]) for name, pool in pools if i < len(pool)]
        i += 1
    return picked[:limit]


def encode(prompts: list[tuple[str, Prompt]], tokenizer, max_prompt: int) -> list[tuple[str, Prompt, list[int]]]:
    """Each prompt's first turn as ids; one longer than max_prompt tokens keeps its last max_prompt."""
    return [(src, p, encode_prompt(p, tokenizer)[-max_prompt:]) for src, p in prompts]


@torch.inference_mode()
def distil(runner, batch: list[tuple[str, Prompt, list[int]]], layers: tuple[int, ...], max_new_tokens: int,
           eos: list[int]) -> list[Sequence]:
    """The target's greedy answers to a batch of prompts, then each sequence's states and choices."""
    ids = [e for _, _, e in batch]
    result = generate(runner, Proposer(), ids, max_new_tokens=max_new_tokens, sampling=SamplingConfig(),
                      eos_ids=eos)
    return [_read(runner, src, prompt.id, prompt_ids, answer, layers, "target")
            for (src, prompt, prompt_ids), answer in zip(batch, result.output_ids)]


def reference_ids(prompt: Prompt, tokenizer, max_tokens: int) -> list[int]:
    """The data set's reply to the prompt as ids (its first max_tokens; [] when it has none)."""
    if not prompt.reference:
        return []
    return list(tokenizer(prompt.reference, add_special_tokens=False)["input_ids"])[:max_tokens]


@torch.inference_mode()
def teacher_forced(runner, batch: list[tuple[str, Prompt, list[int]]], layers: tuple[int, ...], tokenizer,
                   max_tokens: int) -> list[Sequence]:
    """Each prompt followed by the data set's own reply (at most max_tokens of it), read in one forward: the
    states there and the target's choice after every prefix. Prompts without a reply give nothing."""
    out = []
    for src, prompt, prompt_ids in batch:
        reply = reference_ids(prompt, tokenizer, max_tokens)
        if reply:
            out.append(_read(runner, src, prompt.id, prompt_ids, reply, layers, "data"))
    return out


def _read(runner, src: str, pid: str, prompt_ids: list[int], answer: list[int], layers: tuple[int, ...],
          answered_by: str) -> Sequence:
    """One forward over prompt + answer: the states the head reads and the target's argmax at every position."""
    tokens = torch.tensor(prompt_ids + list(answer), dtype=torch.long)
    taps = Taps(layers)
    cache = runner.new_cache(1, len(tokens) + 1)
    try:
        logits = runner.run(cache, Step(tokens[None].to(runner.device), [0], taps=taps))
    finally:
        runner.release(cache)
    states = taps.states()[0].float().cpu()
    return Sequence(src, pid, tokens, states.to(torch.bfloat16), logits[0].argmax(-1).cpu(), len(prompt_ids),
                    answered_by)


def save_shard(folder: Path, index: int, sequences: list[Sequence]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"shard-{index:05d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save([vars(s) for s in sequences], tmp)
    tmp.replace(path)  # a shard is there whole or not at all


def load_shards(folder: Path) -> list[Sequence]:
    found = []
    for path in sorted(folder.glob("shard-*.pt")):
        found += [Sequence(**d) for d in torch.load(path, weights_only=True)]
    return found


def first_roots(seqs: list[Sequence]) -> torch.Tensor:
    """[B] each sequence's first chain root that decoding drafts from: the prompt's last position (the prefill
    gives the first answer token; the first draft follows it). Roots before it are the prompt's, which a head
    never drafts from: they are neither fitted nor counted."""
    return torch.tensor([max(s.answer_from - 1, 0) for s in seqs])


def pad_batch(seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [B, T], states [B, T, S] (float32), pred [B, T] and lengths [B], padded with zeros."""
    T = max(len(s.tokens) for s in seqs)
    tokens = torch.zeros(len(seqs), T, dtype=torch.long)
    pred = torch.zeros(len(seqs), T, dtype=torch.long)
    states = torch.zeros(len(seqs), T, seqs[0].states.shape[-1])
    for b, s in enumerate(seqs):
        n = len(s.tokens)
        tokens[b, :n], pred[b, :n], states[b, :n] = s.tokens, s.pred, s.states.float()
    return tokens, states, pred, torch.tensor([len(s.tokens) for s in seqs])
