"""`sdbench reproduce`: the claims and the report folder, the DSI reproduction on synthetic runs, and the papers
that are registered but not written yet."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow.parquet as pq
import pytest

from sdbench.commands.reproduce import dsi as dsi_paper
from sdbench.commands.reproduce import papers
from sdbench.commands.reproduce.common import (FAILS, HOLDS, UNTESTABLE, Claim, Figure, Report, claims_frame,
                                               render_page, write_report)
from sdbench.reporting.schema import rows_to_table
from tests.conftest import reproduce_quick, run_cli

TINY = dsi_paper.DsiPlan(limit=1, max_new_tokens=8, workers=2, repeats=2, tokens=60, grid=4, kmax=12)


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


def test_a_claim_that_cannot_be_tested_must_say_why():
    with pytest.raises(ValueError):
        Claim("x", "y", UNTESTABLE)
    with pytest.raises(ValueError):
        Claim("x", "y", "maybe")
    assert Claim("x", "y", HOLDS).why == ""


def test_the_page_is_self_contained_with_the_claims_first(tmp_path):
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 32
    report = Report("demo", "A paper", [Claim("it is fast", "1.5x", HOLDS, "measured"),
                                         Claim("it is <small>", "n/a", UNTESTABLE, "no such hardware")],
                    tables={"numbers": pd.DataFrame({"x": [1.0, 2.0]})}, figures=[Figure("fig", "a figure", png)],
                    setup={"device": "cpu", "git_commit": "abc123"})
    page = write_report(report, tmp_path)
    text = page.read_text()
    sections = [text.index(f'<section id="{s}">') for s in ("claims", "figures", "tables", "setup")]
    assert sections == sorted(sections) and text.index("<h2>") == text.index("<h2>Claims</h2>")
    assert "data:image/png;base64," in text and 'src="http' not in text and "<script" not in text
    assert "&lt;small&gt;" in text and "no such hardware" in text and "abc123" in text
    assert (tmp_path / "fig.png").read_bytes() == png
    assert pd.read_parquet(tmp_path / "numbers.parquet")["x"].tolist() == [1.0, 2.0]
    claims = pd.read_parquet(tmp_path / "claims.parquet")
    assert claims["verdict"].tolist() == [HOLDS, UNTESTABLE]
    assert list(claims_frame(report.claims).columns)[:3] == ["claim", "measured", "verdict"]
    assert render_page(report).count("<tr style=\"background:") == 2  # one coloured row per claim


def test_an_unknown_paper_is_one_line(capsys):
    code, _, err = run_cli(capsys, "reproduce", "dsl")
    assert code != 0 and "unknown paper 'dsl'" in one_line(err) and "did you mean 'dsi'" in err


def test_every_paper_is_registered():
    assert papers.names() == ["adaptive", "dsi", "magicdec", "polybasic"]


# ---- the DSI reproduction on synthetic runs ------------------------------------------------------------------


def _run_rows(strategy: str, k: int, workers: int, verify_per_job: float | None, tpot: float) -> list[dict]:
    """One prompt: the baseline at 20 ms per forward, the strategy with 2 ms drafts and a = 2/3."""
    stats = {"rejections": 10, "drafted_total": 60}
    if verify_per_job is not None:
        stats["verify_s_per_job"] = verify_per_job
    params = {"gamma": k, **({"workers": workers, "backend": "process"} if strategy == "dsi" else {})}
    return [{"role": "baseline", "strategy": "autoregressive", "prompt_id": "p0", "steps": 32, "verify_s": 0.64,
             "wall_s": 0.7, "ttft_s": 0.08, "tpot_s": 0.02, "new_tokens": 32, "drafted": 0, "accepted": 0,
             "draft_s": 0.0, "params": "{}"},
            {"role": "strategy", "strategy": strategy, "prompt_id": "p0", "steps": 12, "verify_s": 0.3,
             "wall_s": 0.5, "ttft_s": 0.05, "tpot_s": tpot, "new_tokens": 32, "drafted": 40, "accepted": 20,
             "draft_s": 0.12, "strategy_stats": json.dumps(stats), "params": json.dumps(params)}]


@pytest.fixture
def fake_runs(monkeypatch):
    """The real runs replaced by written result files; records what the reproduction asked for."""
    asked = {}

    def real_runs(cfg, plan, out, console):
        asked.update(cfg=cfg, plan=plan)
        out.mkdir(parents=True, exist_ok=True)
        paths = {}
        for name, strategy, per_job, tpot in (("si", "draft", None, 0.015), ("dsi", "dsi", 0.05, 0.03)):
            paths[name] = out / f"{name}.parquet"
            pq.write_table(rows_to_table(_run_rows(strategy, 5, plan.workers, per_job, tpot)), paths[name])
        return {**paths, "k": 5, "c_timed": 0.1}

    monkeypatch.setattr(dsi_paper, "real_runs", real_runs)
    monkeypatch.setattr(dsi_paper, "QUICK", TINY)
    return asked


def test_reproduce_dsi_quick_writes_the_report_folder(capsys, tmp_path, fake_runs):
    out = tmp_path / "report"
    claims, text, stdout = reproduce_quick(capsys, "dsi", out, (
        "dsi-heatmap.parquet", "dsi-heatmap.png", "dsi-latency-table.parquet", "dsi-sim-vs-real.parquet",
        "dsi-workers.parquet", "dsi-sim-vs-real.png", "dsi-workers.png"), 3)
    assert fake_runs["plan"] == TINY and fake_runs["cfg"].quick and fake_runs["cfg"].drafter == "smollm2-135m"
    # every verdict the synthetic runs imply (not merely one of the allowed words, which Claim enforces): the
    # model's theorem and SI's slow cells hold on the heat map; the paper's 1.29-1.92x and the worker bound do not
    # at this pair's c = 0.04 with 2 workers; DSI slower than plain (30 ms/token against 20) is untestable because
    # its verifications ran slower than plain forwards (workers sharing the cores), against the paper's premise
    assert list(claims["verdict"]) == [HOLDS, HOLDS, FAILS, FAILS, FAILS, FAILS, UNTESTABLE]
    # the synthetic DSI run has c = 0.04 and k = 5 with 2 workers: fewer than the paper's bound of 5
    assert "warning: 2 workers is fewer than the paper's bound ceil(1/(k·c)) = 5" in stdout
    # the heat-map's four panels, and the model's claims on it
    frame = pd.read_parquet(out / "dsi-heatmap.parquet")
    for col in ("speedup_dsi_vs_si", "speedup_dsi_vs_plain", "speedup_si_vs_plain", "speedup_dsi_vs_best"):
        assert col in frame
    by_claim = claims.set_index("claim")["verdict"]
    assert by_claim.filter(like="given any drafter").iloc[0] == HOLDS
    assert by_claim.filter(like="SI can be slower").iloc[0] == HOLDS
    # the DSI run's workers took 50 ms per verification against 20 ms for a plain forward: the premise fails
    here = claims[claims["claim"].str.contains("on the real run here")].iloc[0]
    assert here["verdict"] == UNTESTABLE and "device per worker" in here["why"]


def test_never_slower_on_the_real_run_judges_the_premise_first():
    from sdbench.analysis.dsi_sim import Setting

    s = Setting(0.02, 0.1, 0.8, 5, 2, 32)
    real = {"plain": 0.020, "plain_si": 0.020, "plain_dsi": 0.020, "si": 0.018, "dsi": 0.017}

    def versus(dsi_forward):
        return pd.DataFrame({"algorithm": ["plain", "si", "dsi"], "target_forward_s": [0.02, 0.02, dsi_forward]})

    assert dsi_paper.claim_never_slower_here(versus(0.02), s, real).verdict == HOLDS
    slow = {**real, "dsi": 0.03}
    # a run slowed down as a whole (its baseline too) is judged against its own baseline
    assert dsi_paper.claim_never_slower_here(versus(0.02), s, {**slow, "plain_dsi": 0.04}).verdict == HOLDS
    assert dsi_paper.claim_never_slower_here(versus(0.021), s, slow).verdict == FAILS
    untestable = dsi_paper.claim_never_slower_here(versus(0.05), s, slow)
    assert untestable.verdict == UNTESTABLE and "50.0 ms against 20.0 ms" in untestable.why


def test_the_real_runs_use_the_papers_lookahead_rule(monkeypatch, tmp_path):
    from sdbench.commands import run as run_module
    from sdbench.commands.reproduce.common import ReproduceConfig

    ran = []

    class FakeHarness:
        def __init__(self, cfg, console=None, pair=None):
            self.cfg, self.pair, self.device, self.dtype = cfg, pair, "cpu", "float32"

        def run(self):
            ran.append((self.cfg, self.pair))
            return tmp_path / f"{self.cfg.strategy}.parquet"

    monkeypatch.setattr(run_module, "RunHarness", FakeHarness)
    monkeypatch.setattr("sdbench.models.loading.pair.load_pair", lambda *a: "the pair")
    for c, k in ((0.1, 5), (1.0, 1), (0.06, 10), (0.01, 10)):
        ran.clear()
        monkeypatch.setattr(dsi_paper, "drafter_ratio", lambda pair, c=c: c)
        runs = dsi_paper.real_runs(ReproduceConfig(draft="d"), TINY, tmp_path, console=_Quiet())
        assert runs["k"] == k and runs["c_timed"] == c
        (si, si_pair), (dsi, dsi_pair) = ran
        assert (si.strategy, dsi.strategy, si.gammas, dsi.gammas) == ("draft", "dsi", (k,), (k,))
        assert dsi.options == {"workers": "2"} and si.drafts == dsi.drafts == ("d",)
        assert si_pair == dsi_pair == "the pair"  # one loaded pair for both runs


class _Quiet:
    def print(self, *a, **k):
        pass

    def status(self, *a, **k):
        import contextlib

        return contextlib.nullcontext()
