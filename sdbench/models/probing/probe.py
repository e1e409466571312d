"""The fidelity probe: a runner's logits against the library's own forward of the same weights.

sdbench's `lossless` column compares sdbench with sdbench: a runner that computes a different model from the
one the user named passes it. The probe closes that gap before a run measures anything. On one seeded
sequence of `length` tokens (the longest context the run will use, so that sliding windows and rope scaling
that depends on the length are reached) it runs, in the run's dtype, on its device and with its fast path:

- prefill: the runner's prefill of the first P tokens -> logits at position P - 1;
- step: single-token forwards at P and P + 1 over the cached prefix;
- verify: a rejected draft of W tokens at P + 2, then the true W tokens at the same positions (a rewind
  over stale keys, as after a rejection) -> logits at the last W positions;

and compares them with the library's own cached forward called as `generate` calls it in plain decoding: the
prefix in one call, then one token per call (`reference`), on plain weights (`cpufast.library_forward`), its
vocabulary head computed only at the compared positions (`logits_to_keep`). So the verification is held to
what decoding its tokens one by one gives, which is what makes speculative decoding lossless.

A verdict does not change between runs of the same weights, dtype, device, forward path and code: it is kept
(`models/probing/probe_cache.py`) and reused by a run whose context it covers (`--probe auto`, the default; rows
record `probe_reused`), re-measured by `--probe always` and by `sdbench check`.

A gap is measured relative to the logits' scale: max |runner - library| / max(1, max |library|) at a
position. The tolerance is 1e-4 in float32 (exact implementations differ by about 1e-6: SmolLM2-135M at
1024 positions, 1.5e-6 native, 1.3e-6 generic). In bfloat16 (8 significant bits, a rounding up to 2e-3 of a
value) the library disagrees with itself: on the same model and positions its cached, chunked forward (the
generic runner) is 2.3e-2 away from its uncached one, as is the native runner. 1e-1 allows four times that
and still refuses a grossly wrong model (a sliding window not applied: 1.5 on a tiny Mistral; rotary tables
for doubled positions: 0.2 on SmolLM2 in bfloat16, 1.8 on a tiny Llama in float32); subtler errors need
float32 to show (`sdbench check --dtype float32`). float16 keeps 3 more bits (8 times less rounding): 2e-2.

A block copy (MODEL@q8_0) whose products quantise the activations to 8 bits per block of 32 (as llama.cpp's do;
`cpufast.block_activations`) is compared with the library's forward over its de-quantised weights, which keeps the
activations in float32: SmolLM2-135M at 1024 positions differs by 2.5e-2 (Q8_0) and 2.3e-2 (Q4_0), as bfloat16's
own forwards differ, so it is held to bfloat16's 1e-1 (BLOCK_TOLERANCE). With float32 activations it is 1e-4.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from sdbench.forward_step import Step
from sdbench.errors import SdbenchError
from sdbench.models.forward import cpufast
from sdbench.models.forward.generic import GenericRunner, cache_keyword, runner_kind
from sdbench.models.forward.recompute import recompute_threshold
from sdbench.models.loading.variants import split_variant

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-1, torch.float16: 2e-2}
BLOCK_TOLERANCE = 1e-1  # a block copy's forward with 8-bit activations (the module docstring says why)
STEPS = 2  # single-token forwards after the prefill
WIDTH = 5  # tokens in the verification (gamma = 4 drafts and the bonus position)
MIN_LENGTH = 32
REFERENCE_CHUNK = 8192  # the library's prefill runs in one call up to this length, in chunks beyond it
SEED = 20240  # the probe's token sequence, the same for every model
PHASES = ("prefill", "step", "verify")
VARIANT_SKIP = ("a quantised copy (MODEL@int8) picks its activations' scale per forward, so its logits depend on "
                "how many tokens share a forward and no one forward is its reference; it only drafts, where "
                "fidelity moves acceptance, never the output")


@dataclass
class ProbeResult:
    model: str
    runner: str  # "native" | "generic"
    length: int  # positions reached
    dtype: torch.dtype
    gaps: dict = field(default_factory=dict)  # phase -> largest relative gap
    worst: tuple = ("", -1, 0.0, 0.0)  # (phase, position, relative gap, absolute gap) of the largest gap
    error: str = ""  # the runner failed to run the probe at all (one line)
    skipped: str = ""  # why this model was not probed (then it passes, with no gaps)
    fallback: bool = False  # the model's native runner failed the probe and this generic one replaced it
    reused: str = ""  # when the kept verdict reused here was measured (models/probing/probe_cache.py); "": measured now
    activations: str | None = None  # a block copy's on the native runner: "int8" or "float32" (None: float weights)

    @property
    def tolerance(self) -> float:
        if self.activations == "int8":
            return BLOCK_TOLERANCE
        return TOLERANCE.get(self.dtype, TOLERANCE[torch.bfloat16])

    @property
    def gap(self) -> float | None:
        """The largest gap over the phases; None when not probed."""
        if self.skipped:
            return None
        return max(self.gaps.values(), default=float("inf"))

    @property
    def passed(self) -> bool:
        return bool(self.skipped) or (not self.error and self.gap <= self.tolerance)

    def line(self) -> str:
        """Why the model is refused, in one line."""
        where = f"model '{self.model}' on the {self.runner} runner"
        if self.error:
            return f"{where} failed the fidelity probe: {self.error}"
        phase, pos, rel, absolute = self.worst
        dtype = str(self.dtype).removeprefix("torch.") if self.activations != "int8" else "8-bit activations'"
        return (f"{where} does not compute the library's model: at {phase} position {pos} its logits differ from "
                f"the library's forward by {absolute:.3g} ({rel:.2g} of the logits' scale; {dtype} tolerance "
                f"{self.tolerance:g})")


def probe_pair(pair, length: int, native: dict[str, str], console, verdicts=None) -> None:
    """Probe every model runner of a loaded pair once (a draft that is the target shares its probe); a model
    that fails is refused in one line, after a fallback to the generic runner where the run allows one
    (`native`: model name -> what needs it native). Results go to pair.probes; fallbacks replace the runner.
    verdicts: a ProbeCache whose kept verdicts are reused (and new ones kept), or None."""
    vocab = len(pair.tokenizer) if pair.tokenizer is not None else None
    swapped = {}
    for runner in {id(r): r for r in (pair.target, *pair.drafts) if not isinstance(r, str)}.values():
        why = native.get(runner.name)
        used, result, note = probe_runner(runner, length, vocab, console, fallback=not why, verdicts=verdicts)
        if result.skipped:
            note = f"{runner.name} is not probed: {result.skipped}"
        elif result.reused and result.passed:
            note = (f"{runner.name}: the fidelity probe's verdict of {result.reused} is reused (largest gap "
                    f"{result.gap:.2g} over {result.length} positions, {result.runner} runner; --probe always "
                    f"probes again){'; ' + note if note else ''}")
        if note:
            console.print(f"note: {note}", style="yellow", highlight=False, soft_wrap=True)
        if not result.passed:
            raise SdbenchError(result.line() + (f"; {why} needs the native runner" if why else ""))
        swapped[id(runner)] = used
        pair.probes.append(result)
    pair.target = swapped.get(id(pair.target), pair.target)
    pair.drafts = [d if isinstance(d, str) else swapped.get(id(d), d) for d in pair.drafts]


def probe_runner(runner, length: int, vocab: int | None, console, fallback: bool = True, verdicts=None):
    """(the runner to use, its ProbeResult, a one-line note or ''). A native runner that fails is replaced by
    the generic runner over the same model when `fallback` allows it and the generic one passes (the note
    says so); otherwise the failing result comes back for the caller to refuse. verdicts: see probe_pair."""
    if split_variant(runner.name)[1] == "int8":  # a MODEL@random has one reference forward like any model
        return runner, ProbeResult(runner.name, runner_kind(runner), 0, runner.dtype, skipped=VARIANT_SKIP), ""
    result = _shown(runner, length, vocab, console, verdicts)
    if result.passed or result.runner != "native" or not fallback:
        return runner, result, ""
    found = _fallback(runner, length, vocab, console, verdicts)
    if found is None:
        return runner, result, ""
    note = f"{result.line()}; running it on the generic runner (the library's own forward) instead"
    return found[0], found[1], note


def _shown(runner, length: int, vocab: int | None, console, verdicts=None) -> "ProbeResult":
    """The runner's verdict: kept from an earlier probe over at least this context, or measured now (and
    kept)."""
    reach = probe_length(runner.model, length)
    kept = verdicts.get(runner, reach) if verdicts is not None else None
    if kept is not None:
        return ProbeResult(runner.name or runner.model.config.model_type, runner_kind(runner), kept.length,
                           runner.dtype, gaps=kept.gaps, worst=tuple(kept.worst), reused=kept.measured,
                           activations=_activations(runner))
    with console.status(f"probing {runner.name} ({runner_kind(runner)} runner): its logits against the "
                        f"library's forward over {reach} positions"):
        result = probe(runner, length, vocab)
    if verdicts is not None:
        verdicts.put(runner, result)
    return result


def _fallback(runner, length: int, vocab: int | None, console, verdicts=None):
    """(the generic runner, its passing ProbeResult) over the native runner's model, or None."""
    try:
        generic = GenericRunner(runner.model, runner.name)
    except SdbenchError:
        return None
    result = _shown(generic, length, vocab, console, verdicts)
    result.fallback = True
    return (generic, result) if result.passed else None


