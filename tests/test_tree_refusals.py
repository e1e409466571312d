"""Impossible tree settings through the CLI: each is one `error:` line and exit code 2, before any decoding: a
malformed shape, a shape deeper than --gamma, a tree option given to a strategy that grows no tree (the line
names those that do), `tune --trees` with none of them, and trees on the static-shape (CUDA graph) forward,
which take them up to the widest captured node count and refuse a larger node budget in one line (emulated on
the CPU by the same static forward, which is what runs on CUDA with --fast)."""

from __future__ import annotations

import pytest

from sdbench.errors import SdbenchError
from sdbench.strategies.spec import tree_growers
from tests.conftest import run_cli
from tests.test_cli import one_line_error

# the strategies that grow trees, as the refusals list them (pinned by hand in the first test)
GROWERS = ", ".join(f"{name} ({', '.join(found)})" for name, found in tree_growers().items())


@pytest.fixture
def tiny(tmp_path, monkeypatch, capsys):
    from tests.references import tiny_cli_files

    files = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w1 w2 w3 w4", "w5 w6 w5 w6 w5"])
    capsys.readouterr()  # the folder's writing is not the command's output
    return [*files, "--max-new-tokens", "4", "--limit", "1", "--device", "cpu", "--out", str(tmp_path / "out")]


def test_the_strategies_that_grow_trees_are_read_from_their_declared_settings():
    topk = ("tree_topk", "tree_nodes", "tree_shape", "tree_dynamic")
    assert tree_growers() == {"draft": (*topk, "tree_sample"), "eagle": topk, "lookahead": ("window", "ngram", "pool"),
                              "magicdec": (*topk, "tree_sample"),
                              "medusa": topk, "mtp": topk, "ngram": ("tree",), "rest": ("tree_nodes",),
                              "suffix": ("tree",)}


@pytest.mark.parametrize("args, said", [
    (["--strategy", "draft", "--draft", "MODEL", "--set", "tree_shape=oak"],
     "error: tree 'oak': not a list of tuples of sibling ranks"),
    (["--strategy", "draft", "--draft", "MODEL", "--set", "tree_shape=[(0,), (0, 0), (1,), (0, 0, 0)]",
      "--gamma", "2"], "error: draft: --set tree_shape is 3 levels deep, deeper than --gamma 2"),
    (["--strategy", "draft", "--draft", "MODEL", "--set", "tree_topk=2", "--set", "tree_shape=[(0,)]"],
     "error: draft: --set tree_topk and tree_shape each give the tree: set one"),
    (["--strategy", "autoregressive", "--set", "tree_topk=2"],
     f"error: strategy 'autoregressive' grows no token tree (--set tree_topk): the strategies that do are "
     f"{GROWERS}"),
    (["--strategy", "polybasic", "--draft", "MODEL", "--set", "tree_nodes=8"],
     f"error: strategy 'polybasic' grows no token tree (--set tree_nodes): the strategies that do are {GROWERS}"),
    (["--strategy", "dsi", "--draft", "MODEL", "--set", "tree=2"],
     f"error: strategy 'dsi' grows no token tree (--set tree): the strategies that do are {GROWERS}"),
    (["--strategy", "draft", "--draft", "MODEL", "--set", "tree=2"],
     "error: strategy 'draft' has no setting 'tree': its token tree is set by tree_topk, tree_nodes, tree_shape, "
     "tree_dynamic, tree_sample"),
    (["--strategy", "ngram", "--set", "tree_topk=2"],
     "error: strategy 'ngram' has no setting 'tree_topk': its token tree is set by tree "),
])
def test_impossible_tree_settings_are_one_line(capsys, tiny, args, said):
    args = [tiny[1] if a == "MODEL" else a for a in args]
    code, out, err = run_cli(capsys, "run", *tiny, *args)
    line = one_line_error(code, err)
    assert code == 2 and line.startswith(said), line
    assert "results:" not in out  # nothing ran


def test_tune_trees_needs_a_strategy_that_grows_trees(capsys, tiny):
    code, _, err = run_cli(capsys, "tune", *tiny, "--strategy", "polybasic", "--draft", tiny[1], "--trees",
                           "--trials", "1")
    assert code == 2
    assert one_line_error(code, err) == ("error: --trees: polybasic grows no token tree; the strategies that do are "
                                         f"{', '.join(tree_growers())}")


@pytest.fixture
def static_when_fast(monkeypatch):
    """Runners as CUDA builds them: the static-shape forward with --fast (the default), the eager one with
    --no-fast; on the CPU the static forward runs uncaptured, refusing trees as the captured one does."""
    from sdbench.models.loading import pair
    from sdbench.models.forward.runner import ModelRunner

    monkeypatch.setattr(pair, "make_runner", lambda model, name, kind, fast, static=None: ModelRunner(model, name, static=fast))


@pytest.mark.parametrize("args", [
    ["run", "--strategy", "ngram", "--set", "tree=2"],
    ["run", "--strategy", "draft", "--draft", "MODEL", "--set", "tree_topk=4", "--set", "tree_nodes=32"],
    ["run", "--strategy", "magicdec", "--set", "tree_topk=2", "--set", "budget=8", "--set", "sink=2"],
    ["tune", "--strategy", "draft", "--draft", "MODEL", "--trees", "--trials", "1"],
])
def test_trees_run_on_the_static_shape_forward(capsys, tiny, static_when_fast, args):
    args = [tiny[1] if a == "MODEL" else a for a in args]
    code, out, err = run_cli(capsys, *args[:1], *tiny, *args[1:])
    assert code == 0, err
    assert ("results:" if args[0] == "run" else "trial 0") in out


def test_a_node_budget_above_the_widest_tree_graph_is_one_line(capsys, tiny, static_when_fast):
    from sdbench.models.forward.graphs import TREE_WIDTHS

    args = ["--strategy", "draft", "--draft", tiny[1], "--gamma", "8", "--set", "tree_topk=8", "--set",
            f"tree_nodes={TREE_WIDTHS[-1]}"]
    code, out, err = run_cli(capsys, "run", *tiny, *args)
    line = one_line_error(code, err)
    assert f"{TREE_WIDTHS[-1] + 1} nodes (the root included) on the static-shape (CUDA graph) forward: a node " \
           "budget above what a CUDA graph was captured for" in line and "--no-fast" in line, line
    assert "results:" not in out
    code, out, err = run_cli(capsys, "run", *tiny, *args, "--no-fast")  # the way out it names works
    assert code == 0 and "results:" in out, err


def test_a_strategy_that_grows_no_tree_refuses_a_presets_tree_setting_too(tmp_path, monkeypatch):
    from sdbench.strategies import resolve_strategy, strategy

    monkeypatch.setenv("SDBENCH_CONFIG", str(tmp_path))
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "odd.yaml").write_text("name: odd\nstrategy: polybasic\noptions: {tree_topk: 2}\n")
    choice = resolve_strategy("odd")
    with pytest.raises(SdbenchError, match="'polybasic' grows no token tree"):
        strategy(choice.base).settings(choice.options)
