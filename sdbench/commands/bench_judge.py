"""bench's outputs held to what they must equal, by the one judge (`commands/divergence.py`), after the measurement and
before anything is printed, so that the table, the lines under it and bench.parquet all say it:

- sdbench's systems on the fast path are held to sdbench's fast plain decoding (the same weights, the same runner):
  exactly, with no tolerance, where both ran every step width-invariant (a row's logits the bits of its token
  decoded alone); else up to a tie in the path's rounding;
- sdbench's fast plain decoding, its system without the fast path and its generic runner are held to transformers'
  generate, up to a tie (the library's products are not sdbench's); the fast plain decoding of a block copy with
  8-bit activations is another arithmetic than the library's float one, so only its agreement is said, as an
  engine's is;
- an engine's rows are judged against generate for ties in its own arithmetic (`divergence.engine_rounding`) and
  said, never failed: an engine is not sdbench's to hold.

A real divergence fails bench (exit 1) once its tables and bench.parquet are out, naming system, prompt and token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sdbench.commands.bench_table import OutputDiffers, SystemMeasurement, fast_row
from sdbench.commands.divergence import engine_rounding, first_difference, judge

PLAIN_FAST = "sdbench's fast plain decoding"
GENERATE = "transformers generate"


@dataclass(frozen=True)
class Parted:
    """Where a system's output first left the one it is held to, on one prompt, and the judge's verdict there."""

    prompt: int  # 0-based
    token: int  # 0-based new token
    verdict: str  # "tie" | "real"
    gap: float  # the target's logit gap there (NaN: one stopped early)
    ours: list[int]
    theirs: list[int]

    def said(self) -> str:
        where = f"prompt {self.prompt + 1} (first at new token {self.token + 1}: {self.ours} vs {self.theirs})"
        gap = "" if math.isnan(self.gap) else f", logit gap {self.gap:.3g}"
        return f"{where}: {'a tie' if self.verdict == 'tie' else 'a real divergence'}{gap}"


@dataclass
class Held:
    """One system's outputs against what they are held to."""

    system: str
    against: str  # PLAIN_FAST or GENERATE
    exact: bool  # both sides' steps width-invariant: held bit for bit, no tie allowed
    failing: bool = True  # a real divergence fails bench (False: an engine's, or 8-bit activations against generate)
    parted: list[Parted] = field(default_factory=list)

    @property
    def real(self) -> list[Parted]:
        return [p for p in self.parted if p.verdict == "real"]

    @property
    def ties(self) -> int:
        return sum(p.verdict == "tie" for p in self.parted)

    def cell(self, prompts: int) -> str:
        """The table's "same output" cell: "yes, exact", "yes", "yes, 1 tie", "NO (2/20 prompts)"; a system held
        without failing (an engine, 8-bit activations against generate), prompts identical: "18/20", "17/20, 1 tie"."""
        ties = f", {self.ties} tie{'s' if self.ties > 1 else ''}" if self.ties else ""
        if not self.failing:
            return f"{prompts - len(self.parted)}/{prompts}{ties}"
        if self.real:
            return f"NO ({len(self.real)}/{prompts} prompts)"
        return ("yes, exact" if self.exact else "yes") + ties

    def verdict(self) -> str | None:
        """bench.parquet's `divergence`: "real" if any prompt's is, else "tie" if any, else None."""
        return "real" if self.real else "tie" if self.parted else None

    def lines(self) -> list[str]:
        """One line per prompt it left its reference on."""
        return [f"{self.system} differs from {self.against} on {p.said()}" for p in self.parted]


def hold(results: list[SystemMeasurement], reference: list[list[int]], prompts: list[list[int]],
         own_arithmetic: bool, ready, engine_dtype: str = "float32") -> dict[str, Held]:
    """{system: Held} for every system not failed, transformers' rows aside. reference: generate's outputs per
    prompt; own_arithmetic: the fast path's activations are 8-bit (a block copy); ready(fast): the weights in the
    layout a system's runner reads (its logits are read once more where outputs differ); engine_dtype: the type the
    engines serve."""
    plain = fast_row(results)
    held = {}
    for m in results:
        if m.failed or m.system.startswith("transformers"):
            continue
        to_plain = m.fast and plain is not None and m is not plain and m.engine is None
        exact = to_plain and _invariant(m) and _invariant(plain)
        h = Held(m.system, PLAIN_FAST if to_plain else GENERATE, exact,
                 failing=m.engine is None and not (m is plain and own_arithmetic))
        judge_on = m if m.engine is None else plain  # an engine's logits are not to be had: the target's fast ones
        step = None if m.engine is None else engine_rounding(engine_dtype)
        for i, (ours, theirs) in enumerate(zip(m.outputs, plain.outputs if to_plain else reference)):
            at = first_difference(theirs, ours)
            if at is None:
                continue
            runner = getattr(judge_on.source, "runner", None)
            ready(judge_on.fast)
            verdict, gap = (("real", math.nan) if runner is None  # a stand-in system: no logits to read
                            else judge(runner, prompts[i], theirs, ours, exact, step))
            h.parted.append(Parted(i, at, verdict, gap, ours[at:at + 1], theirs[at:at + 1]))
        held[m.system] = h
    return held


def _invariant(m: SystemMeasurement) -> bool:
    return getattr(m.source, "varied", None) == 0


def fail_on_real(held: dict[str, Held]) -> None:
    """Raise OutputDiffers for the first system whose real divergence fails bench."""
    for h in held.values():
        if h.failing and h.real:
            raise OutputDiffers(f"bench: {h.system} differs from {h.against} on {h.real[0].said()}")


def held_lines(held: dict[str, Held]) -> list[str]:
    """The lines under the table: every prompt a system left its reference on, ties and real alike."""
    return [line for h in held.values() for line in h.lines()]

