"""Does a speedup carry over to an engine? The decode speedup of speculative decoding predicted from acceptance
measured in one place and step costs measured in another, beside the speedup each engine measures for itself.

A system's decoding is counted in rounds (one target verification each) over the tokens after each prompt's first
(the first comes from the prefill, which speculative decoding leaves alike). Each round commits its accepted drafts
plus one token of the target's, so

    tokens per round  L = tokens / rounds = 1 + accepted / rounds (sdbench's mean accepted length)
    drafts per round  g = drafted / rounds

and with the step costs of the engine that runs it, c (one draft step over one target step) and v(k) (a target
forward over k tokens over one of 1 token, at each width measured, between them on a line), the predicted decode
speedup over the engine's own plain decoding is L / (g c + v + o) (`iid_model.round_speedup`), v the mean of v(k)
over the widths k the rounds verified where they are known (sdbench's rounds), else v(g + 1). Where an
engine's drafter also runs the round's verification batch through the draft (`EngineCosts.round`), g c becomes the
draft forwards that round costs (`EngineCosts.draft_steps`) times c. o is a round's overhead beyond its forwards:
h, the host work of a round (acceptance, bookkeeping) beyond a plain step's, plus s R / N, the proposer's setup
per request (a draft model's prefill of the prompt) spread over its rounds (R requests, N rounds), each timed
beside c and v by sdbench for its own systems (`bench_costs.step_costs`); an engine's step costs come from its
own timings, which hold its host work, and its draft's prefill is not timed apart (o = 0).

Three numbers per engine system:
  carried    L and g from sdbench's own run of the same strategy on the same prompts, c and v the engine's:
             what a user who measured acceptance with sdbench would predict for that engine
  own        L and g from the engine's own counters (its accepted and drafted tokens), c and v the engine's:
             the cost model with the engine's acceptance, so that measured / own is the cost model's error alone
  measured   the engine's decode speedup: tokens after the first over the time after the first token, each summed
             over the prompts, over the same of the engine's plain decoding

and the gap measured / carried factors exactly into acceptance (own / carried: the engine accepts more or less
than sdbench: another drafting rule, arithmetic) times the rest (measured / own: overheads the cost model leaves
out, costs that differ in the engine's speculative loop from its plain forwards).

For sdbench's own systems, whose loop times each part of a round (engine/loop.py), the rest factors further into
forwards x host x setup (`rest_parts`): the predicted round's parts, in plain decoding's measured time per token,
replaced by the measured ones one at a time (the forwards: drafting and verification; the host work beyond a plain
step's; the setup per round), so that each factor is the part's own error and their product is the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sdbench.engine.counters import BLOCK, CHAIN, MIRROR, Rounds
from sdbench.engine.iid_model import round_speedup
from sdbench.reporting.carry import Carried
from sdbench.reporting.cells import ratio


def interpolate(table: dict[int, float], width: float) -> float:
    """table[width], linear between the widths it holds (held at the ends)."""
    ks = sorted(table)
    if not ks or math.isnan(width):
        return math.nan
    if width <= ks[0]:
        return table[ks[0]]
    for lo, hi in zip(ks, ks[1:]):
        if width <= hi:
            return table[lo] + (table[hi] - table[lo]) * (width - lo) / (hi - lo)
    return table[ks[-1]]


@dataclass(frozen=True)
class EngineCosts:
    """An engine's costs in units of its target's forward over one token: verify[k] a forward over k tokens (k = 1
    is 1.0), draft one draft step (0 for a lookup drafter), draft_verify[k] the draft's forward over k tokens over
    its own one-token forward (empty: as the target's), round how the drafter spends a round (CHAIN, MIRROR,
    WIDE_FIRST or BLOCK); `step_s` the target's one-token forward in seconds."""

    verify: dict[int, float]
    draft: float
    step_s: float = math.nan
    draft_verify: dict[int, float] = field(default_factory=dict)
    round: str = CHAIN
    host: float = 0.0  # h: a round's host work beyond a plain step's
    setup: float = 0.0  # s: the proposer's setup per request

    def overhead(self, rounds: Rounds) -> float:
        """o = h + s R / N for `rounds`' R requests in N rounds."""
        per_round = rounds.requests / rounds.rounds if rounds.rounds else 0.0
        return self.host + self.setup * per_round

    def verify_at(self, width: float) -> float:
        """v(width)."""
        return interpolate(self.verify, width)

    def verify_for(self, rounds: Rounds) -> float:
        """v of `rounds`' verifications: the mean of v(k) over the widths they verified where those are known
        (sdbench's rounds), else v(g + 1). A CPU's v is far from a line in k (a forward over 2 or 3 tokens costs
        hardly more than over 1), so v at the mean width misstates rounds that mix 0 and gamma drafts."""
        shares = rounds.width_shares()
        if not shares:
            return self.verify_at(rounds.drafts_per_round + 1.0)
        return sum(share * self.verify_at(k) for k, share in shares.items())

    def draft_steps(self, g: float) -> float:
        """One-token draft forwards a round of g drafts costs (see CHAIN, MIRROR, WIDE_FIRST, BLOCK: one forward of
        cost c, whatever g)."""
        if self.round == CHAIN:
            return g
        if self.round == BLOCK:
            return min(g, 1.0)
        wide = interpolate(self.draft_verify or self.verify, g + 1.0)
        return wide + g if self.round == MIRROR else wide + g - 1.0


