"""`train-head`'s options against the head kinds: an option a kind does not read, a --draft-vocab too small, an --out
holding files train-head did not write are each one line before any model loads; --help says which kinds read
what, from the head-kind registry (a toy kind registered shows up in the checks and the help); a resumed fit says
so; and a fitted head's config declares what its options asked (drafts per round, draft vocabulary, block, heads,
the verifier for a target given as a folder or a hub id), checked against values worked out here by hand."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import run_cli
from tests.heads import one_thread  # noqa: F401  (a fixture)
from tests.test_cli import one_line_error
from tests.test_train_head import fitted  # noqa: F401  (a fixture: a tiny target folder and a prompt file)

pytestmark = pytest.mark.usefixtures("one_thread")

# by hand, from what each trainee is built from (training/heads.py `rebuild`): the kinds that read each option
# whose use depends on the kind; Medusa and MTP draft through the target's own head, over its whole vocabulary
READS = {"--steps": {"eagle3", "medusa", "peagle", "mtp", "dflash", "dspark"},
         "--draft-vocab": {"eagle3", "peagle", "dflash", "dspark"}}
KINDS = sorted(READS["--steps"])
GIVEN = {"--steps": "2", "--draft-vocab": "0"}  # 0: "all", falsy, so a check on the value's truth would miss it


class Loaded(BaseException):
    """The target's load was reached: every check before it passed."""


