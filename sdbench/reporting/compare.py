"""`sdbench compare BASELINE CURRENT`: a regression gate over two sets of result rows.

Both sides must have been run with the same SETTINGS (token budget, sampling, dtype, fast path): results made
with different ones are refused (exit 2, one line naming each difference) unless --across names those settings.
Rows are matched on KEY (a configuration: KEY without the prompt). Per matched key and metric, each side's repeats give a median m and a median absolute
deviation (MAD). The change is m_current / m_baseline - 1, and its noise is (MAD_baseline + MAD_current) /
m_baseline: how far the repeats of the two sides spread. A key regresses on a metric when its drop exceeds
both --max-regression and the noise, so a drop no larger than the runs' own jitter never fails the gate.

A fleet's results (either side holding rows of several hardware classes, the `hardware` column every row
records) are matched within each class: every machine is gated against its own class's baseline, and a class
found on one side only is said, not compared. One class on each side is compared across, with a note when they
differ (a new machine against the old one).

Per configuration and metric, the change of the mean over the matched prompts (current mean / baseline mean
- 1) also gets a 95 % bootstrap interval over prompts, repeats resampled within each prompt (sdbench.reporting.stats).
The interval tells noise (it contains 0) from a regression (it lies wholly below -max_regression): a
configuration whose interval says regression fails the gate even where no single prompt's repeats did. Below
stats.MIN_PROMPTS prompts there is no interval (verdict "too few prompts"); a current speedup above the bound its
accepted length allows (reporting/bounds.py) is never called faster (verdict "above its bound"). Any
current row whose output differed from plain decoding (lossless false) fails the gate too, unless it differed
only from a low-precision tie (divergence "tie", see sdbench.commands.divergence).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table
from rich.text import Text

from sdbench.errors import SdbenchError
from sdbench.options import split_list
from sdbench.reporting.bounds import rows_distorted
from sdbench.reporting.results import read_results
from sdbench.reporting.stats import Interval, bootstrap_ratio, spread

TOO_FEW = "too few prompts"
DISTORTED = "above its bound"  # the current speedup exceeds what its accepted length allows (reporting/bounds.py)
KEY = ("strategy", "params", "target", "draft", "dataset", "prompt_id", "turn", "batch_size")
METRICS = ("tokens_per_s", "speedup")
# column -> the option that sets it, as typed on the command line (and as --across takes it)
SETTINGS = {"max_new_tokens": "max-new-tokens", "temperature": "temperature", "top_p": "top-p", "seed": "seed",
            "dtype": "dtype", "fast": "fast"}


class RegressionFound(SdbenchError):
    """The gate failed: exit code 1 (bad input stays 2)."""

    exit_code = 1


@dataclass
class Comparison:
    deltas: pd.DataFrame  # one row per matched key and metric
    lossy: pd.DataFrame  # current rows that broke losslessness
    only_baseline: int = 0  # keys without a partner
    only_current: int = 0
    notes: list[str] = field(default_factory=list)
    configurations: pd.DataFrame | None = None  # per configuration and metric: the change's interval, verdict
    key: tuple = KEY  # what rows are matched on: KEY, and the hardware class for a fleet

    @property
    def config(self) -> list[str]:
        """One configuration's columns: the key without the prompt."""
        return [k for k in self.key if k != "prompt_id"]

    @property
    def regressions(self) -> pd.DataFrame:
        return self.deltas[self.deltas["regressed"]]

    @property
    def interval_regressions(self) -> pd.DataFrame:
        """Configurations whose interval lies below the gate although no single prompt regressed."""
        configs = self.configurations
        if configs is None or configs.empty:
            return pd.DataFrame(columns=self.config + ["metric"])
        flagged = set(map(tuple, self.regressions[self.config + ["metric"]].astype(str).to_numpy()))
        keys = configs[self.config + ["metric"]].astype(str).to_numpy()
        return configs[configs["verdict"].eq("regression").to_numpy() & np.array([tuple(k) not in flagged
                                                                                 for k in keys], dtype=bool)]

    @property
    def failed(self) -> bool:
        return bool(len(self.regressions) or len(self.lossy) or len(self.interval_regressions))