def predicted(rounds: Rounds, costs: EngineCosts) -> float:
    """L / (d c + v + o) with L, g and the widths verified from `rounds`, d = costs.draft_steps(g) (g for a chain),
    c, v (`EngineCosts.verify_for`) and o from `costs`."""
    g = rounds.drafts_per_round
    return round_speedup(rounds.tokens_per_round, costs.draft_steps(g), costs.draft,
                         costs.verify_for(rounds) + costs.overhead(rounds))


def decode_speedup(rounds: Rounds, plain: Rounds) -> float:
    return ratio(rounds.tokens_per_s, plain.tokens_per_s)


def carry(system: str, engine: str, own: Rounds, plain: Rounds, costs: EngineCosts, reference: Rounds) -> Carried:
    """The carry-over row of a speculative system: `own` its rounds, `plain` its engine's plain decoding's, `costs`
    its engine's, `reference` sdbench's rounds of the same strategy on the same prompts."""
    g = own.drafts_per_round
    return Carried(system, engine, own.tokens_per_round, g, costs.verify_for(own), costs.draft,
                   costs.draft_steps(g) * costs.draft, predicted(reference, costs), predicted(own, costs),
                   decode_speedup(own, plain), costs.overhead(own), costs.host, costs.setup,
                   *rest_parts(own, plain, costs))


def rest_parts(own: Rounds, plain: Rounds, costs: EngineCosts) -> tuple[float, float, float]:
    """(forwards, host, setup): the rest's factors for rounds whose loop timed its parts (sdbench's; NaN for an
    engine's). Each part per round in plain decoding's measured time per token: predicted F = d c + v,
    H = h, S = s R / N; measured S the setup, H the host work beyond plain decoding's per token, F the remainder."""
    nan = (math.nan,) * 3
    if not (own.rounds and own.host_s and plain.tokens and plain.seconds):
        return nan
    unit = plain.seconds / plain.tokens  # plain decoding's measured time per token
    g = own.drafts_per_round
    pred = (costs.draft_steps(g) * costs.draft + costs.verify_for(own), costs.host,
            costs.overhead(own) - costs.host)
    setup = own.setup_s / own.rounds / unit
    host = (own.host_s / own.rounds - plain.host_s / plain.tokens) / unit
    meas = (own.seconds / own.rounds / unit - setup - host, host, setup)
    steps = [sum(meas[:i]) + sum(pred[i:]) for i in range(4)]  # predicted parts replaced one at a time
    return tuple(ratio(steps[i], steps[i + 1]) for i in range(3))
