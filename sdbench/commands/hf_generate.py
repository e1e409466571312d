"""transformers' `generate` in its fastest configuration that runs here, for `bench` to measure against.

Tried in turn on the first prompt, each after its own warm-up (where compiling happens): the library's default
dynamic cache; a static cache (pre-allocated, attention over its full length) with compiling off; and a static
cache with the forward compiled by torch.compile (the library compiles by itself on a GPU; on a CPU it is asked
to). The fastest that ran is measured; what failed is said with its reason.

A static cache is sized once for the longest call of the whole measurement (`room`, the same KV length sdbench's
own systems allocate): sized per call, each new prompt length or budget would make a new cache and, compiled, a
new compilation inside the measured time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from sdbench.engine.clock import now
from sdbench.engine.formulas import rate
from sdbench.errors import SdbenchError
from sdbench.models.loading.shapes import quiet_library

CONFIGS = ("dynamic", "static", "compiled")
MODES = ("fastest", *CONFIGS)
PICK_TOKENS = 16  # new tokens each configuration decodes when picking
_LABELS = {"dynamic": "dynamic cache", "static": "static cache", "compiled": "static cache, torch.compile"}


@dataclass
class Picked:
    name: str  # one of CONFIGS
    rates: dict = field(default_factory=dict)  # config -> tokens/s while picking (empty: named by --generate)
    failed: dict = field(default_factory=dict)  # config -> the first line of why it did not run

    @property
    def label(self) -> str:
        return _LABELS[self.name]

    def line(self) -> str:
        """What was used and why, in one line."""
        if not self.rates:
            return f"transformers generate: {self.label}, as --generate asked"
        tried = ", ".join(f"{_LABELS[n]} {r:.2f}" for n, r in self.rates.items())
        why = f"transformers generate: {self.label}, the fastest of {tried} tokens/s over {PICK_TOKENS} tokens"
        return why + "".join(f"; {_LABELS[n]} did not run: {e}" for n, e in self.failed.items())


def kwargs_for(name: str, device: torch.device, room: int | None = None) -> dict:
    """generate()'s keyword arguments for one configuration; room: the static cache's length for every call
    (None: each call's own prompt and budget)."""
    if name == "dynamic":
        return {}
    static = {"cache_implementation": "static"} | ({} if room is None else {"max_cache_len": room})
    if name == "static":
        return static | {"disable_compile": True}
    from transformers import CompileConfig  # transformers: slow to import, and only a compiled generate needs it

    config = CompileConfig()
    if device.type != "cuda":
        config._compile_all_devices = True  # the library compiles on its own only on accelerators
    return static | {"compile_config": config}


def pick(model, prompt: list[int], eos: list[int], mode: str, device: torch.device, room: int | None = None) -> Picked:
    """The configuration `mode` names, or with "fastest" the fastest of CONFIGS that runs on `prompt` (room: as
    in kwargs_for)."""
    if mode not in MODES:
        raise SdbenchError(f"--generate {mode}: use one of {', '.join(MODES)}")
    if mode != "fastest":
        return Picked(mode)
    picked = Picked("dynamic")
    for name in CONFIGS:
        try:
            run = generator(model, eos, kwargs_for(name, device, room))
            run(prompt, PICK_TOKENS)  # warm-up: allocations, compiling
            t0 = now(device)
            tokens = len(run(prompt, PICK_TOKENS))
            picked.rates[name] = rate(tokens, now(device) - t0)
        except Exception as err:  # noqa: BLE001 (a compiler fails in many ways; each is a reason to say, not a crash)
            text = str(err).strip().splitlines()
            picked.failed[name] = f"{type(err).__name__}: {text[0][:160]}" if text else type(err).__name__
    if not picked.rates:
        raise SdbenchError(f"transformers generate did not run in any configuration: {picked.failed['dynamic']}")
    picked.name = max(picked.rates, key=picked.rates.get)
    return picked


def generator(model, eos: list[int], kwargs: dict):
    """fn(prompt ids, new tokens) -> the new ids, greedy, through model.generate with `kwargs`."""
    def fn(prompt: list[int], max_new: int) -> list[int]:
        ids = torch.tensor([prompt], device=model.device)
        with torch.inference_mode(), quiet_library():  # its assisted calls warn about how it calls itself
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                                 eos_token_id=eos, pad_token_id=eos[0], **kwargs)
        return out[0, len(prompt):].tolist()
    return fn


class _Stamps:
    """A streamer for transformers' generate: when each batch of tokens it puts reached the host (tokens come to a
    streamer as CPU tensors, so on a GPU after the device finished them). generate puts the prompt first."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def after_first(self) -> float:
        """Seconds from the first new tokens put to the last (NaN before any)."""
        new = self.times[1:]
        return new[-1] - new[0] if new else math.nan


@dataclass
class TransformersSystem:
    """fn(prompt ids, budget or None for max_new) -> the new ids, through transformers' greedy generate with
    `kwargs`. after_first: seconds its last call ran after its first new token (its streamer's stamps); decoding:
    (strategy, drafter), as sdbench names the same decoding."""

    model: object
    max_new: int
    eos: list[int]
    kwargs: dict = field(default_factory=dict)
    decoding: tuple[str, str | None] = ("autoregressive", None)
    after_first: float = field(default=math.nan, init=False)

    def __post_init__(self) -> None:
        self._stamps = _Stamps()
        self._run = generator(self.model, self.eos, {**self.kwargs, "streamer": self._stamps})

    def __call__(self, prompt: list[int], budget: int | None) -> list[int]:
        self._stamps.times.clear()
        out = self._run(prompt, budget or self.max_new)
        self.after_first = self._stamps.after_first()
        return out
