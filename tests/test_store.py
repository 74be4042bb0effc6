"""DraftStore: shards per problem, the window, decay, live siblings, modes, and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from dasrl.drafter.base import Drafter, DraftParams, problem_key
from support.reference import ReferenceIndex, best_of
from dasrl.drafter.store import DraftStore, StoreConfig

PROMPT_A, PROMPT_B = [1, 2, 3], [7, 8, 9]
RESP_A = [10, 11, 12, 13, 14, 15]
RESP_B = [20, 21, 22, 23]


def test_is_a_drafter():
    assert isinstance(DraftStore(), Drafter)


def test_history_is_per_problem():
    store = DraftStore(StoreConfig(mode="problem"))
    store.add_rollout("a", PROMPT_A, RESP_A)
    store.add_rollout("b", PROMPT_B, RESP_B)
    store.end_step()
    store.start("r", "a", PROMPT_A)
    d = store.propose(["r"], [10])[0]
    assert d.tokens.tolist() == RESP_A and d.match_len == 3
    store.observe("r", [10, 11])
    assert store.propose(["r"], [2])[0].tokens.tolist() == [12, 13]
    assert store.num_shards == 2
    store.check_integrity()


def test_default_problem_id_is_the_prompt_hash():
    store = DraftStore(StoreConfig(mode="problem"))
    store.add_rollout(None, PROMPT_A, RESP_A)
    store.end_step()
    store.start("r", problem_key(PROMPT_A), PROMPT_A)
    assert store.propose(["r"], [3])[0].tokens.tolist() == RESP_A[:3]


def test_in_flight_siblings_feed_problem_request_mode_only():
    for mode, expect in [("problem+request", [30, 31, 32]), ("problem", [])]:
        store = DraftStore(StoreConfig(mode=mode))
        store.start("s1", "a", PROMPT_A)
        store.start("s2", "a", PROMPT_A)
        store.observe("s1", [30, 31, 32, 33])
        assert store.propose(["s2"], [3])[0].tokens.tolist() == expect, mode


def test_window_evicts_oldest_step_and_decay_prefers_recent():
    store = DraftStore(StoreConfig(mode="problem", window=2, decay=0.5))
    for resp in ([40, 41], [50, 51], [60, 61]):  # three steps, the same problem, different answers
        store.add_rollout("a", PROMPT_A, resp)
        store.end_step()
    store.start("r", "a", PROMPT_A)
    d = store.propose(["r"], [1])[0]
    # step 1 ([40..]) was evicted; [60..] (weight 0.5) beats [50..] (0.25): 0.5 / 0.75.
    assert d.tokens.tolist() == [60] and d.probs[0] == pytest.approx(2 / 3)
    assert store.num_tokens == 2 * 5


def test_finished_rollouts_join_the_window_at_end_step():
    store = DraftStore(StoreConfig(mode="problem"))
    store.start("r1", "a", PROMPT_A)
    store.observe("r1", RESP_A)
    store.finish("r1")
    store.end_step()
    store.start("r2", "a", PROMPT_A)
    assert store.propose(["r2"], [6])[0].tokens.tolist() == RESP_A


def test_global_mode_mixes_problems():
    store = DraftStore(StoreConfig(mode="global"))
    store.add_rollout("a", [5, 6, 1], RESP_A)
    store.end_step()
    store.start("r", "b", [9, 9, 5, 6, 1])  # other problem, same tail
    assert store.propose(["r"], [2])[0].tokens.tolist() == RESP_A[:2]
    assert store.num_shards == 1


def test_store_drafts_equal_reference_on_the_same_corpus():
    rng = np.random.default_rng(3)
    params = DraftParams(max_match=8, branching=2)
    store = DraftStore(StoreConfig(mode="problem", decay=0.5, params=params))
    ref = ReferenceIndex()
    for step in range(3):
        for i in range(4):
            resp = rng.integers(0, 5, 30).tolist()
            store.add_rollout("a", PROMPT_A, resp)
            ref.add(step * 10 + i, PROMPT_A + resp, 1.0)
        store.end_step()
        ref.scale_weights(0.5)
    store.start("r", "a", PROMPT_A)
    ctx = list(PROMPT_A)
    for _ in range(10):
        got = store.propose(["r"], [12])[0]
        want = ref.propose(ctx, 12, params)
        assert got.tokens.tolist() == want.tokens and got.parents.tolist() == want.parents
        np.testing.assert_allclose(got.probs, want.probs, atol=1e-9)
        tok = int(rng.integers(0, 5))
        store.observe("r", [tok])
        ctx.append(tok)


def test_bad_input_names_the_value():
    store = DraftStore(StoreConfig(vocab_size=100))
    with pytest.raises(ValueError, match="unknown store mode 'bogus'"):
        StoreConfig(mode="bogus")
    with pytest.raises(ValueError, match="empty prompt"):
        store.start("r", None, [])
    with pytest.raises(ValueError, match="token id 100 .* vocabulary"):
        store.start("r", None, [1, 100])
    store.start("r", None, [1, 2])
    with pytest.raises(KeyError, match="already started"):
        store.start("r", None, [1, 2])
    with pytest.raises(KeyError, match="unknown request id 'x'"):
        store.propose(["x"], [1])
    with pytest.raises(ValueError, match="budget must be >= 0, got -1"):
        store.propose(["r"], [-1])
    with pytest.raises(ValueError, match="negative token id -5"):
        store.observe("r", [3, -5])
    store.observe("r", [3])
    store.finish("r")
    with pytest.raises(ValueError, match="request 'r' finished twice"):
        store.finish("r")
    with pytest.raises(ValueError, match="request 'r' is finished"):
        store.observe("r", [1])
    with pytest.raises(KeyError, match="unknown request id 'y'"):
        store.finish("y")
    store.check_integrity()


def test_bounds_at_the_boundary_name_the_value():
    store = DraftStore()
    with pytest.raises(ValueError, match="9223372036854775808"):
        store.start("r", None, [1, 2**63])
    with pytest.raises(ValueError, match="token id 2147483648 at position 0 is >= 2\\^31"):
        store.start("r", None, np.array([2**31], np.int64))
    assert store.num_shards == 0  # a refused start leaves no shard behind
    store.start("r", None, [1, 2])
    for bad in (2**40, 2**63, 10**30):
        with pytest.raises(ValueError, match=f"got {bad} for request 'r'"):
            store.propose(["r"], [bad])
        with pytest.raises(ValueError, match=str(bad)):
            store.propose_flat(["r"], [bad])
    with pytest.raises(ValueError, match="2147483648 at position 1"):
        store.observe("r", [1, 2**31])
    with pytest.raises(ValueError, match="9223372036854775808"):
        store.observe("r", [1, 2**63])
    with pytest.raises(ValueError, match="one-dimensional"):
        store.observe("r", np.zeros((2, 2), np.int64))
    with pytest.raises(TypeError, match="float64"):
        store.observe("r", np.zeros(2))
    with pytest.raises(ValueError, match="tokens of request 'r': negative token id -1 at position 1"):
        store.observe_batch(["r"], [[1, -1]])
    assert store.num_tokens == 2  # nothing of the refused calls reached the index
    store.check_integrity()
    for kw, words in [({"window": 1.5}, "window .* 1.5"), ({"window": -1}, "window"), ({"window": True}, "window"),
                      ({"vocab_size": 0}, "vocab_size .* 0"), ({"vocab_size": -1}, "vocab_size .* -1"),
                      ({"vocab_size": 2**40}, "vocab_size"), ({"live_weight": float("inf")}, "live_weight .* inf"),
                      ({"live_weight": float("nan")}, "live_weight"), ({"decay": float("nan")}, "decay"),
                      ({"params": "x"}, "params")]:
        with pytest.raises(ValueError, match=words):
            StoreConfig(**kw)
    for kw, words in [({"max_match": 10**12}, "max_match .* 1000000000000"), ({"max_match": 2.5}, "max_match"),
                      ({"branching": 0}, "branching"), ({"min_prob": float("nan")}, "min_prob")]:
        with pytest.raises(ValueError, match=words):
            DraftParams(**kw)


def test_flat_and_batch_paths_equal_the_per_request_paths():
    rng = np.random.default_rng(5)
    a, b = DraftStore(), DraftStore()
    for store in (a, b):
        for k in range(6):
            store.add_rollout(k % 2, PROMPT_A, rng.integers(0, 8, 50).tolist() if store is a else None or [])
    b = DraftStore()
    hist = [(k % 2, rng.integers(0, 8, 50).tolist()) for k in range(6)]
    for store in (a, b):
        store.__init__()
        for pid, resp in hist:
            store.add_rollout(pid, PROMPT_A, resp)
        store.end_step()
        for r in range(4):
            store.start(r, r % 2, PROMPT_A)
    for step in range(12):
        toks = [rng.integers(0, 8, int(rng.integers(0, 4))) for _ in range(4)]
        a.observe_batch(list(range(4)), [t.tolist() if step % 2 else t for t in toks])
        for r, t in enumerate(toks):
            b.observe(r, t)
        budgets = rng.integers(0, 10, 4).tolist()
        flat = a.propose_flat(list(range(4)), budgets)
        per = b.propose(list(range(4)), budgets)
        assert flat.lengths.tolist() == [len(d) for d in per]
        for i, d in enumerate(per):
            f = flat.draft(i)
            assert (f.tokens.tolist(), f.parents.tolist(), f.match_len) == (d.tokens.tolist(), d.parents.tolist(), d.match_len)
            np.testing.assert_allclose(f.probs, d.probs)
    a.check_integrity()


def test_a_batch_call_after_a_request_came_or_went_reaches_the_requests_now_live():
    """The batch calls keep the last batch's cursors while its ids repeat (vLLM's usual step): an id that
    finished and started again, or an aborted one, must not be served from that cache."""
    s = DraftStore()
    s.start("a", 0, PROMPT_A)
    s.start("b", 1, PROMPT_B)
    s.observe_batch(["a", "b"], [[10], [20]])
    s.observe_batch(["a", "b"], [[11], [21]])  # the same ids again: served from the cache
    s.finish("a")
    s.start("a", 0, PROMPT_B)  # the id reused by a new request
    s.observe_batch(["a", "b"], [[30], [22]])
    assert s._live["a"].output == [30] and s._live["b"].output == [20, 21, 22]
    s.abort("b")
    with pytest.raises(ValueError, match="'b' is finished"):
        s.observe_batch(["a", "b"], [[31], [23]])
    assert s._live["a"].output == [30]  # all or nothing
    s.check_integrity()


def test_shards_do_not_leak():
    """Issue 13: requests never finished (a crashed caller) left an empty shard per problem forever."""
    store = DraftStore(StoreConfig(window=2))
    for step in range(20):
        for p in range(50):
            store.start((step, p), f"p{step}-{p}", [1, 2, step, p])
            store.observe((step, p), [3, 4])
        store.start(("done", step), "shared", [9, 9])
        store.finish(("done", step))
        store.end_step()
        store.check_integrity()
        assert store.num_shards == 1  # only the finished problem's history
    prob = DraftStore(StoreConfig(mode="problem"))
    prob.start("r", "new", [1, 2])
    prob.abort("r")
    assert prob.num_shards == 0
    prob.start("r", "new", [1, 2])
    prob.finish("r")
    prob.end_step()
    assert prob.num_shards == 1
    prob.check_integrity()


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), max_size=20)), max_size=5),
                      min_size=1, max_size=7),
       window=st.integers(1, 4), query=st.lists(st.integers(0, 3), max_size=8), problem=st.integers(0, 3),
       cross=st.booleans())
def test_window_rolls_match_a_reference_of_the_window(steps, window, query, problem, cross):
    """After any sequence of steps, a problem's drafts are the reference's over exactly the rollouts of
    that problem in the last `window` steps, weighted decay**age; with the cross-problem source, the
    reference's best of that and every problem's rollouts in the window (problem 3 never has history:
    a first visit)."""
    params = DraftParams(max_match=6, branching=2)
    store = DraftStore(StoreConfig(mode="problem", window=window, decay=0.5, params=params, cross_problem=cross))
    for rollouts in steps:
        for pid, resp in rollouts:
            store.add_rollout(pid, PROMPT_A, resp)
        store.end_step()
        store.check_integrity()
    ref, everyone = ReferenceIndex(), ReferenceIndex()
    for age, rollouts in reversed(list(enumerate(reversed(steps[-window:]), start=1))):  # oldest first
        for k, (pid, resp) in enumerate(rollouts):
            everyone.add(age * 100 + k, PROMPT_A + resp, 0.5**age)
            if pid == problem:
                ref.add(age * 100 + k, PROMPT_A + resp, 0.5**age)
    store.start("q", problem, PROMPT_A)
    store.observe("q", query)
    got = store.propose(["q"], [10])[0]
    ctx = PROMPT_A + query
    want = ref.propose(ctx, 10, params)
    if cross:
        want = best_of([want, everyone.propose(ctx, 10, params)])
    assert (got.match_len, got.tokens.tolist(), got.parents.tolist()) == (want.match_len, want.tokens, want.parents)
    np.testing.assert_allclose(got.probs, want.probs, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(history=st.lists(st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), max_size=16)), max_size=4),
                        max_size=4),
       live=st.lists(st.tuples(st.integers(0, 3), st.lists(st.lists(st.integers(0, 3), max_size=4), max_size=5)),
                     min_size=1, max_size=4),
       window=st.integers(1, 3), branching=st.integers(1, 2))
def test_live_siblings_and_cross_problem_history_match_the_reference(history, live, window, branching):
    """problem+request mode with the cross-problem source, requests of several problems in flight
    (siblings among them) and fed chunk by chunk in turn: every request's draft is the reference's best of
    (its problem's window plus every live sequence of that problem, growing) and (every problem's finished
    rollouts in the window and every live request), after every chunk; finished requests stay in both."""
    params = DraftParams(max_match=6, branching=branching)
    cfg = StoreConfig(window=window, decay=0.5, params=params)
    store = DraftStore(cfg)
    finished: list[list[tuple[int, list[int]]]] = []  # per step: (problem, tokens), in indexing order
    for step in history:
        for pid, resp in step:
            store.add_rollout(pid, PROMPT_A, resp)
        finished.append([(pid, PROMPT_A + resp) for pid, resp in step])
        store.end_step()

    def references():
        shard: dict[int, ReferenceIndex] = {}
        everyone = ReferenceIndex()
        kept = finished[-window:]
        for age, step in zip(range(len(kept), 0, -1), kept):  # oldest first: the native indexing order
            for k, (pid, seq) in enumerate(step):
                everyone.add(age * 100 + k, seq, 0.5**age)
                shard.setdefault(pid, ReferenceIndex()).add(age * 100 + k, seq, 0.5**age)
        return shard, everyone

    shard, everyone = references()
    ctx = {}
    for r, (pid, _) in enumerate(live):
        store.start(r, pid, PROMPT_A)
        ctx[r] = list(PROMPT_A)
        shard.setdefault(pid, ReferenceIndex()).add(10_000 + r, PROMPT_A, 1.0)
        everyone.add(10_000 + r, PROMPT_A, 1.0)
    for turn in range(max(len(chunks) for _, chunks in live)):
        for r, (pid, chunks) in enumerate(live):
            if turn < len(chunks):
                store.observe(r, chunks[turn])
                ctx[r] += chunks[turn]
                shard[pid].append(10_000 + r, chunks[turn])
                everyone.append(10_000 + r, chunks[turn])
            got = store.propose([r], [6])[0]
            want = best_of([shard[pid].propose(ctx[r], 6, params), everyone.propose(ctx[r], 6, params)])
            assert (got.match_len, got.tokens.tolist(), got.parents.tolist()) == \
                (want.match_len, want.tokens, want.parents), (r, ctx[r])
            np.testing.assert_allclose(got.probs, want.probs, atol=1e-9)
    for r in range(len(live)):
        store.finish(r)
    store.end_step()
    store.check_integrity()
    finished.append([(pid, ctx[r]) for r, (pid, _) in enumerate(live)])
    shard, everyone = references()
    for pid in range(4):
        q = ("next", pid)
        store.start(q, pid, PROMPT_A)
        got = store.propose([q], [6])[0]
        want = best_of([shard.get(pid, ReferenceIndex()).propose(PROMPT_A, 6, params),
                        everyone.propose(PROMPT_A, 6, params)])
        assert (got.match_len, got.tokens.tolist()) == (want.match_len, want.tokens)


def test_first_visit_drafts_from_other_problems_history():
    """A problem never seen drafts from the cross-problem index; without it, from its own prompt only."""
    for cross, expect in [(True, RESP_A[:4]), (False, [])]:
        store = DraftStore(StoreConfig(cross_problem=cross))
        store.add_rollout("a", [5, 6, 1], RESP_A)
        store.end_step()
        store.start("r", "new", [9, 9, 5, 6, 1])
        assert store.propose(["r"], [4])[0].tokens.tolist() == expect, cross
        store.check_integrity()


def test_cross_problem_index_evicts_with_the_window():
    store = DraftStore(StoreConfig(window=2))
    sizes = []
    for step in range(12):
        for p in range(5):
            store.start((step, p), f"p{p}-{step}", [1, 2, step % 7, p])
            store.observe((step, p), list(range(50)))
            store.finish((step, p))
        store.end_step()
        store.check_integrity()  # the cross-problem index holds exactly the window's sequences
        sizes.append(store.bytes_used())
    assert store.num_shards == 10 and max(sizes[4:]) <= 1.5 * min(sizes[4:])


def test_save_load_round_trip_keeps_the_window(tmp_path):
    store = DraftStore(StoreConfig(mode="problem", window=3, decay=0.5))
    rng = np.random.default_rng(0)
    for _ in range(5):
        for pid in ("a", 7):
            store.add_rollout(pid, PROMPT_A, rng.integers(0, 6, 40).tolist())
        store.end_step()
    store.save(tmp_path / "s")
    back = DraftStore.load(tmp_path / "s")
    assert back.step == store.step and back.num_tokens == store.num_tokens
    for pid in ("a", 7):
        store.start(("q", pid), pid, PROMPT_A)
        back.start(("q", pid), pid, PROMPT_A)
        a = store.propose([("q", pid)], [20])[0]
        b = back.propose([("q", pid)], [20])[0]
        assert a.tokens.tolist() == b.tokens.tolist() and np.allclose(a.probs, b.probs)
    back.check_integrity()
    (tmp_path / "s" / "store.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read a draft store"):
        DraftStore.load(tmp_path / "s")


def test_close_frees_the_history_and_refuses_new_work():
    with DraftStore(StoreConfig()) as store:
        store.add_rollout("p", [1, 2, 3], [4, 5, 6, 4, 5, 6])
        store.end_step()
        assert store.num_tokens > 0
    assert not store._shards  # freed
    for counted in ("num_tokens", "num_shards"):  # a closed store answers nothing (it used to answer 0)
        with pytest.raises(ValueError, match="closed"):
            getattr(store, counted)
    with pytest.raises(ValueError, match="closed"):
        store.start("r", "p", [1, 2, 3])
    with pytest.raises(ValueError, match="closed"):
        store.add_rollout("p", [1], [2])
    store.close()  # idempotent
