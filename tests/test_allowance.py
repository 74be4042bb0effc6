import math

import numpy as np
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from dasrl.policy.acceptance import AcceptanceRate
from dasrl.drafter.base import Draft, DraftBatch
from dasrl.policy.allowance import _CALIB_PRIOR, ClassCaps, ForwardAllowance, _pace_draft, _tokens_per_forward
from dasrl.policy.base import RequestState
from dasrl.policy.latency import LatencyModel
from support.rowwise_policy import priced_draft

LAT = LatencyModel(0.05, 0.0025)


def _state(i, generated, problem=0):
    return RequestState(req_id=i, problem_id=problem, prompt_len=5, max_new_tokens=100, generated=generated)


def _left(i, remaining):
    """A row predicted to have `remaining` tokens to come: with no length history at all its expected length
    is the midpoint of its partial length g and the length limit (100), so it has (100 - g) / 2 left."""
    return _state(i, 100 - 2 * remaining)


def _caps(k):
    return ClassCaps(k, k, k)


def test_allowance_levels_rows_to_the_critical_path():
    pol = ForwardAllowance(_caps(8), max_tokens=12)
    # Remaining lengths 10, 40, 20, 30 (no history: _left); prior p = 0.6.
    # The row at 40 is critical: it drafts its best, 8, and needs H = 40 / E(8) forwards, E(8) = 2.4748.
    # The others must make r / H tokens per forward: 30 -> 1.856 needs k = 2 (E(2) = 1.96), 20 -> 1.237
    # needs k = 1 (E(1) = 1.6), 10 -> 0.62 needs nothing. 8 + 2 + 1 = 11 <= 12.
    assert pol.budgets([_left(i, r) for i, r in enumerate([10, 40, 20, 30])]) == [0, 8, 1, 2]
    # A tighter allowance is spent on the critical row first: 8, then 2, then nothing is left.
    tight = ForwardAllowance(_caps(8), max_tokens=10)
    assert tight.budgets([_left(i, r) for i, r in enumerate([10, 40, 20, 30])]) == [0, 8, 0, 2]
    assert pol.budgets([_left(0, 50)]) == [8]  # a lone straggler: its full cap
    assert ForwardAllowance(_caps(8), max_tokens=0).budgets([_left(0, 5)]) == [0]


def test_tokens_per_forward_and_pace_by_hand():
    assert _tokens_per_forward([0, 1, 2], [0.5, 0.5, 0.5]).tolist() == [1.0, 1.5, 1.75]
    assert _tokens_per_forward([3], [1.0]).tolist() == [4.0]
    # 100 tokens in at most 40 forwards at p = 0.5 needs 2.5 tokens per forward: above 1/(1-p) = 2, out of
    # reach, so the row drafts its best; 60 tokens need 1.5 (k = 1); 30 need less than 1 (k = 0).
    assert _pace_draft([100, 60, 30], [0.5, 0.5, 0.5], horizon=40, most=[6, 6, 6]).tolist() == [6, 1, 0]
    assert _pace_draft([100], [1.0], horizon=40, most=[6]).tolist() == [2]  # p = 1: k + 1 >= 2.5


def test_history_ranks_by_predicted_remaining_length():
    pol = ForwardAllowance(max_tokens=30)
    for _ in range(4):
        pol.lengths.record("short", 10)
        pol.lengths.record("long", 90)
    states = [_state(0, 5, problem="short"), _state(1, 5, problem="long")]
    caps = pol.budgets(states)
    assert states[1].classes[-1] == "long" and caps[1] == pol.caps.long and caps[0] == 0


def test_priced_draft_by_hand():
    # (share + row + c_tok d + [d > 0] kv) / E(d, p), E(d, 0.5) = 2 - 0.5^d. A row carrying the forward
    # (share 0.05): d = 0..4 cost 0.0525, 0.0367, 0.0329, 0.0320, 0.0323 per token -> 3.
    price = dict(row=0.0025, c_tok=0.0025)
    assert priced_draft([0.5], [6], share=0.05, kv=0.0, **price).tolist() == [3]
    # Alone (share 0) it pays only for itself: d = 1 costs 0.005 / 1.5 > 0.0025 -> plain decoding.
    assert priced_draft([0.5], [6], share=0.0, kv=0.0, **price).tolist() == [0]
    # A fixed cost of drafting at all (kv 0.02) is spread over longer drafts: 0.0525, 0.05, 0.0443,
    # 0.04267, 0.04258, 0.04317 -> 4.
    assert priced_draft([0.5], [6], share=0.05, kv=0.02, **price).tolist() == [4]
    assert priced_draft([0.0, 1.0, 0.5], [6, 6, 2], share=0.05, kv=0.0, **price).tolist() == [0, 6, 2]
    assert priced_draft([], [], share=0.05, kv=0.0, **price).tolist() == []


