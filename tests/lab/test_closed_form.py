"""The paper's closed form, its (k, alpha) acceptance model and the lab's ablation policies
(dasrl_lab/policies.py), and the lab's registry over the library's."""

import math

import numpy as np
import pytest

from dasrl.drafter import Draft, DraftBatch
from dasrl.policy import ForwardAllowance, LatencyModel, RequestState, make_policy
from dasrl_lab.policies import (ALL_POLICIES, AcceptancePrior, AcceptanceStats, make_lab_policy, marginal_sum,
                                optimal_budgets, solve_n_fwd, trim_draft)


def forwards_needed(p, *, l, k, alpha):
    """N_i(p) of the closed form's model (the inverse of optimal_budgets), written out as the oracle."""
    return [li * (1 - (1 - math.exp(-alpha * pi / li)) / k) for pi, li in zip(p, l)]


def test_closed_form_hand_worked():
    # l=100, k=1, alpha=1, N=50: p = -100 ln(1 - 0.5) = 100 ln 2
    p = optimal_budgets(l=[100.0], k=1.0, alpha=1.0, n_fwd=50.0)
    assert p[0] == pytest.approx(100 * math.log(2))
    # k=2, alpha=2, N=75: p = -(100/2) ln(1 - 2*0.25) = 50 ln 2
    assert optimal_budgets(l=[100.0], k=2.0, alpha=2.0, n_fwd=75.0)[0] == pytest.approx(50 * math.log(2))
    # p* inverts the forwards curve
    assert forwards_needed(p, l=[100.0], k=1.0, alpha=1.0)[0] == pytest.approx(50.0)


def test_zero_for_short_requests_and_monotone_in_length():
    l = np.array([10, 50, 80, 100, 200, 400, 1000.0])
    p = optimal_budgets(l=l, k=1.2, alpha=0.8, n_fwd=80.0)
    assert np.all(p[l <= 80] == 0)
    assert np.all(p[l > 80] > 0)
    assert np.all(np.diff(p) >= 0)


def test_smaller_k_gives_less_budget():
    ks = [1.0, 1.1, 1.3, 1.6]
    ps = [optimal_budgets(l=[500.0], k=k, alpha=1.0, n_fwd=300.0)[0] for k in ks]
    assert all(a < b for a, b in zip(ps, ps[1:]))


def test_n_fwd_solve_satisfies_its_equation():
    rng = np.random.default_rng(1)
    l = rng.lognormal(6, 1, 64)
    k = rng.uniform(1.0, 1.6, 64)
    a = rng.uniform(0.3, 2.0, 64)
    c_base, c_tok = 0.02, 2e-4
    n = solve_n_fwd(l=l, k=k, alpha=a, c_base=c_base, c_tok=c_tok)
    assert 1 <= n < l.max()
    assert c_tok * marginal_sum(n, l=l, k=k, alpha=a) == pytest.approx(c_base, rel=1e-6)
    # and it minimises the step time c_base*N + c_tok*sum p(N)
    def cost(x):
        return c_base * x + c_tok * optimal_budgets(l=l, k=k, alpha=a, n_fwd=x).sum()
    assert cost(n) <= min(cost(n * 0.97), cost(n * 1.03)) + 1e-12


def test_n_fwd_edge_cases():
    # drafting too expensive: N = max length, no budgets
    n = solve_n_fwd(l=[100, 50], k=1.0, alpha=0.01, c_base=0.001, c_tok=1.0)
    assert n == 100 and optimal_budgets(l=[100, 50], k=1.0, alpha=0.01, n_fwd=n).sum() == 0
    # cheap drafting: N approaches the floor l(1-1/k) from above
    n = solve_n_fwd(l=[1000.0], k=2.0, alpha=1.0, c_base=1.0, c_tok=1e-9)
    assert 500 < n < 501
    with pytest.raises(ValueError, match=r"k\[1\]"):
        solve_n_fwd(l=[10, 20], k=[1.0, -1.0], alpha=1.0, c_base=1, c_tok=1)


def test_acceptance_estimate_prior_and_fit():
    st = AcceptanceStats()
    assert st.estimate("new") == (st.prior.k, st.prior.alpha)
    k, a = 1.1, 0.9
    for x in [0.2, 0.5, 1.0, 2.0, 4.0, 8.0] * 3:
        l = 1000
        acc = (1 - math.exp(-a * x)) / k
        st.record("p", length=l, drafted=int(x * l), accepted=int(acc * l))
    ke, ae = st.estimate("p")
    assert ke == pytest.approx(k, rel=0.1) and ae == pytest.approx(a, rel=0.2)
    st2 = AcceptanceStats()
    st2.load_state_dict(st.state_dict())
    assert st2.estimate("p") == (ke, ae)
    with pytest.raises(ValueError, match="accepted"):
        st.record("p", length=10, drafted=2, accepted=3)


def test_acceptance_stats_keep_the_most_recent_problems():
    acc = AcceptanceStats(AcceptancePrior(max_problems=2))
    for pid in range(5):
        acc.record(pid, length=10, drafted=4, accepted=2)
    assert [p for p, _ in acc.state_dict()["problems"]] == [3, 4]
    assert acc.estimate(0) == (AcceptancePrior().k, AcceptancePrior().alpha)  # forgotten: the prior


def test_acceptance_prior_max_problems_is_validated():
    with pytest.raises(ValueError, match="max_problems"):
        AcceptancePrior(max_problems=0)


def test_optimal_policy_gives_long_more():
    pol = make_lab_policy("optimal", latency=LatencyModel(0.02, 1e-4))
    for L in [100, 110, 90]:
        pol.lengths.record("short", L)
    for L in [5000, 6000, 5500]:
        pol.lengths.record("long", L)
    st = [RequestState(i, p, 5, 8000) for i, p in enumerate(["short", "long", "long"])]
    b = pol.budgets(st)
    assert b[0] == 0 and b[1] > 0 and b[1] == b[2]


def test_confidence_trim_tree():
    d = Draft(np.array([1, 2, 3, 4], np.int32), np.array([-1, 0, 0, 1], np.int32),
              np.array([0.9, 0.2, 0.6, 0.5]), 3)
    t = trim_draft(d, 0.4)
    assert list(t.tokens) == [1, 3] and list(t.parents) == [-1, 0]
    chain = Draft.chain([5, 6, 7], [0.9, 0.5, 0.1])
    pol = make_lab_policy("confidence", threshold=0.3, cap=8)
    assert pol.budgets([RequestState(i, "a", 5, 1000) for i in range(2)]) == [8, 8]
    got = pol.trim([], DraftBatch.from_drafts([chain, Draft.empty()])).drafts()
    assert [list(x.tokens) for x in got] == [[5, 6], []]


def test_lab_registry_errors():
    with pytest.raises(ValueError, match="valid policies: " + ", ".join(ALL_POLICIES)):
        make_lab_policy("greedy")
    with pytest.raises(ValueError, match="'unbounded': bad arguments"):
        make_lab_policy("unbounded", bogus=1)
    assert make_lab_policy("unbounded").budgets([RequestState(0, "a", 5, 1000)]) == [256]


def test_the_labs_das_is_the_librarys():
    """The library's das and the lab's das are one object kind: the class caps inside the priced allowance."""
    lat = LatencyModel(0.05, 2e-3)
    for pol in (make_policy("das", latency=lat), make_lab_policy("das", latency=lat)):
        assert isinstance(pol, ForwardAllowance) and pol.latency == lat and pol.lengths is not None
