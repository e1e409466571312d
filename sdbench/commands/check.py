"""`sdbench check MODEL [--draft MODEL ...]`: can these models be benchmarked faithfully? One table, and a
non-zero exit on any failure, so that a CI job can run it before a benchmark.

Per model: the runner that serves it (native, generic, or generic after the native one failed), the fidelity
probe's largest gap per phase (`models/probing/probe.py`), the draft's tokenizer against the target's, the weights'
memory, and a short greedy run: the target's plain decoding against the library's own `generate`, and each
draft's speculative decoding against the target's plain decoding. A trained head (`--head`) gets a row too: the
target's hidden states it reads, through the runner, against the library's `output_hidden_states` (its gaps),
and speculative decoding with it against the target's plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table

from sdbench.config import SamplingConfig
from sdbench.drafting.ngram import DRAFT_NAME
from sdbench.engine.loop import generate
from sdbench.errors import CheckFailed, SdbenchError
from sdbench.models.loading.loader import check_fit, check_same_tokenizer, eos_token_ids, load_tokenizer
from sdbench.models.loading.names import with_weights
from sdbench.models.loading.pair import device_and_dtype, load_models
from sdbench.models.probing.probe import PHASES, TOLERANCE, probe_runner
from sdbench.models.probing.probe_cache import ProbeCache
from sdbench.models.loading.variants import split_variant
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.strategies.draft import DraftModel
from sdbench.strategies.ngram import NGram

PROMPT_TOKENS = 24
GAMMA = 4
SEED = 1


@dataclass
class Checked:
    """One model's row of the table."""

    model: str
    role: str  # "target" | "draft" | "head"
    runner: str = "–"
    gaps: dict = field(default_factory=dict)  # phase -> the probe's largest relative gap
    tolerance: float | None = None
    tokenizer: str = "–"  # the target's: "same", "differs", or "same model" (the target drafting for itself)
    weights: int | None = None  # bytes
    greedy: str = "–"  # the short lossless run: "✓", "✗" or "–" (not run)
    problems: list[str] = field(default_factory=list)  # one line each
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def run_check(target: str, drafts: list[str], device: str, dtype: str, fast: bool, context: int, tokens: int,
              console: Console, heads: list[str] = ()) -> None:
    """Check the target, every draft and every trained head; print the table; raise CheckFailed (exit 1) on any
    failure."""
    if context < 1 or tokens < 1:
        raise SdbenchError("check: --context and --tokens must be at least 1")
    dev, dt = device_and_dtype(device, dtype)
    cpu = dev.type == "cpu"
    target = with_weights(target, dtype, cpu)
    drafts = [d if d == DRAFT_NAME else with_weights(d, dtype, cpu) for d in drafts]
    check_fit([n for n in (target, *drafts) if n != DRAFT_NAME], dev, dt)
    rows = [Checked(target, "target")]
    got, runner = _model(rows[0], target, dev, dt, fast, context, console)
    loaded = got.loaded if got is not None else None
    prompt = None
    if runner is not None:
        prompt = _prompt(loaded.tokenizer, runner)
        with console.status(f"greedy decoding of {target}: sdbench against the library's generate"):
            plain = _greedy_vs_generate(rows[0], loaded, runner, prompt, tokens)
    for name in drafts:
        row = Checked(name, "draft")
        rows.append(row)
        if name == target:  # the target drafting for itself: the same runner, already checked
            row.runner, row.gaps, row.tolerance = rows[0].runner, rows[0].gaps, rows[0].tolerance
            row.tokenizer = "same model"
            draft = runner
        else:
            draft = _draft(row, name, target, got, dev, dt, fast, context, console)
        if draft is not None and runner is not None:
            with console.status(f"speculative decoding with {name} against plain decoding"):
                _lossless(row, runner, draft, prompt, tokens, plain, loaded)
    for name in heads:
        rows.append(Checked(name, "head"))
        if runner is not None:  # a head is read against the target's runner: none when the target failed
            with console.status(f"the hidden states {name} reads, and speculative decoding with it"):
                _head(rows[-1], runner, loaded, prompt, tokens, plain)
    console.print(_table(rows, dev, dtype, context, tokens))
    for row in rows:
        for line in row.notes:
            console.print(f"note: {line}", style="yellow", highlight=False, soft_wrap=True)
        for line in row.problems:
            console.print(f"[red]✗[/red] {line}", highlight=False, soft_wrap=True)
    problems = [line for row in rows for line in row.problems]
    if problems:
        more = f" (and {len(problems) - 1} more: the ✗ lines above)" if len(problems) > 1 else ""
        raise CheckFailed(f"check failed: {problems[0]}{more}")


