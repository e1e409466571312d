"""The real llama.cpp (built by `make test` where missing; in CI a missing build fails): its server's own account
of a forward after a cached prefix (`LlamaCpp.probe`), and `bench --engine llama.cpp` with a draft model named
apart from the target, so that the draft's own plain server measures the draft's costs, with every carry-over
ingredient of its rows checked by hand against the engine's own counters (llama.cpp's draft-simple mirrors the
verification batch through the draft: `analysis/carry.py` MIRROR)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from sdbench.models.loading.loader import model_files
from sdbench.servers.engines import EngineRole
from sdbench.servers.process import Server
from tests.conftest import run_cli
from tests.references import session_memory

SMOL = "smollm2-135m"


def test_the_servers_probe_counts_only_what_follows_its_cached_prefix(llamacpp, tmp_path):
    """After a prompt, a second one sharing its first 64 tokens computes only the rest (its own prompt_n), and one
    sharing nothing computes all of it: the count the step costs rely on is the server's real one."""
    argv = llamacpp.command(SMOL, EngineRole("autoregressive"), "float32", 256, 2)
    prefix = list(range(1000, 1064))
    with Server("llama.cpp", argv, tmp_path / "server.log", llamacpp.health).start() as server:
        seconds, computed = llamacpp.probe(server.url, prefix + [7])
        assert computed == 65 and seconds > 0
        for k in (1, 3, 5):
            seconds, computed = llamacpp.probe(server.url, prefix + list(range(2000 + k, 2000 + 2 * k)))
            assert computed == k and seconds > 0, (k, computed)
        _, computed = llamacpp.probe(server.url, list(range(3000, 3040)))
        assert computed == 40


def test_bench_with_a_draft_server_carries_over_by_the_engines_own_counts(llamacpp, capsys, tmp_path):
    """SmolLM2 drafting for itself, the draft named by its file: four servers (plain, n-gram, draft-simple, and
    the draft's own plain server). By hand from each row's counters: L = decoded / rounds and g = drafted / rounds,
    rounds = decoded - accepted (one verification per round, each committing its accepted drafts and one more);
    the draft's one-token cost c from its own server; llama.cpp's drafting round costs c (w(g + 1) + g), w the
    draft's forward over g + 1 tokens over its own one-token forward (at least a one-token forward); the own
    prediction L / (drafting + v(g + 1)). Bounds, not values, where a noisy machine's timings enter."""
    _, gguf = model_files(SMOL)
    code, out, err = run_cli(capsys, "bench", "--draft", str(gguf), "--limit", "1", "--max-new-tokens", "24",
                             "--repeats", "1", "--engine", "llama.cpp", "--out", str(tmp_path / "b"))
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "b" / "bench.parquet")
    engine = df[df.engine == "llama.cpp"].set_index("system")
    assert len(engine) == 4 and engine.failed.isna().all() and (engine.tokens > 0).all(), engine.T
    # draft-simple once more at sdbench's acceptance (synthetic): itself drafting, (nearly) every draft accepted on
    # sdbench's side, so on llama.cpp's too; a carry-over row of its own, from sdbench's L and its own
    (synthetic,) = [row for name, row in engine.iterrows() if "at sdbench's acceptance (synthetic)" in name]
    ours = df[(df.engine.isna() | (df.engine == "sdbench")) & df.system.str.startswith("sdbench draft")].iloc[0]
    accepted = (ours.tokens_per_round - 1) / ours.drafts_per_round
    assert synthetic.engine_drafted > 0 and accepted > 0.8
    assert synthetic.engine_accepted / synthetic.engine_drafted == pytest.approx(accepted, abs=0.2)
    assert synthetic.carried_speedup > 0 and synthetic.decode_speedup > 0
    engine = engine.drop(synthetic.name)
    assert len(list((tmp_path / "b").glob("engine-logs/llama.cpp-4-autoregressive.log"))) == 1  # the draft's server (after the replay)
    ngram, draft = (engine[engine.index.str.contains(name)].iloc[0] for name in ("ngram-simple", "draft-simple"))
    for row, drafting in ((ngram, 0.0), (draft, None)):
        decoded = row.tokens - 1  # after the first token
        rounds = decoded - row.engine_accepted
        assert row.engine_drafted >= row.engine_accepted >= 0
        assert row.tokens_per_round == pytest.approx(decoded / rounds)
        assert row.drafts_per_round == pytest.approx(row.engine_drafted / rounds)
        assert row.step_verify_cost > 0
        if drafting is not None:
            assert row.step_draft_cost == 0 and row.round_draft_cost == drafting
    c, g, v = draft.step_draft_cost, draft.drafts_per_round, draft.step_verify_cost
    assert 0 < c < 100 and c != 1.0, c  # measured on the draft's own server (1.0 is a self-draft's given cost)
    w = draft.round_draft_cost / c - g  # MIRROR: the round's verification batch through the draft, then g steps
    assert w >= 0.5, (w, v)  # a chain's drafting (g alone) leaves w = 0, vLLM's wide first step w - 1 below 0.5
    assert draft.own_predicted_speedup == pytest.approx(draft.tokens_per_round / (draft.round_draft_cost + v))
    assert "Traceback" not in err


