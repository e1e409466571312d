"""The on-the-fly adaptation paper on this machine: Liu, Park and Shen, "A Drop-In Solution for On-the-Fly
Adaptation of Speculative Decoding in Large Language Models" (ACL 2025).

Two draft candidates with different cost and acceptance: a model (by default an int8 copy of the target;
`--draft MODEL` replaces it) and prompt lookup (`ngram`). On each data set (MT-Bench, GSM8K, HumanEval, first
turns), every run on one loaded pair and each beside plain decoding on the same prompts:
1. sweep: sdbench's `adaptive` (candidate chosen every round, alpha shrunk toward a prior) with
   `compare=1,2,4,6,8`, so fixed-gamma SD with each candidate at each gamma runs on the same prompts. Its best
   fixed setting is the oracle a user needs offline benchmarking to find; gamma = 4 (sdbench's default) is the
   one a user would guess.
2. paper: the paper's method, `adaptive` with `select=prompt` (the draft chosen per prompt from its features)
   and `prior_trials=0` (the plain maximum-likelihood alpha).
3. alone: the paper's method with one candidate at a time (window-size optimisation only).
4. fsm-step, fsm-heuristic: `adaptive-fsm`, the state-machine schedules, drafting with the candidate that
   was fastest at its best fixed gamma in that data set's sweep (the draft a user would keep).
A system is judged by its speedup over its own run's plain decoding, so load that differs between runs
cancels; the claims are in adaptive_claims.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import pandas as pd

from sdbench.commands import run as run_module  # the module: tests replace run.RunHarness
from sdbench.commands.reproduce.adaptive_claims import GUESSED, MARGIN, TUNING_GAP, judge
from sdbench.commands.reproduce.common import (Figure, Report, ReproduceConfig, environment_facts, figure_png,
                                               grouped_bars, pyplot)
from sdbench.config import RunConfig
from sdbench.drafting.ngram import DRAFT_NAME as NGRAM
from sdbench.engine.counters import AdaptiveRowStats
from sdbench.errors import SdbenchError
from sdbench.models.loading import pair as pair_module  # the module: tests replace pair.load_pair
from sdbench.reporting import results  # the module: tests replace results.read_results
from sdbench.reporting.summary import ALL, summarize

TITLE = ("A Drop-In Solution for On-the-Fly Adaptation of Speculative Decoding in Large Language Models "
         "(Jiesong Liu, Brian Park, Xipeng Shen, ACL 2025)")
DATASETS = ("mt-bench", "gsm8k", "humaneval")
PAPER_OPTIONS = {"select": "prompt", "prior_trials": "0"}
SCHEDULES = ("step", "heuristic")


@dataclass(frozen=True)
class AdaptivePlan:
    datasets: tuple[str, ...]
    limit: int  # prompts per run
    max_new_tokens: int
    turns: int = 1  # MT-Bench: first turns only
    compare: tuple[int, ...] = (1, 2, 4, 6, 8)  # the fixed-gamma sweep


QUICK = AdaptivePlan(DATASETS, limit=2, max_new_tokens=48)
FULL = AdaptivePlan(DATASETS, limit=4, max_new_tokens=64)


def reproduce(cfg: ReproduceConfig, folder, console) -> Report:
    plan = QUICK if cfg.quick else FULL
    start = time.perf_counter()
    done = real_runs(cfg, plan, folder / "runs", console)
    seconds = time.perf_counter() - start
    rows = collect(done["runs"])
    systems, selection, gammas = systems_table(rows), selection_table(rows, done["candidates"]), gamma_table(rows)
    claims = judge(systems, selection, done["candidates"], done["fsm_draft"])
    figures = [speedup_figure(systems, done["candidates"], done["fsm_draft"]), gamma_figure(gammas, done["fsm_draft"])]
    setup = setup_facts(cfg, plan, done, seconds, folder)
    tables = {"adaptive-systems": systems, "adaptive-selection": selection, "adaptive-gamma": gammas}
    return Report("adaptive", TITLE, claims, tables, figures, setup, notes(systems, selection, done["candidates"]))


# ---- the real runs ---------------------------------------------------------------------------------------


def candidates(cfg: ReproduceConfig) -> tuple[str, str]:
    """(the model candidate, prompt lookup)."""
    model = cfg.small_draft
    if model == NGRAM:
        raise SdbenchError(f"reproduce adaptive: --draft names the model candidate; prompt lookup ({NGRAM}) is "
                           "always the other one")
    return model, NGRAM


def run_configs(cfg: ReproduceConfig, plan: AdaptivePlan, dataset: str, out, fsm_draft: str) -> dict:
    """Run name -> RunConfig for one data set, the sweep first."""
    both = candidates(cfg)
    base = RunConfig(target=cfg.target, drafts=both, strategy="adaptive", dataset=dataset, limit=plan.limit,
                     max_new_tokens=plan.max_new_tokens, turns=plan.turns, device=cfg.device, dtype=cfg.dtype,
                     out=str(out / dataset), gammas=(GUESSED,))
    configs = {"sweep": replace(base, options={"compare": ",".join(map(str, plan.compare))}),
               "paper": replace(base, options=dict(PAPER_OPTIONS))}
    for c in both:
        configs[f"alone:{c}"] = replace(base, drafts=(c,), options={"prior_trials": "0"})
    for schedule in SCHEDULES:
        configs[f"fsm-{schedule}"] = replace(base, strategy="adaptive-fsm", drafts=(fsm_draft,),
                                             options={"schedule": schedule})
    return configs


def real_runs(cfg: ReproduceConfig, plan: AdaptivePlan, out, console) -> dict:
    """Every run of the plan on one loaded pair. Returns {"runs": {dataset: {run: Parquet path}},
    "fsm_draft": {dataset: candidate}, "candidates": (model, ngram)}."""
    both = candidates(cfg)
    checked = [run_module.RunHarness(c, console)  # every setting before the models load
               for d in plan.datasets for fsm in both
               for name, c in run_configs(cfg, plan, d, out, fsm).items() if fsm == both[0] or name.startswith("fsm")]
    pair = pair_module.load_pair(checked[0].cfg, checked[0].device, checked[0].dtype, console)
    runs, fsm_drafts = {}, {}
    for dataset in plan.datasets:
        sweep = run_configs(cfg, plan, dataset, out, both[0])["sweep"]
        paths = {"sweep": run_module.RunHarness(sweep, console, pair=pair).run()}
        fsm_drafts[dataset] = sweep_winner(paths["sweep"], both)
        console.print(f"{dataset}: the FSM schedules draft with {fsm_drafts[dataset]}, the candidate fastest at its "
                      "best fixed γ in the sweep", highlight=False)
        for name, config in run_configs(cfg, plan, dataset, out, fsm_drafts[dataset]).items():
            if name != "sweep":
                paths[name] = run_module.RunHarness(config, console, pair=sub_pair(pair, both, config.drafts)).run()
        runs[dataset] = paths
    return {"runs": runs, "fsm_draft": fsm_drafts, "candidates": both}


def sub_pair(pair, both: tuple[str, ...], drafts: tuple[str, ...]):
    """The loaded pair with only the drafts a run names (the models stay loaded once)."""
    return replace(pair, drafts=[pair.drafts[both.index(d)] for d in drafts])


def sweep_winner(path, both: tuple[str, ...]) -> str:
    """The candidate whose best fixed-gamma configuration had the most tokens/s in a sweep run."""
    rows = collect({"-": {"sweep": path}})
    fixed = systems_table(rows)
    fixed = fixed[fixed["kind"] == "fixed"]
    return str(fixed.loc[fixed["tokens_per_s"].idxmax(), "draft"]) if len(fixed) else both[0]


# ---- measurements ----------------------------------------------------------------------------------------


def collect(runs: dict):
    """Every row of every run, with `dataset` the plan's name for it and `run` the run's name."""
    frames = [results.read_results([str(path)]).assign(dataset=dataset, run=run)
              for dataset, paths in runs.items() for run, path in paths.items()]
    return pd.concat(frames, ignore_index=True)


def describe_system(run: str, role: str, group) -> tuple[str, str, str, float]:
    """(system, kind, draft, fixed gamma) of one role of one run."""
    draft = str(group["draft"].iloc[0] or "")
    if role == "baseline":
        return "plain", "plain", "", math.nan
    if run == "sweep" and role == "strategy":
        return "adaptive (sdbench)", "sdbench", draft, math.nan
    if run == "sweep":
        gamma = int(group["gamma"].iloc[0])
        return f"fixed γ={gamma}, {draft}", "fixed", draft, float(gamma)
    if run == "paper":
        return "adaptive (paper)", "paper", draft, math.nan
    if run.startswith("alone:"):
        return f"adaptive (paper), {draft} only", "alone", draft, math.nan
    schedule = run.removeprefix("fsm-")
    return f"FSM {schedule}, {draft}", f"fsm-{schedule}", draft, math.nan


def systems_table(rows):
    """Per data set x system: tokens/s, speedup over its own run's plain decoding (with its interval), mean
    accepted length, acceptance rate, mean gamma chosen (plain steps count as 0) and the run's plain tokens/s.
    Plain decoding appears once per data set (the sweep's); every run's own is in plain_tokens_per_s."""
    out = []
    for (dataset, run), df in rows.groupby(["dataset", "run"], sort=False):
        summary = summarize(df)
        summary = summary[summary["category"] == ALL].set_index("role")
        plain = float(summary.loc["baseline", "tokens_per_s"]) if "baseline" in summary.index else math.nan
        for role, group in df.groupby("role", sort=False):
            if role == "baseline" and run != "sweep":
                continue
            s = summary.loc[role]
            system, kind, draft, gamma = describe_system(run, role, group)
            out.append({"dataset": dataset, "system": system, "kind": kind, "run": run, "draft": draft,
                        "gamma": gamma, "prompts": int(s["n_prompts"]), "tokens_per_s": float(s["tokens_per_s"]),
                        "speedup": float(s["speedup"]), "speedup_low": float(s["speedup_low"]),
                        "speedup_high": float(s["speedup_high"]), "mean_accepted_len": float(s["mean_accepted_len"]),
                        "acceptance_rate": float(s["acceptance_rate"]),
                        "mean_gamma": gamma if kind == "fixed" else mean_gamma(gamma_hist(group)),
                        "plain_tokens_per_s": plain})
    return pd.DataFrame(out)


def row_stats(group) -> list[AdaptiveRowStats]:
    return [AdaptiveRowStats.from_dict(results.parse_stats(s)) for s in group["strategy_stats"]]


def gamma_hist(group) -> dict[int, int]:
    """Rounds at each gamma (0 = a plain step), pooled over the rows of an adaptive strategy; {} otherwise."""
    hist: dict[int, int] = {}
    for stats in row_stats(group):
        for g, n in stats.gamma_hist.items():
            hist[g] = hist.get(g, 0) + n
    return dict(sorted(hist.items()))


def mean_gamma(hist: dict[int, int]) -> float:
    rounds = sum(hist.values())
    return sum(g * n for g, n in hist.items()) / rounds if rounds else math.nan


def gamma_table(rows):
    """Per data set and adaptive or state-machine system: the share of its rounds at each gamma. Rows record
    how many rounds used each gamma (RowTrace), not their order, so this is a distribution, not a trajectory."""
    out = []
    for (dataset, run, role), group in rows.groupby(["dataset", "run", "role"], sort=False):
        hist = gamma_hist(group)
        system = describe_system(run, role, group)
        for g, n in hist.items():
            out.append({"dataset": dataset, "system": system[0], "kind": system[1], "draft": system[2], "gamma": g,
                        "rounds": n, "share": n / sum(hist.values())})
    return pd.DataFrame(out, columns=["dataset", "system", "kind", "draft", "gamma", "rounds", "share"])


def selection_table(rows, both: tuple[str, str]):
    """Per prompt of the paper's runs: the draft it selected, whether that was an exploration (a candidate not
    measured yet) or the prompt model's choice, each candidate's tokens/s at its best fixed gamma on that prompt
    (the sweep), the fastest, and whether the selection was right (within MARGIN of the fastest)."""
    out = []
    for dataset, df in rows.groupby("dataset", sort=False):
        fixed = df[(df["run"] == "sweep") & df["role"].str.startswith("compare-")]
        best = fixed.groupby(["prompt_id", "turn", "draft"])["tokens_per_s"].max()
        paper = df[(df["run"] == "paper") & (df["role"] == "strategy")]
        for row, stats in zip(paper.itertuples(), row_stats(paper)):
            speeds = {c: float(best.get((row.prompt_id, row.turn, c), math.nan)) for c in both}
            fastest = max(both, key=lambda c: -math.inf if math.isnan(speeds[c]) else speeds[c])
            chosen = stats.selected or ""
            mine = speeds.get(chosen, math.nan)
            out.append({"dataset": dataset, "prompt_id": row.prompt_id, "turn": int(row.turn), "selected": chosen,
                        "exploring": bool(stats.exploring), "fastest": fastest,
                        "model_draft": both[0], "model_best_tokens_per_s": speeds[both[0]],
                        "ngram_best_tokens_per_s": speeds[both[1]],
                        "gap": max(speeds.values()) / min(speeds.values()) - 1.0,
                        "right": bool(mine >= speeds[fastest] * (1.0 - MARGIN))})
    columns = ["dataset", "prompt_id", "turn", "selected", "exploring", "fastest", "model_draft",
               "model_best_tokens_per_s", "ngram_best_tokens_per_s", "gap", "right"]
    return pd.DataFrame(out, columns=columns)


def notes(systems, selection, both: tuple[str, str]) -> list[str]:
    """Plain sentences on what the pair and the plan here leave room for, from the measurements."""
    out = []
    fixed = systems[(systems["kind"] == "fixed") & (systems["draft"] == both[0])]
    best = fixed.groupby("dataset")["speedup"].max()
    if len(best) and (best < 1.0).all():
        out.append(f"{both[0]} never beat plain decoding at any fixed γ (at best {best.max():.2f}x, with acceptance "
                   f"up to {fixed['acceptance_rate'].max():.0%}): drafting with it costs more time than it saves "
                   f"here, so with it the adaptation can only gain by drafting less; {both[1]} is the candidate "
                   "that pays.")
    explored = int(selection["exploring"].sum())
    if explored:
        out.append(f"{explored} of the {len(selection)} prompts of the paper's runs explored a candidate whose cost "
                   "the run had not measured yet rather than being chosen by the prompt model; the speedups of "
                   "the paper's method include that exploration.")
    half = ((systems["speedup_high"] - systems["speedup_low"]) / 2).median()
    if half == half:  # not NaN
        out.append(f"With {int(systems['prompts'].max())} prompts per run the speedups' 95% bootstrap intervals have "
                   f"a median half-width of ±{half:.2f}: smaller differences are within this plan's noise.")
    return out


# ---- figures and setup -----------------------------------------------------------------------------------


def headline(systems, both: tuple[str, str], fsm_drafts: dict):
    """Per data set, the speedups the figure shows: both adaptive systems, the sweep's best fixed setting,
    the guessed gamma (with the faster candidate there and with the model), the paper's method with the FSM's
    draft alone and the FSM schedules with it; `draft` names the candidate where one is fixed."""
    out = []
    for dataset, df in systems.groupby("dataset", sort=False):
        c = fsm_drafts.get(dataset, both[0])
        fixed = df[df["kind"] == "fixed"]
        guessed = fixed[fixed["gamma"] == GUESSED]
        pick = [("adaptive (paper)", df[df["kind"] == "paper"]), ("adaptive (sdbench)", df[df["kind"] == "sdbench"]),
                ("best fixed γ (sweep)", fixed), (f"γ={GUESSED}, faster draft", guessed),
                (f"γ={GUESSED}, model draft", guessed[guessed["draft"] == both[0]]),
                ("paper, FSM's draft only", df[(df["kind"] == "alone") & (df["draft"] == c)])]
        pick += [(f"FSM {s}", df[df["kind"] == f"fsm-{s}"]) for s in SCHEDULES]
        for label, part in pick:
            top = part.loc[part["speedup"].idxmax()] if part["speedup"].notna().any() else None
            out.append({"dataset": dataset, "system": label, "draft": "" if top is None else top["draft"],
                        "speedup": math.nan if top is None else float(top["speedup"])})
    return pd.DataFrame(out, columns=["dataset", "system", "draft", "speedup"])


def speedup_figure(systems, both: tuple[str, str], fsm_drafts: dict) -> Figure:
    frame = headline(systems, both, fsm_drafts)
    datasets, labels = list(dict.fromkeys(frame["dataset"])), list(dict.fromkeys(frame["system"]))
    fig, ax = pyplot().subplots(figsize=(10, 5.4), layout="constrained")
    x = range(len(datasets))
    grouped_bars(ax, x, [(label, frame[frame["system"] == label].set_index("dataset")["speedup"].reindex(datasets))
                         for label in labels])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(x, [f"{d}\n(FSM draft: {fsm_drafts.get(d, '')})" for d in datasets])
    ax.set_ylabel("speedup over plain decoding (its own run)")
    fig.legend(loc="outside lower center", fontsize=8, ncol=4)
    ax.set_title(f"speedup per system and data set (model draft: {both[0]}; grey: plain decoding)")
    return Figure("adaptive-speedup", "Speedup over plain decoding per system and data set, each over the plain "
                  "decoding of its own run", figure_png(fig))


def gamma_figure(gammas, fsm_drafts: dict) -> Figure:
    datasets = list(dict.fromkeys(gammas["dataset"])) or ["-"]
    fig, axes = pyplot().subplots(1, len(datasets), figsize=(4 * len(datasets), 3.8), constrained_layout=True,
                             squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        c = fsm_drafts.get(dataset)
        part = gammas[(gammas["dataset"] == dataset) & (gammas["draft"] == c)
                      & gammas["kind"].isin(["alone", *(f"fsm-{s}" for s in SCHEDULES)])]
        share = part.pivot_table(index="gamma", columns="system", values="share", sort=True)
        grouped_bars(ax, share.index, [(system, share[system].fillna(0.0))
                                       for system in dict.fromkeys(part["system"])])
        ax.set_title(f"{dataset} ({c})")
        ax.set_xlabel("γ (0 = plain step)")
        ax.set_ylabel("share of rounds")
        ax.legend(fontsize=7)
    return Figure("adaptive-gamma", "Share of rounds at each γ: the paper's window-size optimisation against the "
                  "state machines, same draft (rows record γ counts, not their order)", figure_png(fig))


def setup_facts(cfg: ReproduceConfig, plan: AdaptivePlan, done: dict, seconds: float, folder) -> dict:
    facts = environment_facts(cfg)
    facts.update({
        "target": cfg.target, "draft candidates": ", ".join(done["candidates"]), "quick": cfg.quick,
        "data sets": ", ".join(plan.datasets), "prompts per run": plan.limit, "max new tokens": plan.max_new_tokens,
        "turns": plan.turns, "fixed-γ sweep": ",".join(map(str, plan.compare)),
        "guessed γ (standard SD)": f"{GUESSED} (sdbench's default; transformers' assisted generation starts at 5)",
        "paper's method": "adaptive, " + ", ".join(f"{k}={v}" for k, v in PAPER_OPTIONS.items()),
        "FSM draft per data set": ", ".join(f"{d}: {c}" for d, c in done["fsm_draft"].items()),
        "noise margin": f"{MARGIN:.0%}", "tuning gap allowed": f"{TUNING_GAP:.0%}",
        "runs wall time (s)": round(seconds, 1),
        "runs": "; ".join(f"{d}/{r}: {p}" for d, paths in done["runs"].items() for r, p in paths.items()),
        "folder": str(folder),
    })
    return facts
