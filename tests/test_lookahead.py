"""Lookahead decoding (`--strategy lookahead`): the window's tree, its n-grams and the pool against hand
computations (a stub target whose argmax is the token after the node's own), its decoding against transformers'
`generate` and the target's exact sampled marginals (at T = 1 and at T = 0.6, top-p = 0.8), the window doing what
it is for (its n-grams are accepted), the refusals, the CLI and the registry.
"""

from __future__ import annotations

import pytest
import torch

from sdbench.config import SamplingConfig
from sdbench.drafting.lookahead import Pool, Window, candidates, window_tree
from sdbench.engine.loop import generate, serve
from sdbench.engine.scheduler import Request, Scheduler
from sdbench.engine.state import Proposal, Side
from sdbench.engine.tree import Tree
from sdbench.errors import SdbenchError
from sdbench.models.forward.generic import GenericRunner
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies import strategy
from sdbench.strategies.lookahead import Lookahead, LookaheadStrategy
from tests.conftest import run_cli
from tests.references import hf_generate, tiny_cli_files
from tests.test_cli import one_line_error
from tests.test_tree_loop import (NEW, POINTS, _chain_mask, _prompts, assert_target_marginals_through_branches,  # noqa: F401
                                    sampled, sampled_checks, small, warped_checks)
from tests.test_random_weights import small as small_random  # noqa: F401 (fixture)

GREEDY = SamplingConfig()
DEFAULTS = LookaheadStrategy.settings({})


# ---- the window, the pool and the trie by hand ----------------------------------------------------------------

def test_the_window_tree_hangs_each_level_from_the_one_before_one_column_left():
    """W = 3, 3 levels: level 0 a chain; (l, column c) the child of (l - 1, c - 1); depth = column + 1."""
    tree = window_tree(3, 3)
    assert tree.parents == (-1, 0, 1, 0, 1, 2, 3, 4, 5)
    # level l's i-th node is at column l + i
    assert tree.depth == (1, 2, 3, 2, 3, 4, 3, 4, 5)
    assert tree.path_to(8) == (0, 1, 2, 5, 8)  # (2, col 4): level 0 up to column 2, then its diagonal
    assert window_tree(1, 4).parents == Tree.chain(4).parents


def test_a_full_window_gives_its_diagonals_as_ngrams_and_rolls():
    w = Window([10, 11, 12], ngram=3)
    assert w.advance([20, 21, 22]) == [] and w.levels == [[10, 11, 12], [20, 21, 22]] and w.full
    grams = w.advance([0, 0, 0, 30, 31, 32])  # only the newest level's guesses make the next level
    assert grams == [(10, 20, 30), (11, 21, 31), (12, 22, 32)]  # (0, i), (1, i + 1), the new guess at i + 2
    assert w.levels == [[20, 21, 22], [30, 31, 32]]
    with pytest.raises(ValueError):
        w.advance([1, 2, 3])
    assert Window.from_context([7, 8], 5, 4).levels == [[7, 8, 7, 8, 7]]
    assert Window.from_context([1, 2, 3, 4, 5, 6], 3, 4).levels == [[4, 5, 6]]


def test_the_pool_keeps_g_ngrams_per_key_newest_first():
    pool = Pool(2)
    for gram in ((1, 2, 3), (1, 4, 5), (2, 9, 9), (1, 6, 7)):
        pool.add(gram)
    assert pool.get(1) == [(6, 7), (4, 5)]  # (2, 3), the oldest, went
    pool.add((1, 4, 5))  # seen again: to the front, nothing dropped
    assert pool.get(1) == [(4, 5), (6, 7)] and pool.get(2) == [(9, 9)] and pool.get(3) == []
    seeded = Pool(5)
    seeded.seed([1, 2, 3, 1, 2, 4], 3)
    assert seeded.get(1) == [(2, 4), (2, 3)] and seeded.get(2) == [(3, 1)] and seeded.get(3) == [(1, 2)]


def test_candidates_merge_shared_prefixes_in_the_pools_order():
    tree, tokens = candidates([(5, 6, 7), (5, 8, 9), (3, 1, 1)], 3)
    assert tree.parents == (-1, 0, 1, 0, 3, -1, 5, 6) and tokens == [5, 6, 7, 8, 9, 3, 1, 1]
    tree, tokens = candidates([(5, 6, 7), (5, 8, 9)], 1)  # cut to the row's depth
    assert tree.parents == (-1,) and tokens == [5]


