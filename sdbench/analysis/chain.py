"""A polybasic chain's costs, measured: the insertion test for a candidate model, and the measured answer.

A short profiling pass decodes a few prompts for a few tokens with each chain, and reads from each level's
records (`LevelRecord`) its time per forward T_i, its mean accepted length L_i, the block sizes N_i and the
bottom's forwards per block. `analysis.theory.ChainCosts` turns these into the predicted time per token of each
chain, and `insertion_times` into the verdict: does the candidate pay? The measured pass decodes the full prompts
with every system, interleaved prompt by prompt so that drift on a shared machine falls on all alike. Time per
token is decode time after the first token over the tokens after the first; the measured figure also pays each
level's prefill and the loop's bookkeeping, which the formula leaves out.

Beside sdbench's test, the paper's own insertion inequality (its Theorem 3.2, `theory.paper_insertion_times`)
is worked out from the same profile. The profiling pass of each chain can run once more under sampling, for the
mean and variance of the tokens a round commits per verifying level (the paper's Theorem 3.3 is about that
variance), beside the variance independent acceptances at the same mean would give.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from rich.console import Console

from sdbench.analysis.theory import (ChainCosts, accepted_length_variance, alpha_from_tokens_per_step,
                                     insertion_times, paper_bottom_insertion_times, paper_insertion_times)
from sdbench.config import RunConfig, SamplingConfig
from sdbench.engine.counters import BatchResult
from sdbench.engine.loop import generate
from sdbench.errors import SdbenchError
from sdbench.models.loading import pair as pair_module  # the module: tests replace pair.load_pair
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.strategies.chain_levels import LevelRecord, length_variance
from sdbench.strategies.polybasic import NGRAM, Polybasic, PolybasicRowStats, check_chain

GREEDY = SamplingConfig()


@dataclass
class ChainRun:
    """One system's figures: the profile it was predicted from, and what the measured pass saw."""

    label: str
    chain: list[str]  # the drafts, top down (empty: plain decoding)
    costs: ChainCosts | None = None
    profile_forward_s: float = 0.0  # plain decoding only: one target forward in the profiling pass
    seconds: float = 0.0  # measured decode time after each first token, summed over prompts
    tokens: int = 0  # measured tokens after each first token
    prefill_s: float = 0.0  # of `seconds`: the lower levels' own prefills, which the formula leaves out
    outputs: list[list[int]] = field(default_factory=list)
    spread: dict = field(default_factory=dict)  # "greedy" / "sampling" -> per verifying level, LevelSpread

    @property
    def predicted(self) -> float:
        return self.costs.time_per_token() if self.costs else self.profile_forward_s

    @property
    def measured(self) -> float:
        return self.seconds / self.tokens if self.tokens else float("nan")


def costs_from_records(records: list[list[LevelRecord]]) -> ChainCosts:
    """ChainCosts from the levels (PolybasicRowStats.levels) of several generations (batch 1 each)."""
    levels = _pooled(records)
    k = len(levels) - 1

    def ratio(i: int, num: float, den: float, what: str) -> float:
        if not den:
            raise SdbenchError(f"the profiling pass saw no {what} at level {i}: raise --profile-tokens")
        return num / den

    costs = tuple(ratio(i, lv.forward_s, lv.forwards, "forwards") for i, lv in enumerate(levels))
    accepted = tuple(ratio(i, lv.committed, lv.rounds, "rounds") for i, lv in enumerate(levels[:k]))
    blocks = tuple(ratio(i, lv.proposed, lv.proposals, "proposals") for i, lv in enumerate(levels[1:k], 1))
    return ChainCosts(costs, accepted, blocks, ratio(k, levels[k].forwards, levels[k].blocks, "blocks"))