def _model(row: Checked, name: str, dev, dt, fast: bool, context: int, console, tokenizer=None, given=None):
    """(pair.Loaded, runner) with row filled in; (loaded or None, None) on a failure recorded in the row. The
    variant MODEL@int8 is made of the target's weights (given: {target: its Loaded})."""
    try:
        names = [*given, name] if given else [name]
        got = load_models(names, dev, dt, console, fast=fast, fit=False, given=given)[name]  # fits checked already
    except SdbenchError as e:
        row.problems.append(str(e))
        return None, None
    row.weights = got.weight_bytes
    return got, _probed(row, got.runner, context, tokenizer or got.loaded.tokenizer, console)


def _probed(row: Checked, runner, context: int, tokenizer, console):
    """The runner to use after the probe (a generic one where the native one failed), or None."""
    # measured afresh, and kept for the runs that follow (they reuse it within this context)
    runner, result, note = probe_runner(runner, context, len(tokenizer), console, verdicts=ProbeCache("always"))
    row.runner = result.runner + (" (fallback)" if result.fallback else "")
    row.gaps, row.tolerance = dict(result.gaps), result.tolerance
    if note:
        row.notes.append(note)
    if result.skipped:
        row.notes.append(f"{row.model} is not probed: {result.skipped}")
    if not result.passed:
        row.problems.append(result.line())
        return None
    return runner


def _draft(row: Checked, name: str, target: str, got, dev, dt, fast: bool, context: int, console):
    """The draft's runner (None for a failure recorded in the row, or for prompt lookup, which needs none).
    got: the target as loaded (pair.Loaded), None where it failed."""
    loaded = got.loaded if got is not None else None
    if name == DRAFT_NAME:
        row.runner, row.tokenizer = "none (prompt lookup)", "–"
        return name
    try:
        base = split_variant(name)[0]
        if loaded is not None:
            check_same_tokenizer(loaded.tokenizer, load_tokenizer(base), target, base)
            row.tokenizer = "same"
        if split_variant(name)[1] and loaded is None:
            raise SdbenchError(f"model '{name}': a variant is made from loaded weights, and '{target}' did not load")
    except SdbenchError as e:
        row.tokenizer = "differs" if "share a tokenizer" in str(e) else row.tokenizer
        row.problems.append(str(e))
        return None
    given = {target: got} if split_variant(name)[1] else None
    return _model(row, name, dev, dt, fast, context, console, loaded.tokenizer if loaded else None, given)[1]


def _prompt(tokenizer, runner) -> list[int]:
    vocab = min(len(tokenizer), runner.vocab_size)
    return torch.randint(0, vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(SEED)).tolist()


def _greedy_vs_generate(row: Checked, loaded, runner, prompt: list[int], tokens: int) -> list[int]:
    """sdbench's plain greedy tokens, after comparing them with the library's own generate."""
    eos = eos_token_ids(loaded)
    ours = generate(runner, Autoregressive(), [prompt], max_new_tokens=tokens, sampling=SamplingConfig(),
                    eos_ids=eos).output_ids[0]
    ids = torch.tensor([prompt], device=runner.device)
    with runner.library_forward(), torch.inference_mode():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                                    max_new_tokens=tokens, eos_token_id=eos or None,
                                    pad_token_id=eos[0] if eos else 0, repetition_penalty=1.0,
                                    no_repeat_ngram_size=0)
    theirs = out[0, len(prompt):].tolist()
    row.greedy = "✓" if ours == theirs else "✗"
    if ours != theirs:
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        if runner.block_activations() == "int8":  # generate keeps float32 activations: not its reference
            row.greedy = "≈"
            row.notes.append(f"{row.model} quantises its activations to 8 bits (as llama.cpp does), generate over its "
                             f"de-quantised weights does not: their greedy tokens part at token {first}")
            return ours
        row.problems.append(f"model '{row.model}': sdbench's greedy tokens differ from the library's generate "
                            f"from token {first} on")
    return ours