def _text_config(model):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def probe_length(model, length: int) -> int:
    """The positions a probe asked for `length` reaches: at least MIN_LENGTH, at most the model's positions
    (a dynamic rope, made to scale past them, has no such bound)."""
    config = _text_config(model)
    most = getattr(config, "max_position_embeddings", None) or length
    if _rescaled(config):
        most = max(most, length)
    return max(min(max(length, MIN_LENGTH), most), STEPS + WIDTH + 1)


def _rescaled(config) -> bool:
    """A rope the library rescales per call (`models/forward/rotary.py`)."""
    from sdbench.models.forward.rotary import config_length_dependent  # imports transformers

    return config_length_dependent(config)


def _activations(runner) -> str | None:
    """A block copy's activations on the runner's fast path (`block_activations`), else None."""
    return getattr(runner, "block_activations", lambda: None)()


def probe(runner, length: int, vocab: int | None = None) -> ProbeResult:
    """The runner's logits against the library's forward on `probe_length` positions. vocab: draw tokens
    below it (the tokenizer's size; default the head's)."""
    model = runner.model
    config = _text_config(model)
    length = probe_length(model, length)
    result = ProbeResult(runner.name or config.model_type, runner_kind(runner), length, runner.dtype,
                         activations=_activations(runner))
    vocab = min(vocab or config.vocab_size, config.vocab_size)
    ids = _sequence(length, vocab)
    first = length - STEPS - WIDTH - 1  # the position the prefill's logits are taken at
    try:
        ref = reference(model, ids, first + 1, runner.device)  # [K, V] at positions first..length-1
        ours = _run(runner, ids, first + 1, vocab)
    except Exception as exc:  # noqa: BLE001 - whatever a runner raises on a model it cannot compute
        result.error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        return result
    for (phase, logits), pos in zip(ours, range(first, length)):
        _compare(result, phase, pos, logits, ref[pos - first])
    return result


