import math

import pytest

from dasrl.policy.allowance import ForwardAllowance, allowance_for, justified_length, pace_draft, tokens_per_forward
from dasrl.policy.base import FixedBudget, RequestState
from dasrl.policy.budget import DASPolicy
from dasrl.policy.latency import LatencyModel

LAT = LatencyModel(0.05, 0.0025)


def _state(i, generated, cls="long", problem=0):
    s = RequestState(req_id=i, problem_id=problem, prompt_len=5, max_new_tokens=100, generated=generated)
    s.classes.append(cls)
    return s


def test_allowance_levels_rows_to_the_critical_path():
    pol = ForwardAllowance(FixedBudget(8), max_tokens=12)
    # No length history: the partial length stands for the remaining one (10, 40, 20, 30); prior p = 0.6.
    # The row at 40 is critical: it drafts its best, 8, and needs H = 40 / E(8) forwards, E(8) = 2.4748.
    # The others must make r / H tokens per forward: 30 -> 1.856 needs k = 2 (E(2) = 1.96), 20 -> 1.237
    # needs k = 1 (E(1) = 1.6), 10 -> 0.62 needs nothing. 8 + 2 + 1 = 11 <= 12.
    assert pol.budgets([_state(i, g) for i, g in enumerate([10, 40, 20, 30])]) == [0, 8, 1, 2]
    # A tighter allowance is spent on the critical row first: 8, then 2, then nothing is left.
    tight = ForwardAllowance(FixedBudget(8), max_tokens=10)
    assert tight.budgets([_state(i, g) for i, g in enumerate([10, 40, 20, 30])]) == [0, 8, 0, 2]
    assert pol.budgets([_state(0, 50)]) == [8]  # a lone straggler: its full cap
    assert ForwardAllowance(FixedBudget(8), max_tokens=0).budgets([_state(0, 5)]) == [0]


def test_tokens_per_forward_and_pace_by_hand():
    assert tokens_per_forward([0, 1, 2], [0.5, 0.5, 0.5]).tolist() == [1.0, 1.5, 1.75]
    assert tokens_per_forward([3], [1.0]).tolist() == [4.0]
    # 100 tokens in at most 40 forwards at p = 0.5 needs 2.5 tokens per forward: above 1/(1-p) = 2, out of
    # reach, so the row drafts its best; 60 tokens need 1.5 (k = 1); 30 need less than 1 (k = 0).
    assert pace_draft([100, 60, 30], [0.5, 0.5, 0.5], horizon=40, most=[6, 6, 6]).tolist() == [6, 1, 0]
    assert pace_draft([100], [1.0], horizon=40, most=[6]).tolist() == [2]  # p = 1: k + 1 >= 2.5


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
