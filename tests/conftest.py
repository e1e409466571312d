"""Shared fixtures: tiny random decoders that need no download."""

from __future__ import annotations

import os
import random

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from sdbench.models.forward.runner import ModelRunner

VOCAB = 96


def pytest_addoption(parser):
    parser.addoption("--order", default="file", help="file (default), reverse, or shuffle:SEED (modules "
                     "shuffled, then the tests within each): finds tests that pass only after or before others")


def pytest_collection_modifyitems(config, items):
    order = config.getoption("--order")
    kind, _, seed = order.partition(":")
    if (kind, seed) == ("reverse", ""):
        items.reverse()
    elif kind == "shuffle" and seed.isdigit():
        rng = random.Random(int(seed))
        modules: dict[str, list] = {}
        for item in items:
            modules.setdefault(item.nodeid.split("::")[0], []).append(item)
        names = list(modules)
        rng.shuffle(names)
        for name in names:
            rng.shuffle(modules[name])
        items[:] = [item for name in names for item in modules[name]]
    elif order != "file":
        raise pytest.UsageError(f"--order {order}: use file, reverse or shuffle:SEED")


def tiny_model(seed: int = 0, arch: str = "llama", layers: int = 2, hidden: int = 64, heads: int = 4, kv: int = 2):
    torch.manual_seed(seed)
    cls_cfg, cls_model = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                          "qwen3": (Qwen3Config, Qwen3ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM)}[arch]
    # a wide init makes logits peaked, so greedy choices are far from ties and robust to summation order
    cfg = cls_cfg(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, initializer_range=0.3,
                  max_position_embeddings=1024, tie_word_embeddings=False)
    return cls_model(cfg).eval()


@pytest.fixture(scope="session", autouse=True)
def user_config(tmp_path_factory):
    """No test reads or writes the real ~/.config/sdbench: the user's folder is a fresh one for the session (a
    test that writes presets points SDBENCH_CONFIG at its own tmp_path)."""
    with pytest.MonkeyPatch.context() as mp:
        folder = tmp_path_factory.mktemp("config")
        mp.setenv("SDBENCH_CONFIG", str(folder))
        yield folder


@pytest.fixture(autouse=True)
def probe_verdicts(tmp_path_factory, monkeypatch):
    """Each test starts with no kept fidelity-probe verdicts (models/probing/probe_cache.py): a verdict kept by another
    test on the same tiny weights would stand in for the probe a test means to run (a runner broken on
    purpose). A test of the reuse runs both commands within itself."""
    folder = tmp_path_factory.mktemp("probes")
    monkeypatch.setenv("SDBENCH_PROBES", str(folder))
    return folder


@pytest.fixture(scope="session")
def target():
    return ModelRunner(tiny_model(0), "tiny-target")


@pytest.fixture(scope="session")
def small_draft():
    return ModelRunner(tiny_model(1, layers=1, hidden=32, heads=2, kv=1), "tiny-draft")


def skip_unless_ci(reason: str):
    """Skip where a capability is optional (a developer's machine); fail in CI (`CI` set, as .ci/run does),
    where `make setup` installs it and a skip would hide a lost test."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}, which CI provides")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def llamacpp():
    """llama.cpp's real build, which `make test` makes where missing (once per machine): in CI a missing one fails."""
    from sdbench.servers.llamacpp import LlamaCpp

    engine = LlamaCpp()
    if not engine.installed():
        skip_unless_ci(f"needs llama.cpp's build ({engine.install}; `make test` makes it)")
    return engine


@pytest.fixture(scope="session")
def vllm():
    """vLLM's CPU build in its own environment, which `make test` installs where missing (once per machine, kept
    by version): in CI a missing one fails."""
    from sdbench.servers.vllm import Vllm

    engine = Vllm()
    if not engine.installed():
        skip_unless_ci("needs vLLM's environment (`make engine-vllm`; `make test` installs it)")
    return engine


@pytest.fixture(scope="session")
def ray_cluster():
    """Ray's local cluster, started once for the whole test session (starting one takes seconds). CI installs
    the `ray` extra, so there a missing Ray fails instead of skipping."""
    try:
        import ray
    except ImportError:
        skip_unless_ci("needs the `ray` extra")
    from sdbench.dsi.pools import shutdown_pools

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    yield ray
    shutdown_pools()
    ray.shutdown()


