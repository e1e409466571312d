"""sdbench's clocks: a synchronised read of the time, and marks and spans read without a wait of their own."""

from __future__ import annotations

import time

import torch


def now(device: torch.device | str | None = None) -> float:
    """perf_counter after the device has finished its queued work."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Marks:
    """Phase timestamps that need no wait of their own: CUDA events on a GPU, read once the round's results
    have reached the host anyway (the one wait per round), perf_counter elsewhere. The time between two
    marks is then the device's time from one to the other, as a synchronised clock would measure it."""

    def __init__(self, device: torch.device | str | None = None):
        self.cuda = device is not None and torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, a, b) -> float:
        """Time from mark a to mark b; on a GPU, read once the work before b has finished (a mark made just after
        the round's wait, on an idle stream, is waited for: no time)."""
        if not self.cuda:
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1e3


class Spans:
    """A sum of durations taken without waiting for the device: each span is a pair of `Marks`, read only when
    `settle` is called after the work has reached the host anyway (the decode loop's one wait per round)."""

    def __init__(self, device: torch.device | str | None = None):
        self.marks = Marks(device)
        self.pending: list = []

    def start(self):
        return self.marks.mark()

    def stop(self, start) -> None:
        self.pending.append((start, self.marks.mark()))

    def settle(self) -> float:
        """Seconds of the spans stopped since the last settle."""
        seconds = sum(self.marks.seconds(a, b) for a, b in self.pending)
        self.pending.clear()
        return seconds
