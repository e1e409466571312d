"""report --explain: the factors multiply to the measured speedup, on synthetic rows and on a real run."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from sdbench.engine.formulas import specbench_mean_accepted_tokens, vllm_mean_acceptance_length
from sdbench.reporting.explain import FACTORS, breakdown, definitions


def synthetic() -> pd.DataFrame:
    """Two prompts, one per batch; the strategy spends time outside drafting and verifying, as does the baseline."""
    rows = []
    for p, (n, base_wall, strat_wall) in enumerate(((33, 3.3, 1.9), (17, 1.8, 1.2))):
        common = dict(run_id="r", prompt_id=f"p{p}", batch_id=p, repeat=0, category="c", new_tokens=n, ttft_s=0.2)
        rows.append(dict(common, role="baseline", strategy="autoregressive", steps=n - 1, accepted=0, drafted=0,
                         wall_s=base_wall, verify_s=0.09 * (n - 1), draft_s=0.0, drafted_per_position=[]))
        steps = (n - 1) // 2
        rows.append(dict(common, role="strategy", strategy="draft", steps=steps, accepted=n - 1 - steps,
                         drafted=3 * steps, wall_s=strat_wall, verify_s=0.1 * steps, draft_s=0.04 * steps,
                         drafted_per_position=[steps - 1, steps - 1, steps - 1]))
    return pd.DataFrame(rows)


def test_factors_equal_values_computed_by_hand_from_the_synthetic_run():
    """Each factor against the README's definition worked out by hand from the rows above (sums over the two
    batches). The product is the measured speedup only because each factor is right: a factor that were
    defined as a remainder would make the product hold however wrong the others were."""
    # baseline: 50 tokens, 48 steps, V = 0.09 * 48 = 4.32 s, wall 5.1 s, ttft 0.4 s, so D = 4.7 s
    # strategy: 50 tokens, 24 steps, V = 0.1 * 24 = 2.4 s, Dr = 0.04 * 24 = 0.96 s, wall 3.1 s, D = 2.7 s
    [row] = breakdown(synthetic()).to_dict("records")
    assert row["speedup"] == pytest.approx(5.1 / 3.1)  # tokens/s ratio, same tokens on both sides
    assert row["ideal"] == pytest.approx((48 / 24) / (48 / 48))
    assert row["verification"] == pytest.approx((4.32 / 48) / (2.4 / 24))
    assert row["verify_cost"] == pytest.approx(0.1 / 0.09)
    assert row["draft"] == pytest.approx(2.4 / (2.4 + 0.96))
    assert row["overhead"] == pytest.approx(((2.4 + 0.96) / 2.7) / (4.32 / 4.7))
    assert row["prefill"] == pytest.approx((5.1 / 3.1) / (4.7 / 2.7))  # measured over decode speedup (48/2.7)/(48/4.7)
    assert row["product"] == pytest.approx(row["speedup"], rel=1e-12)
    assert all(math.isfinite(row[f]) for f in FACTORS)


def test_other_tools_definitions_on_the_same_rows():
    [row] = definitions(synthetic()).to_dict("records")
    assert row["sdbench_mean_accepted_len"] == pytest.approx(2.0)
    assert row["specbench_mean_accepted_tokens"] == pytest.approx((24 + 24) / 24)
    # vLLM leaves the two steps that proposed nothing out of num_drafts
    assert row["vllm_mean_acceptance_length"] == pytest.approx(1 + 24 / 22)
    assert row["vllm_draft_acceptance_rate"] == pytest.approx(24 / 72)
    assert specbench_mean_accepted_tokens(3, 0) != specbench_mean_accepted_tokens(3, 0)  # NaN without steps
    assert vllm_mean_acceptance_length(5, 5) == 2.0


def test_explain_reproduces_a_real_run_on_the_embedded_model(tmp_path, capsys):
    from tests.conftest import run_cli

    code, out, err = run_cli(capsys, "run", "--target", "smollm2-135m", "--strategy", "ngram", "--limit", "2",
                             "--max-new-tokens", "16", "--device", "cpu", "--out", str(tmp_path))
    assert code == 0, err
    code, out, err = run_cli(capsys, "report", str(tmp_path), "--explain")
    assert code == 0, err
    assert "Where the speedup goes" in out and "Spec-Bench" in out, out[-3000:]
    from sdbench.reporting.results import read_results

    df = read_results([str(tmp_path)])
    [row] = breakdown(df).to_dict("records")
    assert np.isfinite([row[f] for f in FACTORS]).all()
    # each factor from the rows themselves (one prompt per batch, one repeat: every row is its own batch)
    sums = df.groupby("role")[["new_tokens", "steps", "verify_s", "draft_s", "wall_s", "ttft_s"]].sum()
    s, b = sums.loc["strategy"], sums.loc["baseline"]
    decode_s, decode_b = s.wall_s - s.ttft_s, b.wall_s - b.ttft_s
    busy = s.verify_s + s.draft_s
    assert row["speedup"] == pytest.approx(b.wall_s / s.wall_s)  # same tokens on both sides (lossless)
    assert row["ideal"] == pytest.approx(((s.new_tokens - 2) / s.steps) / ((b.new_tokens - 2) / b.steps))
    assert row["verification"] == pytest.approx((b.verify_s / b.steps) / (s.verify_s / s.steps))
    assert row["draft"] == pytest.approx(s.verify_s / busy)
    assert row["overhead"] == pytest.approx((busy / decode_s) / (b.verify_s / decode_b))
    assert row["prefill"] == pytest.approx((b.wall_s / s.wall_s) / (decode_b / decode_s))
    assert row["product"] == pytest.approx(row["speedup"], rel=1e-9)


def test_report_plots_a_waterfall_per_configuration(tmp_path):
    from sdbench.reporting.plots import write_plots

    paths = write_plots(synthetic().assign(target="t", dataset="d", params="{}", draft=""), tmp_path)
    waterfalls = [p for p in paths if p.name.startswith("speedup_waterfall")]
    assert len(waterfalls) == 1 and waterfalls[0].read_bytes().startswith(b"\x89PNG")


def test_trees_are_explained_by_the_tree_cost_model_worked_out_by_hand():
    """A static draft tree, [(0,), (1,), (0, 0)], verified in 10 rounds; acceptance by depth and rank, the draft
    cost per level and the verification cost taken from the rows, the predictions by hand."""
    from io import StringIO

    from rich.console import Console

    from sdbench.analysis.tree_explain import explain_trees
    from sdbench.reporting.explain import print_explain

    common = dict(run_id="r", prompt_id="p0", batch_id=0, repeat=0, category="c", new_tokens=21, ttft_s=0.2,
                  wall_s=1.0, draft="d")
    df = pd.DataFrame([
        dict(common, role="baseline", strategy="autoregressive", params="{}", steps=20, accepted=0, drafted=0,
             verify_s=0.2, draft_s=0.0, drafted_per_position=[], tree_steps=0, tree_nodes=0, verified_width=20,
             tried_per_depth_rank=[], accepted_per_depth_rank=[]),
        dict(common, role="strategy", strategy="draft", params='{"gamma": 2, "tree_shape": "[(0,), (1,), (0, 0)]"}',
             steps=10, accepted=10, drafted=30, verify_s=0.12, draft_s=0.014, drafted_per_position=[10, 4],
             tree_steps=10, tree_nodes=30, verified_width=40, tried_per_depth_rank=[[10, 6], [4]],
             accepted_per_depth_rank=[[4, 3], [2]]),
    ])
    [row] = explain_trees(df)
    # p = 0.4, 0.5 at depth 1 and 0.5 at depth 2: (0,) 0.4, (1,) 0.6 * 0.5, (0, 0) 0.4 * 0.5
    expected = 1 + 0.4 + 0.3 + 0.2
    c, v = 0.014 / 14 / 0.01, 0.012 / 0.01  # drafting per level, a verification, over the baseline's step
    assert (row["tree_size"], row["width"], row["acc_len"]) == (3.0, 4.0, 2.0)
    assert row["acceptance"] == "d1 40/50 · d2 50 %"
    assert row["model_acc_len"] == pytest.approx(expected)
    assert row["model_speedup"] == pytest.approx(expected / (2 * c + v))
    # the best 3-node tree for this acceptance is this one: (1, 0) would add 0.3 * 0.5 only
    assert (row["best_nodes"], row["best_acc_len"]) == (3, pytest.approx(expected))
    out = StringIO()
    print_explain(df, Console(file=out, width=250), [row])
    assert "Token trees" in out.getvalue() and "d1 40/50 · d2 50 %" in out.getvalue()
