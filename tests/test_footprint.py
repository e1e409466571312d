"""What engines' servers will hold in memory, checked before any starts (`servers/footprint.py`): a model's shape by
hand, a mapped file counted once, the one-line refusal of `bench` and `run --engine` before any model loads or any
server starts, and vLLM's KV cache sized for the run. Against the real servers' memory: tests/test_llamacpp_real.py
(llama.cpp, which CI builds) and tests/test_engines.py (vLLM, where installed)."""

from __future__ import annotations

import pytest

from sdbench.models.loading.memory import GIB
from sdbench.servers import footprint
from sdbench.servers.engines import EngineRole
from sdbench.servers.footprint import Footprint, check_servers_fit, shape, total
from sdbench.servers.llamacpp import LlamaCpp
from sdbench.servers.vllm import KV_FLOOR, Vllm
from sdbench.errors import SdbenchError
from tests.conftest import run_cli
from tests.references import tiny_model_dir
from tests.test_engines import stand_in


def test_a_models_shape_by_hand(tmp_path):
    """The tiny Llama (vocabulary 96, hidden 64, 2 layers of 4 heads and 2 KV heads of 16, MLP 128, untied head):
    embedding and head 96 × 64 each; per layer q and o 64 × 64, k and v 64 × 32, gate, up and down 64 × 128, two
    norms of 64; a final norm. KV per position: keys and values, 2 layers × 2 heads × 16, two bytes each."""
    folder = tiny_model_dir(tmp_path / "tiny")
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    found = shape(str(folder))
    assert found.params == 2 * 96 * 64 + 2 * layer + 64
    assert (found.table, found.vocab, found.kv_per_position) == (96 * 64, 96, 2 * 2 * 2 * 16 * 2)
    assert found.weights("q8_0") == int(found.params * 34 / 32) and found.weights("q4_0") == int(found.params * 18 / 32)


def test_a_file_mapped_by_several_servers_is_counted_once():
    a = Footprint(100, {"m:q8_0": 1000})
    b = Footprint(50, {"m:q8_0": 1000, "d:q8_0": 300})
    assert total([a, b]) == 100 + 50 + 1000 + 300 and total([a]) == 1100


def test_llamacpp_servers_of_one_model_share_its_file(tmp_path):
    """Plain decoding and draft-simple drafting with the model itself: one target file; the draft's weights held
    apart by the server that drafts, beside its KV cache and buffers."""
    folder = str(tiny_model_dir(tmp_path / "tiny"))
    eng = LlamaCpp()
    plain = eng.footprint(folder, EngineRole("autoregressive"), "q8_0", 100)
    draft = eng.footprint(folder, EngineRole("draft", 4, folder), "q8_0", 100)
    assert plain.files == draft.files == {f"{folder}:q8_0": shape(folder).weights("q8_0")}
    assert draft.own > plain.own + shape(folder).weights("q8_0")


def test_the_refusal_names_each_engines_servers_and_what_is_free():
    one = Footprint(3 * GIB)
    with pytest.raises(SdbenchError) as err:
        check_servers_fit([("vllm", [one, one]), ("llama.cpp", [Footprint(GIB, {"f": GIB})])], "fewer",
                          beside=GIB, free=8 * GIB)
    said = str(err.value)
    assert said == ("the engines' servers would hold about 8.0 GiB (vllm 2 servers about 6.0 GiB, llama.cpp 1 server "
                    "about 2.0 GiB) beside sdbench's own models' 1.0 GiB and 8.0 GiB are free: fewer; no server was "
                    "started")
    check_servers_fit([("vllm", [one, one, None])], "fewer", beside=GIB, free=8 * GIB)  # 7 GiB of 8: fits


def _no_loading(monkeypatch):
    import sdbench.commands.bench as bench

    monkeypatch.setattr(bench, "load_models", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(footprint, "free_bytes_cpu", lambda: GIB)


def test_bench_refuses_servers_that_would_not_fit_before_anything_loads(capsys, tmp_path, monkeypatch):
    folder, data = stand_in(tmp_path, monkeypatch)
    _no_loading(monkeypatch)
    code, _, err = run_cli(capsys, "bench", "--target", str(folder), "--dataset", str(data), "--limit", "1",
                           "--engine", "vllm", "--out", str(tmp_path / "b"))
    last = err.strip().splitlines()[-1]  # (the lines before: the test's own model written)
    assert code != 0 and "Traceback" not in err and "vllm 3 servers about" in last, err
    assert "1.0 GiB are free" in last and "--autoregressive-only" in last
    assert not (tmp_path / "b" / "engine-logs").exists()  # no server was started


def test_run_through_an_engine_refuses_servers_that_would_not_fit(capsys, tmp_path, monkeypatch):
    folder, data = stand_in(tmp_path, monkeypatch)
    monkeypatch.setattr(footprint, "free_bytes_cpu", lambda: GIB)
    code, _, err = run_cli(capsys, "run", "--target", str(folder), "--dataset", str(data), "--limit", "1",
                           "--strategy", "ngram", "--gamma", "2,4", "--engine", "vllm", "--out", str(tmp_path / "r"))
    assert code != 0 and "Traceback" not in err and "vllm 3 servers about" in err and "fewer --gamma" in err, err
    assert not (tmp_path / "r" / "engine-logs").exists()


def test_vllm_gets_a_kv_cache_sized_for_the_run(tmp_path):
    """Twice what the run's positions take in every model the server loads, at least KV_FLOOR; the legacy variable,
    which would override it, is not set. Qwen2.5-Coder-1.5B: 28 layers × 2 KV heads × 128, keys and values, two
    bytes each (bfloat16: what vLLM computes a Q4_0 model in)."""
    eng = Vllm()
    tiny = str(tiny_model_dir(tmp_path / "tiny"))
    argv = eng.command(tiny, EngineRole("autoregressive"), "float32", 512, 2)
    assert int(argv[argv.index("--kv-cache-memory-bytes") + 1]) == KV_FLOOR
    assert "VLLM_CPU_KVCACHE_SPACE" not in eng.server_env(2)
    role = EngineRole("autoregressive")
    assert eng.kv_space("qwen2.5-coder-1.5b", role, "q4_0", 100_000) == 2 * 100_000 * (2 * 28 * 2 * 128 * 2)
    assert eng.kv_space("qwen2.5-coder-1.5b", role, "float32", 100_000) == 2 * 100_000 * (2 * 28 * 2 * 128 * 4)
