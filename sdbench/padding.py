"""Rows of token ids of different lengths as one right-padded [B, W] tensor: the batch layout of every
prompt buffer and forward. Padding sits past each row's length, where no query of that row looks."""

from __future__ import annotations

from typing import Sequence

import torch


def right_pad(rows: Sequence[Sequence[int]], width: int | None = None) -> torch.Tensor:
    """[B, width] long: row b's ids at [b, : len(rows[b])], zeros after. width: at least the longest row
    (default: exactly it)."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out