@settings(max_examples=200, deadline=None)
@given(p=st.floats(0, 1), most=st.integers(0, 40), share=st.floats(0, 0.1), row=st.floats(1e-4, 0.01),
       kv=st.floats(0, 0.02), c_tok=st.floats(1e-5, 0.01))
def test_priced_draft_is_the_cheapest_per_token(p, most, share, row, kv, c_tok):
    def per_token(d):  # the price, summed term by term
        return (share + row + c_tok * d + (kv if d else 0.0)) / sum(p ** j for j in range(d + 1))
    d = int(priced_draft([p], [most], share=share, row=row, kv=kv, c_tok=c_tok)[0])
    assert 0 <= d <= most
    assert all(per_token(d) <= per_token(e) * (1 + 1e-9) for e in range(most + 1))


def test_a_lone_row_carries_the_forward_and_alike_rows_do_not_draft():
    # One row: it is the critical path, carries all of c_base and drafts its priced best at the prior p.
    pol = ForwardAllowance(_caps(16), max_tokens=64, latency=LAT)
    assert pol.budgets([_left(0, 50)]) == priced_draft([0.6], [16], share=0.05, row=0.0025, kv=0.0, c_tok=0.0025).tolist() == [4]
    # 32 rows alike: all of them must speed up to shorten the step, each carries c_base / 32 and none of them
    # pays for a draft.
    pol = ForwardAllowance(_caps(16), max_tokens=64, latency=LAT)
    assert pol.budgets([_left(i, 50) for i in range(32)]) == [0] * 32
    # The collapsed tail: one row far ahead of 31 short ones drafts alone, as if alone.
    pol = ForwardAllowance(_caps(16), max_tokens=64, latency=LAT)
    assert pol.budgets([_left(0, 50)] + [_left(i, 5) for i in range(1, 32)]) == [4] + [0] * 31


def test_low_acceptance_stops_drafting_and_the_problem_is_probed_again():
    pol = ForwardAllowance(_caps(16), max_tokens=64, latency=LAT)
    s = _left(0, 50)
    assert pol.budgets([s]) == [4]
    for _ in range(50):  # every draft rejected at its first token, until drafts stop paying
        cap = pol.budgets([s])[0]
        if not cap:
            break
        s.drafted += cap
    assert cap == 0 and pol.acceptance_rate(s) < 0.1  # a lone row pays for a 1-token draft at p > 0.05
    pol.finish(s)
    for _ in range(6):  # the problem's counts halve at every step end: back towards the prior
        pol.end_step()
    assert pol.budgets([_left(1, 50)]) == [4]


def test_acceptance_is_a_geometric_rate():
    pol = ForwardAllowance(_caps(64), max_tokens=64, latency=LAT)
    s = _left(0, 50)
    pol.budgets([s])
    s.drafted, s.accepted = 10, 10  # the whole draft was accepted: no rejection
    caps = pol.budgets([s])
    run = (10 + 0.6 * 8) / 18  # the run's counts pulled to the prior by 8 pseudo-tokens
    problem = (10 + run * 8) / 18  # the problem's, pulled to the run's
    assert pol.acceptance_rate(s) == pytest.approx((10 + problem * 8) / 18)
    assert caps == priced_draft([pol.acceptance_rate(s)], [64], share=0.05, row=0.0025, kv=0.0, c_tok=0.0025).tolist()
    assert caps[0] > 4
    before = pol.acceptance_rate(s)
    s.drafted, s.accepted = 20, 10  # the next draft of 10 was rejected at its first token
    pol.budgets([s])
    run = (10 + 0.6 * 8) / 19  # 10 accepted, 1 rejection
    problem = (10 + run * 8) / 19
    assert pol.acceptance_rate(s) == pytest.approx((10 + problem * 8) / 19) and pol.acceptance_rate(s) < before


def test_spending_is_logged_per_class():
    pol = ForwardAllowance(_caps(8), max_tokens=20)
    for _ in range(4):  # thresholds: medium from 60, long from 95
        pol.lengths.record("short", 10)
        pol.lengths.record("medium", 60)
        pol.lengths.record("long", 95)
    a, b = _state(0, 30, "long"), _state(1, 30, "medium")
    assert pol.budgets([a, b]) == [8, 1] and (a.classes, b.classes) == (["long"], ["medium"])  # drafting rows
    a.drafted, b.drafted = 8, 3
    pol.finish(b)
    pol.budgets([a])
    assert pol.take_spent() == {"long": 8, "medium": 3}
    assert pol.take_spent() == {}


