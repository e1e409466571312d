"""Bad input and faults a user meets: each ends in one `error:` line on stderr (or one note), never a traceback."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.conftest import run_cli
from tests.references import tiny_cli_files, tiny_model_dir
from tests.test_cli import one_line_error


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.mark.parametrize("damage", ["header", "truncated"])
def test_a_corrupt_safetensors_file_is_one_line_naming_it(capsys, tmp_path, monkeypatch, tiny_folder, damage):
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\xff" * 64 if damage == "header" else data[: len(data) // 2])
    code, _, err = run_cli(capsys, "check", str(folder), "--device", "cpu")
    line = one_line_error(code, err)
    assert f"{weights} is not a readable safetensors file" in line


def test_check_keeps_its_table_and_says_its_failure_on_stderr(capsys, tmp_path, monkeypatch, tiny_folder):
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    code, out, err = run_cli(capsys, "check", str(tiny_folder), "--draft", str(tmp_path / "nope"), "--device", "cpu",
                             "--context", "32", "--tokens", "4")
    assert code == 1
    line = one_line_error(code, err)
    assert line.startswith("error: check failed: ") and "no such file or folder" in line
    assert "sdbench check" in out and "failed" in out  # the table stays on stdout


@pytest.mark.parametrize("argv", [
    ["bench", "--target", "smollm2-135m@random", "--limit", "1"],
    ["run", "--target", "smollm2-135m@random", "--limit", "1"],
    ["run", "--target", "smollm2-135m", "--draft", "smollm2-135m@random", "--strategy", "draft", "--limit", "1"],
    ["check", "smollm2-135m@random"],
    ["simulate", "dsi", "--target", "smollm2-135m@random"],
    ["predict", "speedup", "--alpha", "0.8", "--target", "smollm2-135m@random"],
    ["tune", "--target", "smollm2-135m@random", "--limit", "1", "--trials", "1"],
])
def test_a_model_that_cannot_fit_is_refused_before_anything_is_built(capsys, tmp_path, monkeypatch, argv):
    from sdbench.models.loading import memory, random_weights

    monkeypatch.setattr(memory, "free_bytes", lambda device: 64 << 20)
    monkeypatch.setattr(random_weights, "seeded_model", lambda *a: pytest.fail("a model was built"))
    out = [] if argv[0] == "check" or argv[:2] == ["predict", "speedup"] else ["--out", str(tmp_path)]
    code, _, err = run_cli(capsys, *argv, "--device", "cpu", *out)
    line = one_line_error(code, err)
    assert re.search(r"its weights take 0\.\d GiB in float32 and 0\.1 GiB are free on cpu: nothing was built", line) \
        or re.search(r"smollm2-135m and smollm2-135m@random: their weights take 1\.0 GiB", line), line


@pytest.mark.parametrize("argv, expect", [
    (["--storage", "bogus://x"], "error: --storage bogus://x: "),
    (["--strategy", "autoregressive"], "error: strategy 'autoregressive' has nothing to tune"),
])
def test_tune_refuses_a_bad_storage_or_strategy_before_loading(capsys, tmp_path, monkeypatch, tiny_folder, argv,
                                                               expect):
    from sdbench.models.loading import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(loader, "load_tokenizer", lambda *a, **k: pytest.fail("a tokenizer was loaded"))
    code, _, err = run_cli(capsys, "tune", "--target", str(tiny_folder), "--limit", "1", "--trials", "1",
                           "--out", str(tmp_path), *argv)
    assert one_line_error(code, err).startswith(expect)
    assert not (tmp_path / "tune.db").exists() or argv[0] == "--storage"


class Killed(BaseException):
    """The process dying mid-run (SIGKILL): no handler of the run's own sees it."""


def test_a_run_stopped_mid_way_reads_as_partial_until_resumed(capsys, tmp_path, monkeypatch):
    from sdbench.reporting.writer import RunWriter

    args = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w1 w2", "w4 w5 w6 w4 w5"])
    out = tmp_path / "out"
    real = RunWriter.append

    def append_then_die(self, rows):
        real(self, rows)
        raise Killed

    monkeypatch.setattr(RunWriter, "append", append_then_die)
    with pytest.raises(Killed):
        run_cli(capsys, "run", *args, "--strategy", "ngram", "--limit", "2", "--max-new-tokens", "4", "--no-probe",
                "--out", str(out))
    monkeypatch.setattr(RunWriter, "append", real)
    capsys.readouterr()
    (parts,) = out.glob("*.parts")
    run_id = parts.name.removesuffix(".parts")
    code, report, _ = run_cli(capsys, "report", str(out))
    said = " ".join(report.split())  # the title wraps where the temporary folder's path is long enough
    assert code == 0 and f"{run_id} (partial)" in said
    assert f"{run_id} is partial: its process stopped before the run's end" in said

    code, _, err = run_cli(capsys, "run", "--resume", run_id, "--out", str(out))
    assert code == 0, err
    code, report, _ = run_cli(capsys, "report", str(out))
    assert code == 0 and run_id in report and "partial" not in report


def test_a_batch_larger_than_the_prompts_and_turns_beyond_them_are_said_and_recorded(capsys, tmp_path, monkeypatch):
    from sdbench.reporting.results import read_results

    args = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w1 w2", "w4 w5 w6 w4 w5"])
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "run", *args, "--strategy", "ngram", "--limit", "2", "--batch-size", "8",
                                "--turns", "3", "--max-new-tokens", "4", "--gamma", "2", "--no-probe",
                                "--out", str(out))
    assert code == 0, err
    said = " ".join(stdout.split())
    assert "note: --batch-size 8 with 2 prompt(s): batches of 2 are run and recorded" in said
    assert "note: --turns 3: the prompts have at most 1 turn(s), so 1 is run" in said
    rows = read_results([out])
    assert set(rows["batch_size"]) == {2} and set(rows["turn"]) == {1}

    code, _, err = run_cli(capsys, "compare", str(out), str(out), "--across", "dtype,,")
    assert one_line_error(code, err) == ("error: --across dtype,,: an empty item in the list (two commas in a row, "
                                         "or one at an end)")


@pytest.mark.parametrize("argv", [
    ["run", "--gamma", "1,,2"],
    ["run", "--request-rate", "1,4,"],
    ["sweep", "--prompt-len", ",256"],
    ["predict", "magicdec", "--batch", "1,,4"],
])
def test_an_empty_list_item_is_refused(capsys, monkeypatch, argv):
    from sdbench.models.loading import loader

    monkeypatch.setattr(loader, "load_config", lambda *a, **k: pytest.fail("the command went on"))
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("the command went on"))
    monkeypatch.setattr(loader, "load_tokenizer", lambda *a, **k: pytest.fail("the command went on"))
    code, _, err = run_cli(capsys, *argv)
    assert one_line_error(code, err).endswith("an empty item in the list (two commas in a row, or one at an end)")


def test_a_tree_too_large_for_the_context_names_the_trees_size(capsys, tmp_path, monkeypatch):
    """A round's lookahead (here 100000 x 4 tree nodes) past the target's positions names --gamma and the tree,
    not --prompt-len and --max-new-tokens, which fit."""
    args = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w1 w2"])
    capsys.readouterr()
    code, _, err = run_cli(capsys, "run", *args, "--strategy", "draft", "--draft", args[1], "--set", "tree_topk=100000",
                           "--limit", "1", "--max-new-tokens", "8", "--no-probe", "--out", str(tmp_path / "out"))
    line = one_line_error(code, err)
    assert "a round drafts up to 400000 tokens" in line and "lower --gamma or the tree's size" in line, line
    assert "--prompt-len" not in line
