"""What `train-head` fits on, carries over and reports: a fit interrupted and resumed is, weight for weight and
Adam moment for Adam moment, the fit that was never interrupted; the loss counts the answer's positions only
(the prompt and its chat template are read, never fitted), as a cross-entropy computed here by hand; the
held-out acceptance it records is the written head's, and above an untrained head's where there is something
to learn."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import run_cli
from tests.heads import one_thread  # noqa: F401  (a fixture)
from tests.test_train_head import _train, fitted  # noqa: F401  (fitted: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _stopping_fit(real, steps: int, stop_at: int | None = None):
    """command.fit with the fit ending after `steps` steps (not at the clock), interrupted after `stop_at`, on
    batches small enough that an epoch is several of them (their order matters)."""
    def run(model, optimizer, train, heldout, plan, progress, budget, device, on_eval, on_step=None):
        def step(p):
            if on_step is not None:
                on_step(p)
            if p.step == stop_at:
                raise KeyboardInterrupt
        return real(model, optimizer, train, heldout, replace(plan, max_steps=steps, batch_tokens=256), progress,
                    budget, device, on_eval, step)
    return run


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_a_resumed_fit_is_the_uninterrupted_fit_weight_for_weight(fitted, capsys, monkeypatch, kind):
    """12 steps in one run, and 5 steps interrupted then resumed to 12 on the same data: the same head, the same
    AdamW moments and step counts, the same learning rate and smoothed loss (the warm-up spans the interruption,
    so a schedule restarted from zero would show too)."""
    import sdbench.commands.train_head as command

    real, n, k = command.fit, 12, 5
    whole, resumed = fitted / f"whole-{kind}", fitted / f"resumed-{kind}"
    monkeypatch.setattr(command, "fit", _stopping_fit(real, n))
    code, _, err = _train(capsys, fitted, whole, "5", "--kind", kind)
    assert code == 0, err
    resumed.mkdir()  # the same data: the sequences made by the first run (generating them again is not the point)
    shutil.copytree(whole / "data", resumed / "data")
    shutil.copy(whole / "train_state.json", resumed / "train_state.json")
    monkeypatch.setattr(command, "fit", _stopping_fit(real, n, stop_at=k))
    code, _, err = _train(capsys, fitted, resumed, "5", "--kind", kind)
    assert code == 130, err
    assert torch.load(resumed / "checkpoint.pt", weights_only=False)["progress"]["step"] == k
    monkeypatch.setattr(command, "fit", _stopping_fit(real, n))
    code, _, err = _train(capsys, fitted, resumed, "5", "--kind", kind)
    assert code == 0, err

    a, b = (torch.load(f / "checkpoint.pt", weights_only=False) for f in (whole, resumed))
    assert a["progress"]["step"] == b["progress"]["step"] == n
    assert a["progress"]["loss"] == b["progress"]["loss"]
    assert a["model"].keys() == b["model"].keys() and len(a["model"]) >= 8
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert (a["draft_ids"] is None) == (b["draft_ids"] is None)
    assert a["draft_ids"] is None or torch.equal(a["draft_ids"], b["draft_ids"])
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys() and len(sa) == len(a["model"])
    for i in sa:
        for moment in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[i][moment], sb[i][moment]), (i, moment)
        assert float(sa[i]["step"]) == n
    weights = "model.safetensors" if kind == "eagle3" else "medusa_lm_head.safetensors"
    assert (whole / weights).read_bytes() == (resumed / weights).read_bytes()
    assert json.loads((whole / "sdbench_head.json").read_text())["steps"] == n


TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_the_loss_counts_the_answer_only_as_a_masked_cross_entropy_by_hand(fitted, kind):
    """A chat prompt through its template, then the data set's reply, read as train-head reads it: the loss
    counts, at every step k, the roots from the prompt's last character on (where decoding drafts from) whose
    label lies within the sequence, labelled with the target's own choice of token root + k + 2; it is the
    mean over steps of each step's mean cross-entropy over those roots, computed here position by position."""
    from sdbench.data import Prompt
    from sdbench.models.loading.loader import load_model
    from sdbench.models.loading.pair import pick_runner
    from sdbench.training import data as D
    from sdbench.training.fit import step_losses
    from sdbench.training.heads import build, head_layers

    loaded = load_model(str(fitted / "target"))
    loaded.tokenizer.chat_template = TEMPLATE
    runner = pick_runner(loaded.model, "tiny", fast=False)
    question, reply = "Tom has 7 apples.", "He has 10."
    chat = Prompt("p/0", "x", (question,), reference=reply)
    [encoded] = D.encode([("p", chat)], loaded.tokenizer, 512)
    [seq] = D.teacher_forced(runner, [encoded], layers=head_layers(kind, loaded.model.config),
                             tokenizer=loaded.tokenizer, max_tokens=64)
    prompt_text = f"[user] {question}\n[assistant] "  # the template by hand: one token a character
    assert loaded.tokenizer.decode(seq.tokens) == prompt_text + reply
    P, T, n = len(prompt_text), len(prompt_text) + len(reply), 3
    assert len(seq.tokens) == T

    trainee = build(kind, loaded.model, [seq], n, 0)
    loss, logits, labels = step_losses(trainee, [seq], n, "cpu")
    logits = [lg.detach() for lg in logits]
    assert len(logits) == n
    by_step = []
    for k in range(n):
        counted = [q for q in range(T) if q >= P - 1 and q + k + 1 < T]  # the prompt's last character on
        assert [q for q in range(T) if labels[k][0, q] != -100] == counted, k
        assert all(int(labels[k][0, q]) == int(seq.pred[q + k + 1]) for q in counted)  # full vocabulary: ids
        ce = [torch.logsumexp(logits[k][0, q].double(), 0) - logits[k][0, q, int(seq.pred[q + k + 1])].double()
              for q in counted]
        by_step.append(sum(ce) / len(ce))
    assert loss.item() == pytest.approx(float(sum(by_step) / n), rel=1e-5)
    # the prompt's roots, counted too, would give another loss: the mask is what the check above measured
    everything = sum(F.cross_entropy(logits[k][0, : T - k - 1].float(), seq.pred[k + 1:].long()) for k in range(n)) / n
    assert abs(float(everything) - loss.item()) > 1e-3