def test_acceptance_rate_by_hand_and_its_state():
    acc = AcceptanceRate(prior_p=0.6, prior_tokens=8, decay=0.5)
    assert acc.rate("r", "p") == 0.6  # nothing seen: the prior
    acc.record("r", "p", drafted=4, accepted=4)  # accepted whole: no rejection
    acc.record("r", "p", drafted=4, accepted=1)  # rejected at its second token
    run = (5 + 0.6 * 8) / (5 + 1 + 8)  # 0.7: every problem's counts, pulled to the prior
    problem = (5 + run * 8) / (5 + 1 + 8)
    assert acc.rate("r", "p") == pytest.approx((5 + problem * 8) / (5 + 1 + 8))
    assert acc.rate("s", "p") == pytest.approx(problem)  # a sibling starts from its problem
    assert acc.rate("t", "q") == pytest.approx(run)  # a problem never drafted starts from the run's rate
    acc.idle("r")  # a forward without a draft: r's own counts age by row_decay (0.99): (4.95, 0.99)
    assert acc.rate("r", "p") == pytest.approx((4.95 + problem * 8) / (4.95 + 0.99 + 8))
    acc.end_step()  # rows forgotten, counts halve: (2.5, 0.5) for the problem and the run
    run = (2.5 + 0.6 * 8) / (3 + 8)
    assert acc.rate("r", "p") == pytest.approx((2.5 + run * 8) / (3 + 8))
    again = AcceptanceRate()
    again.load_state_dict(acc.state_dict())
    assert again.rate("x", "p") == acc.rate("x", "p")
    for bad in ({"problems": [[1, "x"]]}, {"problems": [[[1], [1, 1]]]}, {"problems": [["p", [-1, 0]]]},
                {"problems": [["p", [float("nan"), 0]]]}, {"problems": [], "run": [1]}, {"problems": [], "run": "x"},
                {"problems": [], "run": [-1, 0]}):
        with pytest.raises(ValueError, match="acceptance state"):
            AcceptanceRate().load_state_dict(bad)


def test_the_critical_group_shares_the_fixed_cost_of_drafting():
    # c_draft = 20 ms is paid once by a forward in which any row drafts. A lone row carries it and c_base:
    # (0.0525 + 0.0025 d + 0.02) / E(d, 0.6) is lowest at d = 5 (d = 4: 0.03578, 5: 0.03566, 6: 0.03600).
    lat = LatencyModel(0.05, 0.0025, c_draft=0.02)
    price = dict(row=0.0025, c_tok=0.0025)
    assert ForwardAllowance(_caps(16), latency=lat).budgets([_left(0, 50)]) == [5]
    assert priced_draft([0.6], [16], share=0.05, kv=0.02, **price).tolist() == [5]
    # Two alike rows must both speed up to shorten the step: each carries half of c_base and of c_draft.
    assert ForwardAllowance(_caps(16), latency=lat).budgets([_left(0, 50), _left(1, 50)]) == [4, 4]
    assert priced_draft([0.6], [16], share=0.025, kv=0.01, **price).tolist() == [4]
    # A cap, when given, is spent critical row first.
    assert ForwardAllowance(_caps(16), 6, latency=lat).budgets([_left(0, 50), _left(1, 50)]) == [4, 2]


def _trim_spec(pol, states, drafts):
    """The trim row by row (the loop the batched trim replaced): each draft's prefix with the fewest expected
    seconds per emitted token, node i accepted with probability min(path probability x calibration, 1)."""
    a, x = pol._calib
    calib = (a + _CALIB_PRIOR) / (x + _CALIB_PRIOR)
    q = np.minimum(drafts.probs * calib, 1.0)
    keep, expected = drafts.lengths.copy(), {}
    price = {}
    if pol._prices is not None:  # the last priced batch: its keys, [B] each row's share, own cost and extra cost
        keys, *cols = pol._prices
        price = dict(zip(keys, zip(*(c.tolist() for c in cols))))
    for b, s in enumerate(states):
        lo, hi = int(drafts.offsets[b]), int(drafts.offsets[b + 1])
        if hi == lo or s.req_id not in price:
            continue
        share, row, kv = price[s.req_id]
        n = np.arange(hi - lo + 1)
        cost = (share + row + pol.latency.c_tok * n + kv * (n > 0)) / (1.0 + np.concatenate([[0.0], np.cumsum(q[lo:hi])]))
        keep[b] = int(np.argmin(cost))
        if keep[b]:
            expected[s.req_id] = float(q[lo:lo + keep[b]].sum() / calib)
    return keep, expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.lists(st.floats(0.0, 1.0), max_size=12)), min_size=1, max_size=8),
       st.floats(0.001, 0.1), st.floats(1e-5, 0.01), st.floats(0.0, 50.0), st.floats(0.0, 50.0))
def test_the_batched_trim_equals_the_row_by_row_spec(rows, c_base, c_tok, accepted, expected):
    pol = ForwardAllowance(latency=LatencyModel(c_base, c_tok))
    states = [_state(i, g) for i, (g, _) in enumerate(rows)]
    pol.budgets(states)
    pol._calib = [accepted, expected]
    drafts = DraftBatch.from_drafts([Draft.chain(np.arange(len(ps)), np.array(sorted(ps, reverse=True)), match_len=1)
                                     for _, ps in rows])
    want_keep, want_expected = _trim_spec(pol, states, drafts)
    got = pol.trim(states, drafts)
    assert got.lengths.tolist() == want_keep.tolist()
    assert pol._expected == want_expected