# ---- the loop with a stub target whose argmax is known --------------------------------------------------------

class Counting:
    """A target whose argmax after any token t is t + 1 (mod V), whatever came before; it records every
    verifying forward's tokens, rows' starts and the tree's positions."""

    name, vocab_size, fast, graphs, static = "counting", 50, False, False, False
    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self):
        self.calls = []

    def new_cache(self, batch, capacity):
        return None

    def release(self, cache):
        pass

    def tree_refusal(self, cache, nodes=None):
        return None

    def _logits(self, tokens):
        return torch.nn.functional.one_hot((tokens + 1) % self.vocab_size, self.vocab_size).float() * 10

    def prefill(self, cache, prompts, chunk=None, taps=None):
        return self._logits(torch.tensor([p[-1] for p in prompts]))

    def run(self, cache, step):
        tree = step.tree
        positions = tree.positions(torch.tensor(step.start)) if tree is not None else None  # as TreeStep places them
        self.calls.append((step.tokens.tolist(), list(step.start), None if tree is None else tree.trees,
                           None if positions is None else positions.tolist()))
        return self._logits(step.tokens)


def test_each_step_feeds_the_candidates_then_the_window_and_grows_the_pool():
    """Hand-computed (W = 3, N = 3, G = 2): prompt 4 0 3, first token 4, so level 0 is 0 3 4 and the pool holds
    the context's own 3-grams: 4 -> (0 3), 0 -> (3 4)."""
    target, proposer = Counting(), Lookahead(window=3, ngram=3, pool=2)
    out = generate(target, proposer, [[4, 0, 3]], max_new_tokens=5, sampling=GREEDY)
    assert out.output_ids == [[4, 5, 6, 7, 8]]
    # step 1: the root 4, its candidate 0 3, the window's level 0 (a chain from the root)
    tokens, start, (tree,), positions = target.calls[0]
    assert tokens == [[4, 0, 3, 0, 3, 4]] and start == [3]
    assert tree.parents == (-1, 0, 1, 0, 3, 4)
    assert positions == [[3, 4, 5, 4, 5, 6]]  # prefix length + depth: a node's column
    # step 2: no n-gram starts with 5 yet; the window has grown its second level from the argmax 1 4 5
    tokens, start, (tree,), positions = target.calls[1]
    assert tokens == [[5, 0, 3, 4, 1, 4, 5]] and tree.parents == (-1, 0, 1, 2, 1, 2, 3)
    assert positions == [[4, 5, 6, 7, 6, 7, 8]]  # level 1 at columns 1, 2, 3
    # after step 2 the window is full: its diagonals 0 1 2, 3 4 5, 4 5 6 went to the pool, newest first
    pools = proposer._pools[0]
    assert target.calls[2][0] == [[6, 1, 4, 5, 2, 5, 6]]  # the levels rolled: 1 4 5 / 2 5 6
    assert pools.get(0) == [(1, 2), (3, 4)] and pools.get(3) == [(4, 5)]
    assert pools.get(4) == [(5, 6), (0, 3)] and pools.get(1) == [(2, 3)] and pools.get(5) == [(6, 7)]
    assert out.rows[0].tree_nodes == 2  # the window never counts as drafted: only step 1's candidate
    assert out.extras == [{"window_ngrams": 9}]  # steps 2, 3, 4 (the step of the last token drafts nothing)


def test_the_windows_ngrams_are_what_gets_accepted(small):  # noqa: F811
    """On the tiny model the window's n-grams carry the acceptance: without them only the prompt's own remain."""

    class NoWindow(Lookahead):
        def observe(self, state, proposal, rnd):
            pass

    runner = ModelRunner(small)
    found = {cls: generate(runner, cls(3, 4, 3), _prompts(), max_new_tokens=NEW, sampling=GREEDY)
             for cls in (Lookahead, NoWindow)}
    accepted = {cls: sum(r.accepted for r in out.rows) for cls, out in found.items()}
    assert accepted[Lookahead] > 3 * accepted[NoWindow] + 10, accepted
    assert found[Lookahead].output_ids == found[NoWindow].output_ids


# ---- decoding: the library's generate and the target's marginals ----------------------------------------------

