"""`sdbench bench`: sdbench's decoding against transformers in one process, on the same prompts.

Peers are measured back to back with the same greedy settings and token budget; every system's tokens
are counted from the ids it returns, and outputs are compared token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from sdbench.config import SamplingConfig
from sdbench.decode import generate, needed_capacity
from sdbench.metrics import now, rate
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.ngram import NGram


@dataclass
class Measured:
    system: str
    tokens: int
    seconds: float
    outputs: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return rate(self.tokens, self.seconds)


def _measure(systems: list, prompts: list[list[int]], repeats: int, device, status) -> list[Measured]:
    """Each prompt through every system in turn, `repeats` times: drift in the machine's speed then falls
    on all systems alike instead of on whichever ran last."""
    results = [Measured(name, 0, 0.0, []) for name, _ in systems]
    for name, fn in systems:
        fn(prompts[0], 4)  # warm-up, not counted
    for r in range(repeats):
        for i, p in enumerate(prompts):
            status.update(f"measuring: repeat {r + 1}/{repeats}, prompt {i + 1}/{len(prompts)}")
            for m, (_, fn) in zip(results, systems):
                t0 = now(device)
                out = fn(p, None)
                m.seconds += now(device) - t0
                m.tokens += len(out)
                if r == 0:
                    m.outputs.append(out)
    return results


def _hf(model, max_new: int, eos: list[int], **kwargs):
    def fn(prompt: list[int], budget: int | None) -> list[int]:
        ids = torch.tensor([prompt], device=model.device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=budget or max_new, eos_token_id=eos, pad_token_id=eos[0],
                                 **kwargs)
        return out[0, len(prompt):].tolist()
    return fn


def _ours(runner, proposer_factory, max_new: int, eos: list[int], capacity: int):
    """capacity: one KV length for every prompt, so that a static-shape (CUDA-graph) runner captures its
    graphs during the warm-up and replays them for every measured prompt."""
    def fn(prompt: list[int], budget: int | None) -> list[int]:
        res = generate(runner, proposer_factory(), [prompt], max_new_tokens=budget or max_new,
                       sampling=SamplingConfig(), eos_ids=eos, capacity=capacity)
        return res.output_ids[0]
    return fn


def memory_bandwidth(device: torch.device, mib: int = 512) -> float:
    """Bytes per second for streaming reads of a large buffer (best of a few passes)."""
    x = torch.ones(mib * 1024 * 1024 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(5):
        t0 = now(device)
        x.sum()
        best = min(best, now(device) - t0)
    return x.numel() * 4 / best


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def run_peers(target: str, draft: str, dataset: str, limit: int, max_new: int, gamma: int, device: str,
              dtype: str, seed: int, console: Console, repeats: int = 2) -> list[Measured]:
    from sdbench.benchmark import resolve_device, resolve_dtype
    from sdbench.models.loader import check_same_tokenizer, eos_token_ids, load_model
    from sdbench.models.runner import ModelRunner
    from sdbench.tasks import encode_prompt, load_prompts

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    with console.status("loading models"):
        tgt = load_model(target, dev, dt)
        drf = tgt if draft == target else load_model(draft, dev, dt)
    if drf is not tgt:
        check_same_tokenizer(tgt.tokenizer, drf.tokenizer, target, draft)
    eos = eos_token_ids(tgt)
    prompts = [encode_prompt(p, tgt.tokenizer) for p in load_prompts(dataset, limit=limit, seed=seed)]
    plain = ModelRunner(tgt.model, target)
    runner = ModelRunner(tgt.model, target, fast=True)
    d_runner = runner if drf is tgt else ModelRunner(drf.model, draft, fast=True)
    fast = (" (CUDA graphs)" if runner.graphs else " (fast)") if runner.fast else ""
    room = needed_capacity(prompts, max_new, gamma)  # the most any system here looks ahead is gamma
    systems = [
        ("transformers generate", _hf(tgt.model, max_new, eos)),
        ("sdbench autoregressive (no fast path)", _ours(plain, Autoregressive, max_new, eos, room)),
        (f"sdbench autoregressive{fast}", _ours(runner, Autoregressive, max_new, eos, room)),
        (f"transformers assisted (γ={gamma})",
         _hf(tgt.model, max_new, eos, assistant_model=drf.model, num_assistant_tokens=gamma,
             num_assistant_tokens_schedule="constant")),
        (f"sdbench draft (γ={gamma}){fast}",
         _ours(runner, lambda: DraftModel(d_runner, gamma), max_new, eos, room)),
        (f"transformers prompt lookup (γ={gamma})", _hf(tgt.model, max_new, eos, prompt_lookup_num_tokens=gamma)),
        (f"sdbench ngram (γ={gamma}){fast}", _ours(runner, lambda: NGram(gamma), max_new, eos, room)),
    ]
    with console.status("measuring") as status:
        results = _measure(systems, prompts, repeats, dev, status)
    roofline = memory_bandwidth(dev) / weight_bytes(tgt.model)
    console.print(_table(results, roofline, f"{target} / draft {draft}, {dataset} x{limit} x{repeats} repeats, "
                                            f"{max_new} new tokens, greedy, {dev} {dtype}, "
                                            f"{torch.get_num_threads()} threads"))
    return results


def _table(results: list[Measured], roofline: float, title: str) -> Table:
    table = Table(title=title)
    for col in ("system", "tokens", "tokens/s", "vs peer", "same output as generate", "of roofline"):
        table.add_column(col, justify="right" if col != "system" else "left")
    ref = results[0].outputs
    peer = None
    for m in results:
        if m.system.startswith("transformers"):
            peer = m  # each sdbench row is compared with the transformers row above it
        ratio = "" if m is peer else f"{m.tokens_per_s / peer.tokens_per_s:.2f}x"
        table.add_row(m.system, str(m.tokens), f"{m.tokens_per_s:.1f}", ratio,
                      "yes" if m.outputs == ref else "no", f"{m.tokens_per_s / roofline:.0%}")
    plain = next((m for m in results if "no fast path" in m.system), None)
    fast = next((m for m in results if m is not plain and m.system.startswith("sdbench autoregressive")), None)
    table.caption = f"roofline (weights read once per token at measured bandwidth): {roofline:.1f} tokens/s"
    if plain and fast and plain.tokens_per_s:
        table.caption += f"; fast path / no fast path (autoregressive): {fast.tokens_per_s / plain.tokens_per_s:.2f}x"
    return table
