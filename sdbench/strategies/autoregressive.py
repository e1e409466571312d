"""Plain decoding: the proposer that proposes nothing."""

from sdbench.strategies.base import BuildContext, Proposer, take_options


class Autoregressive(Proposer):
    name = "autoregressive"

    def params(self) -> dict:
        return {}


def build(ctx: BuildContext) -> Proposer:
    take_options((), ctx.options, Autoregressive.name)
    return Autoregressive()
