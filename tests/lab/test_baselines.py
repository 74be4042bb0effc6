"""The lab's baseline drafters (dasrl_lab/drafters/baselines.py): what they draft, and the protocol's refusals."""

from __future__ import annotations

import re

import numpy as np
import pytest

from dasrl_lab.drafters.baselines import NGramDrafter, OracleDrafter


@pytest.mark.parametrize("bad", [1.9, "3", True, np.float64(2.0), np.bool_(True), None, [2]])
def test_budgets_that_are_not_ints_are_refused_not_truncated(bad):
    ngram, oracle = NGramDrafter(), OracleDrafter({"r": [1, 2]})
    ngram.start("r", 1, [1, 2, 3])
    oracle.start("r", 1, [1, 2, 3])
    for d in (ngram, oracle):
        with pytest.raises(ValueError, match=rf"draft budget must be an int, got {re.escape(repr(bad))} .* for request 'r'"):
            d.propose(["r"], [bad])


def test_ngram_drafts_what_followed_the_latest_earlier_match():
    ngram = NGramDrafter(min_n=2, max_n=3)
    ngram.start("r", None, [5, 1, 2, 7, 8, 1, 2, 9, 4])
    ngram.observe("r", [1, 2])  # the last 2 tokens [1, 2] occur twice before: the latest one is followed by 9, 4
    (draft,) = ngram.propose(["r"], [3])
    assert list(draft.tokens) == [9, 4, 1] and draft.match_len == 2
    assert len(ngram.propose(["r"], [0])[0].tokens) == 0


def test_oracle_drafts_the_continuation_from_where_the_request_stands():
    oracle = OracleDrafter({"r": [4, 5, 6, 7]})
    oracle.start("r", None, [1, 2])
    assert list(oracle.propose(["r"], [2])[0].tokens) == [4, 5]
    oracle.observe("r", [4, 5, 6])
    assert list(oracle.propose(["r"], [5])[0].tokens) == [7]
    oracle.finish("r")
    with pytest.raises(KeyError, match="unknown request id 'r'"):
        oracle.propose(["r"], [1])
