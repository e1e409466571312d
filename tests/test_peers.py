"""`sdbench bench`'s measuring loop, cost ratios and Parquet output, on fake systems and tiny models."""

import pandas as pd
import pytest

from sdbench.models.forward.runner import ModelRunner
from sdbench.commands.bench_costs import StepCosts, step_costs
from sdbench.commands.bench_measure import measure_systems
from sdbench.commands.bench_table import SystemMeasurement, _table, write_bench
from tests.conftest import run_cli, skip_unless_ci, tiny_model
from tests.references import tiny_model_dir


class _Status:
    def update(self, text: str) -> None:
        pass


def test_measure_readies_weights_before_each_clock_and_keeps_repeats():
    calls = []

    def system(name):
        def fn(prompt, budget):
            calls.append(name)
            return prompt[: budget or 3]
        return fn

    weights = []
    systems = [("transformers a", system("a"), False), ("sdbench b", system("b"), True),
               ("transformers c", system("c"), False)]
    results = measure_systems(systems, [[1, 2, 3, 4], [5, 6, 7]], 2, "cpu", _Status(), weights.append)
    assert [len(m.tokens) for m in results] == [2, 2, 2] and results[1].tokens == [6, 6]
    # per prompt the plain-weight systems run first: the weights change twice a prompt, not per system
    assert calls[3:6] == ["a", "c", "b"] and weights[3:6] == [False, False, True]
    assert all(m.outputs == [[1, 2, 3], [5, 6, 7]] for m in results)
    table = _table(results, 10.0, {}, "t")
    assert table.row_count == 3


def test_write_bench_has_one_row_per_system_and_repeat(tmp_path):
    results = [SystemMeasurement("transformers generate", False, [10, 12], [1.0, 2.0], [[1]]),
               SystemMeasurement("sdbench autoregressive (fast)", True, [10, 12], [0.5, 1.0], [[2]])]
    path = write_bench(results, str(tmp_path), {"model": "m", "draft": "d", "dataset": "x", "device": "cpu",
                                                "dtype": "float32", "verify_cost": 1.2, "draft_cost": 0.3})
    df = pd.read_parquet(path)
    assert len(df) == 4
    for col in ("system", "model", "draft", "dataset", "tokens", "seconds", "tokens_per_s", "same_output",
                "torch_version", "hardware", "repeat"):
        assert col in df.columns
    assert list(df.tokens_per_s) == [10.0, 6.0, 20.0, 12.0]
    assert list(df.same_output) == [True, True, False, False]
    assert results[1].tokens_per_s == 16.0  # the median over repeats


class _Timed:
    """A runner whose forwards take a known time: `cost[width]` seconds for a forward of `width` tokens, on a
    clock that only forwards advance. Each forward is checked to run where a step does: at the prompt's end,
    over a cache that holds the prompt."""

    def __init__(self, runner, cost: dict, clock: list):
        self.runner, self.cost, self.clock = runner, cost, clock
        self.device = runner.device
        self.filled: dict[int, int] = {}

    def new_cache(self, batch, capacity):
        return self.runner.new_cache(batch, capacity)

    def prefill(self, cache, prompts):
        self.filled[id(cache)] = len(prompts[0])
        return self.runner.prefill(cache, prompts)

    def release(self, cache):
        self.runner.release(cache)

    def run(self, cache, step):
        assert step.start == [self.filled[id(cache)]]  # right after the prompt, as a decode step or verification
        self.clock[0] += self.cost[step.width]
        return self.runner.run(cache, step)