@pytest.fixture
def cluster():
    """A real Ray cluster of two nodes on this machine (ray.cluster_utils.Cluster: a head and a second node, each a
    raylet of its own with 2 CPUs), for `--ray ADDRESS`; (cluster, second node). Fresh per test: a test may kill
    the second node."""
    try:
        from ray.cluster_utils import Cluster
    except ImportError:
        skip_unless_ci("needs the `ray` extra")
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    second = made.add_node(num_cpus=2)
    made.wait_for_nodes()
    yield made, second
    made.shutdown()


@pytest.fixture(scope="session")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 11, 3, 8)]


def second_token_chi_square(target, proposer, cfg, prompt=(5, 17, 42, 8), n: int = 3000, seed: int = 0):
    """Decode `n` copies of a prompt for two tokens through `proposer` under sampling `cfg`, and compare the
    second token (decided by the first verification) with its exact marginal under the target.

    Returns (chi-square statistic, degrees of freedom, the BatchResult); bins expected below 5 are pooled."""
    from sdbench.engine.loop import generate
    from sdbench.engine.sampling import probs_from_logits

    prompt = list(prompt)
    with torch.no_grad():
        q1 = probs_from_logits(target.model(torch.tensor([prompt])).logits[0, -1], cfg)  # [V]
        ctx = torch.tensor([prompt + [t] for t in range(VOCAB)])
        q2 = probs_from_logits(target.model(ctx).logits[:, -1], cfg)  # [V, V]
    exact = q1 @ q2  # the second token's marginal: a sum over the first
    g = torch.Generator().manual_seed(seed)
    out = generate(target, proposer, [prompt] * n, max_new_tokens=2, sampling=cfg, generator=g)
    counts = torch.bincount(torch.tensor([o[1] for o in out.output_ids]), minlength=VOCAB).double()
    expected = exact.double() * n
    big = expected >= 5
    stat = ((counts[big] - expected[big]) ** 2 / expected[big]).sum() + (
        (counts[~big].sum() - expected[~big].sum()) ** 2 / max(expected[~big].sum(), 1e-9))
    return float(stat), int(big.sum()), out


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """Run the CLI in-process: (exit code, stdout, stderr)."""
    from sdbench.cli import main

    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def reproduce_quick(capsys, paper: str, out, files: tuple[str, ...], figures: int, *args: str):
    """`sdbench reproduce PAPER --quick --out OUT` must succeed and write its folder: every named file non-empty,
    report.html with the claims first, `figures` inlined PNGs and the environment. Returns (claims, page, stdout)."""
    import pandas as pd

    code, stdout, err = run_cli(capsys, "reproduce", paper, "--quick", *args, "--out", str(out))
    assert code == 0, err
    for name in ("report.html", "claims.parquet", *files):
        assert (out / name).stat().st_size > 0, name
    text = (out / "report.html").read_text()
    assert text.index("<h2>Claims</h2>") < text.index("<h2>Figures</h2>") < text.index("<h2>Setup</h2>")
    assert text.count("data:image/png;base64,") == figures and "torch_version" in text
    assert "verdict" in stdout and "report:" in stdout
    return pd.read_parquet(out / "claims.parquet"), text, stdout


@pytest.fixture(scope="session", autouse=True)
def packed_fast_path():
    """The CPU fast path packs every float32 model in tests, for sdbench's own products where they build here (what
    the measured choice takes on this project's machines), else for oneDNN's: a measured choice would make which path
    a test exercises depend on the machine's speed. tests/test_fast_choice.py measures; the tests of oneDNN's layout
    ask for it (`SDBENCH_CPU_FAST=packed`)."""
    from sdbench.models.forward import cpukernel
    from sdbench.models.forward.cpumeasure import FAST_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAST_ENV, "kernel" if cpukernel.available() else "packed")
        yield


@pytest.fixture(scope="session", autouse=True)
def plain_generate():
    """`bench` measures transformers generate with its default dynamic cache in tests (picking the fastest
    configuration compiles the model, minutes on a small CPU); tests/test_fast_choice.py picks."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDBENCH_GENERATE", "dynamic")
        yield
