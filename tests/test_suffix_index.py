"""The native index against the brute-force reference, draft for draft (hypothesis), plus bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dasrl.drafter.base import DraftParams
from support.reference import ReferenceIndex
from dasrl.drafter.suffix import SuffixIndex, extend_batch, propose_batch, propose_flat

# Dyadic weights keep every weighted sum exact, so ties rank the same in both implementations.
WEIGHTS = st.sampled_from([1.0, 0.5, 0.25, 2.0, 0.125])
# Mostly a 4-token alphabet (long, frequent matches) with a wide one mixed in, so that a node can have
# more than 16 distinct continuations (the core switches from a linear scan to a hash map there).
TOKEN = st.one_of(st.integers(0, 3), st.integers(0, 3), st.integers(4, 60))
SMALL_SEQ = st.lists(TOKEN, min_size=0, max_size=40)


def assert_same(native: SuffixIndex, ref: ReferenceIndex, ctx: list[int], budget: int, params: DraftParams) -> None:
    got = native.propose(ctx, budget, params)
    want = ref.propose(ctx, budget, params)
    assert got.match_len == want.match_len, (ctx, got, want)
    assert got.tokens.tolist() == want.tokens, (ctx, got, want)
    assert got.parents.tolist() == want.parents, (ctx, got, want)
    np.testing.assert_allclose(got.probs, want.probs, rtol=0, atol=1e-9)


# An operation script: add / append / remove / scale, each followed by integrity and draft checks.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), SMALL_SEQ, WEIGHTS),
        st.tuples(st.just("append"), st.integers(0, 50), SMALL_SEQ),
        st.tuples(st.just("remove"), st.integers(0, 50)),
        st.tuples(st.just("scale"), st.sampled_from([0.5, 2.0])),
    ),
    min_size=1, max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, contexts=st.lists(SMALL_SEQ, min_size=1, max_size=4), budget=st.integers(0, 50),
       max_match=st.integers(1, 12), branching=st.integers(1, 3),
       min_prob=st.sampled_from([0.0, 0.1, 0.3]))
def test_native_equals_reference(ops, contexts, budget, max_match, branching, min_prob):
    native, ref = SuffixIndex(), ReferenceIndex()
    params = DraftParams(max_match=max_match, min_prob=min_prob, branching=branching)
    next_id = 0
    for op in ops:
        live = sorted(ref.seqs)
        if op[0] == "add":
            native.add(next_id, op[1], op[2])
            ref.add(next_id, op[1], op[2])
            next_id += 1
        elif op[0] == "append" and live:
            sid = live[op[1] % len(live)]
            native.append(sid, op[2])
            ref.append(sid, op[2])
        elif op[0] == "remove" and live:
            sid = live[op[1] % len(live)]
            native.remove(sid)
            ref.remove(sid)
        elif op[0] == "scale":
            native.scale_weights(op[1])
            ref.scale_weights(op[1])
        native.check_integrity()
        assert len(native) == len(ref.seqs)
        for ctx in contexts:
            assert_same(native, ref, ctx, budget, params)


# The fan-out case: a head token (0) followed by many distinct tokens, often more than 16 per node, with
# repeats (the core groups a node's continuations by a linear scan up to 16 groups, a hash map beyond).
FAN_SEQ = st.tuples(st.integers(1, 40), st.lists(st.one_of(st.just(0), st.integers(1, 40)), max_size=3)).map(
    lambda t: [0, t[0], *t[1]])


@settings(max_examples=100, deadline=None)
@given(corpus=st.lists(st.tuples(FAN_SEQ, WEIGHTS), min_size=30, max_size=100), budget=st.integers(1, 12),
       branching=st.integers(1, 4))
def test_wide_fan_out_equals_reference(corpus, budget, branching):
    native, ref = SuffixIndex(), ReferenceIndex()
    for i, (seq, w) in enumerate(corpus):
        native.add(i, seq, w)
        ref.add(i, seq, w)
    native.check_integrity()
    for ctx in ([0], [5, 0], [0, 0]):
        assert_same(native, ref, ctx, budget, DraftParams(max_match=3, branching=branching))


def test_seventeenth_distinct_continuation_joins_its_group():
    """Issue 12: past 16 distinct continuations a node's groups move to a hash map; the token that
    crossed the limit was left out of the map, so its next occurrence opened a second group."""
    for order in ("many first", "distinct first"):
        native, ref = SuffixIndex(), ReferenceIndex()
        seqs = [[1000, 200]] * 10 + [[1000, 300 + k] for k in range(16)]
        for sid, seq in enumerate(seqs if order == "many first" else seqs[::-1]):
            native.add(sid, seq)
            ref.add(sid, seq)
        for branching in (1, 3):
            assert_same(native, ref, [1000], 3, DraftParams(branching=branching))
        tree = native.propose([1000], 3, DraftParams(branching=3))
        assert tree.tokens.tolist() == [200, 300, 301], order
        np.testing.assert_allclose(tree.probs, [10 / 26, 1 / 26, 1 / 26])


@settings(max_examples=100, deadline=None)
@given(corpus=st.lists(SMALL_SEQ, min_size=1, max_size=6), stream=st.lists(TOKEN, max_size=60),
       chunks=st.lists(st.integers(0, 5), min_size=1, max_size=30), sibling_every=st.integers(0, 3),
       max_match=st.integers(1, 10), branching=st.integers(1, 3))
def test_cursors_per_request_and_flat_equal_reference(corpus, stream, chunks, sibling_every, max_match, branching):
    """Two cursors fed a few tokens at a time (one growing its own live sequence, like a request in
    problem+request mode, while a sibling sequence grows too) draft exactly the reference's drafts on
    their whole contexts, through the per-request path and the flat batch path alike."""
    native, ref = SuffixIndex(), ReferenceIndex()
    for i, seq in enumerate(corpus):
        native.add(i, seq)
        ref.add(i, seq)
    sib, own = len(corpus), len(corpus) + 1
    for sid in (sib, own):
        native.add(sid, [])
        ref.add(sid, [])
    plain, live = native.cursor(max_match), native.cursor(max_match, seq_id=own)
    params = DraftParams(max_match=max_match, branching=branching)
    ctx: list[int] = []
    pos = 0
    for step, n in enumerate(chunks):
        piece = stream[pos : pos + n]
        pos += n
        if step % 2:
            assert extend_batch([plain, live], np.array(piece + piece, np.int64),
                                np.array([0, len(piece), 2 * len(piece)])) == -1
        else:
            plain.extend(piece)
            live.extend(piece)
        ctx += piece
        ref.append(own, piece)
        if sibling_every and step % sibling_every == 0:
            native.append(sib, piece[::-1])
            ref.append(sib, piece[::-1])
        want = ref.propose(ctx, 8, params)
        flat = propose_flat([plain, live], np.array([8, 8], np.int64), branching=branching)
        per_request = propose_batch([live], [8], branching=branching)[0]
        for got in (flat.draft(0), flat.draft(1), per_request):
            assert (got.match_len, got.tokens.tolist(), got.parents.tolist()) == \
                (want.match_len, want.tokens, want.parents)
            np.testing.assert_allclose(got.probs, want.probs, rtol=0, atol=1e-9)
    assert native.tokens(own).tolist() == ctx == live.context().tolist()
    native.check_integrity()


def test_hand_worked_chain_and_tree():
    ix = SuffixIndex()
    ix.add(1, [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 7])
    ix.add(2, [9, 2, 3, 4, 5, 6], weight=0.5)
    d = ix.propose([2, 3, 4], 10)
    # "2 3 4" occurs 3 times: followed by 5 (w 1 + 0.5) and 7 (w 1): 5 wins with 1.5 / 2.5.
    assert d.match_len == 3 and d.tokens.tolist() == [5, 6, 1, 2, 3, 4, 7]
    np.testing.assert_allclose(d.probs, [0.6] * 7)
    tree = ix.propose([0, 2, 3, 4], 10, DraftParams(branching=2))
    assert tree.tokens.tolist() == [5, 6, 1, 2, 3, 4, 7, 7]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4, 5, -1]
    assert tree.probs[-1] == pytest.approx(0.4)
    assert not tree.is_chain and d.is_chain


def test_drafts_are_not_depth_capped():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 32000, 3000).astype(np.int32)
    ix = SuffixIndex()
    ix.add(0, base)
    d = ix.propose(base[:100], 512)
    assert len(d) == 512 and d.tokens.tolist() == base[100:612].tolist()


def test_removal_compacts_and_keeps_others():
    rng = np.random.default_rng(1)
    ix = SuffixIndex()
    seqs = {i: rng.integers(0, 50, 3000) for i in range(8)}
    for i, s in seqs.items():
        ix.add(i, s)
    before = ix.bytes_used()
    for i in range(6):
        ix.remove(i)
        ix.check_integrity()
    assert ix.num_tokens == 6000 and sorted(ix.ids()) == [6, 7]
    assert ix.bytes_used() < before
    assert ix.propose(seqs[7][:50], 20).tokens.tolist() == seqs[7][50:70].tolist()


@pytest.mark.parametrize("bad, err, words", [
    ([1, -2], ValueError, "negative token id -2"),
    ([1, 2**31], ValueError, "2147483648"),
    (np.array([1.0, 2.0]), TypeError, "dtype float64"),
    (np.arange(10, dtype=np.int32)[::2], ValueError, "contiguous"),
    ([1, "a"], TypeError, "'a'"),
])
def test_bad_tokens_leave_index_unchanged(bad, err, words):
    ix = SuffixIndex()
    ix.add(0, [1, 2, 3])
    with pytest.raises(err, match=words):
        ix.append(0, bad)
    with pytest.raises(err, match=words):
        ix.add(1, bad)
    assert ix.tokens(0).tolist() == [1, 2, 3] and len(ix) == 1
    ix.check_integrity()


def test_bad_ids_and_budgets():
    ix = SuffixIndex()
    ix.add(0, [1, 2, 3])
    with pytest.raises(KeyError, match="unknown sequence id 5"):
        ix.append(5, [1])
    with pytest.raises(KeyError, match="already indexed"):
        ix.add(0, [1])
    ix.remove(0)
    with pytest.raises(KeyError, match="unknown sequence id 0"):
        ix.remove(0)
    with pytest.raises(ValueError, match="budget must be >= 0, got -1"):
        ix.propose([1, 2], -1)
    with pytest.raises(ValueError, match="got -3 for request 1"):
        propose_batch([ix.cursor(), ix.cursor()], [1, -3])
    for big in (2**40, 2**63, 2**64):
        with pytest.raises(ValueError, match=str(big)):
            propose_batch([ix.cursor()], [big])
    with pytest.raises(ValueError, match="max_match must be in .*1000000000000"):
        ix.cursor(10**12)
    with pytest.raises(ValueError, match="max_match must be in .*1000000000000"):
        DraftParams(max_match=10**12)
    ix.add(7, [1, 2, 3])
    with pytest.raises(ValueError, match="9223372036854775808 at position 1"):
        ix.append(7, [1, 2**63])
    with pytest.raises(ValueError, match="18446744073709551616 at position 0"):
        ix.append(7, [2**64])
    assert ix.tokens(7).tolist() == [1, 2, 3]
    c = ix.cursor()
    assert c.feed(np.array([1, -1, 2])) == 1 and c.context_len == 0  # unchecked path: reported, nothing changed
    with pytest.raises(ValueError, match="weight"):
        ix.add(3, [1], weight=0.0)
    ix.check_integrity()


# ---------------------------------------------------------------------- bounded work (issue 26)
def test_bounds_are_shared_with_the_core():
    from dasrl import _core
    from dasrl.drafter import base
    from support import reference
    assert (_core.MAX_OCCURRENCES, _core.MAX_DRAFT, _core.ORDER) == (
        reference.MAX_OCCURRENCES, base.MAX_DRAFT, reference.ORDER)


def test_matches_consider_the_newest_occurrences_only_even_after_compaction(monkeypatch):
    """A binary alphabet and a long loop of one token give every 4-gram thousands of occurrences. Tokens
    are appended to several live sequences interleaved, and removals compact the index (which must keep
    the chains in indexing order). The native index drafts exactly what the reference drafts with its
    candidates bounded to the MAX_OCCURRENCES newest, and for some contexts not what an unbounded
    reference drafts: the bound is real, and the same in both."""
    from support import reference
    rng = np.random.default_rng(26)
    native, ref = SuffixIndex(), ReferenceIndex()
    for sid in range(300):
        seq = rng.integers(0, 2, rng.integers(1, 12)).tolist()
        native.add(sid, seq, float(rng.choice([1.0, 0.5, 0.25])))
        ref.add(sid, seq, native.weight(sid))
    for _ in range(300):  # interleaved growth of a few sequences, one of them looping on token 1
        sid = int(rng.integers(0, 4))
        piece = [1] * 40 if sid == 0 else rng.integers(0, 2, rng.integers(1, 30)).tolist()
        native.append(sid, piece)
        ref.append(sid, piece)
    for sid in range(10, 300):  # slots > 2 x live + 64 after ~150 of these: the index compacts
        native.remove(sid)
        ref.remove(sid)
    native.check_integrity()
    assert native.num_tokens > 4 * reference.MAX_OCCURRENCES
    contexts = [[1] * 70, [0, 1] * 35, [1, 1, 0, 1] * 10] + [rng.integers(0, 2, 70).tolist() for _ in range(8)]
    differs = 0
    for ctx in contexts:
        for params in (DraftParams(max_match=64), DraftParams(max_match=7, branching=3), DraftParams(max_match=3)):
            assert_same(native, ref, ctx, 20, params)
            with monkeypatch.context() as m:
                m.setattr(reference, "MAX_OCCURRENCES", 10**9)
                unbounded = ref.propose(ctx, 20, params)
            got = native.propose(ctx, 20, params)
            differs += (got.match_len, got.tokens.tolist()) != (unbounded.match_len, unbounded.tokens)
    assert differs > 0


def test_a_looping_request_walks_a_bounded_number_of_occurrences():
    """200k tokens of one token in the request's own live sequence: the draft is the one the bounded
    reference gives, i.e. from the MAX_OCCURRENCES newest occurrences (the 200k-long walk is gone)."""
    from support import reference
    native, ref = SuffixIndex(), ReferenceIndex()
    loop = [7] * 200_000
    native.add(0, [3, 4, 5, 7, 7, 7, 7, 8] * 3)
    ref.add(0, [3, 4, 5, 7, 7, 7, 7, 8] * 3)
    native.add(1, [1, 2] + loop)
    ref.add(1, [1, 2] + loop)
    m, occ = ref.match([1, 2] + loop, 64)
    assert m == 64 and len(occ) == reference.MAX_OCCURRENCES - 1  # the newest one has no continuation
    assert_same(native, ref, [1, 2] + loop, 16, DraftParams())
    assert native.propose([7] * 70, 16, DraftParams()).tokens.tolist() == [7] * 16


def test_drafts_stop_at_max_draft_whatever_the_budget():
    from dasrl.drafter.base import MAX_DRAFT
    native, ref = SuffixIndex(), ReferenceIndex()
    seq = list(range(3 * MAX_DRAFT))
    native.add(0, seq)
    ref.add(0, seq)
    for budget in (MAX_DRAFT - 1, MAX_DRAFT, 2 * MAX_DRAFT, 2**31 - 1):
        d = native.propose([0], budget)
        assert len(d) == min(budget, MAX_DRAFT) == len(ref.propose([0], budget).tokens)
        cursor = native.cursor()
        cursor.extend([0])
        assert len(propose_flat([cursor], np.array([budget], np.int64))) == 1
        assert len(propose_flat([cursor], np.array([budget], np.int64)).tokens) == min(budget, MAX_DRAFT)


@settings(max_examples=120, deadline=None)
@given(own=st.lists(st.tuples(SMALL_SEQ, WEIGHTS), max_size=4), others=st.lists(st.lists(st.tuples(SMALL_SEQ, WEIGHTS),
       max_size=4), min_size=1, max_size=2), stream=st.lists(TOKEN, max_size=40),
       chunks=st.lists(st.integers(0, 6), min_size=1, max_size=12), budget=st.integers(0, 20),
       max_match=st.integers(1, 10), branching=st.integers(1, 3), min_prob=st.sampled_from([0.0, 0.2]),
       live_source=st.booleans())
def test_sources_draft_the_reference_best_of(own, others, stream, chunks, budget, max_match, branching, min_prob,
                                             live_source):
    """A cursor with added sources (its own index growing a live sequence; further indexes, the first of
    them growing a live sequence too when live_source) drafts what the reference's best_of gives over each
    source's own draft, as the context grows; the best continuation is the reference's largest over the
    sources."""
    from support.reference import best_of
    from dasrl.drafter.suffix import best_continuation_batch

    def build(seqs):
        native, ref = SuffixIndex(), ReferenceIndex()
        for i, (seq, w) in enumerate(seqs):
            native.add(i, seq, w)
            ref.add(i, seq, w)
        return native, ref

    first, first_ref = build(own)
    live = len(own)
    first.add(live, [])
    first_ref.add(live, [])
    extra = [build(seqs) for seqs in others]
    cur = first.cursor(max_match, seq_id=live)
    for k, (native, ref) in enumerate(extra):
        if k == 0 and live_source:
            native.add(99, [])
            ref.add(99, [])
            cur.add_source(native, 99)
        else:
            cur.add_source(native)
    params = DraftParams(max_match=max_match, branching=branching, min_prob=min_prob)
    ctx: list[int] = []
    pos = 0
    for n in chunks:
        piece = stream[pos:pos + n]
        pos += n
        cur.extend(piece)
        first_ref.append(live, piece)
        if live_source:
            extra[0][1].append(99, piece)
        ctx += piece
        want = best_of([first_ref.propose(ctx, budget, params)] + [r.propose(ctx, budget, params) for _, r in extra])
        got = propose_flat([cur], np.array([budget], np.int64), min_prob=min_prob, branching=branching).draft(0)
        assert (got.match_len, got.tokens.tolist(), got.parents.tolist()) == (want.match_len, want.tokens, want.parents)
        np.testing.assert_allclose(got.probs, want.probs, rtol=0, atol=1e-9)
        target = stream[pos:pos + 8]
        oracle = best_continuation_batch([cur], np.array(target, np.int64), np.array([0, len(target)]))
        assert oracle.tolist() == [max(r.best_continuation(ctx, target, max_match)
                                       for r in [first_ref] + [r for _, r in extra])]
    if live_source:
        assert extra[0][0].tokens(99).tolist() == ctx


def test_a_source_wins_on_score_and_ties_go_to_the_first():
    own, other = SuffixIndex(), SuffixIndex()
    own.add(0, [1, 2, 3, 9])  # after [.., 3]: 9, one occurrence: score 1 at budget 1
    own.add(1, [1, 2, 3, 8])  # ... and 8: each 1/2
    other.add(0, [5, 3, 7, 7, 7])  # after 3: 7 7 7, probability 1 each
    cur = own.cursor(8)
    cur.add_source(other)
    cur.extend([4, 3])
    d = propose_batch([cur], [3])[0]
    assert d.tokens.tolist() == [7, 7, 7] and d.match_len == 1  # 3.0 beats 0.5 + 0.5
    one, tie = SuffixIndex(), SuffixIndex()
    one.add(0, [1, 2, 3, 9])
    tie.add(0, [4, 3, 6])
    solo = one.cursor(8)
    solo.add_source(tie)
    solo.extend([1, 2, 3])
    d = propose_batch([solo], [1])[0]
    assert d.tokens.tolist() == [9] and d.match_len == 3  # 1.0 each: the tie goes to the cursor's own index
    with pytest.raises(ValueError, match="already a source"):
        solo.add_source(tie)
    with pytest.raises(TypeError, match="must be a SuffixIndex"):
        solo.add_source([1, 2])
    with pytest.raises(ValueError, match="already a source"):
        solo.add_source(one)
    fresh = SuffixIndex()
    fresh.add(5, [1])
    with pytest.raises(ValueError, match="sequence 5 holds 1 tokens, the cursor's context 3"):
        solo.add_source(fresh, 5)
    with pytest.raises(KeyError, match="unknown sequence id 6"):
        solo.add_source(fresh, 6)


def test_score_tie_is_shared_with_the_core():
    from dasrl import _core
    from support import reference

    assert _core.SCORE_TIE == reference.SCORE_TIE
