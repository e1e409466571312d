"""Prompt lookup's matching rules (drafting/ngram.py) on plain integer lists, each case worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdbench.drafting.ngram import NGramDrafter, lookup


def _lookup(seq, k, max_n=3, min_n=1):
    return lookup(np.array(seq), k, max_n, min_n).tolist()


@pytest.mark.parametrize("seq, k, max_n, min_n, want, rule", [
    ([1, 2, 3, 9, 1, 2, 3], 3, 3, 1, [9, 1, 2], "the whole suffix matched: what followed it"),
    ([1, 2, 7, 3, 2, 8, 1, 2], 3, 3, 1, [7, 3, 2], "the longest n-gram wins over a more recent shorter one"),
    ([1, 5, 1, 6, 1], 2, 1, 1, [6, 1], "of several matches the most recent"),
    ([4, 9, 4], 5, 3, 1, [9, 4], "at most what follows the match"),
    ([1, 2, 3, 1], 3, 3, 2, [], "nothing shorter than min_n"),
    ([1, 2, 3, 1], 3, 3, 1, [2, 3, 1], "a 1-gram when min_n allows it"),
    ([7, 7, 7], 2, 3, 1, [7], "a match may overlap the suffix, never be the suffix itself"),
    ([2, 3, 9, 5, 3, 8, 2, 3], 3, 2, 1, [9, 5, 3], "the 2-gram [2, 3] matched at the start"),
    ([2, 3, 9, 5, 3, 8, 2, 3], 3, 1, 1, [8, 2, 3], "max_n 1: only the 1-gram [3], most recently before [8]"),
    ([3], 4, 3, 1, [], "a one-token context has nothing before it"),
    ([1, 2, 3], 4, 3, 1, [], "no earlier occurrence"),
])
def test_lookup_rules(seq, k, max_n, min_n, want, rule):
    assert _lookup(seq, k, max_n, min_n) == want, rule


def test_the_drafter_drafts_per_row_within_each_rows_limit():
    ctx = torch.tensor([[1, 2, 3, 9, 1, 2, 3, 0, 0],  # 7 tokens: [9, 1, 2, ...]
                        [4, 9, 4, 0, 0, 0, 0, 0, 0],  # 3 tokens: only [9, 4] follow
                        [1, 2, 3, 0, 0, 0, 0, 0, 0]])  # no match
    proposal = NGramDrafter(3, 1).draft(ctx, [7, 3, 3], [2, 4, 4])
    assert proposal.lengths.tolist() == [2, 2, 0]
    assert proposal.tokens[0, :2].tolist() == [9, 1] and proposal.tokens[1, :2].tolist() == [9, 4]
    # a row that can commit nothing more drafts nothing
    assert NGramDrafter(3, 1).draft(ctx[:1], [7], [0]).lengths.tolist() == [0]