@pytest.mark.parametrize("kind", ["native", "generic"])
@pytest.mark.parametrize("settings", [(5, 7, 7), (3, 4, 2), (1, 2, 1)])
def test_greedy_lookahead_gives_the_librarys_greedy_tokens(small, kind, settings):  # noqa: F811
    runner = ModelRunner(small) if kind == "native" else GenericRunner(small)
    for batch in (_prompts()[:1], _prompts()):  # batch 1, and ragged prompts
        out = generate(runner, Lookahead(*settings), batch, max_new_tokens=NEW, sampling=GREEDY)
        assert out.output_ids == [hf_generate(small, p, NEW) for p in batch]
        assert sum(r.accepted for r in out.rows) > 0 and sum(r.tree_steps for r in out.rows) > 0


def test_requests_joining_a_running_batch(small):  # noqa: F811
    prompts = _prompts() + [p[::-1] for p in _prompts()]
    budgets = [9, 20, 6, 14, 11, 7]
    requests = [Request(i, p, 0.0, m) for i, (p, m) in enumerate(zip(prompts, budgets))]
    done = serve(ModelRunner(small), Lookahead(3, 4, 3), Scheduler(requests, 2), sampling=GREEDY)
    assert [r.output_ids for r in done.requests] == [hf_generate(small, p, m) for p, m in zip(prompts, budgets)]


def _sampled(sampled):  # noqa: F811
    model, marginals = sampled
    return sampled_checks(ModelRunner(model), Lookahead(2, 3, 3), marginals)


def test_sampled_lookahead_follows_the_targets_marginals(sampled):  # noqa: F811
    assert_target_marginals_through_branches(*_sampled(sampled))


def test_sampled_lookahead_follows_the_targets_marginals_at_temperature_and_top_p(sampled):  # noqa: F811
    model, _ = sampled
    assert_target_marginals_through_branches(*warped_checks(ModelRunner(model), Lookahead(2, 3, 3), model, POINTS[0]))


def test_the_same_check_catches_lookahead_verified_without_the_tree_mask(sampled, monkeypatch):  # noqa: F811
    _chain_mask(monkeypatch, ModelRunner)
    checks, _ = _sampled(sampled)
    assert any(stat > bound for _, stat, bound in checks), checks


def test_side_nodes_follow_each_rows_drafts_and_are_never_verified():
    """Ragged rows: row 0 has 2 drafts and 2 side nodes, row 1 none and 1; the block puts each row's side
    nodes right after its own drafts, and a depth cut of the drafts keeps them."""
    p = Proposal.of_trees([(Tree((-1, 0)), [7, 8]), (Tree(()), [])])
    p = Proposal(p.tokens, p.lengths, trees=p.trees, side=(Side(Tree((-1, 0)), (1, 2)), Side(Tree((-1,)), (3,))))
    tokens, trees = p.block(torch.tensor([5, 6]))
    assert tokens.tolist() == [[5, 7, 8, 1, 2], [6, 3, 0, 0, 0]]
    assert [t.parents for t in trees] == [(-1, 0, 1, 0, 3), (-1, 0)]
    assert p.side_columns() == [[3, 4], [1]]
    cut = p.fit([1, 1])
    assert cut.side == p.side and [len(t) for t in cut.trees] == [1, 0]


# ---- declared once: options, refusals, the registry, tune -----------------------------------------------------

@pytest.mark.parametrize("given, words", [
    ({"window": 0}, "window >= 1"),
    ({"ngram": 1}, "ngram >= 2"),
    ({"pool": 0}, "pool >= 1"),
    ({"window": 100, "ngram": 10, "pool": 20}, r"\(window \+ pool\) x \(ngram - 1\) = 1080 nodes"),
])
def test_bad_settings_are_one_line(given, words):
    with pytest.raises(SdbenchError, match=words) as e:
        LookaheadStrategy.check(4, {**DEFAULTS, **given}, ())
    assert "\n" not in str(e.value)
    with pytest.raises(SdbenchError, match="has no setting 'tree': its token tree is set by window, ngram, pool"):
        LookaheadStrategy.settings({"tree": "2"})


def test_the_cli_refuses_a_bad_setting_in_one_line(capsys, tmp_path, monkeypatch):
    args = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w1 w2"])
    capsys.readouterr()
    for setting, words in (("ngram=1", "ngram >= 2"), ("tree_nodes=4", "has no setting 'tree_nodes'")):
        code, _, err = run_cli(capsys, "run", *args, "--strategy", "lookahead", "--set", setting, "--limit", "1",
                               "--no-probe", "--out", str(tmp_path / "out"))
        assert words in one_line_error(code, err)


