"""Suffix decoding (`--strategy suffix`): its index and the nodes it keeps (the best-scoring ones, when the budget
binds too) against a brute-force scan, its trees against hand computations, its decoding against transformers'
`generate` and the target's exact sampled marginals (at T = 1 and at T = 1.3), and the cache of earlier
responses doing what it is for (a second prompt answered with the first's words drafts from it; a prompt decoded
again never drafts from its own answer; kept across runs with persist=1).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from sdbench.config import SamplingConfig
from sdbench.drafting.suffix import SEP, ResponseCache, grow, match, speculate_context
from sdbench.engine.loop import generate, serve
from sdbench.engine.scheduler import Request, Scheduler
from sdbench.errors import SdbenchError
from sdbench.models.forward.generic import GenericRunner
from sdbench.models.forward.runner import ModelRunner
from sdbench.strategies import BuildContext, build_proposer, strategy
from sdbench.strategies.suffix import Suffix, SuffixStrategy, cache_file
from tests.conftest import run_cli
from tests.references import hf_generate, tiny_cli_files
from tests.test_cli import one_line_error
from tests.test_tree_loop import (NEW, POINTS, _chain_mask, _prompts, assert_target_marginals_through_branches,  # noqa: F401
                                    sampled, sampled_checks, small, warped_checks)

GREEDY = SamplingConfig()
DEFAULTS = SuffixStrategy.settings({})


# ---- the index against a brute-force scan ---------------------------------------------------------------------

def _docs(corpus: list[int]) -> list[list[int]]:
    out, doc = [], []
    for t in corpus:
        if t == SEP:
            out.append(doc)
            doc = []
        else:
            doc.append(t)
    return out + [doc]


def brute_count(docs: list[list[int]], pattern: list[int], ends_before: int | None = None) -> int:
    """Occurrences of `pattern` inside one document (ending before index ends_before of the first one, when
    given), by trying every start."""
    n, found = len(pattern), 0
    for d, doc in enumerate(docs):
        for s in range(len(doc) - n + 1):
            if doc[s : s + n] == pattern and (ends_before is None or d > 0 or s + n - 1 < ends_before):
                found += 1
    return found


def brute_match(docs, context: list[int], max_depth: int, ends_before=None) -> int:
    for m in range(min(max_depth, len(context)), 0, -1):
        if brute_count(docs, context[-m:], ends_before):
            return m
    return 0


def brute_scores(count, vocab, below: int, depth: int) -> list[float]:
    """The score count(path) / below of every continuation path the scan finds (count > 0), up to `depth`
    tokens: each path tried token by token over `vocab`, kept while the scan still finds it."""
    found, frontier = [], [[]]
    for _ in range(depth):
        grown = []
        for path in frontier:
            for t in vocab:
                if n := count(path + [t]):
                    found.append(n / below)
                    grown.append(path + [t])
        frontier = grown
    return found


def assert_best_kept(scores, found: list[float], budget: int, min_prob: float) -> bool:
    """The nodes kept (their scores, each already checked against the scan) are the best the scan finds: as many
    as the budget allows of those scoring at least min_prob, with the best scores (the ranking by hand; which
    of equal scores is kept is the hand-built cases' business). -> whether the budget held the tree back, so
    that the ranking decided what was left out."""
    ranked = sorted((x for x in found if x >= min_prob), reverse=True)
    assert sorted(scores, reverse=True) == pytest.approx(ranked[:budget]), ranked
    return len(ranked) > budget


def check_against_brute_force(spec, docs, context, max_depth, budget: int, ends_before=None, min_prob=0.0) -> bool:
    """Each node's score is count(suffix + its path) / count(suffix) by the scan, and the nodes kept are the best
    ones (`assert_best_kept`, whose verdict it returns)."""
    m = brute_match(docs, context, max_depth, ends_before)
    assert spec.match_len == m
    suffix = context[-m:] if m else []
    below = brute_count(docs, suffix, ends_before)
    paths = []
    for i, (a, t) in enumerate(zip(spec.parents, spec.tokens)):
        paths.append((paths[a] if a >= 0 else []) + [t])
        # a continuation must start before the end of the first document's allowed part: count whole patterns
        assert spec.scores[i] == pytest.approx(brute_count(docs, suffix + paths[i]) / below), (i, paths[i])
    assert len({tuple(p) for p in paths}) == len(paths)  # no path twice
    vocab = sorted({t for doc in docs for t in doc})
    return assert_best_kept(spec.scores, brute_scores(lambda path: brute_count(docs, suffix + path), vocab, below,
                                                      budget), budget, min_prob)


@pytest.mark.parametrize("seed", range(6))
def test_the_cache_matches_and_counts_as_a_scan_of_its_responses(seed):
    """Matches and scores as a scan of the live responses finds them, and keeps the best-scoring nodes, in trees
    the budget holds back too (where only the ranking decides what is left out)."""
    rng = random.Random(seed)
    held_back = 0
    cache = ResponseCache(capacity=5)
    held: dict[str, list[int]] = {}
    for i in range(12):  # adds past the capacity (the oldest go), drops, replacements: compaction on the way
        key = f"p{rng.randrange(7)}"
        if rng.random() < 0.25:
            cache.drop(key)
            held.pop(key, None)
            continue
        toks = [rng.randrange(4) for _ in range(rng.randrange(1, 15))]
        cache.add(key, toks)
        held.pop(key, None)
        held[key] = toks
        while len(held) > 5:
            held.pop(next(iter(held)))
        assert [t for _, t in cache.responses()] == list(held.values())
        for token in range(4):  # the positions kept per token are every live occurrence
            live = [j for j, t in enumerate(cache.corpus.tolist()) if t == token]
            assert sorted(cache.occurrences(token).tolist()) == live
        for _ in range(5):
            context = [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
            spec = cache.speculate(np.array(context), max_depth=4, limit=6, spec_factor=3.0, min_prob=0.0)
            if not spec.tokens:  # no match, or a match nothing follows
                docs = list(held.values())
                m = brute_match(docs, context, 4)
                assert m == 0 or all(not brute_count(docs, context[-m:] + [t]) for t in range(4))
                continue
            held_back += check_against_brute_force(spec, list(held.values()), context, 4,
                                                   budget=min(6, 3 * spec.match_len))
    assert held_back > 0  # the ranking decided what was left out


@pytest.mark.parametrize("seed", range(6))
def test_the_rows_own_context_matches_as_a_scan_of_its_earlier_tokens(seed):
    rng = random.Random(100 + seed)
    row = [rng.randrange(3) for _ in range(rng.randrange(8, 30))]
    spec = speculate_context(np.array(row), max_depth=5, limit=8, spec_factor=2.0, min_prob=0.05)
    m = brute_match([row], row, 5, ends_before=len(row) - 1)  # its last token's own occurrence excluded
    assert spec.match_len == m or (not spec.tokens and m == 0)
    if spec.tokens:
        # below the match, the scan counts occurrences ending before the last token, continuing anywhere
        n, suffix = len(row), row[-m:]
        ends = [j for j in range(m - 1, n - 1) if row[j - m + 1 : j + 1] == suffix]

        def hits(path: list[int]) -> int:
            return sum(row[j + 1 : j + 1 + len(path)] == path for j in ends)

        paths = []
        for i, (a, t) in enumerate(zip(spec.parents, spec.tokens)):
            paths.append((paths[a] if a >= 0 else []) + [t])
            assert spec.scores[i] == pytest.approx(hits(paths[i]) / len(ends))
        budget = min(8, int(2.0 * m))
        assert_best_kept(spec.scores, brute_scores(hits, range(3), len(ends), budget), budget, 0.05)


def test_match_stops_at_separators_and_the_depth():
    corpus = np.array([1, 2, 3, SEP, 2, 3, 4, 1, 2, 3, 5])
    ends = np.flatnonzero(corpus == 3)
    m, at = match(corpus, ends, np.array([9, 1, 2, 3]), max_depth=8)
    assert m == 3 and at.tolist() == [2, 9]
    m, at = match(corpus, ends, np.array([9, 1, 2, 3]), max_depth=2)
    assert m == 2 and at.tolist() == [2, 5, 9]
    assert match(corpus, ends[:0], np.array([3]), 8)[0] == 0


# ---- the tree, by hand ------------------------------------------------------------------------------------------

def test_the_tree_grown_from_earlier_responses_is_the_hand_computed_one():
    """Responses "1 2 3 4", "1 2 3 5", "1 2 6" and a context ending "1 2": the match has 3 occurrences, followed
    by 3 twice (2/3) and 6 once (1/3); below 3, 4 and 5 once each (2/3 x 1/2 = 1/3). Best first, siblings of
    equal count the later seen first, ties between levels in the order found."""
    cache = ResponseCache(10)
    for key, toks in (("a", [1, 2, 3, 4]), ("b", [1, 2, 3, 5]), ("c", [1, 2, 6])):
        cache.add(key, toks)
    ctx = np.array([7, 1, 2])
    kw = dict(max_depth=24, limit=8, spec_factor=4.0)
    spec = cache.speculate(ctx, **kw, min_prob=0.1)
    assert spec.match_len == 2
    assert spec.tokens == (3, 6, 5, 4) and spec.parents == (-1, -1, 0, 0)
    assert spec.scores == pytest.approx((2 / 3, 1 / 3, 1 / 3, 1 / 3)) and spec.score == pytest.approx(5 / 3)
    assert cache.speculate(ctx, **kw, min_prob=0.5).tokens == (3,)  # the threshold: 1/3 is below it
    assert cache.speculate(ctx, **{**kw, "limit": 3}, min_prob=0.1).tokens == (3, 6, 5)  # --gamma caps the nodes
    small_factor = cache.speculate(ctx, **{**kw, "spec_factor": 1.0}, min_prob=0.1)  # 1 x a match of 2: 2 nodes
    assert small_factor.tokens == (3, 6) and not small_factor.is_chain
    path = cache.speculate(ctx, **kw, min_prob=0.1, branch=False)  # only the best path: 3, then 5 (later seen)
    assert path.tokens == (3, 5) and path.is_chain
    assert cache.speculate(np.array([9]), **kw, min_prob=0.1).tokens == ()  # no match


def test_a_longer_match_buys_a_larger_tree():
    row = np.array([1, 2, 3, 4, 5, 6, 9, 9, 2, 3, 4, 5, 6, 7, 8, 0, 9, 3, 4, 5])
    spec = speculate_context(row, max_depth=24, limit=16, spec_factor=1.0, min_prob=0.1)
    # "3 4 5" twice, then 6 both times; after it 7 (seen later) and 9, 1/2 each; 8 below 7 also scores 1/2 but
    # was found after 9: a budget of 3 nodes (1 x 3 matched tokens) keeps 6, 7, 9
    assert spec.match_len == 3 and spec.tokens == (6, 7, 9) and spec.parents == (-1, 0, 0)
    assert spec.scores == pytest.approx((1.0, 0.5, 0.5))
    assert speculate_context(row[:-1], max_depth=24, limit=16, spec_factor=1.0, min_prob=0.1).tokens == (5, 6)


def test_grow_without_occurrences_is_empty():
    assert grow(np.array([1, 2]), np.array([], dtype=np.int64), 0, 4, 0.1).tokens == ()


# ---- decoding: the library's generate and the target's marginals ----------------------------------------------

@pytest.mark.parametrize("kind, tree", [("native", False), ("native", True), ("generic", True)])
def test_greedy_suffix_decoding_gives_the_librarys_greedy_tokens(small, kind, tree):  # noqa: F811
    prompts = _prompts()
    runner = ModelRunner(small) if kind == "native" else GenericRunner(small)
    proposer = Suffix(6, max_spec_factor=2.0, min_token_prob=0.05, tree=tree)
    for batch in (prompts, [p[::-1] for p in prompts]):  # the second batch drafts from the first's answers too
        out = generate(runner, proposer, batch, max_new_tokens=NEW, sampling=GREEDY)
        assert out.output_ids == [hf_generate(small, p, NEW) for p in batch]
        assert sum(sum(r.accepted_per_position[1:]) for r in out.rows) > 0  # accepted at depth >= 2
        if tree:
            assert sum(r.tree_steps for r in out.rows) > 0 and sum(r.sibling_accepts for r in out.rows) > 0
    assert sum(e["cache_drafts"] for e in out.extras) > 0


def test_requests_joining_a_running_batch(small):  # noqa: F811
    prompts = _prompts() + [p[::-1] for p in _prompts()]
    budgets = [9, 20, 6, 14, 11, 7]
    requests = [Request(i, p, 0.0, m) for i, (p, m) in enumerate(zip(prompts, budgets))]
    proposer = Suffix(4, max_spec_factor=2.0, tree=True)
    done = serve(ModelRunner(small), proposer, Scheduler(requests, 2), sampling=GREEDY)
    assert [r.output_ids for r in done.requests] == [hf_generate(small, p, m) for p, m in zip(prompts, budgets)]
    assert len(proposer.cache) == len(set(map(tuple, prompts)))  # every finished request's answer kept


def _sampled(sampled, point=None):  # noqa: F811
    model, marginals = sampled
    proposer = Suffix(3, max_spec_factor=3.0, min_token_prob=0.0, tree=True)
    if point is not None:
        return warped_checks(ModelRunner(model), proposer, model, point)
    return sampled_checks(ModelRunner(model), proposer, marginals)


def test_sampled_suffix_trees_follow_the_targets_marginals(sampled):  # noqa: F811
    assert_target_marginals_through_branches(*_sampled(sampled))


def test_sampled_suffix_trees_follow_the_targets_marginals_at_temperature(sampled):  # noqa: F811
    assert_target_marginals_through_branches(*_sampled(sampled, POINTS[1]))


def test_the_same_check_catches_suffix_trees_verified_without_the_tree_mask(sampled, monkeypatch):  # noqa: F811
    _chain_mask(monkeypatch, ModelRunner)
    checks, _ = _sampled(sampled)
    assert any(stat > bound for _, stat, bound in checks), checks


# ---- the cache of earlier responses ---------------------------------------------------------------------------

def _accepted(out) -> float:
    return sum(r.accepted for r in out.rows) / sum(r.steps for r in out.rows)


def test_a_second_prompt_answered_with_the_firsts_words_drafts_from_the_cache(small):  # noqa: F811
    """The second prompt is the first with half its answer: the target goes on with the rest of that answer,
    which its own context does not hold and the cache does."""
    runner = ModelRunner(small)
    first = _prompts()[2]
    answer = hf_generate(small, first, 2 * NEW)
    second = first + answer[:NEW]

    def second_run(max_cached: int):
        proposer = Suffix(6, max_spec_factor=2.0, max_cached=max_cached)
        generate(runner, proposer, [first], max_new_tokens=2 * NEW, sampling=GREEDY)
        out = generate(runner, proposer, [second], max_new_tokens=NEW, sampling=GREEDY)
        assert out.output_ids == [answer[NEW:]]
        return out

    on, off = second_run(10), second_run(0)
    assert on.extras[0]["cache_drafts"] > 0 and off.extras[0]["cache_drafts"] == 0
    assert _accepted(on) > _accepted(off) + 0.5


def test_a_prompt_decoded_again_never_drafts_from_its_own_answer(small):  # noqa: F811
    runner = ModelRunner(small)
    prompt = _prompts()[0]
    proposer = Suffix(6, max_spec_factor=2.0)
    once = generate(runner, proposer, [prompt], max_new_tokens=NEW, sampling=GREEDY)
    again = generate(runner, proposer, [prompt], max_new_tokens=NEW, sampling=GREEDY)  # a repeat
    assert again.extras[0]["cache_drafts"] == 0
    assert (again.rows[0].steps, again.rows[0].accepted) == (once.rows[0].steps, once.rows[0].accepted)
    proposer.warmed_up()  # the run's warm-up: its answers go
    assert len(proposer.cache) == 0


def test_persist_keeps_the_answers_across_runs(small, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SDBENCH_CACHE", str(tmp_path))
    runner = ModelRunner(small, name="tiny/llama")
    first = _prompts()[2]
    answer = hf_generate(small, first, 2 * NEW)

    def build():
        return build_proposer("suffix", BuildContext(runner, gamma=6, options={"persist": "1",
                                                                                "max_spec_factor": "2"}))

    generate(runner, build(), [first], max_new_tokens=2 * NEW, sampling=GREEDY)
    assert cache_file("tiny/llama") == tmp_path / "suffix" / "tiny_llama.npz" and cache_file("tiny/llama").exists()
    later = build()  # another run
    assert len(later.cache) == 1 and str(cache_file("tiny/llama")) in later.notes(100)[0]
    out = generate(runner, later, [first + answer[:NEW]], max_new_tokens=NEW, sampling=GREEDY)
    assert out.output_ids == [answer[NEW:]] and out.extras[0]["cache_drafts"] > 0
    assert len(build().cache) == 2
    cache_file("tiny/llama").write_bytes(b"not a cache")
    with pytest.raises(SdbenchError, match="cannot be read"):
        build()


# ---- declared once: options, refusals, the registry, tune -----------------------------------------------------

@pytest.mark.parametrize("given, words", [
    ({"max_depth": 0}, "max_depth >= 1"),
    ({"max_spec_factor": 0}, "max_spec_factor > 0"),
    ({"min_token_prob": 1.5}, "min_token_prob between 0 and 1"),
    ({"max_cached": -1}, "max_cached >= 0"),
    ({"persist": True, "max_cached": 0}, "max_cached=0 keeps none"),
])
def test_bad_settings_are_one_line(given, words):
    with pytest.raises(SdbenchError, match=words) as e:
        SuffixStrategy.check(4, {**DEFAULTS, **given}, ())
    assert "\n" not in str(e.value)
    with pytest.raises(SdbenchError, match="--gamma must be at least 1"):
        SuffixStrategy.check(0, DEFAULTS, ())
    with pytest.raises(SdbenchError, match="expected float"):
        SuffixStrategy.settings({"min_token_prob": "often"})


def test_the_cli_refuses_a_bad_setting_in_one_line(capsys, tmp_path, monkeypatch):
    args = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w1 w2"])
    capsys.readouterr()  # the model folder's writing
    code, _, err = run_cli(capsys, "run", *args, "--strategy", "suffix", "--set", "min_token_prob=2", "--limit", "1",
                           "--no-probe", "--out", str(tmp_path / "out"))
    assert "min_token_prob between 0 and 1" in one_line_error(code, err)


def test_a_run_through_the_cli_is_lossless_and_listed(capsys, tmp_path, monkeypatch):
    from sdbench.reporting.results import read_results

    args = tiny_cli_files(tmp_path, monkeypatch, ["w1 w2 w3 w1 w2 w3 w1 w2", "w4 w5 w6 w4 w5 w6 w4 w5"])
    code, _, err = run_cli(capsys, "run", *args, "--strategy", "suffix", "--limit", "2", "--max-new-tokens", "12",
                           "--no-probe", "--out", str(tmp_path / "out"))
    assert code == 0, err
    rows = read_results([tmp_path / "out"])
    assert set(rows["strategy"]) == {"suffix", "autoregressive"}
    by_role = {r: list(rows[rows["role"] == r].sort_values("prompt_id")["output_ids"].map(list))
               for r in ("baseline", "strategy")}
    assert by_role["baseline"] == by_role["strategy"] and rows[rows["role"] == "strategy"]["lossless"].all()
    code, out, _ = run_cli(capsys, "list", "strategies")
    assert code == 0 and "suffix" in out and "suffix decoding" in " ".join(out.split())


def test_declared_once_and_searchable():
    from optuna.trial import FixedTrial

    from sdbench.commands.tune_space import draw
    from sdbench.strategies.spec import SearchContext

    assert strategy("suffix-decoding") is SuffixStrategy
    got = draw("suffix", FixedTrial({"gamma": 8, "max_spec_factor": 2.0, "min_token_prob": 0.05}), SearchContext())
    assert got == {"gamma": 8, "options": {"max_spec_factor": 2.0, "min_token_prob": 0.05}, "drafts": []}
    proposer = Suffix(5, tree=True)
    assert proposer.proposes_trees and not Suffix(5).proposes_trees and proposer.max_lookahead == 5
    assert proposer.params() == {"gamma": 5, "max_depth": 24, "max_spec_factor": 1.0, "min_token_prob": 0.1,
                                 "max_cached": 10000, "tree": True, "persist": False}