def match_key(baseline: pd.DataFrame, current: pd.DataFrame) -> tuple:
    """KEY, plus the hardware class when either side holds several classes' rows (a fleet)."""
    if "hardware" in baseline and "hardware" in current and \
            max(baseline["hardware"].nunique(), current["hardware"].nunique()) > 1:
        return KEY + ("hardware",)
    return KEY


def _keyed(df: pd.DataFrame, key: tuple) -> pd.DataFrame:
    data = df.copy()
    for column in key:
        if column not in data:
            data[column] = None
        if column == "turn":  # files from before turns hold first turns only
            data[column] = data[column].fillna(1).astype("int64")
        data[column] = data[column].astype(object).where(data[column].notna(), "")
    return data


def compare_frames(baseline: pd.DataFrame, current: pd.DataFrame, max_regression: float = 0.05) -> Comparison:
    """Medians, MADs and relative changes per matched key; max_regression is a fraction (0.05 = 5 %)."""
    key_columns = match_key(baseline, current)
    base, cur = _keyed(baseline, key_columns), _keyed(current, key_columns)
    base_groups = dict(list(base.groupby(list(key_columns), sort=False)))
    cur_groups = dict(list(cur.groupby(list(key_columns), sort=False)))
    matched = [k for k in cur_groups if k in base_groups]
    records = []
    for key in matched:
        for metric in METRICS:
            if metric not in base or metric not in cur or (metric == "speedup" and key[0] == "autoregressive"):
                continue  # plain decoding's speedup over itself is 1 by definition
            b_med, b_mad, b_n = spread(pd.to_numeric(base_groups[key][metric], errors="coerce").to_numpy(float))
            c_med, c_mad, c_n = spread(pd.to_numeric(cur_groups[key][metric], errors="coerce").to_numpy(float))
            if not (b_n and c_n and b_med > 0):
                continue
            change = c_med / b_med - 1.0
            noise = (b_mad + c_mad) / b_med
            records.append({**dict(zip(key_columns, key)), "metric": metric, "baseline": b_med, "current": c_med,
                            "change": change, "noise": noise, "n_baseline": b_n, "n_current": c_n,
                            "regressed": -change > max_regression and -change > noise})
    columns = list(key_columns) + ["metric", "baseline", "current", "change", "noise", "n_baseline", "n_current",
                                   "regressed"]
    deltas = pd.DataFrame(records, columns=columns)
    lossless = cur["lossless"] if "lossless" in cur else pd.Series(dtype="boolean")
    broke = lossless.astype("boolean").fillna(True).eq(False).astype(bool)
    if "divergence" in cur and len(broke):
        broke &= ~cur["divergence"].eq("tie").fillna(False).astype(bool)
    lossy = cur[broke] if len(lossless) else cur.iloc[:0]
    configs = configuration_intervals(base_groups, cur_groups, matched, deltas, max_regression, key_columns)
    return Comparison(deltas, lossy, len(set(base_groups) - set(matched)), len(set(cur_groups) - set(matched)),
                      machine_notes(base, cur, key_columns), configs, key_columns)


def machine_notes(base: pd.DataFrame, cur: pd.DataFrame, key: tuple) -> list[str]:
    """What differs in machines: a fleet's classes found on one side only; else each side's one class when
    they differ (and the device)."""
    notes = []
    if "hardware" in key:
        old, new = set(base["hardware"].dropna()), set(cur["hardware"].dropna())
        notes += [f"hardware {h}: no baseline rows, not compared" for h in sorted(map(str, new - old))]
        notes += [f"hardware {h}: no current rows" for h in sorted(map(str, old - new))]
        return notes
    for column in ("hardware", "device"):
        if column in base and column in cur:
            old, new = set(base[column].dropna()), set(cur[column].dropna())
            if old and new and old != new:
                notes.append(f"{column} differs: baseline {', '.join(map(str, old))} vs current "
                             f"{', '.join(map(str, new))}")
    return notes