def test_a_run_through_the_cli_is_lossless_and_listed(capsys, tmp_path, monkeypatch):
    from sdbench.reporting.results import read_results

    args = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w1 w2 w3 w1 w2", "w4 w5 w6 w4 w5 w6 w4 w5"])
    code, _, err = run_cli(capsys, "run", *args, "--strategy", "lookahead", "--set", "window=3", "--set", "ngram=4",
                           "--limit", "2", "--max-new-tokens", "12", "--no-probe", "--out", str(tmp_path / "out"))
    assert code == 0, err
    rows = read_results([tmp_path / "out"])
    assert set(rows["strategy"]) == {"lookahead", "autoregressive"}
    by_role = {r: list(rows[rows["role"] == r].sort_values("prompt_id")["output_ids"].map(list))
               for r in ("baseline", "strategy")}
    assert by_role["baseline"] == by_role["strategy"] and rows[rows["role"] == "strategy"]["lossless"].all()
    assert '"window": 3' in rows.loc[rows["role"] == "strategy", "params"].iloc[0]
    code, out, _ = run_cli(capsys, "list", "strategies")
    assert code == 0 and "lookahead" in out and "Jacobi" in " ".join(out.split())


def test_declared_once_and_searchable():
    from optuna.trial import FixedTrial

    from sdbench.commands.tune_space import draw
    from sdbench.strategies.spec import SearchContext, tree_growers

    assert strategy("lookahead-decoding") is LookaheadStrategy and strategy("jacobi") is LookaheadStrategy
    assert tree_growers()["lookahead"] == ("window", "ngram", "pool")
    got = draw("lookahead", FixedTrial({"ngram": 5, "window": 4, "pool": 3}), SearchContext())
    assert got == {"gamma": 4, "options": {"window": 4, "ngram": 5, "pool": 3}, "drafts": []}
    proposer = Lookahead()
    assert proposer.proposes_trees and proposer.max_lookahead == (5 + 7) * 6 and proposer.gamma == 6
    assert proposer.params() == {"gamma": 6, "window": 5, "ngram": 7, "pool": 7}


# ---- the tree cost model: the window widens every verification -----------------------------------------------

def test_predict_tree_verifies_each_tree_with_the_runs_window(small_random, tmp_path, capsys, monkeypatch):
    """A lookahead run (W = 3, N = 4: 9 window nodes): its acceptance is read as any tree run's, and every
    verification it is costed at carries the window too: widths profiled and looked up at tree + 9 + 1."""
    import re

    from sdbench.analysis import costs
    from sdbench.analysis.tree_acceptance import measured_trees
    from sdbench.analysis.trees import Acceptance, expected_accepted
    from sdbench.commands import predict_tree
    from sdbench.reporting.results import read_results
    from tests.test_predict_scale import table_rows
    from tests.test_tree_predict import _results, _rows

    asked = []

    def spy(runner, batch, context, gammas, budgets, *args):
        asked.append(tuple(gammas))
        return costs.Profile(batch, context, 0.01, {g: 0.01 * (1 + g / 10) for g in gammas}, {})

    monkeypatch.setattr(predict_tree, "profile", spy)
    rows = [{**r, "params": '{"gamma": 3, "window": 3, "ngram": 4, "pool": 7}'} if r["role"] == "strategy" else r
            for r in _rows(strategy="lookahead")]
    path = _results(tmp_path, rows)
    assert measured_trees(read_results([path])).side == 9
    code, out, err = run_cli(capsys, "predict", "tree", path, "--budget", "4,8", "--device", "cpu")
    assert code == 0, err
    assert asked == [(10, 11, 13, 17)] and "also feeds 9 side nodes" in out
    acc = Acceptance(((15 / 31, 6 / 14, 1 / 3),) * 2)
    shapes = dict(re.findall(r"batch 1, budget (\d+): --gamma \d+ --set tree_shape=\"(.+)\"", out))
    for r in [r for r in table_rows(out, 9) if r[0] == "1"]:
        tree = Tree.from_vllm(shapes[r[1]])
        assert float(r[4]) == pytest.approx(expected_accepted(tree, acc) + 1, abs=0.006)
        assert float(r[5]) == pytest.approx(1 + (len(tree) + 9) / 10, abs=0.006)  # the window's 9 nodes too
