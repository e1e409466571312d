"""Phi-3's switch from its short to its long rope factors, computed as its `generate` computes it.

Phi-3 (and PhiMoE, Phi-4-multimodal) use longrope: the short factors while a sequence is within
`original_max_position_embeddings` (O), the long ones past it. Their `generate` does more than rotate new
tokens with the long factors (models/forward/rotary.py): when a sequence first reaches O + 1 tokens with a cache of
at most O, it drops the cache and computes the whole sequence again in one forward (their
`prepare_inputs_for_generation`), so every key and value of every layer is then the long-rope one. Plain
decoding of such a model is therefore two models: the logits at a position q < O come from the sequence with
the short factors, those at q >= O from the sequence with the long ones.

The runner does the same with the tokens its cache keeps (`KVCache.ids`) and a per-row flag (`crossed`: the
row's keys are the long-rope ones): a forward whose queries lie on both sides of O is split there; before the
part at q >= O a row that has not crossed computes positions [0, start) again with the long factors, and
before a part at q < O a row that had crossed (a rejected verification rewound it below O) computes them
again with the short ones. A prompt longer than O is long-rope from the start and never switches. Rows that
switch run one by one (eagerly); every other forward is untouched. The generic runner (the library's forward)
does the same with its own calls (`models/forward/generic.py`): the sequence up to the first position past O in one
call, as `generate` makes it.
"""

from __future__ import annotations

import torch

from sdbench.forward_step import Step

RECOMPUTING = ("phi3", "phimoe", "phi4_multimodal")  # model types whose generate recomputes at O + 1 tokens


def recompute_threshold(config, rescaled: bool) -> int | None:
    """O for a model whose generate recomputes its cache when a sequence passes O and whose rope is rescaled
    there (`rescaled`: models/forward/rotary.py), else None."""
    limit = getattr(config, "original_max_position_embeddings", None)
    if config.model_type not in RECOMPUTING or limit is None or not rescaled:
        return None
    return int(limit)


def scaling_floor(cache, limit: int | None) -> torch.Tensor | None:
    """Each row's floor of the rope's scaling length [B] (host): its prompt length, raised past O for a
    row whose keys are the long-rope ones."""
    floor = getattr(cache, "prompt_len", None)
    crossed = getattr(cache, "crossed", None)
    if floor is None or limit is None or crossed is None or not bool(crossed.any()):
        return floor
    return torch.where(crossed, floor.clamp(min=limit + 1), floor)


def switches(cache, limit: int | None, start: list[int], width: int) -> bool:
    """Whether some row of this forward must split it at O or compute its keys again first."""
    if limit is None or getattr(cache, "ids", None) is None:
        return False
    for b, s in enumerate(start):
        if int(cache.prompt_len[b]) > limit:
            continue
        crossed = bool(cache.crossed[b])
        if (s < limit and (crossed or s + width > limit)) or (s + width > limit and not crossed):
            return True
    return False


def forward_switching(runner, cache, step, limit: int) -> torch.Tensor:
    """The runner's logits of a step (`forward_step.py`; as `ModelRunner.run` returns them) where some row
    switches: every row on its own, each split at O; the states its taps name kept row by row, then joined."""
    out, kept = [], []
    for b in range(step.batch):
        row = step.row(b, None if step.taps is None else type(step.taps)(step.taps.layers))
        h = _row_hidden(runner, cache.row(b), row, limit)
        if row.taps is not None:
            kept.append(row.taps.states())
        out.append(runner.logits(row.pick(h)))
    if step.taps is not None:
        step.taps.put_joined(torch.cat(kept))
    return torch.cat(out)


def _row_hidden(runner, view, step, limit: int) -> torch.Tensor:
    """Hidden states [1, T, H] of one row's step, the part before O with the short-rope keys, the part from O
    on with the long-rope ones."""
    start, width = step.start[0], step.width
    if int(view.prompt_len[0]) > limit:
        return runner.hidden(view, step)
    cut = min(max(limit - start, 0), width)
    parts = []
    if cut:
        if bool(view.crossed[0]):
            _recompute(runner, view, start, crossed=False)
        parts.append(runner.hidden(view, step.part(0, cut, [start], step.taps)))
    if cut < width:
        if not bool(view.crossed[0]):
            _recompute(runner, view, start + cut, crossed=True)
        parts.append(runner.hidden(view, step.part(cut, width, [start + cut], step.taps)))
    return torch.cat(parts, 1)


def _recompute(runner, view, upto: int, crossed: bool) -> None:
    """Positions [0, upto) of a row computed again from its kept tokens, with the long-rope keys (crossed)
    or the short ones, in prefill-sized pieces."""
    view.crossed[0] = crossed
    ids = view.ids[:, :upto].clone()  # the forward writes the same tokens back there
    chunk = max(1, runner.prefill_tokens)
    for c0 in range(0, upto, chunk):
        runner.hidden(view, Step(ids[:, c0 : c0 + chunk], [c0]))