def _lossless(row: Checked, target, draft, prompt: list[int], tokens: int, plain: list[int], loaded) -> None:
    """Greedy speculative decoding with the draft must give the target's plain tokens."""
    proposer = NGram(GAMMA) if draft == DRAFT_NAME else DraftModel(draft, GAMMA)
    out = generate(target, proposer, [prompt], max_new_tokens=tokens, sampling=SamplingConfig(),
                   eos_ids=eos_token_ids(loaded)).output_ids[0]
    row.greedy = "✓" if out == plain else "✗"
    if out != plain:
        row.problems.append(f"model '{row.model}': speculative decoding with it as the draft changed the target's "
                            "greedy output")


def _head(row: Checked, runner, loaded, prompt: list[int], tokens: int, plain: list[int]) -> None:
    """A trained head: it loads and fits the target; the runner's states at its layers equal the library's;
    greedy speculative decoding with it gives the target's plain tokens."""
    from sdbench.models.heads.load import load_head  # reads weights: only a check with --head
    from sdbench.models.heads.probe import tap_gaps
    from sdbench.strategies.spec import head_strategy

    try:
        head = load_head(row.model, runner)
        declared = head_strategy(head.kind)
        proposer = declared.proposer_for(head, runner, min(GAMMA, declared.max_gamma((row.model,))))
    except SdbenchError as e:
        row.problems.append(str(e))
        return
    row.runner, row.tokenizer = f"{head.kind} head", "the target's"
    row.weights = sum(w.numel() * w.element_size() for w in head.weights.values())
    row.gaps = tap_gaps(runner, loaded.model, head.layers, prompt)
    row.tolerance = TOLERANCE.get(runner.dtype, TOLERANCE[torch.bfloat16])  # the fidelity probe's, for states
    phase = max(row.gaps, key=row.gaps.get)
    if row.gaps[phase] > row.tolerance:
        row.problems.append(f"--head {row.model}: the target's hidden states at layers {head.layers} differ from the "
                            f"library's output_hidden_states by {row.gaps[phase]:.1e} at the {phase} "
                            f"(tolerance {row.tolerance:g})")
    out = generate(runner, proposer, [prompt], max_new_tokens=tokens, sampling=SamplingConfig(),
                   eos_ids=eos_token_ids(loaded)).output_ids[0]
    row.greedy = "✓" if out == plain else "✗"
    if out != plain:
        row.problems.append(f"--head {row.model}: speculative decoding with it changed the target's greedy output")


def _table(rows: list[Checked], dev, dtype: str, context: int, tokens: int) -> Table:
    table = Table(title=f"sdbench check · {dev} {dtype} · probe over {context} positions · {tokens} greedy tokens")
    for col in ("model", "role", "runner", *(f"{p} gap" for p in PHASES), "tokenizer", "weights", "greedy", ""):
        table.add_column(col, justify="right" if col.endswith("gap") or col == "weights" else "left",
                         no_wrap=col in ("model", "runner"))
    for r in rows:
        gaps = [f"{r.gaps[p]:.1e}" if p in r.gaps else "–" for p in PHASES]
        weights = f"{r.weights / 2**20:,.1f} MiB" if r.weights is not None else "–"
        table.add_row(r.model, r.role, r.runner, *gaps, r.tokenizer, weights, r.greedy,
                      "[green]ok[/green]" if r.ok else "[red]failed[/red]")
    tol = next((r.tolerance for r in rows if r.tolerance is not None), None)
    table.caption = ("gap: the largest |runner - library| / max(1, max |logit|) over the probed positions"
                     + (f"; tolerance {tol:g}" if tol is not None else "")
                     + "; tokenizer: a draft's against the target's; greedy: the target against the library's "
                     "generate, a draft against the target's plain decoding"
                     + ("; a head's gaps: the target's hidden states at its layers against the library's "
                        "output_hidden_states, and greedy: decoding with it against plain"
                        if any(r.role == "head" for r in rows) else ""))
    return table