def test_the_held_out_acceptance_recorded_is_the_written_heads_and_beats_an_untrained_one(fitted, capsys,
                                                                                        monkeypatch):
    """Prompts asked twice (the held-out one's twin is trained on, so what the head memorises carries over):
    after a fixed number of steps, few enough that some chains are accepted and others not, the acceptance
    recorded is the one drafting through the written head's files gives on the held-out answer (counted by hand
    in tests/test_train_head.py), and it is far above an untrained head's on the same answer."""
    import sdbench.commands.train_head as command
    from sdbench.models.loading.loader import load_model
    from sdbench.training.data import load_shards
    from sdbench.training.heads import build, write_head
    from tests.test_train_head import _heldout_tau_by_hand

    lines = ["prompt"] + [f'"Tom has {i // 2} apples and buys {i // 2 + 3} more. How many now?"' for i in range(20)]
    (fitted / "twins.csv").write_text("\n".join(lines) + "\n")
    out = fitted / "twins"
    monkeypatch.setattr(command, "fit", _stopping_fit(command.fit, 120))
    code, _, err = run_cli(capsys, "train-head", "--target", str(fitted / "target"), "--out", str(out), "--data",
                           str(fitted / "twins.csv"), "--prompts", "20", "--max-new-tokens", "24", "--minutes", "5",
                           "--device", "cpu", "--draft-vocab", "0")
    assert code == 0, err
    record = json.loads((out / "sdbench_head.json").read_text())
    trained = next(iter(record["trained_on"].values()))
    assert record["steps"] == 120 and len(trained) == 19
    fitted_tau = _heldout_tau_by_hand(fitted, out, trained)
    assert record["heldout_acceptance"] == pytest.approx(fitted_tau)
    untrained = fitted / "untrained"
    model = load_model(str(fitted / "target")).model
    write_head(untrained, "eagle3", build("eagle3", model, load_shards(out / "data"), 3, 0), model, "tiny",
               torch.float32)
    shutil.copytree(out / "data", untrained / "data")
    assert fitted_tau > _heldout_tau_by_hand(fitted, untrained, trained) + 1.0


def test_a_fits_budget_counts_its_evaluations_and_checkpoints(monkeypatch):
    """--minutes is wall-clock: a fit whose evaluations and checkpoints take longer than its steps (a 1.5B target's
    head written ten times) stops within one evaluation of its budget, not after the steps alone fill it."""
    import time

    from sdbench.training import fit as F

    model = torch.nn.Linear(1, 1)
    monkeypatch.setattr(F, "batches", lambda *args: iter(lambda: None, 0))  # endless, empty batches
    monkeypatch.setattr(F, "step_losses", lambda m, batch, steps, device, sample: (m.weight.pow(2).sum(), None, None))
    monkeypatch.setattr(F, "chain_acceptance", lambda *args: {"tau": 1.0})
    evaluations = []

    def on_eval(progress):
        evaluations.append(progress.step)
        time.sleep(0.2)  # the checkpoint's writing

    start = time.perf_counter()
    done = F.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), [], [], F.FitPlan(1, 0.1, 8, eval_every_s=0.0),
                 F.Progress(), 1.0, "cpu", on_eval)
    assert time.perf_counter() - start < 1.0 + 0.2 + 0.5 and 4 <= len(evaluations) <= 7
    assert done.seconds >= 0.2 * (len(evaluations) - 1)
