"""How busy the machine was while sdbench measured: the share of its cores that other processes used, and the share
the hypervisor gave to other guests (CPU steal), over one measured window.

Read from Linux's /proc: the CPU time of the cores this process may run on (/proc/stat, their `cpuN` lines), less
the CPU time of sdbench's own process tree (itself, its threads, the children it has reaped and the live ones: an
engine's server, a worker pool), over the window's whole core time. A busy loop beside a measurement on a 2-core
machine reads about 0.5; an idle machine a few thousandths. Where /proc cannot be read (not Linux) both are NaN:
unknown, never 0. A container limited by a CPU quota rather than a set of cores sees the host's cores: other
tenants' work on cores it does not use counts too.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

BUSY = 0.10  # other processes' share of the cores above which a measurement is said to be on a busy machine
STEAL = 0.05  # the same for the CPU time stolen by the hypervisor
_PROC = Path("/proc")


@dataclass(frozen=True)
class Busy:
    """One window's use of the machine by others: shares of the window's core time, NaN when not readable."""

    others: float = math.nan  # other processes' CPU time / (window × cores)
    steal: float = math.nan  # stolen CPU time / (window × cores)

    @property
    def busy(self) -> bool:
        return is_busy(self.others, self.steal)

    def said(self) -> str:
        """'others 48 %', with the steal where any: what a note says of the window."""
        parts = [f"{name} {value:.0%}" for name, value in (("others", self.others), ("steal", self.steal))
                 if math.isfinite(value) and (name == "others" or value > 0)]
        return ", ".join(parts) or "unknown"


def weighted(windows: list[tuple[Busy, float]]) -> Busy:
    """Windows' shares taken together, each weighted by its seconds; unknown windows left out."""
    def share(which: str) -> float:
        known = [(getattr(b, which), s) for b, s in windows if math.isfinite(getattr(b, which)) and s > 0]
        total = sum(s for _, s in known)
        return sum(v * s for v, s in known) / total if total else math.nan

    return Busy(share("others"), share("steal"))


def is_busy(others: float, steal: float) -> bool:
    """Whether shares of other processes' use and of steal say the machine was busy (NaN says nothing)."""
    return bool((math.isfinite(others) and others > BUSY) or (math.isfinite(steal) and steal > STEAL))


@dataclass(frozen=True)
class _Reading:
    total: int  # ticks of the cores, every state
    used: int  # ticks spent running something (user, nice, system, irq, softirq)
    steal: int
    ours: int  # ticks of sdbench's process tree


class Window:
    """`with Window() as w: ...` then `w.busy`: the machine's use by others while the block ran."""

    def __init__(self, root: int | None = None):
        self.root = root or os.getpid()
        self.busy = Busy()
        self._start: _Reading | None = None

    def __enter__(self) -> Window:
        self._start = _read(self.root)
        return self

    def __exit__(self, *exc) -> None:
        end = _read(self.root)
        self.busy = between(self._start, end)


def between(start: _Reading | None, end: _Reading | None) -> Busy:
    """The shares between two readings; unknown when either is missing or no core time passed."""
    if start is None or end is None or end.total <= start.total:
        return Busy()
    total = end.total - start.total
    others = (end.used - start.used) - (end.ours - start.ours)
    return Busy(min(1.0, max(0.0, others / total)), min(1.0, max(0.0, (end.steal - start.steal) / total)))


def _read(root: int) -> _Reading | None:
    try:
        cores = _cores()
        total = used = steal = 0
        for line in (_PROC / "stat").read_text().splitlines():
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
                continue
            user, nice, system, idle, iowait, irq, softirq, stolen = (int(x) for x in fields[:8])
            used += user + nice + system + irq + softirq
            steal += stolen
            total += user + nice + system + idle + iowait + irq + softirq + stolen
        return _Reading(total, used, steal, _tree_ticks(root)) if total else None
    except (OSError, ValueError):
        return None


def _cores() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _tree_ticks(root: int) -> int:
    """CPU ticks of root and its live descendants, each with the children it has reaped."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone, or not ours to read
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": the comm may hold spaces
        pid = int(entry.name)
        parents[pid] = int(fields[1])
        ticks[pid] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    tree, frontier = {root}, [root]
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(ticks.get(pid, 0) for pid in tree)