def test_step_costs_are_the_forwards_time_ratios(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("sdbench.analysis.costs.now", lambda device=None: clock[0])
    target = _Timed(ModelRunner(tiny_model(0)), {1: 0.010, 2: 0.0101, 3: 0.0104, 4: 0.012, 5: 0.013}, clock)
    draft = _Timed(ModelRunner(tiny_model(1, layers=1)), {1: 0.002}, clock)
    costs = step_costs(target, draft, [], [[1, 2, 3, 4, 5], [6, 7, 8]], 4)
    assert costs.verify == pytest.approx({1: 1.0, 2: 1.01, 3: 1.04, 4: 1.2, 5: 1.3})  # each width, not a line
    assert costs.at(5) == pytest.approx(1.3) and costs.draft == pytest.approx(0.2)


@pytest.mark.parametrize("args", [["--repeats", "0"], ["--limit", "0"], ["--gamma", "0"]])
def test_bench_rejects_impossible_settings(capsys, args):
    code, _, err = run_cli(capsys, "bench", *args)
    assert code != 0 and "at least 1" in err and "Traceback" not in err




# --- bench against transformers, for real --------------------------------------------------------------------


@pytest.fixture
def tiny_bench(tmp_path, monkeypatch):
    """A tiny model folder and a two-prompt CSV whose prompts repeat (prompt lookup finds matches)."""
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    folder = tiny_model_dir(tmp_path / "tiny")
    data = tmp_path / "prompts.csv"
    data.write_text("prompt\n" + "".join(f"\"{' '.join(f'w{(k * i) % 90}' for i in range(9)) * 2}\"\n"
                                         for k in (3, 7)))
    return ["bench", "--target", str(folder), "--dataset", str(data), "--limit", "2", "--max-new-tokens", "12",
            "--repeats", "1"]


def test_bench_runs_every_system_and_passes_when_outputs_equal_generate(capsys, tiny_bench, tmp_path, monkeypatch):
    from sdbench.servers.llamacpp import LlamaCpp

    monkeypatch.setattr(LlamaCpp, "installed", lambda self: False)  # what a fresh checkout has
    code, out, err = run_cli(capsys, *tiny_bench, "--out", str(tmp_path / "bench"))
    assert code == 0, err
    assert ("llama.cpp at the same weights and dtype beside these: `make engine-llama.cpp` in sdbench's checkout "
            "installs it, then add --engine llama.cpp") in out
    df = pd.read_parquet(tmp_path / "bench" / "bench.parquet")
    # 8 systems (the generic runner too), 2 prompts x 12 tokens; generate in the configuration the suite sets
    assert len(df) == 8 and df.same_output.all() and (df.tokens == 24).all()
    assert {"transformers generate (dynamic cache)", "transformers assisted (γ=4)",
            "transformers prompt lookup (γ=4)"} <= set(df.system)


def test_bench_measures_trained_heads_beside_the_others_and_checks_their_outputs(capsys, tiny_bench, tmp_path):
    """--head adds one sdbench row per head (EAGLE-3, Medusa, DFlash, DSpark, P-EAGLE, MTP), interleaved with the
    others and held to generate's tokens like every sdbench row; a DFlash block of 4 drafts 3 tokens, so its gamma
    is 3 (DSpark's drafts from the anchor too: 4)."""
    from transformers import AutoModelForCausalLM

    from tests.heads import dflash_dir, eagle3_dir, medusa_dir, mtp_dir

    target = AutoModelForCausalLM.from_pretrained(tiny_bench[2])
    eagle3_dir(tmp_path / "e3", target, draft_vocab=48, layer_ids=[0, 1, 2])
    medusa_dir(tmp_path / "md", target, heads=4)
    dflash_dir(tmp_path / "df", target, block=4, layer_ids=(1, 2))
    dflash_dir(tmp_path / "ds", target, block=4, layer_ids=(1, 2), anchor=True, dspark={"type": "rnn"})
    eagle3_dir(tmp_path / "pe", target, fmt="peagle", layer_ids=[0, 1, 2])
    mtp_dir(tmp_path / "mt", target)
    code, out, err = run_cli(capsys, *tiny_bench, *[a for h in ("e3", "md", "df", "ds", "pe", "mt")
                                                    for a in ("--head", str(tmp_path / h))],
                             "--out", str(tmp_path / "bench"))
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "bench" / "bench.parquet")
    names = ("sdbench eagle eagle3 e3 (γ=4)", "sdbench medusa md (γ=4)", "sdbench dflash df (γ=3)",
             "sdbench dspark ds (γ=4)", "sdbench peagle pe (γ=4)", "sdbench mtp mt (γ=4)")
    heads = df[df.system.str.startswith(names)]
    assert len(heads) == 6 and heads.same_output.all() and (heads.tokens == 24).all(), df.system.tolist()
    blocks = heads[heads.system.str.startswith(names[2:4])]  # one timed round drafts the block: c, whatever g
    assert (blocks.step_draft_cost > 0).all() and (blocks.round_draft_cost == blocks.step_draft_cost).all()
    for _, row in blocks.iterrows():  # sdbench's own row: L / (c + v(g + 1) + o), its own acceptance carried
        assert row.own_predicted_speedup == pytest.approx(row.tokens_per_round / (
            row.step_draft_cost + row.step_verify_cost + row.round_overhead_cost))
        assert row.round_overhead_cost > row.round_host_cost  # a head's setup reads the prompt's states
        assert row.carried_speedup == pytest.approx(row.own_predicted_speedup)
    others = heads[~heads.system.str.startswith(names[2:4])]  # a chain: its round's drafting per draft, g c
    assert (others.step_draft_cost > 0).all()
    for _, row in others.iterrows():
        assert row.round_draft_cost == pytest.approx(row.drafts_per_round * row.step_draft_cost)
        assert row.own_predicted_speedup == pytest.approx(row.tokens_per_round / (
            row.round_draft_cost + row.step_verify_cost + row.round_overhead_cost))