def _block_head(kind: str, folder) -> str:
    """A random head of `kind` at SmolLM2's shape as train-head writes it (speculators format), drafting over six
    of the most common English tokens: its drafts are a real function of its forward, and the target takes one
    now and then."""
    import torch

    from sdbench.models.loading.loader import load_model
    from sdbench.training.data import Sequence
    from sdbench.training.heads import build, verifier_name, write_head
    from tests.test_train_head import _perturb

    loaded = load_model(SMOL)
    common = [loaded.tokenizer.encode(w, add_special_tokens=False)[0] for w in (",", " the", ".", " and", " a", " to")]
    seq = Sequence("x", "x/0", torch.arange(6), torch.zeros(6, 1), torch.tensor(common))
    trainee = _perturb(build(kind, loaded.model, [seq], 3, len(common)), seed=7).eval()
    write_head(folder, kind, trainee, loaded.model, verifier_name(loaded), torch.float32)
    return str(folder)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_block_head_drafts_alike_in_llamacpp(llamacpp, capsys, tmp_path, kind):
    """The head train-head writes, converted by llama.cpp's own converter and run by its draft-dflash / draft-dspark
    (every drafted token verified: DSpark's cut off on both sides): lossless, and the same drafts accepted in every
    turn as sdbench's own loop with that head (greedy, float32 on both sides, the same prompts). The engine counts
    fewer drafts (not the ones past the token budget), so drafted counts are not compared."""
    head = _block_head(kind, tmp_path / "head")
    common = ["run", "--strategy", kind, "--head", head, "--gamma", "3", "--limit", "3", "--max-new-tokens", "32",
              "--device", "cpu", *(["--set", "confidence=0"] if kind == "dspark" else [])]
    code, _, err = run_cli(capsys, *common, "--out", str(tmp_path / "ours"))
    assert code == 0, err
    engine = [a for a in common if a not in ("--set", "confidence=0")]
    code, _, err = run_cli(capsys, *engine, "--engine", "llama.cpp", "--out", str(tmp_path / "engine"))
    assert code == 0, err
    ours, theirs = (pd.concat(pd.read_parquet(p) for p in (tmp_path / d).glob("*.parquet")) for d in ("ours", "engine"))
    ours, theirs = (df[df.role != "baseline"].set_index(["prompt_id", "turn"]).sort_index() for df in (ours, theirs))
    assert len(ours) == len(theirs) == 6 and ours.lossless.all() and theirs.lossless.all()  # 3 prompts, 2 turns
    assert (theirs.drafted > 0).all() and ours.accepted.sum() > 0
    assert ours.accepted.tolist() == theirs.accepted.tolist()
    assert "Traceback" not in err


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_a_block_copy_holds_the_bytes_llama_quantize_writes(llamacpp, kind):
    """The GGUF llama.cpp serves at --dtype q8_0 / q4_0 (its own llama-quantize --pure re-typing the shipped file)
    holds, tensor for tensor, the blocks sdbench's block copy of the same model packs: the same weights on both
    sides, byte for byte (q and k are left out: the converter permutes their rows for llama.cpp's rotation)."""
    import torch
    from gguf import GGUFReader

    from sdbench.models.forward import quants
    from sdbench.models.loading import loader

    tensors = {t.name: t for t in GGUFReader(str(llamacpp.gguf(f"{SMOL}@{kind}", "float32"))).tensors}
    model = loader.load_model(SMOL, torch.device("cpu"), torch.float32).model
    layer = model.model.layers[3]
    for name, weight in (("token_embd.weight", model.model.embed_tokens.weight), ("blk.3.attn_v.weight",
                         layer.self_attn.v_proj.weight), ("blk.3.attn_output.weight", layer.self_attn.o_proj.weight),
                         ("blk.3.ffn_gate.weight", layer.mlp.gate_proj.weight),
                         ("blk.3.ffn_down.weight", layer.mlp.down_proj.weight)):
        stored = tensors[name]
        assert stored.tensor_type.name == kind.upper(), name
        ours = quants.quantise(weight.detach(), kind).numpy()
        assert (stored.data.reshape(ours.shape) == ours).all(), name


