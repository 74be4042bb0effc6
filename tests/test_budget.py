"""The library's budget policies: DAS's class caps (ForwardAllowance) and the registry (`dasrl.policy.make_policy`). The
paper's closed form and the lab's ablation policies are tested in tests/lab/test_closed_form.py."""

import pytest

from dasrl.policy import POLICIES, ClassCaps, FixedBudget, ForwardAllowance, LatencyModel, RequestState, make_policy


def states(gen, pid="a", max_new=1000):
    return [RequestState(req_id=i, problem_id=pid, prompt_len=5, max_new_tokens=max_new, generated=g)
            for i, g in enumerate(gen)]


def test_das_policy_classes_and_learning():
    pol = ForwardAllowance(ClassCaps(short=0, medium=3, long=9))  # unpriced: each row its class cap, paced
    for L in [10, 12, 11, 9, 13, 10, 500, 520]:
        pol.lengths.record("a", L)
    for L in [30] * 8:
        pol.lengths.record("b", L)
    lo, hi = pol.lengths.thresholds()
    st = states([0, 14, 480, hi + 1])
    b = pol.budgets(st)
    # problem a mostly short at start; past its short lengths only its long ones are left: long
    assert [s.classes for s in st] == [["short"], ["long"], ["long"], ["long"]]
    assert b[0] == 0 and b[1] == 9  # the short row's cap is 0; the row with the most to come drafts its cap
    assert max(b) <= 9


def test_history_policy_learns_from_vanished_requests():
    pol = ForwardAllowance()
    st = states([5, 7], pid="z")
    pol.budgets(st)
    pol.budgets(st[:1])  # request 1 finished
    assert list(pol.lengths.lengths("z")) == [7]
    pol.end_step()
    assert sorted(pol.lengths.lengths("z")) == [5, 7]


def test_registry_errors():
    with pytest.raises(ValueError, match="valid policies: " + ", ".join(POLICIES)):
        make_policy("greedy")
    with pytest.raises(ValueError, match="k must be an int >= 0, got -1"):
        make_policy("fixed", k=-1)
    assert make_policy("fixed", k=3).budgets(states([0])) == [3]
    assert make_policy("none").budgets(states([0, 1])) == [0, 0] and isinstance(make_policy("none"), FixedBudget)


def test_das_is_the_priced_session_policy():
    """das: the class caps inside the priced allowance."""
    lat = LatencyModel(0.05, 2e-3)
    pol = make_policy("das", latency=lat)
    assert isinstance(pol, ForwardAllowance) and pol.latency == lat and pol.lengths is not None
    assert make_policy("das", caps=ClassCaps(0, 0, 0), latency=lat).budgets(states([0, 3])) == [0, 0]
