"""sdbench report --plots/--html: valid PNGs for the data present, one self-contained page."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from sdbench.cli import main
from sdbench.errors import MissingPackageError
from sdbench.reporting.writer import RunWriter

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sweep_rows() -> list[dict]:
    """A gamma sweep of ngram beside the baseline: three prompts of different lengths."""
    rows = []
    for i, prompt_tokens in enumerate((40, 80, 120)):
        common = {"target": "smollm2-135m", "dataset": "mt-bench", "category": "writing", "prompt_id": f"p{i}",
                  "batch_size": 1, "batch_id": i, "repeat": 0, "new_tokens": 32, "prompt_tokens": prompt_tokens,
                  "steps": 32}
        rows.append({**common, "role": "baseline", "strategy": "autoregressive", "params": "{}", "wall_s": 1.0,
                     "tokens_per_s": 32.0, "speedup": 1.0, "mean_accepted_len": 1.0, "lossless": True})
        for j, gamma in enumerate((2, 4)):
            speed = 1.0 + 0.1 * gamma + 0.05 * i
            rows.append({**common, "role": f"strategy-{j + 1}", "strategy": "ngram", "gamma": gamma,
                         "params": json.dumps({"gamma": gamma}), "wall_s": 1.0 / speed, "tokens_per_s": 32.0 * speed,
                         "speedup": speed, "predicted_speedup": speed * 1.1, "steps": 20, "drafted": 40,
                         "accepted": 12, "mean_accepted_len": 1.6, "lossless": True,
                         "accepted_per_position": [8, 4][:gamma], "drafted_per_position": [20, 20][:gamma]})
    return rows


@pytest.fixture
def results(tmp_path) -> str:
    writer = RunWriter(tmp_path, "sweep")
    writer.append(sweep_rows())
    return str(writer.finalize())


def test_report_writes_valid_pngs_and_a_self_contained_page(tmp_path, results, capsys):
    folder, page = tmp_path / "plots", tmp_path / "report.html"
    try:
        main(["report", results, "--plots", str(folder), "--html", str(page)])
    except SystemExit as e:
        assert e.code == 0
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["acceptance_length.png", "acceptance_per_position.png", "predicted_vs_measured.png",
                     "speedup_by_strategy.png", "speedup_vs_gamma.png", "speedup_vs_prompt_tokens.png"]
    for path in folder.iterdir():
        assert path.read_bytes().startswith(PNG_MAGIC) and path.stat().st_size > 2000
    text = page.read_text()
    assert text.count('<img src="data:image/png;base64,iVBORw0KGgo') == 6  # base64 of the PNG signature
    assert "ngram gamma=4" in text and "Speedup vs γ" in text and "<script" not in text and "http" not in text
    out = capsys.readouterr().out
    assert f"wrote {folder / 'speedup_vs_gamma.png'}" in out and f"wrote {page}" in out


def test_only_plots_with_data_are_drawn():
    from sdbench.reporting.plots import render

    baseline_only = pd.DataFrame([r for r in sweep_rows() if r["role"] == "baseline"]).assign(run_id="r")
    assert render(baseline_only) == []


def test_missing_matplotlib_is_one_line(monkeypatch, results):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    from sdbench.reporting.plots import render
    from sdbench.reporting.results import read_results

    with pytest.raises(MissingPackageError, match="pip install matplotlib"):
        render(read_results([results]))
