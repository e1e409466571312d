"""`sdbench predict chain`: the insertion test for a polybasic chain, then the measured answer.

The chain as it is, the chain with --candidate inserted under level --at, and plain decoding are profiled and
measured by analysis/chain.py on the same prompts; this prints the predicted and measured time per token of
each, sdbench's insertion verdict and the paper's (its Theorem 3.2), each against the measured outcome, and the
accepted length's mean and variance per verifying level under greedy decoding and under sampling.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from sdbench.analysis.chain import (ChainRun, chain_config, insertion_verdict, load_chains, paper_verdict,
                                    profile_and_measure)
from sdbench.config import PredictChainConfig, SamplingConfig
from sdbench.data.prompts import encode_prompts
from sdbench.errors import SdbenchError
from sdbench.strategies.polybasic import NGRAM


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


def run_chain_prediction(cfg: PredictChainConfig, console: Console) -> list[ChainRun]:
    slot = check_insertion(list(cfg.drafts), cfg.at)
    for name, value in (("--limit", cfg.limit), ("--max-new-tokens", cfg.max_new_tokens),  # --gamma: check_chain
                        ("--profile-prompts", cfg.profile_prompts), ("--profile-tokens", cfg.profile_tokens)):
        if value < 1:
            raise SdbenchError(f"{name} must be at least 1 (got {value})")
    if not cfg.temperature >= 0:
        raise SdbenchError(f"--temperature {cfg.temperature}: expected 0 (no sampling pass) or more")
    drafts = list(cfg.drafts)
    new_chain = [cfg.candidate if d is None else d for d in slot]
    rc = chain_config(cfg.target, [drafts, new_chain], cfg.dataset, cfg.limit, cfg.max_new_tokens, cfg.gamma, cfg.mu,
                      cfg.seed, cfg.device, cfg.dtype)
    pair, runners = load_chains(rc, console)
    _, encoded = encode_prompts(rc, pair)
    runs = [ChainRun("plain", []), ChainRun("chain", drafts), ChainRun("with candidate", new_chain)]
    sampling = SamplingConfig(cfg.temperature, seed=cfg.seed) if cfg.temperature > 0 else None
    profile_and_measure(pair, runs, runners, encoded[: cfg.profile_prompts], encoded, cfg.profile_tokens,
                        cfg.max_new_tokens, cfg.gamma, cfg.mu, sampling, console)
    print_chain_report(runs, cfg.target, cfg.candidate, cfg.at, console)
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
