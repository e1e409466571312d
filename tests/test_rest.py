"""Retrieval drafting (REST, `--strategy rest`): the suffix array and its search against brute force, the counted
trie against a hand computation, decoding against transformers' greedy `generate` and the target's exact sampled
marginals (at T = 1 and at T = 0.6, top-p = 0.8), the datastore's build-save-load round trip, and the command
line's refusals and notes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdbench.config import SamplingConfig
from sdbench.drafting import datastore as D
from sdbench.drafting.retrieval import SEP, RetrievalDrafter, continuations, counted_trie, occurrences, suffix_array
from sdbench.engine.loop import generate
from sdbench.errors import SdbenchError
from sdbench.models.forward.generic import GenericRunner
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies import strategy
from sdbench.strategies.rest import Rest
from tests.references import hf_generate, tiny_cli_files, tiny_model_dir, tiny_text_model_dir
from tests.test_cli import one_line_error, run_cli
from tests.test_tree_loop import (NEW, POINTS, V, _prompts, _small,  # noqa: F401
                                  assert_target_marginals_through_branches, sampled, sampled_checks, warped_checks)

GREEDY = SamplingConfig()


def _rows(conts: np.ndarray) -> list[list[int]]:
    """Continuations as lists, each up to its first SEP."""
    return [[t for t in row if t != SEP] for row in conts.tolist()]


def _random_corpus(seed: int, docs: int = 6, vocab: int = 4) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return D.index([rng.integers(0, vocab, rng.integers(0, 30)).tolist() for _ in range(docs)])[0]


# ---- the index on plain integer arrays -------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_the_suffix_array_is_the_sorted_suffixes(seed):
    tokens = _random_corpus(seed)
    brute = sorted(range(len(tokens)), key=lambda i: tuple(tokens[i:].tolist()))
    assert suffix_array(tokens).tolist() == brute
    assert suffix_array(np.zeros(0, dtype=np.int32)).tolist() == []
    assert suffix_array(np.array([5, 5, 5, 5])).tolist() == [3, 2, 1, 0]  # each a prefix of the next


@pytest.mark.parametrize("seed", range(4))
def test_the_search_finds_exactly_the_occurrences_a_scan_finds(seed):
    tokens = _random_corpus(seed)
    sa = suffix_array(tokens)
    rng = np.random.default_rng(100 + seed)
    patterns = [tokens[s: s + m] for s in rng.integers(0, len(tokens), 20) for m in (1, 2, 3, 5)]
    patterns += [rng.integers(0, 5, m) for m in (1, 2, 3, 4) for _ in range(5)]  # 4: a token the corpus lacks
    for pattern in patterns:
        if SEP in pattern:
            continue
        lo, hi = occurrences(tokens, sa, pattern)
        scan = {i for i in range(len(tokens) - len(pattern) + 1) if (tokens[i: i + len(pattern)] == pattern).all()}
        assert set(sa[lo:hi].tolist()) == scan and hi - lo == len(scan), pattern.tolist()


HAND_DOCS = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [7, 1, 2, 3, 4, 8], [9, 1, 2]]


def test_the_tree_from_a_hand_built_corpus_is_the_hand_computed_one():
    tokens, sa = D.index(HAND_DOCS)
    ctx = np.array([0, 1, 2])  # "0 1 2" occurs nowhere; "1 2" five times, once at a document's end
    conts = continuations(tokens, sa, ctx, depth=3, max_matches=5000, max_suffix=16, min_suffix=2)
    # in suffix order: "1 2 | ..." (nothing after it: dropped), "1 2 3 4 |", "1 2 3 4 8 |", "1 2 3 5", "1 2 6"
    assert _rows(conts) == [[3, 4], [3, 4, 8], [3, 5], [6]]
    tree, toks, counts = counted_trie(conts, nodes=16)
    # counts 3:3, 3-4:2, then 1 each, the shallower first: 6 (depth 1), 3-5 (2), 3-4-8 (3)
    assert toks == [3, 4, 6, 5, 8] and counts == [3, 2, 1, 1, 1] and tree.parents == (-1, 0, -1, 0, 1)
    tree, toks, _ = counted_trie(conts, nodes=3)
    assert toks == [3, 4, 6] and tree.parents == (-1, 0, -1)
    # the longest suffix wins: "7 1 2" occurs once, so its one continuation is a chain
    one = continuations(tokens, sa, np.array([7, 1, 2]), 3, 5000, 16, 2)
    assert _rows(one) == [[3, 4, 8]] and counted_trie(one, 16)[0].parents == (-1, 0, 1)
    # max_matches takes occurrences in suffix order; min_suffix bounds the shortest suffix tried
    assert _rows(continuations(tokens, sa, ctx, 3, 2, 16, 2)) == [[3, 4]]
    assert continuations(tokens, sa, np.array([5, 2]), 3, 5000, 16, 2).shape == (0, 3)
    assert len(continuations(tokens, sa, np.array([5, 2]), 3, 5000, 16, 1)) == 4  # "2" alone
    # equal continuations count once each: "3 4" twice
    tree, toks, counts = counted_trie(np.array([[3, 4], [5, SEP], [3, 4]]), nodes=16)
    assert toks == [3, 4, 5] and counts == [2, 2, 1] and tree.parents == (-1, 0, -1)


def test_the_drafter_proposes_each_rows_tree_within_its_depth():
    tokens, sa = D.index(HAND_DOCS)
    drafter = RetrievalDrafter(tokens, sa, tree_nodes=4)
    ctx = torch.tensor([[0, 1, 2], [7, 1, 2]])
    out = drafter.draft(ctx, [3, 3], [2, 0])
    assert out.trees[0].parents == (-1, 0, -1, 0) and out.tokens[0, :4].tolist() == [3, 4, 6, 5]
    assert len(out.trees[1]) == 0 and out.lengths.tolist() == [4, 0]  # a row at its limit drafts nothing


# ---- decoding through the one loop -----------------------------------------------------------------------------

def _store_for(model, prompts, seed: int = 0):
    """A datastore over the model's own greedy continuations of the prompts, each with a token changed here and
    there, plus random text: lookups find right and wrong continuations side by side."""
    rng = np.random.default_rng(seed)
    docs = []
    for p in prompts:
        said = p + hf_generate(model, p, NEW)
        for _ in range(3):
            noisy = np.array(said)
            flip = rng.random(len(noisy)) < 0.15
            noisy[flip] = rng.integers(0, V, int(flip.sum()))
            docs.append(noisy.tolist())
    docs += [rng.integers(0, V, 40).tolist() for _ in range(4)]
    return D.index(docs)


class Spy(Rest):
    def __init__(self, *args):
        super().__init__(*args)
        self.sizes: list[int] = []

    def propose(self, state):
        proposal = super().propose(state)
        self.sizes += [len(t) for t in proposal.trees]
        return proposal


@pytest.mark.parametrize("kind", ["native", "generic"])
def test_greedy_rest_gives_the_librarys_greedy_tokens(kind):
    model = _small()
    prompts = _prompts()
    tokens, sa = _store_for(model, prompts)
    runner = ModelRunner(model) if kind == "native" else GenericRunner(model)
    spy = Spy(RetrievalDrafter(tokens, sa, tree_nodes=8), 4, "test")
    out = generate(runner, spy, prompts, max_new_tokens=NEW, sampling=GREEDY)
    assert out.output_ids == [hf_generate(model, p, NEW) for p in prompts]
    assert max(spy.sizes) > 4  # trees, not chains
    assert sum(r.sibling_accepts for r in out.rows) > 0  # a later sibling accepted
    assert sum(sum(r.accepted_per_position[1:]) for r in out.rows) > 0  # and nodes below the first level


def _sampled_rest() -> Rest:
    rng = np.random.default_rng(3)
    tokens, sa = D.index([rng.integers(0, V, 60).tolist() for _ in range(8)])
    return Rest(RetrievalDrafter(tokens, sa, tree_nodes=8, min_suffix=1), 3, "test")


def test_sampled_rest_follows_the_targets_marginals(sampled):  # noqa: F811
    model, marginals = sampled
    assert_target_marginals_through_branches(*sampled_checks(ModelRunner(model), _sampled_rest(), marginals))


def test_sampled_rest_follows_the_targets_marginals_at_temperature_and_top_p(sampled):  # noqa: F811
    model, _ = sampled
    assert_target_marginals_through_branches(*warped_checks(ModelRunner(model), _sampled_rest(), model, POINTS[0]))


# ---- the datastore on disk and the command line ---------------------------------------------------------------

def test_the_datastore_round_trips_through_build_save_and_load(tmp_path, monkeypatch, capsys):
    from transformers import AutoTokenizer

    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path / "cache"))
    folder = tiny_model_dir(tmp_path / "tiny")
    text = tmp_path / "corpus.txt"
    text.write_text("w1 w2 w3\n\nw4 w5 w1 w2 w6\n")
    code, out, err = run_cli(capsys, "datastore", "build", "words", "--from", str(text), "--target", str(folder))
    assert code == 0, err
    assert "1 documents, 8 tokens" in out
    tok = AutoTokenizer.from_pretrained(folder)
    store = D.load("words", tok, str(folder))
    ids = tok("w1 w2 w3\n\nw4 w5 w1 w2 w6", add_special_tokens=False)["input_ids"]
    assert store.tokens.tolist() == [*ids, SEP] and ids == [4, 5, 6, 7, 8, 4, 5, 9]
    assert store.suffixes.tolist() == suffix_array(store.tokens).tolist()
    m = store.meta
    assert (m.name, m.target, m.source, m.documents, m.tokens, m.prompt_ids) == (
        "words", str(folder), str(text), 1, 8, [])
    assert m.vocab_hash == D.vocab_hash(tok)
    code, out, _ = run_cli(capsys, "datastore", "list")
    assert code == 0 and "words" in out
    other = AutoTokenizer.from_pretrained(tiny_text_model_dir(tmp_path / "text"))
    with pytest.raises(SdbenchError, match="holds token ids of .*'s tokenizer, not of"):
        D.load("words", other, "text")


def test_a_run_on_the_prompts_a_datastore_holds_says_so_and_stays_lossless(tmp_path, monkeypatch, capsys):
    from sdbench.reporting.results import read_results

    args = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w1 w2 w3", "w4 w5 w6 w4 w5"])
    target, csv = args[1], args[3]
    code, _, err = run_cli(capsys, "datastore", "build", "mine", "--from", csv, "--target", target)
    assert code == 0, err
    assert D.read_meta("mine").prompt_ids == ["p/2", "p/3"]  # the CSV's rows, by line
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, "run", *args, "--strategy", "rest", "--set", "datastore=mine", "--limit", "2",
                                "--max-new-tokens", "8", "--no-probe", "--out", str(out))
    assert code == 0, err
    said = " ".join(stdout.split())
    assert ("note: --set datastore=mine holds the text of 2 of these 2 prompts (e.g. p/3): its acceptance on "
            "them overstates what unseen prompts get; build one from another data set") in said
    rows = read_results([out])
    assert rows["lossless"].all() and set(rows["strategy"]) == {"autoregressive", "rest"}
    assert '"datastore": "mine"' in rows.loc[rows["strategy"] == "rest", "params"].iloc[0]

    other = tmp_path / "q.csv"
    other.write_text('prompt\n"w9 w8 w7"\n')
    code, stdout, err = run_cli(capsys, "run", "--target", target, "--dataset", str(other), "--strategy", "rest",
                                "--set", "datastore=mine", "--limit", "1", "--max-new-tokens", "4", "--no-probe",
                                "--out", str(out))
    assert code == 0, err
    assert "holds" not in stdout  # prompts it does not hold: nothing to say


def test_bad_input_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    args = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3"])
    target = args[1]
    run = ("run", *args, "--strategy", "rest", "--limit", "1", "--max-new-tokens", "4", "--no-probe",
           "--out", str(tmp_path / "out"))
    code, _, err = run_cli(capsys, *run)
    assert one_line_error(code, err) == (
        "error: strategy 'rest' needs --set datastore=NAME; make one with "
        "`sdbench datastore build NAME --from DATASET|FILE --target MODEL`")
    code, _, err = run_cli(capsys, *run, "--set", "datastore=nowhere")
    assert one_line_error(code, err) == ("error: --set datastore=nowhere: no such datastore; build it with "
                                         "`sdbench datastore build nowhere --from DATASET|FILE`")
    # another tokenizer's ids
    text_model = tiny_text_model_dir(tmp_path / "text")
    code, _, err = run_cli(capsys, "datastore", "build", "chars", "--from", args[3], "--target", str(text_model))
    assert code == 0, err
    code, _, err = run_cli(capsys, *run, "--set", "datastore=chars")
    assert "holds token ids of" in one_line_error(code, err) and "--target " + target in err
    for setting, says in (("tree_nodes=0", "tree_nodes=N with N >= 1"), ("max_matches=0", "max_matches=N"),
                          ("min_suffix=20", "1 <= min_suffix <= max_suffix"), ("depth=2", "has no setting 'depth'"),
                          ("tree_nodes=x", "expected int")):
        code, _, err = run_cli(capsys, *run, "--set", "datastore=chars", "--set", setting)
        assert says in one_line_error(code, err), setting
    for argv, says in ((("bad/name", "--from", args[3]), "datastore name 'bad/name'"),
                       (("ok", "--from", str(tmp_path / "none.jsonl")), "no such file"),
                       (("ok", "--from", "no-such-set"), "unknown task 'no-such-set'"),
                       (("ok", "--from", "passkey"), "a retrieval task"),
                       (("ok", "--from", args[3], "--limit", "0"), "--limit must be at least 1")):
        code, _, err = run_cli(capsys, "datastore", "build", *argv, "--target", target)
        assert says in one_line_error(code, err), argv


def test_the_strategy_is_declared_once_and_searchable(tmp_path, monkeypatch):
    import optuna

    declared = strategy("retrieval")
    assert declared is strategy("rest")
    assert {o.name for o in declared.options} == {"datastore", "tree_nodes", "max_matches", "max_suffix",
                                                   "min_suffix"}
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path))
    from sdbench.strategies.spec import SearchContext

    trial = optuna.create_study().ask()
    with pytest.raises(SdbenchError, match="needs a datastore to tune with"):
        declared.search_space(trial, SearchContext())
    tokens, sa = D.index(HAND_DOCS)
    D.save(D.DatastoreMeta("a", "t", "t", "h", "x"), tokens, sa)
    gamma, options = declared.search_space(trial, SearchContext())
    assert options["datastore"] == "a" and 1 <= gamma <= 8 and declared.settings(options)["tree_nodes"] >= 1