def _sequence(length: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, vocab, (length,), generator=g)


@torch.inference_mode()
def reference(model, ids: torch.Tensor, prefix: int, device) -> torch.Tensor:
    """The library's logits [K, V] (float32) at positions prefix - 1 .. len(ids) - 1, from its own cached
    forward called as plain decoding (`generate`) calls it: the prefix in one call (in REFERENCE_CHUNK pieces
    beyond that, since one call holds attention scores quadratic in its length, except for a rope rescaled
    per call, whose prompt is one call in `generate`), then one token per call. Plain weights
    (`cpufast.library_forward`: a block model's de-quantised one product at a time); its rotary modules start
    from their loaded state; the head runs only where compared."""
    # transformers (and rotary, which imports it): slow to import, and only the reference forward needs them
    from transformers import DynamicCache

    from sdbench.models.forward.rotary import reset_library_rotary

    keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
    config = _text_config(model)
    chunk = prefix if _rescaled(config) else REFERENCE_CHUNK
    bounds = [*range(0, prefix, chunk), *range(prefix, len(ids) + 1)]
    compared = {prefix - 1, *range(prefix, len(ids))}
    limit = recompute_threshold(config, _rescaled(config))  # Phi-3: generate recomputes when passing it
    out = []
    with cpufast.library_forward(model):
        reset_library_rotary(model)
        cache = DynamicCache(config=model.config)
        for c0, c1 in zip(bounds, bounds[1:]):
            last = len(compared.intersection(range(c0, c1)))
            if limit is not None and c0 == limit >= prefix:  # the step at O: the whole sequence again
                cache, c0 = DynamicCache(config=model.config), 0
            logits = _library(model, ids[None, c0:c1].to(device), max(last, 1), keeps, cache)
            out.extend(logits[logits.shape[0] - last:])
        reset_library_rotary(model)
    return torch.stack(out)