def test_bench_drafts_with_an_int8_copy_made_at_load_time(capsys, tiny_bench, tmp_path):
    """--draft MODEL@int8, as `run` takes it: the quantised copy drafts for sdbench's SD and for transformers'
    assisted generation alike, every output held to generate's tokens."""
    draft = f"{tiny_bench[2]}@int8"
    code, out, err = run_cli(capsys, *tiny_bench, "--draft", draft, "--out", str(tmp_path / "bench"))
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "bench" / "bench.parquet")
    assert len(df) == 8 and df.same_output.all() and (df.tokens == 24).all()
    assert set(df.draft) == {draft}


def test_bench_fails_naming_the_system_and_prompt_whose_output_differs(capsys, tiny_bench, monkeypatch):
    import sdbench.commands.bench as bench

    real = bench._systems

    def one_token_off(*args, **kwargs):
        systems = real(*args, **kwargs)
        name, fn, fast = systems[-1]  # sdbench ngram

        def wrong(prompt, budget):
            out = fn(prompt, budget)
            if budget is None and prompt == prompts_seen[1]:  # measured, second prompt: one token changed
                out[5] = (out[5] + 1) % 96
            return out
        systems[-1] = (name, wrong, fast)
        return systems

    prompts_seen = []
    real_measure = bench.measure_systems
    monkeypatch.setattr(bench, "measure_systems", lambda systems, prompts, *a: (prompts_seen.extend(prompts),
                                                                        real_measure(systems, prompts, *a))[1])
    monkeypatch.setattr(bench, "_systems", one_token_off)
    monkeypatch.setattr(bench, "step_costs", lambda *a: StepCosts({1: 1.0, 5: 1.0}, 1.0))  # not what this test is about
    capsys.readouterr()
    code, out, err = run_cli(capsys, *tiny_bench)
    assert code == 1 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1
    assert "sdbench ngram (γ=4)" in lines[0] and "prompt 2" in lines[0] and "new token 6" in lines[0]
    # the table came out first, with the differing system marked
    table = out.split("Does it carry over?")[0]  # the systems' table, not the carry-over's under it
    assert ["NO (1/2 prompts)" in line for line in table.splitlines() if "│ sdbench" in line] == [False] * 4 + [True]


@pytest.mark.slow
def test_bench_on_smollm2_through_the_cli(capsys, tmp_path, monkeypatch):
    """The default bench (SmolLM2-135M drafting for itself, MT-Bench), cut short: every sdbench system's
    output equals `generate`'s, or the command fails."""
    import sdbench.commands.bench as bench
    from sdbench.models.loading import embedded
    from sdbench.models.loading.aliases import model_registry

    spec = model_registry.get("smollm2-135m")
    if embedded.missing_packages(spec):
        skip_unless_ci(f"needs `{spec.install_command()}`")
    monkeypatch.setattr(bench, "step_costs", lambda *a: StepCosts({1: 1.0, 5: 1.0}, 1.0))  # timings only (tested on a tiny pair)
    code, out, err = run_cli(capsys, "bench", "--limit", "1", "--max-new-tokens", "8", "--repeats", "1",
                             "--out", str(tmp_path))
    assert code == 0, err
    df = pd.read_parquet(tmp_path / "bench.parquet")
    assert len(df) == 8 and df.same_output.all() and (df.tokens == 8).all()
    assert (df.model == "smollm2-135m").all() and (df.dataset == "mt-bench").all()


