"""Plain decoding: the proposer that proposes nothing."""

from sdbench.errors import SdbenchError
from sdbench.strategies.base import Proposer


class Autoregressive(Proposer):
    name = "autoregressive"

    def __init__(self, gamma: int = 0):
        super().__init__(0)

    def params(self) -> dict:
        return {}

    @classmethod
    def search_space(cls, trial, space):
        raise SdbenchError("strategy 'autoregressive' has nothing to tune (no lookahead, no settings)")
