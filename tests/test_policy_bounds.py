"""Issue 26: the policy's per-problem state is bounded (the most recently recorded problems are kept), the
pooled length statistics stay exact under eviction, and abort forgets a request without learning from it."""

from __future__ import annotations

import numpy as np
import pytest

from dasrl.policy.acceptance import AcceptanceRate
from dasrl.policy.allowance import ClassCaps, ForwardAllowance
from dasrl.policy.base import RequestState
from dasrl.policy.length import LengthClassifier, LengthConfig


def state(rid, pid, generated=10, drafted=6, accepted=3):
    return RequestState(req_id=rid, problem_id=pid, prompt_len=4, max_new_tokens=64, generated=generated,
                        drafted=drafted, accepted=accepted)


def test_length_history_keeps_the_most_recent_problems():
    lc = LengthClassifier(LengthConfig(max_problems=3, history=2), max_len=100)
    for pid in range(10):
        lc.record(pid, 10 + pid)
    lc.record(7, 50)  # recorded again: now the most recent
    lc.record(10, 60)  # evicts 8, the least recently recorded
    assert lc.num_problems == 3
    assert [pid for pid, _ in lc.state_dict()["problems"]] == [9, 7, 10]
    assert lc.lengths(8).size == 0 and lc.lengths(7).tolist() == [17, 50]
    assert sorted(lc.pooled().tolist()) == [17, 19, 50, 60]
    assert lc.expected_length("unknown", 0) == pytest.approx(np.mean([17, 19, 50, 60]))  # the pooled mean


def test_loading_more_problems_than_the_bound_keeps_the_last_ones():
    src = LengthClassifier(LengthConfig(max_problems=100), max_len=100)
    for pid in range(20):
        src.record(f"p{pid}", pid)
    lc = LengthClassifier(LengthConfig(max_problems=5), max_len=100)
    lc.load_state_dict(src.state_dict())
    assert [p for p, _ in lc.state_dict()["problems"]] == [f"p{i}" for i in range(15, 20)]
    assert sorted(lc.pooled().tolist()) == list(range(15, 20))


@pytest.mark.parametrize("seed", range(5))
def test_pooled_statistics_equal_a_direct_computation_under_eviction(seed):
    """Thresholds (np.quantile), class probabilities and expected lengths from the incremental pooled
    counts equal those computed from scratch from the kept lengths, as problems and lengths are evicted."""
    rng = np.random.default_rng(seed)
    cfg = LengthConfig(max_problems=6, history=3, min_pooled=4)
    lc = LengthClassifier(cfg, max_len=500)
    for _ in range(200):
        lc.record(int(rng.integers(0, 15)), int(rng.integers(0, 3000 if rng.random() < 0.05 else 400)))
        pooled = np.sort(lc.pooled())
        if len(pooled) >= cfg.min_pooled:
            lo = max(int(np.ceil(np.quantile(pooled, cfg.q_short))), 1)
            hi = max(int(np.ceil(np.quantile(pooled, cfg.q_long))), lo + 1)
            assert lc.thresholds() == (lo, hi)
        g = int(rng.integers(0, 500))
        above = pooled[pooled >= g]
        if above.size:
            assert lc.expected_length("never seen", g) == pytest.approx(min(above.mean(), 500))
        pid = int(rng.integers(0, 15))
        lo, hi = lc.thresholds()
        own, pool = lc.lengths(pid), pooled
        counts = [np.array([(x[x >= g] < lo).sum(), ((x[x >= g] >= lo) & (x[x >= g] < hi)).sum(), (x[x >= g] >= hi).sum()],
                           float) for x in (own, pool)]
        if counts[1].sum() and (counts[0] + counts[1] / counts[1].sum()).sum():
            want = counts[0] + cfg.prior_weight * counts[1] / counts[1].sum()
            assert np.allclose(lc.probabilities(pid, g), want / want.sum())


def test_allowance_keeps_the_most_recent_problems():
    allowance = ForwardAllowance(ClassCaps(4, 4, 4), 16, acceptance=AcceptanceRate(max_problems=2))
    for pid in range(5):
        allowance.finish(state(("r", pid), pid))
    assert [p for p, _ in allowance.acceptance.state_dict()["problems"]] == [3, 4]  # the two most recent


def test_a_das_policy_stays_bounded_over_many_problems():
    policy = ForwardAllowance(ClassCaps(), 16, length_config=LengthConfig(max_problems=50),
                              acceptance=AcceptanceRate(max_problems=50))
    for pid in range(2000):
        s = state(("r", pid), pid, generated=10 + pid % 90)
        policy.budgets([s])
        policy.finish(s)
    assert policy.lengths.num_problems == 50
    assert len(policy.acceptance.state_dict()["problems"]) == 50


def test_abort_forgets_a_request_and_its_id_may_finish_later():
    policy = ForwardAllowance(ClassCaps(), 16)
    s = state(("r", 0), "p", generated=30, drafted=0, accepted=0)
    policy.budgets([s])
    s.drafted, s.accepted = 6, 3  # its last draft was verified, then its generate failed
    policy.abort(s)
    policy.end_step()  # a still-tracked request would be learnt from here
    assert policy.lengths.num_problems == 0 and policy.acceptance.state_dict()["problems"] == []
    again = state(("r", 0), "p", generated=12)  # the same id run again (a retried generate)
    policy.budgets([again])
    policy.finish(again)
    assert policy.lengths.lengths("p").tolist() == [12]


def test_max_problems_is_validated():
    with pytest.raises(ValueError, match="max_problems"):
        LengthConfig(max_problems=0)
    with pytest.raises(ValueError, match="max_problems"):
        AcceptanceRate(max_problems=0)
