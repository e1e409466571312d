"""The check's output: per call one folder of at most 8 files (one Parquet, a few PNGs, index.html), and the
merge of the parts' folders into one page.

The Parquet holds every section's rows (column `section`), the checks (section `checks`: claim, measured,
verdict, why) and the setup (section `setup`: key, setting), so that a merge needs nothing but the folders.
"""

from __future__ import annotations

from pathlib import Path

from sdbench.commands.reproduce.common import Claim, Figure, Report, figure_png, grouped_bars, pyplot, render_page
from sdbench.errors import SdbenchError
from sdbench.reporting.owned import publish, staged

PAGE = "index.html"
TITLE = "sdbench gpu-check: step costs, graphs, MagicDec and DSI at real models' shapes (random weights)"


def part_file(part: int) -> str:
    return f"part-{part}.parquet"


def arrow_safe(frame):
    """Object columns holding more than one kind of value (sections share column names) as text, so that
    Parquet can type them; missing values stay missing."""
    out = frame.copy()
    for col in out.columns:
        if out[col].dtype == object:
            kinds = {type(v) for v in out[col] if v is not None and v == v}
            if len(kinds) > 1:
                out[col] = out[col].map(lambda v: v if v is None or v != v else str(v))
    return out


def part_frame(part: int, sections, setup: dict):
    import pandas as pd  # not at import: see the package's docstring

    frames = [s.frame.assign(section=s.name) for s in sections if len(s.frame)]
    checks = [dict(vars(c), section="checks") for s in sections for c in s.checks]
    frames.append(pd.DataFrame(checks + [{"section": "setup", "key": k, "setting": str(v)} for k, v in setup.items()]))
    return arrow_safe(pd.concat(frames, ignore_index=True).assign(part=part))


def write_part(folder: Path, part: int, sections, setup: dict, notes: list[str]) -> Path:
    """folder/part-N.parquet, a PNG per section that draws one, and index.html; the files an earlier write
    recorded and this one lacks removed (reporting/owned.py), so a folder never mixes two calls and no file of
    anyone else's goes. Returns the page."""
    folder.mkdir(parents=True, exist_ok=True)
    frame = part_frame(part, sections, setup)
    figures = figures_of(frame)
    with staged(folder) as staging:
        frame.to_parquet(staging / part_file(part), index=False)
        for fig in figures:
            (staging / f"{fig.name}.png").write_bytes(fig.png)
        report = _report(f"sdbench gpu-check, part {part}", frame, figures, notes)
        (staging / PAGE).write_text(render_page(report), encoding="utf-8")
        publish(staging, folder)
    return folder / PAGE


def merge(out: Path) -> Path:
    """out/index.html from every out/part-N/part-N.parquet and its PNGs: one page for the parts' calls."""
    import pandas as pd  # not at import: see the package's docstring

    files = sorted(out.glob("part-*/part-*.parquet"))
    if not files:
        raise SdbenchError(f"{out}: no part-N/part-N.parquet to merge; run `sdbench gpu-check --part N --out {out}` "
                           "first (or copy the parts' folders there)")
    frame = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    figures = [Figure(f"{png.parent.name}-{png.stem}", f"{png.parent.name}: {png.stem}", png.read_bytes())
               for f in files for png in sorted(f.parent.glob("*.png"))]
    notes = [f"merged from {', '.join(str(f.relative_to(out)) for f in files)}"]
    with staged(out) as staging:  # out/index.html replaced only where an earlier merge wrote it
        (staging / PAGE).write_text(render_page(_report("sdbench gpu-check", frame, figures, notes)), encoding="utf-8")
        publish(staging, out)
    return out / PAGE


def _report(heading: str, frame, figures, notes) -> Report:
    checks = frame[frame["section"] == "checks"]
    claims = [Claim(r["claim"], r["measured"], r["verdict"], r["why"] if isinstance(r["why"], str) else "")
              for r in checks.to_dict("records")]
    tables = {}
    for (part, section), rows in frame.groupby(["part", "section"], sort=False):
        if section not in ("checks", "setup"):
            tables[f"part {part}: {section}"] = rows.drop(columns=["part", "section"]).dropna(axis=1, how="all")
    setup: dict = {}
    for r in frame[frame["section"] == "setup"].to_dict("records"):  # a setting that differs between parts: per part
        same = setup.get(r["key"], r["setting"]) == r["setting"]
        setup[r["key"] if same else f"{r['key']} (part {r['part']})"] = r["setting"]
    return Report("gpu-check", TITLE, claims, tables, figures, setup, notes, heading=heading)


# ---- figures ---------------------------------------------------------------------------------------------------