def _library(model, ids: torch.Tensor, last: int, keeps: bool, cache) -> torch.Tensor:
    kwargs = {"logits_to_keep": last} if keeps else {}
    out = model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache}, **kwargs)
    return out.logits[0, -last:].float()


def _run(runner, ids: torch.Tensor, prefix: int, vocab: int) -> list[tuple[str, torch.Tensor]]:
    """(phase, logits [V]) at every position from prefix - 1 to the end of ids, through the runner (whose
    forwards run in inference mode themselves). The cache is made outside inference mode: a static runner
    takes it back into its pool, and a later generation prepares it outside that mode."""
    length = len(ids)
    cache = runner.new_cache(1, length)
    try:
        out = [("prefill", runner.prefill(cache, [ids[:prefix].tolist()])[0])]
        for p in range(prefix, prefix + STEPS):
            out.append(("step", runner.run(cache, Step(ids[None, p : p + 1], [p]))[0, 0]))
        at = prefix + STEPS
        rejected = (ids[None, at:] + 1) % vocab  # other tokens first, then the rewind to the true ones
        runner.run(cache, Step(rejected, [at]))
        out += [("verify", row) for row in runner.run(cache, Step(ids[None, at:], [at]))[0]]
    finally:
        runner.release(cache)
    return out


def _compare(result: ProbeResult, phase: str, pos: int, ours: torch.Tensor, ref: torch.Tensor) -> None:
    ours, ref = ours.float().to(ref.device), ref.float()
    diff = (ours - ref).abs()
    diff[ours == ref] = 0.0  # equal infinities (a masked vocabulary entry) are no gap
    absolute = float(diff.max()) if bool(torch.isfinite(diff).all()) else float("inf")
    finite = ref[torch.isfinite(ref)]
    scale = max(1.0, float(finite.abs().max()) if finite.numel() else 1.0)
    rel = absolute / scale
    if rel != rel:  # NaN: treat as the largest gap
        rel = absolute = float("inf")
    result.gaps[phase] = max(result.gaps.get(phase, 0.0), rel)
    if rel > result.worst[2] or result.worst[1] < 0:
        result.worst = (phase, pos, rel, absolute)
