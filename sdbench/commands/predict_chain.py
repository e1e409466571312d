"""`sdbench predict chain`: the insertion test for a polybasic chain, then the measured answer.

A short profiling pass decodes a few prompts for a few tokens with the chain as it is and with the candidate
inserted, and reads from each level's records its time per forward T_i, its mean accepted length L_i, the
block sizes N_i and the bottom's forwards per block. `sdbench.theory.ChainCosts` turns these into the
predicted time per token of each chain, and `insertion_times` into the verdict: does the candidate pay? Then
the measured pass decodes the full prompts with plain decoding and both chains, interleaved prompt by prompt
so that drift on a shared machine falls on all three alike, and prints the measured time per token next to
the prediction. Time per token is decode time after the first token over the tokens after the first; the
measured figure also pays each level's prefill and the loop's bookkeeping, which the formula leaves out.

Beside sdbench's test, the paper's own insertion inequality (its Theorem 3.2, `theory.paper_insertion_times`)
is printed from the same profile, with the measured verdict for both. The profiling pass of each chain is run
once more under sampling (--temperature), and a table gives, per verifying level, the mean and variance of the
tokens a round commits under greedy decoding and under sampling (the paper's Theorem 3.3 is about that
variance), beside the variance independent acceptances at the same mean would give.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table

from sdbench.config import RunConfig, SamplingConfig
from sdbench.engine.loop import generate
from sdbench.errors import SdbenchError
from sdbench.engine.metrics import BatchResult
from sdbench.strategies.autoregressive import Autoregressive
from sdbench.strategies.polybasic import NGRAM, Polybasic, check_chain
from sdbench.strategies.chain_levels import length_variance
from sdbench.theory import (ChainCosts, accepted_length_variance, alpha_from_tokens_per_step, insertion_times,
                            paper_bottom_insertion_times, paper_insertion_times)

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


def costs_from_records(records: list[dict]) -> ChainCosts:
    """ChainCosts from Polybasic.row_stats()["levels"] of several generations (batch 1 each)."""
    k = len(records[0]) - 1

    def total(i: int, key: str) -> float:
        return sum(r[i][key] for r in records)

    def ratio(i: int, num: str, den: str) -> float:
        d = total(i, den)
        if not d:
            raise SdbenchError(f"the profiling pass saw no {den} at level {i}: raise --profile-tokens")
        return total(i, num) / d

    costs = tuple(ratio(i, "forward_s", "forwards") for i in range(k + 1))
    accepted = tuple(ratio(i, "committed", "rounds") for i in range(k))
    blocks = tuple(ratio(i, "proposed", "proposals") for i in range(1, k))
    return ChainCosts(costs, accepted, blocks, ratio(k, "forwards", "blocks"))


@dataclass(frozen=True)
class LevelSpread:
    """One verifying level's accepted length over the rounds of a pass: mean, variance, and the variance of
    independent acceptances at that mean over blocks of the mean size (`theory.accepted_length_variance`)."""

    model: str
    rounds: int
    mean: float
    var: float
    iid_var: float


def spread_from_records(records: list[dict]) -> list[LevelSpread]:
    """Per verifying level (top down), from Polybasic.row_stats()["levels"] of several generations."""
    out = []
    for i in range(len(records[0]) - 1):  # the bottom verifies nothing
        rounds = sum(r[i]["rounds"] for r in records)
        total, total_sq = sum(r[i]["committed"] for r in records), sum(r[i]["committed_sq"] for r in records)
        blocks = sum(r[i + 1]["proposals"] for r in records)
        mean = total / rounds if rounds else float("nan")
        block = max(1, round(sum(r[i + 1]["proposed"] for r in records) / blocks)) if blocks else 1
        iid = accepted_length_variance(alpha_from_tokens_per_step(mean, block), block)
        out.append(LevelSpread(records[0][i]["model"], rounds, mean, length_variance(total, total_sq, rounds), iid))
    return out


def _decode(pair, proposer, prompt: list[int], max_new: int, sampling: SamplingConfig = GREEDY,
            generator=None) -> BatchResult:
    return generate(pair.target, proposer, [prompt], max_new_tokens=max_new, sampling=sampling, eos_ids=pair.eos,
                    generator=generator)


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
            records = [res.extras[0]["levels"] for res in results]
            run.costs = costs_from_records(records)
            run.spread["greedy"] = spread_from_records(records)
            if sampling is not None:
                g = torch.Generator().manual_seed(sampling.seed)
                records = [_decode(pair, proposer, p, tokens, sampling, g).extras[0]["levels"] for p in prompts]
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
            run.prefill_s += sum(level.get("prefill_s", 0.0) for level in (res.extras[0].get("levels") or []))


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


def check_insertion(drafts: list[str], at: int) -> list[str]:
    """The chain with the candidate slot at `at` (None), or SdbenchError: under the target (0), under a
    --draft level, or under the bottom when the bottom is a model (prompt lookup verifies nothing)."""
    if not drafts:
        raise SdbenchError("predict chain needs the chain as it is: --draft once per level, from the top down")
    if not 0 <= at <= len(drafts) or (at == len(drafts) and drafts[-1] == NGRAM):
        raise SdbenchError(f"--at {at}: insert under the target (0) or under one of the --draft levels 1.."
                           f"{len(drafts)} (under the bottom only when it is a model: prompt lookup verifies "
                           "nothing)")
    return drafts[:at] + [None] + drafts[at:]


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
    from sdbench.models.pair import load_pair, resolve_device, resolve_dtype

    dev = resolve_device(cfg.device)
    pair = load_pair(cfg, dev, resolve_dtype(cfg.dtype, dev), console)
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


def run_chain_prediction(target: str, drafts: list[str], candidate: str, at: int, gamma: int, mu: str,
                         dataset: str, limit: int, max_new_tokens: int, profile_prompts: int, profile_tokens: int,
                         device: str, dtype: str, seed: int, console: Console,
                         temperature: float = 1.0) -> list[ChainRun]:
    from sdbench.data.prompts import encode_prompts

    slot = check_insertion(drafts, at)
    for name, value in (("--limit", limit), ("--max-new-tokens", max_new_tokens),  # --gamma: check_chain
                        ("--profile-prompts", profile_prompts), ("--profile-tokens", profile_tokens)):
        if value < 1:
            raise SdbenchError(f"{name} must be at least 1 (got {value})")
    if not temperature >= 0:
        raise SdbenchError(f"--temperature {temperature}: expected 0 (no sampling pass) or more")
    new_chain = [candidate if d is None else d for d in slot]
    cfg = chain_config(target, [drafts, new_chain], dataset, limit, max_new_tokens, gamma, mu, seed, device, dtype)
    pair, runners = load_chains(cfg, console)
    _, encoded = encode_prompts(cfg, pair)
    runs = [ChainRun("plain", []), ChainRun("chain", list(drafts)), ChainRun("with candidate", new_chain)]
    sampling = SamplingConfig(temperature, seed=seed) if temperature > 0 else None
    profile_and_measure(pair, runs, runners, encoded[:profile_prompts], encoded, profile_tokens, max_new_tokens,
                        gamma, mu, sampling, console)
    print_chain_report(runs, target, candidate, at, console)
    print_spread(runs, console)
    return runs


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def print_chain_report(runs: list[ChainRun], target: str, candidate: str, at: int, console: Console) -> None:
    plain, old, new = runs
    table = Table(title=f"polybasic chains on {target}, ms per token: predicted from the profiling pass, measured; "
                        "per level (top down) ms per forward T and accepted length L")
    for col in ("system", "levels", "T ms", "L", "predicted", "simple form", "measured", "draft prefill",
                "speedup", "same tokens"):
        table.add_column(col, justify="left" if col in ("system", "levels") else "right", overflow="fold")
    for run in runs:
        costs = run.costs
        forwards = " / ".join(_ms(t) for t in costs.costs) if costs else _ms(run.profile_forward_s)
        lengths = " / ".join(f"{a:.2f}" for a in costs.accepted) if costs else "1.00"
        simple = costs.seed_time_per_token() if costs else run.profile_forward_s
        prefill = run.prefill_s / max(run.tokens, 1)
        table.add_row(run.label, " <- ".join([target] + run.chain), forwards, lengths, _ms(run.predicted),
                      _ms(simple), _ms(run.measured), _ms(prefill), f"{plain.measured / run.measured:.2f}x",
                      "yes" if run.outputs == plain.outputs else "NO")
    console.print(table)
    names = [target] + old.chain
    k = len(old.chain)
    compared = names[at - 1] if at == k else names[at]  # under the bottom: the level above it is compared
    t_old, t_new = insertion_verdict(old.costs, new.costs, at)
    predicted, measured = t_new < t_old, new.measured < old.measured
    console.print(f"insertion test, {candidate} under {names[at]}: a token of {compared} costs {_ms(t_old)} ms "
                  f"now, {_ms(t_new)} ms with it -> predicted to {'help' if predicted else 'hurt'}")
    verdict = "called it right" if predicted == measured else "got it wrong"
    console.print(f"measured: {_ms(old.measured)} -> {_ms(new.measured)} ms/token, it "
                  f"{'helped' if measured else 'hurt'}: the test {verdict}")
    p_old, p_new = paper_verdict(old.costs, new.costs, at)
    paper = p_new < p_old
    if at == k:
        inequality = "T_j / L'_j + (T'_k + b_c T_c) / L'_k < (T_j + b_k T_k) / L_j"
    else:
        bottom = " + b_k T_k / L_c" if at == k - 1 else ""
        inequality = f"T_j / L'_j + T_c / L_c{bottom} < T_j / L_j{bottom.replace('_c', '_j')}"
    console.print(f"Theorem 3.2 as sdbench reads the paper, {inequality}: "
                  f"{_ms(p_new)} vs {_ms(p_old)} ms -> predicted to {'help' if paper else 'hurt'}: it "
                  f"{'called it right' if paper == measured else 'got it wrong'}"
                  f"{'' if paper == predicted else ' (sdbench test and paper disagree)'}", soft_wrap=True)


def print_spread(runs: list[ChainRun], console: Console) -> None:
    """Accepted length per verifying level under greedy decoding and sampling (profiling passes)."""
    modes = [m for m in ("greedy", "sampling") if any(m in run.spread for run in runs)]
    table = Table(title="tokens committed per verification round, per verifying level (profiling pass): mean, "
                        "variance, and the variance of independent acceptances at that mean")
    table.add_column("system")
    table.add_column("level", justify="left")
    for mode in modes:
        for col in ("rounds", "mean", "var", "iid var"):
            table.add_column(f"{mode} {col}", justify="right")
    for run in runs:
        for i, level in enumerate(run.spread.get("greedy", [])):
            cells = []
            for mode in modes:
                s = run.spread[mode][i] if mode in run.spread else None
                cells += ([str(s.rounds), f"{s.mean:.2f}", f"{s.var:.2f}", f"{s.iid_var:.2f}"] if s
                          else ["-"] * 4)
            table.add_row(run.label, f"{i} {level.model}", *cells)
    console.print(table)