def figures_of(frame) -> list[Figure]:
    """One figure per section that has one and rows to draw."""
    out = []
    for section, draw in (("bench", bench_figure), ("step-costs", cost_figure), ("predict", predict_figure),
                          ("magicdec", magicdec_figure), ("dsi", dsi_figure)):
        rows = frame[frame["section"] == section].dropna(axis=1, how="all")
        if len(rows):
            out.append(draw(rows))
    return out


def bench_figure(rows) -> Figure:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    models = list(dict.fromkeys(rows["model"]))
    kinds = list(dict.fromkeys(rows["kind"]))

    def series(col):
        return [(k, [float(rows[(rows["model"] == m) & (rows["kind"] == k)][col].max()) for m in models])
                for k in kinds]

    grouped_bars(left, range(len(models)), series("tokens_per_s"))
    grouped_bars(right, range(len(models)), series("of_roofline"))
    for ax, label in ((left, "tokens/s (median), batch 1"), (right, "share of the memory roofline")):
        ax.set_xticks(range(len(models)), models, fontsize=8)
        ax.set_ylabel(label)
    left.legend(fontsize=8)
    fig.tight_layout()
    return Figure("bench", "bench: plain decoding per system and model shape", figure_png(fig))


def cost_figure(rows) -> Figure:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    timed = rows[rows["kind"] != "not measured"].astype({"batch": int, "context": int})
    for batch, group in timed.groupby("batch"):
        target = group[group["kind"] == "target"].sort_values("context")
        line = axes[0].plot(target["context"], target["ms"], marker="o", label=f"batch {batch}: target")[0]
        draft = group[group["kind"] == "draft"]
        if len(draft):
            smallest = draft[draft["budget"] == draft["budget"].min()].sort_values("context")
            axes[0].plot(smallest["context"], smallest["ms"], ls="--", color=line.get_color())
        verify = group[group["kind"] == "verify"]
        if len(verify):
            widest = verify[verify["gamma"] == verify["gamma"].max()].sort_values("context")
            ratio = widest["ms"].to_numpy() / target.set_index("context").loc[widest["context"], "ms"].to_numpy()
            axes[1].plot(widest["context"], ratio, marker="o", color=line.get_color(), label=f"batch {batch}")
    axes[0].set_ylabel("ms per step")
    axes[0].set_title("solid: target, dense cache; dashed: sparse draft, smallest budget", fontsize=9)
    axes[1].set_ylabel("T(gamma + 1) / T(1), widest gamma")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return Figure("step-costs", "step costs through the graphs, per batch size", figure_png(fig))


def predict_figure(rows) -> Figure:
    plt = pyplot()
    best = rows.astype({"batch": int, "context": int}).groupby(["batch", "context"])["predicted_speedup"].max()
    best = best.unstack("context")
    fig, ax = plt.subplots(figsize=(7, 4))
    image = ax.imshow(best.to_numpy(), cmap="RdYlGn", vmin=0.5, vmax=1.5, aspect="auto", origin="lower")
    ax.set_xticks(range(len(best.columns)), [str(c) for c in best.columns])
    ax.set_yticks(range(len(best.index)), [str(b) for b in best.index])
    for (i, j), v in _cells(best.to_numpy()):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("batch")
    fig.colorbar(image, label="best predicted speedup (gamma, budget)")
    fig.tight_layout()
    return Figure("predict", f"MagicDec's predicted speedup, alpha {rows['alpha'].iloc[0]}", figure_png(fig))


def _cells(values):
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            if v == v:
                yield (i, j), v


def magicdec_figure(rows) -> Figure:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    shown = rows[rows["kind"] != "run: baseline"]
    ax.bar(range(len(shown)), shown["speedup"], color=["tab:blue"] + ["tab:gray"] * (len(shown) - 1))
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(shown)), [k.replace("run: strategy", "measured") for k in shown["kind"]], fontsize=8)
    ax.set_ylabel("speedup over plain decoding (decode phase)")
    fig.tight_layout()
    return Figure("magicdec", "MagicDec run: measured against predicted speedup", figure_png(fig))


def dsi_figure(rows) -> Figure:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = rows.astype({"workers": int})
    workers = sorted(rows["workers"].unique())
    grouped_bars(ax, range(len(workers)), [(role, [float(rows[(rows["workers"] == w) & (rows["role"] == role)]
                                                         ["tokens_per_s"].mean()) for w in workers])
                                           for role in dict.fromkeys(rows["role"])])
    ax.set_xticks(range(len(workers)), [f"{w} workers" for w in workers])
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return Figure("dsi", "DSI on one device against plain decoding", figure_png(fig))