def configuration_intervals(base_groups: dict, cur_groups: dict, matched: list, deltas: pd.DataFrame,
                            max_regression: float, key_columns: tuple = KEY) -> pd.DataFrame:
    """Per configuration and metric compared per prompt: the change of the mean over its prompts, its 95 %
    bootstrap interval (prompts resampled, repeats within them) and the verdict it gives."""
    records = []
    config_columns = [c for c in key_columns if c != "prompt_id"]
    for key in deltas.groupby(config_columns + ["metric"], sort=False).groups:
        config, metric = key[:-1], key[-1]
        keys = [k for k in matched if tuple(k[i] for i, c in enumerate(key_columns) if c != "prompt_id") == config]
        sides = [[pd.to_numeric(g[k][metric], errors="coerce").to_numpy(float) for g in (cur_groups, base_groups)]
                 for k in keys]
        change = bootstrap_ratio(_value_cells(sides), paired_repeats=False).shifted(-1.0)
        said = verdict(change, max_regression)
        if metric == "speedup" and said != "regression" and rows_distorted(pd.concat([cur_groups[k] for k in keys])):
            said = DISTORTED  # a speedup above its bound is no gain, whatever its interval says
        records.append({**dict(zip(config_columns, config)), "metric": metric, "prompts": len(keys),
                        "change": change.value, "low": change.low, "high": change.high, "verdict": said})
    return pd.DataFrame(records, columns=config_columns + ["metric", "prompts", "change", "low", "high", "verdict"])


def _value_cells(sides: list[list[np.ndarray]]) -> np.ndarray:
    """[prompts, repeats, 4]: (current value, 1, baseline value, 1) per prompt and repeat, NaN past a side's
    repeats, so the ratio of sums is current mean / baseline mean."""
    repeats = max(len(v) for pair in sides for v in pair)
    cells = np.full((len(sides), repeats, 4), np.nan)
    for i, (current, baseline) in enumerate(sides):
        for j, values in enumerate((current, baseline)):
            values = values[np.isfinite(values)]
            cells[i, : len(values), 2 * j] = values
            cells[i, : len(values), 2 * j + 1] = 1.0
    return cells


def verdict(change: Interval, max_regression: float) -> str:
    """What a change's interval says: regression (wholly below -max_regression), noise (it contains 0),
    faster, or a drop within the gate; 'too few prompts' below stats.MIN_PROMPTS, '–' without an interval."""
    if not change.known:
        return TOO_FEW if change.too_few else "–"
    if change.high < -max_regression:
        return "regression"
    if change.contains(0.0):
        return "noise"
    return "faster" if change.low > 0 else "drop within gate"


def different_settings(baseline: pd.DataFrame, current: pd.DataFrame) -> dict[str, tuple[set, set]]:
    """Option name -> (baseline values, current values) for each SETTINGS column the two sides disagree on
    (a column either side lacks, as in files older than it, is not compared)."""
    found = {}
    for column, option in SETTINGS.items():
        if column in baseline and column in current:
            old, new = set(baseline[column].dropna()), set(current[column].dropna())
            if old and new and old != new:
                found[option] = (old, new)
    return found


