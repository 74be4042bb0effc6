import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dasrl.policy.length import LengthClassifier, LengthConfig


def make():
    c = LengthClassifier(LengthConfig(q_short=0.5, q_long=0.9), max_len=1000)
    rng = np.random.default_rng(0)
    for L in rng.integers(10, 30, 20):
        c.record("easy", int(L))
    for L in rng.integers(200, 400, 20):
        c.record("mid", int(L))
    for L in [900] * 6:
        c.record("hard", L)
    return c


def test_initial_class_from_problem_history():
    c = make()
    assert c.classify("easy") == "short"  # generated = 0: the initial class
    assert c.classify("hard") == "long"
    assert c.classify("mid") == "medium"


def test_runtime_update_grows_with_partial_length():
    c = make()
    lo, hi = c.thresholds()
    assert c.classify("easy", 0) == "short"
    assert c.classify("easy", lo) != "short"  # cannot be short any more
    assert c.classify("easy", hi) == "long"
    assert c.classify("easy", 5000) == "long"  # past everything seen
    # monotone: the class index never decreases as l grows
    order = {"short": 0, "medium": 1, "long": 2}
    seq = [order[c.classify("mid", g)] for g in range(0, 1000, 10)]
    assert seq == sorted(seq)


def test_probabilities_and_expected_length():
    c = make()
    p = c.probabilities("mid", 0)
    assert p.sum() == pytest.approx(1) and np.argmax(p) == 1
    assert c.expected_length("hard", 0) == pytest.approx(900)
    assert 200 <= c.expected_length("mid", 250) <= 400
    assert c.expected_length("mid", 250) > c.expected_length("mid", 0)


def test_unseen_problem_uses_pooled_and_empty_history_uses_fallback():
    c = make()
    assert c.classify("never") in ("short", "medium", "long")
    e = LengthClassifier(max_len=1000)
    assert e.thresholds() == (250, 600)
    assert e.classify("x", 0) == "medium" and e.classify("x", 700) == "long"
    assert e.expected_length("x", 100) == 550


def test_state_roundtrip_json_and_validation():
    c = make()
    c.record(17, 50)
    s = json.loads(json.dumps(c.state_dict()))
    d = LengthClassifier(max_len=1)
    d.load_state_dict(s)
    assert d.max_len == 1000 and list(d.lengths(17)) == [50]
    assert d.thresholds() == c.thresholds()
    with pytest.raises(ValueError, match=r"problems\[0\]"):
        d.load_state_dict({"problems": [["p", [-1]]]})
    with pytest.raises(ValueError, match="length"):
        c.record("p", -3)


def test_history_window():
    c = LengthClassifier(LengthConfig(history=3), max_len=100)
    for L in [1, 2, 3, 4, 5]:
        c.record("p", L)
    assert list(c.lengths("p")) == [3, 4, 5]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 60)), max_size=30), st.integers(0, 4),
       st.lists(st.integers(0, 80), min_size=1, max_size=6), st.integers(1, 10))
def test_spans_hold_the_value_over_their_span(history, problem, gens, min_pooled):
    """expected_span and classify_span: the value is E[L | L >= g] (the mean of the problem's lengths that reach
    g, else of the pooled ones, capped at max_len; none: the midpoint of g and max_len) / classify's, and stays
    it for every length up to the span's end (what the policy caches per row)."""
    c = LengthClassifier(LengthConfig(min_pooled=min_pooled), max_len=70)
    for pid, n in history:
        c.record(pid, n)

    def mean_from(g):
        for ls in (c.lengths(problem), c.pooled()):
            if (ls >= g).any():
                return min(int(ls[ls >= g].sum()) / int((ls >= g).sum()), c.max_len)
        return (g + c.max_len) / 2

    for g in gens:
        e, last = c.expected_span(problem, g)
        cls, clast = c.classify_span(problem, g)
        assert last >= g and clast >= g
        for h in range(g, min(last, g + 40) + 1):
            assert c.expected_length(problem, h) == e == mean_from(h)
        for h in range(g, min(clast, g + 40) + 1):
            assert c.classify(problem, h) == cls