def _pooled(records: list[list[LevelRecord | Mapping]]) -> list[LevelRecord]:
    """Per level, top down: its counts summed over the generations (rates left out: they do not add up). A
    level given as the dict a row's stats hold is parsed first."""
    typed = [[lv if isinstance(lv, LevelRecord) else LevelRecord.from_dict(lv) for lv in levels] for levels in records]
    out = []
    for i, first in enumerate(typed[0]):
        same = [levels[i] for levels in typed]
        out.append(LevelRecord(
            level=first.level, model=first.model, forwards=sum(lv.forwards for lv in same),
            forward_s=sum(lv.forward_s for lv in same), prefill_s=sum(lv.prefill_s for lv in same),
            blocks=sum(lv.blocks for lv in same), rounds=sum(lv.rounds for lv in same),
            committed=sum(lv.committed for lv in same), committed_sq=sum(lv.committed_sq for lv in same),
            proposals=sum(lv.proposals for lv in same), proposed=sum(lv.proposed for lv in same),
            accepted=sum(lv.accepted for lv in same)))
    return out


@dataclass(frozen=True)
class LevelSpread:
    """One verifying level's accepted length over the rounds of a pass: mean, variance, and the variance of
    independent acceptances at that mean over blocks of the mean size (`theory.accepted_length_variance`)."""

    model: str
    rounds: int
    mean: float
    var: float
    iid_var: float


def spread_from_records(records: list[list[LevelRecord]]) -> list[LevelSpread]:
    """Per verifying level (top down), from the levels (PolybasicRowStats.levels) of several generations."""
    levels = _pooled(records)
    out = []
    for level, below in zip(levels, levels[1:]):  # the bottom verifies nothing
        mean = level.committed / level.rounds if level.rounds else float("nan")
        block = max(1, round(below.proposed / below.proposals)) if below.proposals else 1
        iid = accepted_length_variance(alpha_from_tokens_per_step(mean, block), block)
        var = length_variance(level.committed, level.committed_sq, level.rounds)
        out.append(LevelSpread(level.model, level.rounds, mean, var, iid))
    return out


def _decode(pair, proposer, prompt: list[int], max_new: int, sampling: SamplingConfig = GREEDY,
            generator=None) -> BatchResult:
    return generate(pair.target, proposer, [prompt], max_new_tokens=max_new, sampling=sampling, eos_ids=pair.eos,
                    generator=generator)


def _levels(res: BatchResult) -> list[LevelRecord]:
    """The levels a chain recorded for the generation's one row (none for plain decoding)."""
    return PolybasicRowStats.from_dict(res.extras[0]).levels


def _build(pair, names: list[str], runners: dict, gamma: int, mu: str):
    if not names:
        return Autoregressive()
    return Polybasic([runners[n] for n in names], gamma, _mu(names, mu), target_name=pair.target.name)


def _mu(chain: list[str], mu: str) -> str:
    """--mu is for the middle levels; a chain of one draft has none."""
    return mu if len(chain) > 1 else ""


def profile(pair, runs: list[ChainRun], runners, prompts, tokens: int, gamma: int, mu: str,
            sampling: SamplingConfig | None = None) -> None:
    """Fill each run's costs from a short pass (after one unrecorded warm-up generation each); with
    `sampling`, each chain's pass once more under it, for the spread of the accepted lengths."""
    for run in runs:
        proposer = _build(pair, run.chain, runners, gamma, mu)
        _decode(pair, proposer, prompts[0], 4)
        results = [_decode(pair, proposer, p, tokens) for p in prompts]
        if run.chain:
            records = [_levels(res) for res in results]
            run.costs = costs_from_records(records)
            run.spread["greedy"] = spread_from_records(records)
            if sampling is not None:
                g = torch.Generator().manual_seed(sampling.seed)
                records = [_levels(_decode(pair, proposer, p, tokens, sampling, g)) for p in prompts]
                run.spread["sampling"] = spread_from_records(records)
        else:
            rows = [res.rows[0] for res in results]
            run.profile_forward_s = sum(r.verify_s for r in rows) / max(sum(r.steps for r in rows), 1)