@pytest.fixture
def no_load(monkeypatch):
    """Loading the target raises Loaded: what a command does before it is all a test sees."""
    from sdbench.models.loading import loader, pair

    def loading(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(pair, "load_models", loading)
    monkeypatch.setattr(loader, "load_model", loading)


def _cli(capsys, out, *args):
    return run_cli(capsys, "train-head", "--out", str(out), "--device", "cpu", "--no-probe", *args)


@pytest.mark.parametrize("option", sorted(READS))
@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_takes_the_options_it_reads_and_refuses_the_others_in_one_line(capsys, tmp_path, no_load, kind,
                                                                                 option):
    out = tmp_path / "head"
    if kind in READS[option]:
        with pytest.raises(Loaded):
            _cli(capsys, out, "--kind", kind, option, GIVEN[option])
        return
    code, _, err = _cli(capsys, out, "--kind", kind, option, GIVEN[option])
    readers = "dflash, dspark, eagle3 or peagle"
    line = one_line_error(code, err)
    assert f"{option} is for --kind {readers}, not {kind}" in line
    assert f"({kind} drafts over the target's vocabulary, through its own head)" in line
    assert not out.exists()  # refused before the folder was made


def _help(option: str) -> str:
    """The option's help as `train-head --help` shows it."""
    import typer

    from sdbench.cli import app

    command = typer.main.get_command(app).commands["train-head"]
    return next(p.help for p in command.params if option in p.opts)


def test_the_help_says_which_kinds_read_each_option():
    assert _help("--draft-vocab").startswith("DFlash, DSpark, EAGLE-3, P-EAGLE: tokens the head drafts over")
    assert _help("--draft-vocab").endswith("refused for --kind medusa or mtp")
    steps = _help("--steps")
    for title, default in (("DFlash, DSpark", 7), ("EAGLE-3, MTP", 3), ("Medusa-1", 4), ("P-EAGLE", 7)):
        assert f"{title}: " in steps and steps.count(f"(default {default})") >= 1, (title, steps)
    assert "refused" not in steps  # every kind reads it
    assert all(f"{kind} (" in _help("--kind") for kind in KINDS)


def test_a_toy_kind_registered_is_checked_and_shown_like_the_others(capsys, tmp_path, no_load):
    """One registration, no other list: a toy kind reading --steps alone is refused --draft-vocab, named in the
    help's refusals and in --kind's; one reading --draft-vocab too is named among its readers."""
    from sdbench.commands.train_head import validate
    from sdbench.config import TrainHeadConfig
    from sdbench.errors import SdbenchError
    from sdbench.training.kinds import HeadKind, head_kinds, kind_help, option_help

    head_kinds.add("toy", HeadKind("Toy", 2, {"--steps": "toy rounds (default 2)"}))
    head_kinds.add("toyvocab", HeadKind("ToyVocab", 2, {"--steps": "toy rounds (default 2)", "--draft-vocab": "toy"}))
    try:
        with pytest.raises(SdbenchError, match="--draft-vocab is for --kind dflash, dspark, eagle3, peagle or "
                                               "toyvocab, not toy"):
            validate(TrainHeadConfig(target="x", kind="toy", out=str(tmp_path), draft_vocab=100))
        validate(TrainHeadConfig(target="x", kind="toy", out=str(tmp_path), steps=5))
        assert option_help("--draft-vocab").endswith("refused for --kind medusa, mtp or toy")
        assert "Toy, ToyVocab: toy rounds (default 2)" in option_help("--steps")
        assert "toy (Toy)" in kind_help() and "toyvocab (ToyVocab)" in kind_help()
    finally:
        head_kinds.remove("toy")
        head_kinds.remove("toyvocab")


@pytest.mark.parametrize("asked", ["1", "-3"])
def test_a_draft_vocabulary_too_small_to_draft_from_is_one_line(capsys, tmp_path, no_load, asked):
    code, _, err = _cli(capsys, tmp_path / "head", "--draft-vocab", asked)
    assert f"--draft-vocab {asked}: at least 2 tokens, or 0 for all the target's" in one_line_error(code, err)


def _results_folder(folder):
    (folder / "runs").mkdir(parents=True)
    (folder / "runs" / "rows.parquet").write_bytes(b"PAR1 rows PAR1")
    return "runs"


def _other_head(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"speculators_model_type": "eagle3"}')
    (folder / "model.safetensors").write_bytes(b"weights")
    return "config.json and 1 more"


def _a_note(folder):
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    return "notes.txt"


@pytest.mark.parametrize("fill", [_results_folder, _other_head, _a_note])
def test_an_out_folder_holding_other_files_is_refused_and_left_as_it_was(capsys, tmp_path, no_load, fill):
    out = tmp_path / "out"
    named = fill(out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, _, err = _cli(capsys, out)
    assert (f"--out {out} holds files train-head did not write ({named}): give a new or empty folder"
            in one_line_error(code, err))
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing written, nothing gone


def test_an_empty_out_folder_is_used_and_a_target_that_failed_to_load_leaves_it_empty(capsys, tmp_path, no_load):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(Loaded):
        _cli(capsys, out, "--target", "first-target")
    assert list(out.iterdir()) == []
    with pytest.raises(Loaded):  # another target in the same folder: nothing there claims it
        _cli(capsys, out, "--target", "second-target")


def _hub_target(fitted, tmp_path, monkeypatch) -> str:
    """The tiny target as the offline hub cache holds a hub model: `owner/name`, read from the cache only."""
    import huggingface_hub.constants

    repo = "sdbench-tests/tiny-target"
    cache = tmp_path / "hub" / f"models--{repo.replace('/', '--')}"
    shutil.copytree(fitted / "target", cache / "snapshots" / ("0" * 40))
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo


# kind, the options given (none at its default), and by hand what the config must then declare: the drafts per
# round (--steps, as speculators writes its training steps, P-EAGLE's depths, a block's drafts), the draft
# vocabulary (--draft-vocab; None: the kind has none), the block (one more than its drafts) or Medusa's heads
FITS = [("eagle3", "folder", ["--steps", "5", "--draft-vocab", "40"], 5, 40),
        ("eagle3", "hub", ["--steps", "2", "--draft-vocab", "60"], 2, 60),
        ("peagle", "folder", ["--steps", "4", "--draft-vocab", "30"], 4, 30),
        ("mtp", "folder", ["--steps", "2"], 2, None),
        ("dflash", "folder", ["--steps", "3", "--draft-vocab", "50"], 3, 50),
        ("dspark", "folder", ["--steps", "5", "--draft-vocab", "20"], 5, 20),
        ("medusa", "hub", ["--steps", "3"], 3, None)]


@pytest.mark.parametrize("kind, source, options, drafts, vocab", FITS)
def test_a_fitted_heads_config_declares_what_its_options_asked(fitted, capsys, tmp_path, monkeypatch, kind, source,
                                                               options, drafts, vocab):
    from dataclasses import replace

    import sdbench.commands.train_head as command

    real = command.fit
    monkeypatch.setattr(command, "fit", lambda *a: real(*a[:4], replace(a[4], max_steps=2), *a[5:]))
    target = _hub_target(fitted, tmp_path, monkeypatch) if source == "hub" else str(fitted / "target")
    verifier = target if source == "hub" else str((fitted / "target").resolve())
    out = tmp_path / kind
    args = ["--target", target, "--kind", kind, "--data", str(fitted / "p.csv"), "--prompts", "4",
            "--max-new-tokens", "8", "--minutes", "5", *options]
    code, _, err = _cli(capsys, out, *args)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    architectures = json.loads((fitted / "target" / "config.json").read_text())["architectures"]
    assert architectures == ["LlamaForCausalLM"]
    if kind == "medusa":
        assert config["medusa_num_heads"] == drafts and config["base_model_name_or_path"] == verifier
    else:
        assert config["speculators_model_type"] == kind
        spec = config["speculators_config"]
        assert spec["algorithm"] == kind and spec["default_proposal_method"] == "greedy"
        assert [m["speculative_tokens"] for m in spec["proposal_methods"]] == [drafts]
        assert spec["verifier"] == {"name_or_path": verifier, "architectures": architectures}
        assert config.get("draft_vocab_size") == vocab
        assert config.get("block_size") == (drafts + 1 if kind in ("dflash", "dspark") else None)
    record = json.loads((out / "sdbench_head.json").read_text())
    assert (record["kind"], record["target"], record["draft_vocab"]) == (kind, target, vocab)
    assert record["target_weights"]["source"] == {"hub": "hub", "folder": "local"}[source]  # loaded as named


def test_the_same_command_on_a_fit_it_made_resumes_it_and_says_so_before_loading(fitted, capsys, tmp_path,
                                                                                  monkeypatch):
    """A folder holding sdbench's own fit (and a file of the user's put there since) is resumed, in one line that
    says how far it went and that --minutes counts from its first run; the same folder with other settings is
    refused."""
    from dataclasses import replace

    import sdbench.commands.train_head as command
    from sdbench.models.loading import pair

    real = command.fit
    monkeypatch.setattr(command, "fit", lambda *a: real(*a[:4], replace(a[4], max_steps=2), *a[5:]))
    out = tmp_path / "head"
    args = ["--target", str(fitted / "target"), "--data", str(fitted / "p.csv"), "--prompts", "4",
            "--max-new-tokens", "8", "--minutes", "5"]
    code, _, err = _cli(capsys, out, *args)
    assert code == 0, err
    (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(pair, "load_models", lambda *a, **k: (_ for _ in ()).throw(Loaded))
    with pytest.raises(Loaded):
        _cli(capsys, out, *args, "--minutes", "7")
    said = " ".join(capsys.readouterr().out.split())
    assert (f"note: --out {out} holds this fit (fitted 2 steps): it goes on from there, its data kept, within "
            "--minutes 7 counted from its first run") in said, said
    code, _, err = _cli(capsys, out, *args, "--steps", "4")
    assert f"--out {out} holds a fit with another steps (None)" in one_line_error(code, err)
    assert (out / "notes.txt").read_text() == "mine"