def test_a_k_quant_mix_runs_through_llamacpp_and_a_file_of_it_is_served_as_it_is(llamacpp, capsys, tmp_path):
    """--dtype q4_k_m: llama-quantize's own mix (not --pure: its Q6_K tensors stay), and a GGUF already of that
    type (a user's own file) served as it is; `run --engine llama.cpp` decodes through it, rows recording it."""
    from gguf import GGUFReader

    from sdbench.servers.llamacpp import file_type

    made = llamacpp.gguf(SMOL, "q4_k_m")
    assert file_type(made) == "Q4_K_M"
    assert {t.tensor_type.name for t in GGUFReader(str(made)).tensors} >= {"Q4_K", "Q6_K"}
    assert llamacpp.gguf(str(made), "q4_k_m") == made  # already of the type: as it is
    code, out, err = run_cli(capsys, "run", "--engine", "llama.cpp", "--dtype", "q4_k_m", "--strategy", "ngram",
                             "--limit", "1", "--max-new-tokens", "8", "--turns", "1", "--out", str(tmp_path))
    assert code == 0, err + out
    df = pd.read_parquet(next(tmp_path.glob("*.parquet")))
    assert (df["dtype"] == "q4_k_m").all() and (df["engine"] == "llama.cpp").all() and (df["new_tokens"] > 0).all()


def test_a_users_q4_0_file_runs_as_its_own_blocks(llamacpp, capsys, tmp_path):
    """A GGUF file of Q4_0 blocks (llama-quantize's) given as the target and as its own draft runs at Q4_0 with no
    --dtype, its blocks read as they are: the rows name it FILE@q4_0, every strategy is lossless, and the blocks
    sdbench packs are the file's bytes, q and k included (their rows in the library's order)."""
    import numpy as np
    import torch

    from sdbench.models.forward import cpufast, cpukernel, quants
    from sdbench.models.loading import gguf_header, variants

    made = str(llamacpp.gguf(f"{SMOL}@q4_0", "float32"))
    code, out, err = run_cli(capsys, "run", "--target", made, "--strategy", "draft", "--draft", made, "--compare",
                             "ngram", "--limit", "1", "--max-new-tokens", "8", "--turns", "1", "--out", str(tmp_path))
    assert code == 0, err + out
    df = pd.read_parquet(next(tmp_path.glob("*.parquet")))
    assert set(df["target"]) == {f"{made}@q4_0"} and df["lossless"].all()
    loaded = variants.own_blocks(made, "q4_0", "cpu")
    fast = cpufast.fast_model(loaded.model)
    stored = {t.name: t.data for t in gguf_header.reader(__import__("pathlib").Path(made)).tensors}
    qkv = fast.layers[2].qkv
    blocks = quants.ungroup(qkv.packed, "q4_0", qkv.out_features, qkv.in_features, cpukernel.group_rows()) \
        if cpukernel.grouped() else qkv.packed
    config = loaded.model.config
    heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    k = stored["blk.2.attn_k.weight"]  # llama.cpp's row order: each head's halves interleaved
    want = k.reshape(kv, dim // 2, 2, -1).swapaxes(1, 2).reshape(k.shape)
    assert np.array_equal(blocks[heads * dim:(heads + kv) * dim].numpy(), want)
    assert torch.equal(blocks[(heads + kv) * dim:], torch.from_numpy(np.array(stored["blk.2.attn_v.weight"])))


def _glm_with_mtp(folder) -> str:
    """A tiny GLM-4.5 checkpoint with its MTP module (`tests/test_mtp_native.py`), SmolLM2's tokenizer with the four
    specials llama.cpp's GLM converter names, and both heads (the target's and the module's shared head) writing only
    six common English tokens, in pairs of opposite rows so one of them always leads: the target decodes among them
    and the module drafts among them, so that its drafts are taken now and then."""
    import torch
    from safetensors.torch import load_file, save_file

    from sdbench.models.loading.loader import load_tokenizer
    from tests.test_mtp_native import H, L, own_mtp_checkpoint

    tokenizer = load_tokenizer(SMOL)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[gMASK]", "<|user|>", "<|endoftext|>",
                                                                "<|observation|>"]})
    own_mtp_checkpoint(folder, "glm4_moe", seed=1, vocab=len(tokenizer))
    tokenizer.save_pretrained(folder)
    common = [tokenizer.encode(w, add_special_tokens=False)[0] for w in (",", " the", ".", " and", " a", " to")]
    weights = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    for key in ("lm_head.weight", f"model.layers.{L}.shared_head.head.weight"):
        head = torch.zeros_like(weights[key])
        for a, b in zip(common[::2], common[1::2]):
            head[a] = torch.randn(H, generator=g)
            head[b] = -head[a]
        weights[key] = head
    save_file(weights, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))  # MT-Bench's prompts
    return str(folder)


