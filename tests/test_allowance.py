import math

import pytest

from dasrl.policy.allowance import ForwardAllowance, allowance_for, justified_length
from dasrl.policy.base import FixedBudget, RequestState
from dasrl.policy.budget import DASPolicy
from dasrl.policy.latency import LatencyModel

LAT = LatencyModel(0.05, 0.0025)


def _state(i, generated, cls="long", problem=0):
    s = RequestState(req_id=i, problem_id=problem, prompt_len=5, max_new_tokens=100, generated=generated)
    s.classes.append(cls)
    return s


def test_allowance_goes_to_the_longest_rows_first():
    pol = ForwardAllowance(FixedBudget(8), max_tokens=12)
    # No length history: the partial length ranks them (40, 30, 20, 10); 8 + 4 = 12.
    assert pol.budgets([_state(i, g) for i, g in enumerate([10, 40, 20, 30])]) == [0, 8, 0, 4]
    assert pol.budgets([_state(0, 50)]) == [8]  # a lone straggler: its full cap
    assert ForwardAllowance(FixedBudget(8), max_tokens=0).budgets([_state(0, 5)]) == [0]


def test_history_ranks_by_predicted_remaining_length():
    inner = DASPolicy()
    for _ in range(4):
        inner.lengths.record("short", 10)
        inner.lengths.record("long", 90)
    pol = ForwardAllowance(inner, max_tokens=30)
    states = [_state(0, 5, problem="short"), _state(1, 5, problem="long")]
    caps = pol.budgets(states)
    assert states[1].classes[-1] == "long" and caps[1] == inner.caps.long and caps[0] == 0


def test_justified_length_by_hand():
    # p^j * t_fwd >= c_tok: j <= ln(0.0025 / 0.0525) / ln(p)
    assert justified_length(0.9, t_fwd=0.0525, c_tok=0.0025) == int(math.log(0.0025 / 0.0525) / math.log(0.9)) == 28
    assert justified_length(0.5, t_fwd=0.0525, c_tok=0.0025) == 4
    assert justified_length(0.0, t_fwd=0.0525, c_tok=0.0025) == 0
    assert justified_length(1.0, t_fwd=0.0525, c_tok=0.0025) > 10**5


def test_acceptance_is_a_geometric_rate_and_caps_the_draft():
    pol = ForwardAllowance(FixedBudget(64), max_tokens=64, latency=LAT, prior_p=0.6, prior_tokens=8)
    s = _state(0, 50)
    assert pol.budgets([s]) == [justified_length(0.6, t_fwd=0.0525, c_tok=0.0025)]  # the prior: 5
    s.drafted, s.accepted = 10, 10  # the whole draft was accepted: no rejection
    caps = pol.budgets([s])
    problem = (10 + 0.6 * 8) / 18
    assert pol.acceptance_rate(s) == pytest.approx((10 + problem * 8) / 18)
    assert caps == [justified_length(pol.acceptance_rate(s), t_fwd=0.0525, c_tok=0.0025)] and caps[0] > 5
    before = pol.acceptance_rate(s)
    s.drafted, s.accepted = 20, 10  # the next draft of 10 was rejected at its first token
    pol.budgets([s])
    problem = (10 + 0.6 * 8) / 19  # 10 accepted, 1 rejection
    assert pol.acceptance_rate(s) == pytest.approx((10 + problem * 8) / 19) and pol.acceptance_rate(s) < before


def test_spending_is_logged_per_class():
    pol = ForwardAllowance(FixedBudget(8), max_tokens=20)
    a, b = _state(0, 30, "long"), _state(1, 20, "medium")
    pol.budgets([a, b])
    a.drafted, b.drafted = 8, 3
    pol.finish(b)
    pol.budgets([a])
    assert pol.take_spent() == {"long": 8, "medium": 3}
    assert pol.take_spent() == {}


def test_allowance_is_c_base_over_c_tok():
    assert allowance_for(LatencyModel(0.05, 0.0025)) == 20
    assert allowance_for(LatencyModel(0.02, 0.0)) > 10**5
