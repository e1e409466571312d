"""The target's hidden states, for a proposer that reads them (a trained head: EAGLE, Medusa).

A proposer names the states it wants (`Proposer.hidden_layers`); the loop then asks the runner for them with a
`Taps` on the prefill and on each verification, and hands them over as `TargetStates` of the committed tokens
(`Proposer.see_target`). A proposer that names none costs nothing: no `Taps` is made and the runner keeps
nothing. Layer indices follow the library's `output_hidden_states`: i < L is the input of layer i (0: the
embeddings), `L` the last layer's output before the final norm, `FINAL` the final-norm output (the state the
model's own head reads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FINAL = -1  # the final-norm hidden state


def eagle3_layers(n_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs an EAGLE-3 head reads unless its config names others: 2, L/2 and L-3,
    as vLLM, SGLang and the EAGLE repository choose."""
    return 2, n_layers // 2, n_layers - 3


class Taps:
    """The hidden states one call of a runner keeps: `layers` as above, joined in that order.

    A runner `put`s each state it passes (pieces along the tokens when a call runs in chunks); `states`
    joins them: [B, T, len(layers) * H]."""

    def __init__(self, layers: tuple[int, ...]):
        self.layers = tuple(layers)
        self._pieces: dict[int, list[torch.Tensor]] = {i: [] for i in self.layers}
        self._joined: list[torch.Tensor] = []

    def put(self, layer: int, h: torch.Tensor) -> None:
        """h [B, T, H]: the state at `layer` of this piece of the call (ignored unless asked for)."""
        if layer in self._pieces:
            self._pieces[layer].append(h)

    def put_joined(self, states: torch.Tensor) -> None:
        """states [B, T, k*H] already joined (a static-shape forward's)."""
        self._joined.append(states)

    def states(self) -> torch.Tensor:
        if self._joined:
            return torch.cat(self._joined, 1)
        return torch.cat([torch.cat(self._pieces[i], 1) for i in self.layers], -1)


@dataclass
class TargetStates:
    """The target's hidden states of committed tokens: row b's states[b, t] belong to the token at position
    start[b] + t, for t < count[b] (0: nothing new for the row)."""

    states: torch.Tensor  # [B, T, k*H] on the target's device
    start: list[int]
    count: list[int]
