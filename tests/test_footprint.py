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


def _tiny_pair(tmp_path):
    """(target folder, its parameters, draft folder, its parameters), each counted by hand. The target: the tiny
    Llama of `test_a_models_shape_by_hand`. The draft: 3 layers of hidden 32, 2 heads and 1 KV head of 16, MLP 64,
    vocabulary 96, untied: embedding and head 96 × 32; per layer q and o 32 × 32, k and v 32 × 16, gate, up and down
    32 × 64, two norms of 32; a final norm."""
    from tests.conftest import tiny_model

    target = tiny_model_dir(tmp_path / "target")
    draft = tiny_model_dir(tmp_path / "draft", model=tiny_model(1, layers=3, hidden=32, heads=2, kv=1))
    t_params = 2 * 96 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    d_params = 2 * 96 * 32 + 3 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32) + 32
    return str(target), t_params, str(draft), d_params


def test_sdbench_own_models_are_counted_by_hand(tmp_path):
    """What `bench` counts of its own copies beside the engines' servers (`own_bytes`): the target and the draft at
    --dtype's bytes a weight; at a block type the float32 model (transformers' rows run it) and the block copy
    beside it (Q4_0: 18 bytes per 32 weights, Q8_0: 34); a K-quant mix only llama.cpp reads, the float32 model
    alone (sdbench runs its file de-quantised: no block copy of its own); the target drafting for itself, once."""
    from sdbench.commands.bench_engines import own_bytes
    from sdbench.config import BenchConfig

    target, t, draft, d = _tiny_pair(tmp_path)
    both = t + d

    def counted(dtype: str, draft_: str = draft) -> int:
        return own_bytes(BenchConfig(target=target, draft=draft_, dtype=dtype))

    assert counted("float32") == 4 * both
    assert counted("bfloat16") == 2 * both
    assert counted("q4_0") == pytest.approx(4 * both + both * 18 / 32, abs=1)
    assert counted("q8_0") == pytest.approx(4 * both + both * 34 / 32, abs=1)
    assert counted("q4_k_m") == 4 * both
    assert counted("float32", "") == 4 * t  # the target drafting for itself: one model
    assert counted("q4_0", target) == pytest.approx(4 * t + t * 18 / 32, abs=1)


def test_sdbench_own_models_are_what_tips_the_servers_over():
    """Servers that fit alone and do not beside sdbench's own models are refused, the line's figures by hand. Free
    10 GiB, of which HEADROOM (0.9) may be used: 9 GiB. Servers 8.5 GiB (vLLM's two of 3 GiB; llama.cpp's one of 1 GiB
    mapping a 1 GiB file and one of 0.5 GiB mapping it too, the file once: 2.5 GiB; one not known) beside 0.25 GiB
    fit; beside 1.5 GiB they do not."""
    from sdbench.models.loading.memory import HEADROOM

    assert HEADROOM == 0.9
    servers = [("vllm", [Footprint(3 * GIB), Footprint(3 * GIB)]),
               ("llama.cpp", [Footprint(GIB, {"f": GIB}), Footprint(GIB // 2, {"f": GIB}), None])]
    check_servers_fit(servers, "fewer", beside=GIB // 4, free=10 * GIB)
    with pytest.raises(SdbenchError) as err:
        check_servers_fit(servers, "fewer", beside=3 * GIB // 2, free=10 * GIB)
    assert str(err.value) == ("the engines' servers would hold about 8.5 GiB (vllm 2 servers about 6.0 GiB, llama.cpp "
                              "2 servers about 2.5 GiB) beside sdbench's own models' 1.5 GiB and 10.0 GiB are free: "
                              "fewer; no server was started")


def test_bench_counts_its_own_models_beside_the_servers_by_hand(monkeypatch):
    """`bench --engine`'s check (`check_engines`) with a stand-in engine whose servers hold what it says: plain
    decoding 1 GiB, n-gram 1.25, the draft model's 2, the draft's cost-only server 0.75, each mapping one 0.5 GiB
    file (held once): 5.5 GiB. sdbench's own models from the shipped configs, counted here: Qwen2.5-Coder-1.5B
    (28 layers of hidden 1536, 12 heads and 2 KV heads of 128 with q, k, v biases, MLP 8960, a tied vocabulary of
    151936) 1,543,714,304 parameters; the 0.5B (24 layers of 896, 14 and 2 heads of 64, MLP 4864) 494,032,768.
    At float32 that is 7.59 GiB: 13.09 GiB with the servers, within 0.9 of 15 GiB free (13.5). At Q4_0 the block
    copy adds 18 bytes per 32 weights: 8.66 GiB, 14.16 GiB with the servers: refused."""
    from dataclasses import replace

    import sdbench.commands.bench_engines as bench_engines
    from sdbench.config import BenchConfig
    from sdbench.servers.engines import Engine

    layer_15 = (1536 * 1536 + 1536) + 2 * (1536 * 256 + 256) + 1536 * 1536 + 3 * 1536 * 8960 + 2 * 1536
    layer_05 = (896 * 896 + 896) + 2 * (896 * 128 + 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896
    big, small = 28 * layer_15 + 151936 * 1536 + 1536, 24 * layer_05 + 151936 * 896 + 896
    assert (big, small) == (1_543_714_304, 494_032_768)  # the models' published sizes: 1.54B and 0.49B

    held = {("autoregressive", None): 1.0, ("ngram", None): 1.25, ("draft", "qwen2.5-coder-0.5b"): 2.0,
            ("autoregressive", "qwen2.5-coder-0.5b"): 0.75}

    class StandIn(Engine):
        name = "stand-in"
        own_names = {"autoregressive": "plain", "ngram": "ngram", "draft": "draft"}
        dtypes = ("float32", "q4_0")

        def check_installed(self) -> None:
            pass

        def footprint(self, target, role, dtype, capacity):
            return Footprint(int(held[role.strategy, role.draft] * GIB), {"file": GIB // 2})

    monkeypatch.setattr(bench_engines, "engine", lambda name: StandIn())
    monkeypatch.setattr(footprint, "free_bytes_cpu", lambda: 15 * GIB)
    cfg = BenchConfig(target="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b", engine="stand-in", device="cpu")
    bench_engines.check_engines(cfg)  # float32: 5.5 + 7.59 of 13.5 GiB
    with pytest.raises(SdbenchError) as err:
        bench_engines.check_engines(replace(cfg, dtype="q4_0"))
    own = (big + small) * (4 + 18 / 32) / GIB
    assert f"{own:.1f}" == "8.7"
    assert str(err.value) == ("the engines' servers would hold about 5.5 GiB (stand-in 4 servers about 5.5 GiB) beside "
                              "sdbench's own models' 8.7 GiB and 15.0 GiB are free: add --autoregressive-only for "
                              "its plain decoding alone, or give a smaller model; no server was started")
