"""The MagicDec reproduction's figures: speedup against batch size per context length (predicted and measured),
throughput against latency per token at the longest prompt length, and step cost against context.

Inputs as magicdec_claims.py takes them: `profiles` ({"target": [Profile], "draft": [Profile]}), `predicted`
(rows of `costs.with_alphas` with a "strategy" key) and `summary` (one row per real run, see
magicdec.run_summary).
"""

from __future__ import annotations

import math

from sdbench.commands.reproduce.common import Figure, figure_png, pyplot
from sdbench.commands.reproduce.magicdec_claims import self_spec_best


def speedup_figure(predicted: list[dict], summary) -> Figure:
    """The paper's central figure: speedup against batch size, one colour per context; lines predicted (solid:
    the best self-speculation setting; dashed: the runs' setting), markers measured (best selector)."""
    plt = pyplot()
    best = self_spec_best(predicted)  # {context: {batch: speedup}}
    spec = summary[summary["strategy"] == "magicdec"]
    at_run = {}
    for r in predicted:
        if r["strategy"] == "magicdec" and (r["gamma"], r["budget"]) in set(zip(spec["gamma"], spec["budget"])):
            key = (r["context"], r["batch"])
            at_run[key] = max(at_run.get(key, 0.0), r["predicted_speedup"])
    fig, ax = plt.subplots(figsize=(8, 4.8), constrained_layout=True)
    colours = plt.get_cmap("viridis")
    contexts = sorted(best)
    for i, context in enumerate(contexts):
        colour = colours(i / max(len(contexts) - 1, 1))
        batches = sorted(best[context])
        ax.plot(batches, [best[context][b] for b in batches], "-", color=colour, label=f"S={context} predicted")
        if context in set(spec["prompt_len"]):
            ax.plot(batches, [at_run.get((context, b), math.nan) for b in batches], "--", color=colour)
            got = spec[spec["prompt_len"] == context].groupby("batch")["measured_speedup"].max()
            ax.plot(got.index, got.values, "o", color=colour, markersize=8, markeredgecolor="black",
                    label=f"S={context} measured")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({b for per in best.values() for b in per}), minor=False)
    ax.xaxis.set_major_formatter("{x:.0f}")
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(fontsize=8, ncol=2)
    ax.set_title("self-speculation: speedup against batch size")
    return Figure("magicdec-speedup", "Speedup against batch size per context length: solid, the cost model's best "
                  "(gamma, budget, selector) with the measured acceptance; dashed, at the real runs' setting; markers, "
                  "measured (decode phase, best selector)", figure_png(fig))


def tradeoff_figure(summary) -> Figure:
    """Throughput against latency per token at the longest prompt length, one point per batch size."""
    plt = pyplot()
    longest = summary[summary["prompt_len"] == summary["prompt_len"].max()]
    fig, ax = plt.subplots(figsize=(8, 4.8), constrained_layout=True)
    plain = longest.groupby("batch")[["plain_latency_ms", "plain_throughput"]].mean()
    series = [("plain decoding", plain["plain_latency_ms"], plain["plain_throughput"], plain.index)]
    for (strategy, selector), g in longest.groupby(["strategy", "selector"], sort=False):
        label = f"MagicDec ({selector})" if strategy == "magicdec" else f"small draft ({selector} cache)"
        g = g.sort_values("batch")
        series.append((label, g["latency_ms"], g["throughput"], g["batch"]))
    for label, latency, throughput, batches in series:
        ax.plot(latency, throughput, "o-", label=label)
        for x, y, b in zip(latency, throughput, batches):
            ax.annotate(f"B={b}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("latency per token (ms, decode phase)")
    ax.set_ylabel("throughput (batch tokens / s)")
    ax.legend(fontsize=8)
    ax.set_title(f"throughput against latency, {int(longest['prompt_len'].iloc[0])}-token prompts")
    return Figure("magicdec-tradeoff", "Throughput against latency per token at the longest prompt length, one "
                  "point per batch size: plain decoding and each speculative configuration", figure_png(fig))


def cost_figure(profiles: dict, budget: int) -> Figure:
    """Step cost against context at batch 1 and the largest batch: T_T, self-speculation's T_D per budget, the
    small draft's dense and compressed step."""
    plt = pyplot()
    batches = sorted({p.batch for p in profiles["target"]})
    shown = dict.fromkeys((batches[0], batches[-1]))
    fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 4.5), constrained_layout=True, squeeze=False)
    for ax, batch in zip(axes[0], shown):
        target = sorted((p for p in profiles["target"] if p.batch == batch), key=lambda p: p.context)
        draft = sorted((p for p in profiles["draft"] if p.batch == batch), key=lambda p: p.context)
        ax.plot([p.context for p in target], [p.target_s * 1e3 for p in target], "o-", label="T_T (target step)")
        for b in sorted({b for p in target for b in p.draft_s}):
            at = [p for p in target if b in p.draft_s]
            ax.plot([p.context for p in at], [p.draft_s[b] * 1e3 for p in at], "s--", label=f"T_D self, budget {b}")
        ax.plot([p.context for p in draft], [p.target_s * 1e3 for p in draft], "^-", label="small draft, dense")
        at = [p for p in draft if budget in p.draft_s]
        ax.plot([p.context for p in at], [p.draft_s[budget] * 1e3 for p in at], "v:",
                label=f"small draft, budget {budget}")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter("{x:.0f}")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per step")
        ax.set_title(f"batch {batch}")
        ax.legend(fontsize=7)
    return Figure("magicdec-step-cost", "Step cost against context at batch 1 and the largest batch: the target's "
                  "step, its sparse-cache draft step per budget, and the small draft with a dense and a compressed "
                  "cache", figure_png(fig))