def test_the_targets_own_mtp_module_drafts_alike_in_llamacpp(llamacpp, capsys, tmp_path):
    """A checkpoint's own MTP module (GLM-4.5's layout), its folder converted by llama.cpp's own converter (the module's
    layers kept) and run by its draft-mtp: lossless, drafting in every turn, its drafts taken about as often as by
    sdbench's own loop reading the module from the checkpoint (greedy, float32 on both sides, the same prompts). Not
    turn for turn: sdbench masks the module's input embedding at position 0 as vLLM does and llama.cpp does not (with
    the mask lifted, γ = 1, the two agreed in 5 of 6 turns and were 1 apart in the sixth)."""
    target = _glm_with_mtp(tmp_path / "glm")
    common = ["run", "--target", target, "--strategy", "mtp", "--gamma", "3", "--limit", "3", "--max-new-tokens",
              "32", "--device", "cpu"]
    code, _, err = run_cli(capsys, *common, "--out", str(tmp_path / "ours"))
    assert code == 0, err
    code, _, err = run_cli(capsys, *common, "--engine", "llama.cpp", "--out", str(tmp_path / "engine"))
    assert code == 0, err
    ours, theirs = (pd.concat(pd.read_parquet(p) for p in (tmp_path / d).glob("*.parquet")) for d in ("ours", "engine"))
    ours, theirs = (df[df.role != "baseline"].set_index(["prompt_id", "turn"]).sort_index() for df in (ours, theirs))
    assert len(ours) == len(theirs) == 6 and ours.lossless.all() and theirs.lossless.all()
    assert (theirs.drafted > 0).all() and ours.accepted.sum() > 0 and theirs.accepted.sum() > 0
    assert abs(ours.accepted.sum() - theirs.accepted.sum()) <= 0.25 * ours.accepted.sum()
    assert "Traceback" not in err



@pytest.mark.parametrize("role, dtype", [(EngineRole("autoregressive"), "float32"),
                                         (EngineRole("draft", 4, SMOL), "q8_0")])
def test_a_servers_memory_is_within_its_footprint(llamacpp, tmp_path, role, dtype):
    """The memory check's estimate (`servers/footprint.py`) against the real server after a request: it holds the
    server, and is at most half a GiB above it (its buffers are counted as allocated, for a micro-batch of 512
    tokens; a short request touches part of them)."""
    from sdbench.servers.footprint import total

    estimate = total([llamacpp.footprint(SMOL, role, dtype, 256)])
    argv = llamacpp.command(SMOL, role, dtype, 256, 2)
    with Server("llama.cpp", argv, tmp_path / "server.log", llamacpp.health).start() as server:
        from sdbench.servers.systems import EngineSystem

        EngineSystem(llamacpp, role, "x", server.url, 16, server).ask(list(range(1000, 1060)), 16)
        held = session_memory(server.proc.pid, "Rss")  # its one process: every page it maps, shared or not
    assert held <= 1.1 * estimate and estimate <= held + 2**29, (held / 2**30, estimate / 2**30)
