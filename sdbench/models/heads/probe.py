"""The target's hidden states a head reads, through the runner, against the library's own `output_hidden_states`
(what `sdbench check --head` reports): a head trained on the library's states drafts well only if the runner
hands it the same ones.

The runner keeps them on the paths a generation takes: the prefill, a one-token step and a multi-token
verification; each is compared with the library's forward over the whole sequence, at the head's layer ids
(engine/hidden.py: i < L the input of layer i, FINAL the final-norm output)."""

from __future__ import annotations

import torch

from sdbench.forward_step import Step
from sdbench.engine.hidden import FINAL, Taps


def tap_gaps(runner, model, layers: tuple[int, ...], prompt: list[int], verify: int = 4) -> dict[str, float]:
    """Phase ("prefill", "step", "verify") -> the largest |runner - library| / max(1, max |library|) of the states
    at `layers`. model: the library's model behind `runner`; verify: tokens in the verification."""
    ids = list(prompt) + [prompt[i % len(prompt)] for i in range(1 + verify)]  # any valid ids past the prompt
    n = len(prompt)
    cache = runner.new_cache(1, len(ids) + 1)
    kept = {}
    try:
        kept["prefill"] = Taps(layers)
        runner.prefill(cache, [prompt], taps=kept["prefill"])
        for phase, at, count in (("step", n, 1), ("verify", n + 1, verify)):
            kept[phase] = Taps(layers)
            tokens = torch.tensor([ids[at: at + count]], device=runner.device)
            runner.run(cache, Step(tokens, [at], taps=kept[phase]))
    finally:
        runner.release(cache)
    with runner.library_forward(), torch.inference_mode():
        hs = model(torch.tensor([ids], device=runner.device), output_hidden_states=True).hidden_states
    ref = torch.cat([hs[-1 if i == FINAL else i][0] for i in layers], -1).float().cpu()  # [T, k*H]
    spans = {"prefill": (0, n), "step": (n, n + 1), "verify": (n + 1, n + 1 + verify)}
    gaps = {}
    for phase, taps in kept.items():
        lo, hi = spans[phase]
        ours, theirs = taps.states()[0, : hi - lo].float().cpu(), ref[lo:hi]
        gaps[phase] = float((ours - theirs).abs().max() / max(1.0, float(theirs.abs().max())))
    return gaps