def test_outputs_are_compared_with_generates_dynamic_cache_when_the_timed_configuration_disagrees(monkeypatch):
    """The fastest `generate` configuration timed is not the reference: its dynamic cache (step-by-step decoding)
    is. Where the two disagree, one line says so, and an sdbench system equal to the timed configuration but not
    to the dynamic cache fails."""
    import sdbench.commands.bench as bench
    import sdbench.commands.bench_table as bench_table
    from sdbench.commands.bench_judge import fail_on_real, hold
    from sdbench.commands.hf_generate import Picked

    dynamic = {(1, 2): [5, 6, 7, 8], (3, 4): [9, 9, 9, 9]}
    monkeypatch.setattr(bench, "generator", lambda model, eos, kwargs: (
        lambda prompt, n: (pytest.fail("not the dynamic cache") if kwargs else dynamic[tuple(prompt)][:n])))
    timed = SystemMeasurement("transformers generate (static cache, torch.compile)", False, [8], [1.0],
                     [[5, 6, 7, 8], [9, 9, 1, 9]])
    ref, line = bench._reference(None, [[1, 2], [3, 4]], [0], 4, Picked("compiled"), timed, _Status(),
                                 lambda fast: None)
    assert ref == [[5, 6, 7, 8], [9, 9, 9, 9]]
    assert "disagree" in line and "prompt 2" in line and "new token 3" in line and "dynamic cache" in line
    ours = SystemMeasurement("sdbench ngram (γ=4)", True, [8], [1.0], [[5, 6, 7, 8], [9, 9, 1, 9]])
    held = hold([timed, ours], ref, [[1, 2], [3, 4]], False, lambda fast: None)
    with pytest.raises(bench_table.OutputDiffers, match="prompt 2 .first at new token 3"):
        fail_on_real(held)
    agree = SystemMeasurement(timed.system, False, [8], [1.0], [list(r) for r in ref])
    assert bench._reference(None, [[1, 2], [3, 4]], [0], 4, Picked("compiled"), agree, _Status(),
                            lambda fast: None) == (ref, None)
    assert bench._reference(None, [], [0], 4, Picked("dynamic"), timed, _Status(), None) == (timed.outputs, None)


def test_bench_measures_a_token_tree_beside_the_chain(capsys, tiny_bench, tmp_path, monkeypatch):
    """--tree 2,6: the draft model's top-2 tree of 6 nodes through sdbench's loop, held to generate's tokens; its
    verification is 7 tokens wide, so the step costs time widths up to 7, and its carry-over row reads v over
    the widths its rounds verified: L / (its round's drafting + v + o)."""
    import sdbench.commands.bench as bench

    seen = {}
    real = bench.step_costs
    monkeypatch.setattr(bench, "step_costs", lambda *a: seen.setdefault("costs", real(*a)))
    code, out, err = run_cli(capsys, *tiny_bench, "--tree", "2,6", "--out", str(tmp_path / "bench"))
    assert code == 0, err
    assert set(seen["costs"].verify) == set(range(1, 8))
    assert f"T(5 tokens) / T(1 token), {tiny_bench[2]}: {seen['costs'].at(5):.2f};" in out  # a chain's, not the tree's
    df = pd.read_parquet(tmp_path / "bench" / "bench.parquet")
    tree = df[df.system.str.startswith("sdbench draft tree (top-2, 6 nodes, γ=4)")].iloc[0]
    assert tree.same_output and tree.tokens == 24
    assert 4 < tree.drafts_per_round <= 6  # six nodes a round, fewer where the budget's end has no room
    assert tree.own_predicted_speedup == pytest.approx(tree.tokens_per_round / (
        tree.round_draft_cost + tree.step_verify_cost + tree.round_overhead_cost))
    assert min(seen["costs"].verify.values()) <= tree.step_verify_cost <= max(seen["costs"].verify.values())


@pytest.mark.parametrize("value, said", [("2", "give the top-K and the node budget as K,NODES"),
                                         ("0,4", "give the top-K and the node budget as K,NODES"),
                                         ("2,x", "give the top-K and the node budget as K,NODES")])
def test_bench_refuses_a_bad_tree_in_one_line(capsys, value, said):
    code, _, err = run_cli(capsys, "bench", "--tree", value)
    assert code == 2 and err.strip() == f"error: --tree {value}: {said}, e.g. 2,8"