def measure(pair, runs: list[ChainRun], runners, prompts, max_new: int, gamma: int, mu: str) -> None:
    proposers = [_build(pair, run.chain, runners, gamma, mu) for run in runs]
    for prompt in prompts:
        for run, proposer in zip(runs, proposers):
            res = _decode(pair, proposer, prompt, max_new)
            run.seconds += res.wall_s - res.ttft_s
            run.tokens += max(len(res.output_ids[0]) - 1, 0)
            run.outputs.append(res.output_ids[0])
            run.prefill_s += sum(level.prefill_s for level in _levels(res))


def insertion_verdict(old: ChainCosts, new: ChainCosts, at: int) -> tuple[float, float]:
    """(old, new) seconds per token of the level the candidate goes under (level `at`), from the insertion
    condition: that level's round in the old chain against its round in the new one. A candidate put under
    the old bottom (at = k) turns that drafter into a verifier, so the level above it (k - 1) is compared:
    its token with the old bottom's blocks against its token with the new two-level tail."""
    k = len(old.costs) - 1
    if at == k:
        return old.level_token_cost(k - 1), new.level_token_cost(k - 1)
    c = at + 1  # the candidate's level in the new chain; never the bottom
    return insertion_times(old.costs[at], old.block_cost(at + 1), old.accepted[at], new.costs[at], new.costs[c],
                           new.accepted[c], new.blocks[c - 1], new.accepted[at])


def paper_verdict(old: ChainCosts, new: ChainCosts, at: int) -> tuple[float, float]:
    """(old, new) of the paper's Theorem 3.2 for the candidate under level `at`, from the same profiles."""
    c, k = at + 1, len(old.costs) - 1
    if at == k:  # under the old bottom: it turns verifier, with the verifying forward the new chain measured
        return paper_bottom_insertion_times(old.costs[k - 1], old.accepted[k - 1], new.accepted[k - 1],
                                            old.block_cost(k), new.costs[k], new.accepted[k], new.block_cost(c))
    bottom = old.bottom_forwards * old.costs[k] if at == k - 1 else None  # the candidate lands above the bottom
    return paper_insertion_times(old.costs[at], old.accepted[at], new.accepted[at], new.costs[c], new.accepted[c],
                                 bottom)


def chain_config(target: str, chains: list[list[str]], dataset: str, limit: int, max_new_tokens: int, gamma: int,
                 mu: str, seed: int, device: str, dtype: str) -> RunConfig:
    """One RunConfig that loads every model of `chains` once; each chain is checked before anything loads."""
    for chain in chains:
        check_chain([d if d == NGRAM else None for d in chain], gamma, _mu(chain, mu))
    drafts = tuple(dict.fromkeys(d for chain in chains for d in chain))
    return RunConfig(target=target, drafts=drafts, dataset=dataset, limit=limit, max_new_tokens=max_new_tokens,
                     gammas=(gamma,), sampling=SamplingConfig(seed=seed), device=device, dtype=dtype)


def load_chains(cfg: RunConfig, console: Console) -> tuple[object, dict]:
    """The loaded pair, and the runner (or "ngram") of each draft name."""
    pair = pair_module.load_pair(cfg, *pair_module.device_and_dtype(cfg.device, cfg.dtype), console)
    return pair, dict(zip(cfg.drafts, pair.drafts))


def profile_and_measure(pair, runs: list[ChainRun], runners, profiling, measuring, profile_tokens: int,
                        max_new_tokens: int, gamma: int, mu: str, sampling: SamplingConfig | None,
                        console: Console) -> None:
    """The profiling pass on `profiling` (again under `sampling` when given), then the measured pass on
    `measuring`, interleaved prompt by prompt; fills every run."""
    with torch.inference_mode(), console.status("profiling"):
        profile(pair, runs, runners, profiling, profile_tokens, gamma, mu, sampling)
    with torch.inference_mode(), console.status("measuring"):
        measure(pair, runs, runners, measuring, max_new_tokens, gamma, mu)
