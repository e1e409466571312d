"""`run --temperature > 0` end to end through the CLI on a tiny model folder, over two-turn prompts.

What a user meets under sampling: rows for every turn of every system; the answer carried into turn 2 is a
sampled one (not what greedy decoding gives), the baseline's for both systems (README, multi-turn questions:
both sides of a comparison decode the very same prompt), the strategy's own with --no-baseline; the same
--seed gives the same tokens again and another seed other tokens. Which prompt each decode was given is read by
wrapping (not replacing) the one `generate` call `run` makes.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from sdbench.commands import run as benchmark
from sdbench.data.tasks import encode_prompt, load_prompts
from sdbench.reporting.results import read_results
from tests.conftest import run_cli
from tests.references import hf_generate, tiny_model_dir

NEW = 10
RECORDS = [{"question_id": 1, "category": "writing", "turns": ["w5 w9 w13 w5 w9 w40", "w20 w21 w22"]},
           {"question_id": 2, "category": "qa", "turns": ["w40 w41 w42 w43", "w7 w8 w7"]}]


@pytest.fixture
def sampled(tmp_path, monkeypatch):
    """(run arguments but --out and --seed, the decodes' log: (proposer class, prompts) per `decode` call)."""
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    folder = tiny_model_dir(tmp_path / "tiny")
    data = tmp_path / "two-turns.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    calls = []
    real = benchmark.decode

    def watched(target, proposer, batch, *args, **kwargs):
        calls.append((type(proposer).__name__, [list(p) for p in batch]))
        return real(target, proposer, batch, *args, **kwargs)

    monkeypatch.setattr(benchmark, "decode", watched)
    args = ["run", "--target", str(folder), "--strategy", "draft", "--draft", str(folder), "--gamma", "3",
            "--dataset", str(data), "--limit", "2", "--max-new-tokens", str(NEW), "--temperature", "1.5",
            "--device", "cpu"]
    return args, calls, folder, data


def _turn2_prompts(folder, data, answers: dict) -> dict:
    """prompt id -> the turn-2 prompt that carries `answers[prompt id]` (turn 1's token ids), its text decoded
    as the README says: the turns and answers one paragraph each (the tiny tokenizer has no chat template)."""
    tok = AutoTokenizer.from_pretrained(folder)
    return {p.id: encode_prompt(p, tok, [tok.decode(answers[p.id], skip_special_tokens=True).strip()])
            for p in load_prompts(str(data))}


def _outputs(df) -> dict:
    return {(r.role, r.prompt_id, int(r.turn)): list(r.output_ids) for r in df.itertuples()}


def test_sampled_run_carries_the_sampled_answer_into_turn_two_and_repeats_with_its_seed(capsys, tmp_path, sampled):
    args, calls, folder, data = sampled
    code, out, err = run_cli(capsys, *args, "--seed", "3", "--out", str(tmp_path / "a"))
    assert code == 0, err
    df = read_results([tmp_path / "a"])
    assert len(df) == 8 and (df["temperature"] == 1.5).all() and (df["seed"] == 3).all()
    assert df.groupby(["role", "turn"]).size().to_dict() == {(r, t): 2 for r in ("baseline", "strategy")
                                                                for t in (1, 2)}
    got = _outputs(df)
    ids = sorted(df["prompt_id"].unique())
    base1 = {i: got["baseline", i, 1] for i in ids}
    strat1 = {i: got["strategy", i, 1] for i in ids}
    assert all(base1.values()) and any(base1[i] != strat1[i] for i in ids)  # the two answers are told apart

    # sampled, not greedy: transformers' greedy generate on turn 1's prompt gives other tokens
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    prompt1 = {p.id: encode_prompt(p, tok) for p in load_prompts(str(data))}
    assert any(hf_generate(model, prompt1[i], NEW, eos=[2]) != base1[i] for i in ids)

    # turn 2 of both systems was given the baseline's sampled answer, never the strategy's
    carried, other = _turn2_prompts(folder, data, base1), _turn2_prompts(folder, data, strat1)
    for i in ids:
        kinds = sorted(kind for kind, batch in calls if batch == [carried[i]])
        assert kinds == ["Autoregressive", "DraftModel"], i
        if strat1[i] != base1[i]:
            assert all(batch != [other[i]] for _, batch in calls)
        assert (df.loc[(df["prompt_id"] == i) & (df["turn"] == 2), "prompt_tokens"] == len(carried[i])).all()

    # the same seed: the same tokens, every system and turn
    code, _, err = run_cli(capsys, *args, "--seed", "3", "--out", str(tmp_path / "b"))
    assert code == 0, err
    assert _outputs(read_results([tmp_path / "b"])) == got

    # without the baseline the strategy carries its own answer; another seed samples other tokens
    calls.clear()
    code, _, err = run_cli(capsys, *args, "--seed", "4", "--no-baseline", "--out", str(tmp_path / "c"))
    assert code == 0, err
    own = read_results([tmp_path / "c"])
    assert set(own["role"]) == {"strategy"} and sorted(own["turn"]) == [1, 1, 2, 2]
    mine = _outputs(own)
    assert any(mine["strategy", i, 1] != got["strategy", i, 1] for i in ids)  # turn 1: the same prompts
    carried = _turn2_prompts(folder, data, {i: mine["strategy", i, 1] for i in ids})
    for i in ids:
        assert [kind for kind, batch in calls if batch == [carried[i]]] == ["DraftModel"], i
