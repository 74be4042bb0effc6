"""Chain and tree verification on hand-worked arrays."""

import numpy as np
import pytest

from dasrl.drafter.base import Draft, DraftBatch
from dasrl.engine.verify import accepted_counts, depths, verify


def verify_chain(tokens, targets):
    return verify(Draft.chain(tokens.tolist(), [1.0] * len(tokens)), targets)


def verify_tree(tokens, parents, targets):
    return verify(Draft(np.asarray(tokens, np.int32), np.asarray(parents, np.int32), np.ones(len(tokens)), 0), targets)


def arr(*x):
    return np.asarray(x, dtype=np.int64)


def test_chain_all_accepted_gives_bonus():
    # draft 5 6 7; targets at pending, 5, 6, 7 -> 5 6 7 9: three accepted, 9 is the bonus.
    v = verify_chain(arr(5, 6, 7), arr(5, 6, 7, 9))
    assert v.tokens.tolist() == [5, 6, 7, 9]
    assert v.accepted == 3 and v.bonus
    assert v.emit_at.tolist() == [0, 1, 2, 3]
    assert v.path.tolist() == [0, 1, 2]


def test_chain_first_mismatch_gives_recovered():
    # draft 5 6 7; the target after 5 is 8, not 6: accept 5, recover 8, ignore the rest.
    v = verify_chain(arr(5, 6, 7), arr(5, 8, 7, 9))
    assert v.tokens.tolist() == [5, 8]
    assert v.accepted == 1 and not v.bonus
    assert v.emit_at.tolist() == [0, 1]


def test_chain_rejected_at_once():
    v = verify_chain(arr(5, 6), arr(4, 6, 7))
    assert v.tokens.tolist() == [4] and v.accepted == 0 and not v.bonus


def test_empty_draft_is_plain_decoding():
    v = verify(Draft.empty(), arr(42))
    assert v.tokens.tolist() == [42] and v.accepted == 0 and v.bonus


def test_chain_needs_one_more_target():
    with pytest.raises(ValueError, match="need 3 targets"):
        verify_chain(arr(1, 2), arr(1, 2))


def test_tree_walk_takes_matching_child():
    #        root
    #       /    \
    #   0:a=10  1:b=11
    #     |      /   \
    #   2:12  3:13  4:14
    #                 |
    #               5:15
    tokens = arr(10, 11, 12, 13, 14, 15)
    parents = np.asarray([-1, -1, 0, 1, 1, 4], dtype=np.int32)
    # targets: pending->11 (take node 1), node1->14 (take node 4), node4->15 (take 5), node5->99 (bonus)
    targets = arr(11, 0, 14, 0, 0, 15, 99)
    v = verify_tree(tokens, parents, targets)
    assert v.tokens.tolist() == [11, 14, 15, 99]
    assert v.path.tolist() == [1, 4, 5]
    assert v.emit_at.tolist() == [0, 2, 5, 6]
    assert v.accepted == 3 and v.bonus


def test_tree_recovers_when_no_child_matches():
    tokens = arr(10, 11, 12, 13)
    parents = np.asarray([-1, -1, 0, 0], dtype=np.int32)
    # pending->10 (node 0); node0->77: neither child 12 nor 13 -> recover 77.
    v = verify_tree(tokens, parents, arr(10, 77, 0, 0, 0))
    assert v.tokens.tolist() == [10, 77]
    assert v.path.tolist() == [0]
    assert not v.bonus


def test_tree_duplicate_siblings_follow_the_first():
    tokens = arr(10, 10, 11)
    parents = np.asarray([-1, -1, 1], dtype=np.int32)
    v = verify_tree(tokens, parents, arr(10, 5, 11, 6))
    assert v.path.tolist() == [0]  # node 0 is followed; its (absent) children do not match 5
    assert v.tokens.tolist() == [10, 5] and v.bonus  # node 0 is a leaf: 5 is a bonus


def test_tree_on_a_chain_equals_chain():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, 6))
        d = rng.integers(0, 3, n)
        t = rng.integers(0, 3, n + 1)
        parents = np.arange(-1, n - 1, dtype=np.int32)
        a, b = verify_chain(d, t), verify_tree(d, parents, t)
        assert a.tokens.tolist() == b.tokens.tolist() and a.bonus == b.bonus


def test_depths_and_bad_parents():
    assert depths(np.asarray([-1, 0, 0, 2, -1])).tolist() == [0, 1, 1, 2, 0]
    with pytest.raises(ValueError, match="parents must come before"):
        depths(np.asarray([-1, 2, 0]))
    with pytest.raises(ValueError, match="parents must come before"):
        verify_tree(arr(1, 2), np.asarray([1, -1]), arr(1, 2, 3))


def test_accepted_counts_is_the_verdicts_rule_on_mixed_batches():
    """accepted_counts (what replays and the vLLM tracker count with) == each row's verdict, chains and trees."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        drafts = []
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(0, 6))
            parents = [int(rng.integers(-1, i)) if rng.random() < 0.5 else i - 1 for i in range(n)]
            drafts.append(Draft(rng.integers(0, 3, n).astype(np.int32), np.asarray(parents, np.int32), np.ones(n), 0))
        batch = DraftBatch.from_drafts(drafts)
        starts = np.concatenate([[0], np.cumsum(batch.lengths + 1)])
        targets = rng.integers(0, 3, int(starts[-1]))
        got = accepted_counts(batch, targets, starts)
        assert got.tolist() == [verify(d, targets[starts[b]: starts[b + 1]]).accepted for b, d in enumerate(drafts)]


@pytest.mark.parametrize("lists", [[], [[]], [[5, 6, 7]], [[1], [], [2, 3, 4], [9, 9]]])
def test_chains_is_from_drafts_of_chain_drafts(lists):
    """DraftBatch.chains builds on the flat arrays what from_drafts([Draft.chain(t) ...]) builds draft by draft."""
    got, want = DraftBatch.chains(lists), DraftBatch.from_drafts([Draft.chain(t) for t in lists])
    for field in ("tokens", "parents", "probs", "offsets", "match_len"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), field
