"""Schedules: a strategy's best settings per batch size (and per context length), tuned once and looked up.

`sdbench tune --batch 1,4 [--prompt-len 1024,4096]` tunes one study per bucket and writes the winners as one
preset with a `schedule` (commands/schedule.py); `sdbench run --strategy PRESET` looks the entry of its batch
size (and prompt length) up here, without tuning again, and records which entry ran (`schedule_entry`).

The lookup rule, per axis: the largest tuned size at or below the asked one; below every tuned size, the
smallest. So a schedule tuned at batch 1 and 4 runs batch 2 and 3 with batch 1's entry and batch 16 with
batch 4's.

The selection rule (`pick`): the best trial is the one with the highest measured objective; a trial whose
value lies inside the best trial's 95 % bootstrap interval (over the prompts, reporting/stats.py) is not shown
worse, and among those the smallest gamma wins (then the highest value). vLLM's sweep scores each point by the
median minus the MAD of three or more runs and gives a 1 % tie to the smaller lookahead; sdbench's trials are one
run each over the same prompts, so the interval over prompts is the noise it knows, and a smaller lookahead
verifies fewer tokens per row, which is what costs more as the batch grows.

`sdbench schedule export` writes a schedule in each engine's own form (sdbench/commands/schedule_formats.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sdbench.errors import SdbenchError


@dataclass(frozen=True)
class Entry:
    """The settings tuned for one bucket: batch size, and prompt length when the schedule has that axis."""

    batch: int
    prompt_len: int | None
    gamma: int
    options: dict = field(default_factory=dict)
    drafts: tuple[str, ...] = ()
    value: float = math.nan  # the tuned objective of the chosen trial
    interval: tuple[float, float] = (math.nan, math.nan)
    study: str = ""
    trial: int | None = None

    @property
    def label(self) -> str:
        """What a result row records in `schedule_entry`, e.g. 'batch 4' or 'batch 1, 2048 tokens'."""
        return f"batch {self.batch}" + (f", {self.prompt_len} tokens" if self.prompt_len is not None else "")

    def spec(self) -> dict:
        out = {"batch": self.batch, **({"prompt_len": self.prompt_len} if self.prompt_len is not None else {}),
               "gamma": self.gamma, "options": dict(self.options)}
        if self.drafts:
            out["drafts"] = list(self.drafts)
        out["tuned"] = {"value": _plain(self.value), "interval": [_plain(b) for b in self.interval],
                        "study": self.study, "trial": self.trial}
        return out

    @classmethod
    def from_spec(cls, spec: dict, where: str) -> "Entry":
        try:
            batch, gamma = int(spec["batch"]), int(spec["gamma"])
            prompt_len = None if spec.get("prompt_len") is None else int(spec["prompt_len"])
        except (KeyError, TypeError, ValueError):
            raise SdbenchError(f"{where}: every schedule entry needs a whole-number batch and gamma") from None
        if batch < 1 or gamma < 0 or (prompt_len is not None and prompt_len < 1):
            raise SdbenchError(f"{where}: schedule entry batch={batch} gamma={gamma} is out of range")
        tuned = spec.get("tuned") or {}
        low, high = (tuned.get("interval") or (None, None))[:2]
        return cls(batch, prompt_len, gamma, dict(spec.get("options") or {}), tuple(spec.get("drafts") or ()),
                   _number(tuned.get("value")), (_number(low), _number(high)), str(tuned.get("study") or ""),
                   tuned.get("trial"))


def _plain(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def _number(x) -> float:
    return math.nan if x is None else float(x)


def bucket(sizes, asked: int) -> int:
    """The lookup rule: the largest of `sizes` at or below `asked`, else the smallest."""
    below = [s for s in sizes if s <= asked]
    return max(below) if below else min(sizes)


@dataclass(frozen=True)
class Schedule:
    entries: tuple[Entry, ...]

    @classmethod
    def from_spec(cls, raw, where: str) -> "Schedule":
        if not isinstance(raw, dict) or not isinstance(raw.get("entries"), list) or not raw["entries"]:
            raise SdbenchError(f"{where}: `schedule` needs a non-empty list of entries")
        entries = tuple(Entry.from_spec(e if isinstance(e, dict) else {}, where) for e in raw["entries"])
        keys = [(e.batch, e.prompt_len) for e in entries]
        if len(set(keys)) != len(keys):
            raise SdbenchError(f"{where}: two schedule entries share a bucket")
        if len({e.prompt_len is None for e in entries}) > 1:
            raise SdbenchError(f"{where}: either every schedule entry names a prompt_len or none does")
        return cls(entries)

    @property
    def by_context(self) -> bool:
        return self.entries[0].prompt_len is not None

    def lookup(self, batch: int, prompt_len: int | None) -> Entry:
        """The entry for a run at this batch size (and prompt length, when the schedule is per context)."""
        b = bucket({e.batch for e in self.entries}, batch)
        mine = [e for e in self.entries if e.batch == b]
        if not self.by_context:
            return mine[0]
        if prompt_len is None:
            lengths = ",".join(str(e.prompt_len) for e in mine)
            raise SdbenchError(f"this schedule is tuned per context length ({lengths} tokens): give --prompt-len")
        length = bucket({e.prompt_len for e in mine}, prompt_len)
        return next(e for e in mine if e.prompt_len == length)

    def spec(self, rule: str = "") -> dict:
        return {**({"rule": rule} if rule else {}), "entries": [e.spec() for e in self.entries]}


def pick(candidates: list[tuple[float, tuple[float, float], int]]) -> int:
    """The selection rule (module docstring) over (value, (low, high), gamma) per trial: the index chosen."""
    if not candidates:
        raise ValueError("no candidates")
    best = max(range(len(candidates)), key=lambda i: candidates[i][0])
    value, (low, _), _ = candidates[best]
    floor = low if low is not None and math.isfinite(low) else value
    tied = [i for i, (v, _, _) in enumerate(candidates) if v >= floor]
    return min(tied, key=lambda i: (candidates[i][2], -candidates[i][0]))
