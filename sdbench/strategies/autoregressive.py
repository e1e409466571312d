"""Plain decoding: the proposer that proposes nothing."""

from sdbench.strategies.base import Proposer


class Autoregressive(Proposer):
    name = "autoregressive"

    def __init__(self, gamma: int = 0):
        super().__init__(0)

    def params(self) -> dict:
        return {}