def check_settings(baseline: pd.DataFrame, current: pd.DataFrame, across: str = "") -> None:
    """Raise (exit 2) when the sides were run with different settings not named in `across`, or when one side
    has random weights (MODEL@random) and the other real ones, which no --across allows."""
    old, new = _weights(baseline), _weights(current)
    if old != new:
        raise SdbenchError(f"baseline has {_values(old)} weights and current {_values(new)}: a run with random weights "
                           "(MODEL@random) is gated only against another with random weights")
    allowed = {s.lstrip("-") for s in split_list(across, "--across")}
    unknown = sorted(allowed - set(SETTINGS.values()))
    if unknown:
        raise SdbenchError(f"--across {across}: unknown setting '{unknown[0]}' (settings: "
                           f"{', '.join(SETTINGS.values())})")
    differ = {k: v for k, v in different_settings(baseline, current).items() if k not in allowed}
    if differ:
        said = "; ".join(f"--{k} {_values(old)} vs {_values(new)}" for k, (old, new) in differ.items())
        raise SdbenchError(f"baseline and current were run with different settings ({said}): pass --across "
                           f"{','.join(differ)} to compare them anyway")


def _weights(rows: pd.DataFrame) -> set:
    """The weights a side's rows were run with: "random" (MODEL@random) or "real" (files from before the column)."""
    if "weights" not in rows:
        return {"real"}
    return set(rows["weights"].astype(object).where(rows["weights"].notna(), "real"))


def _values(values: set) -> str:
    return ",".join(sorted(str(v) for v in values))


def _label(row) -> str:
    """The configuration a delta belongs to, short: 'draft gamma=4 · smollm2-135m'."""
    params = str(row["params"]).strip("{}").replace('"', "").replace(": ", "=")
    name = f"{row['strategy']} {params}".strip()
    return name + (f" · {row['draft']}" if row["draft"] else "")


def comparison_table(result: Comparison, max_regression: float) -> Table:
    """Per configuration and metric: median change over prompts, the worst prompt, regressions flagged."""
    table = Table(title=f"compare · regression gate {max_regression:.0%} (and beyond the repeats' noise)")
    fleet = "hardware" in result.key
    for name, justify in ((("hardware", "left"),) if fleet else ()) + (
            ("configuration", "left"), ("dataset", "left"), ("metric", "left"), ("prompts", "right"),
            ("baseline", "right"), ("current", "right"), ("median Δ", "right"), ("worst Δ", "right"),
            ("noise", "right"), ("mean Δ, 95 % interval", "right"), ("verdict", "left"), ("regressed", "right")):
        table.add_column(name, justify=justify, no_wrap=name.startswith("mean"))
    deltas = result.deltas
    if deltas.empty:
        return table
    group_by = result.config + ["metric"]
    configs = result.configurations
    intervals = {} if configs is None else {tuple(map(str, k)): row for k, row in
                                           zip(configs[group_by].to_numpy(), configs.to_dict("records"))}
    for key, group in deltas.groupby(group_by, sort=False):
        first = group.iloc[0]
        config = intervals.get(tuple(map(str, key)), {})
        worst = group.loc[group["change"].idxmin()]
        bad = int(group["regressed"].sum())
        style = "red" if bad else None
        table.add_row(
            *([Text(str(first["hardware"]))] if fleet else []), Text(_label(first)), Text(str(first["dataset"])), first["metric"], str(len(group)),
            f"{group['baseline'].median():.4g}", f"{group['current'].median():.4g}",
            f"{group['change'].median():+.1%}", Text(f"{worst['change']:+.1%} {worst['prompt_id']}"),
            f"{group['noise'].median():.1%}", _interval_text(config),
            Text(config.get("verdict", "–"), style=_VERDICT_STYLE.get(config.get("verdict"))), Text(str(bad), style=style),
        )
    return table


_VERDICT_STYLE = {"regression": "red", "faster": "green", DISTORTED: "yellow"}


def _interval_text(config: dict) -> str:
    """'-20.0% [-22.1%, -18.0%]'; the change alone when there is no interval."""
    if not config or not np.isfinite(config["change"]):
        return "–"
    bounds = f" [{config['low']:+.1%}, {config['high']:+.1%}]" if np.isfinite(config["low"]) else ""
    return f"{config['change']:+.1%}{bounds}"


OUT_FILES = ("compare.parquet", "compare-configurations.parquet", "compare-lossy.parquet")


