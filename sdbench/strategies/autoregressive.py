"""Plain decoding: the proposer that proposes nothing."""

from sdbench.errors import SdbenchError
from sdbench.strategies.base import Proposer
from sdbench.strategies.spec import Strategy, register


class Autoregressive(Proposer):
    name = "autoregressive"
    rows_join = True  # nothing kept per row

    def begin_rows(self, state, rows: list[int]) -> None:
        pass

    def __init__(self, gamma: int = 0):
        super().__init__(0)

    def params(self) -> dict:
        return {}


@register
class AutoregressiveStrategy(Strategy):
    name = "autoregressive"
    help = "plain decoding, one target forward per token (the baseline)"
    aliases = ("ar", "baseline")
    proposer = Autoregressive

    @classmethod
    def search_space(cls, trial, space):
        raise SdbenchError("strategy 'autoregressive' has nothing to tune (no lookahead, no settings)")