def write_comparison(result: Comparison, folder, baseline_paths, current_paths) -> list:
    """`compare --out FOLDER`: the matched comparisons (each naming both sides' paths), the configurations'
    intervals and verdicts, and the rows that broke losslessness, as Parquet (what `sdbench site` shows)."""
    from sdbench.paths import output_dir

    folder = output_dir(folder)
    sides = {"baseline_paths": ", ".join(map(str, baseline_paths)), "current_paths": ", ".join(map(str, current_paths))}
    frames = (result.deltas.assign(**sides), result.configurations if result.configurations is not None
              else pd.DataFrame(), result.lossy[[c for c in ("run_id", *result.key, "divergence") if c in result.lossy]])
    written = []
    for name, frame in zip(OUT_FILES, frames):
        frame.to_parquet(folder / name, index=False)
        written.append(folder / name)
    return written


def gate_problems(result: Comparison, max_regression_pct: float) -> list[str]:
    """One line per reason the gate fails: lossy rows, prompts that regressed, configurations whose interval
    lies below the gate (each naming its hardware class in a fleet)."""
    def where(row) -> str:
        return _label(row) + (f" on {row['hardware']}" if "hardware" in result.key else "")

    problems = []
    if len(result.lossy):
        first = result.lossy.iloc[0]
        problems.append(f"lossless broke on {len(result.lossy)} row(s), e.g. {first['prompt_id']} ({where(first)})")
    for _, row in result.regressions.iterrows():
        problems.append(f"{row['metric']} {row['change']:+.1%} on {row['prompt_id']} ({where(row)}), beyond "
                        f"-{max_regression_pct:g}% and the noise {row['noise']:.1%}")
    for _, row in result.interval_regressions.iterrows():
        problems.append(f"{row['metric']} {row['change']:+.1%} over {row['prompts']} prompts ({where(row)}): its "
                        f"95 % interval [{row['low']:+.1%}, {row['high']:+.1%}] lies below -{max_regression_pct:g}%")
    return problems


def run_compare(baseline_paths, current_paths, max_regression_pct: float, console: Console,
                across: str = "", out=None) -> Comparison:
    """Read both sides, print the table, raise RegressionFound when the gate fails. across: settings (as
    SETTINGS names them) the two sides may differ in; out: a folder to write the comparison into (before the
    verdict, so a failing gate keeps its record)."""
    if not 0 <= max_regression_pct < 100:
        raise SdbenchError(f"--max-regression {max_regression_pct}: a percentage in [0, 100)")
    limit = max_regression_pct / 100.0
    baseline, current = read_results(baseline_paths), read_results(current_paths)
    check_settings(baseline, current, across)
    for option, (old, new) in different_settings(baseline, current).items():
        console.print(Text(f"note: compared across --{option}: baseline {_values(old)} vs current {_values(new)}",
                           style="dim"))
    result = compare_frames(baseline, current, limit)
    if result.deltas.empty:
        raise SdbenchError(f"nothing to compare: no rows match on {', '.join(result.key)}")
    console.print(comparison_table(result, limit))
    if out is not None:
        written = write_comparison(result, out, baseline_paths, current_paths)
        console.print(f"wrote {', '.join(str(p) for p in written)}", highlight=False)
    unmatched = [f"{n} only in the {side}" for n, side in ((result.only_baseline, "baseline"),
                                                           (result.only_current, "current run")) if n]
    for line in result.notes + ([f"unmatched keys: {', '.join(unmatched)}"] if unmatched else []):
        console.print(Text(f"note: {line}", style="dim"))
    problems = gate_problems(result, max_regression_pct)
    if problems:
        raise RegressionFound(problems[0] + (f"; and {len(problems) - 1} more" if len(problems) > 1 else ""))
    console.print(f"no regression beyond {max_regression_pct:g}% on {len(result.deltas)} matched comparisons")
    return result
