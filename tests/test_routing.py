"""Routing problems to rollout workers: hand-worked assignments (the simulated makespan over many workers is the
lab's: tests/lab/test_sim.py)."""

from __future__ import annotations

import pytest

from dasrl.policy.latency import LatencyModel
from dasrl.rollout.routing import _Group, _LengthAwareRouter, _RandomRouter, _RoundRobinRouter, groups_of, make_router

LAT = LatencyModel(c_base=0.02, c_tok=20e-6)


def test_groups_keep_first_appearance_order():
    assert groups_of([7, 7, 3, 7, 3, 9]) == [_Group(7, 3), _Group(3, 2), _Group(9, 1)]


def test_round_robin_turn_carries_over():
    r = _RoundRobinRouter()
    assert r.assign([_Group("a", 2), _Group("b", 2), _Group("c", 2)], [0, 1]) == {"a": 0, "b": 1, "c": 0}
    assert r.assign([_Group("a", 2)], [0, 1]) == {"a": 1}


def test_random_is_seeded_and_restorable():
    groups = [_Group(i, 1) for i in range(20)]
    a, b = _RandomRouter(3), _RandomRouter(3)
    assert a.assign(groups, [0, 1, 2]) == b.assign(groups, [0, 1, 2])
    state = a.state_dict()
    c = _RandomRouter(99)
    c.load_state_dict(state)
    assert c.assign(groups, [0, 1, 2]) == a.assign(groups, [0, 1, 2])


def test_length_router_interleaves_the_long_problems():
    r = _LengthAwareRouter(latency=LAT, max_len=4096)
    for pid, n in (("long1", 3000), ("long2", 2900), ("s1", 100), ("s2", 120), ("s3", 90), ("s4", 110)):
        r.observe(pid, [n] * 4)
    # arrival order puts both long problems on worker 0 under round robin; LPT splits them
    where = r.assign([_Group(p, 4) for p in ("long1", "s1", "long2", "s2", "s3", "s4")], [0, 1])
    assert where["long1"] != where["long2"]
    rr = _RoundRobinRouter().assign([_Group(p, 4) for p in ("long1", "s1", "long2", "s2", "s3", "s4")], [0, 1])
    assert rr["long1"] == rr["long2"]


def test_length_router_keeps_a_problem_home_when_moving_saves_little():
    r = _LengthAwareRouter(latency=LAT, max_len=4096, affinity_slack=0.05)
    r.observe("a", [1000] * 4)
    r.observe("b", [1000] * 4)
    first = r.assign([_Group("a", 4), _Group("b", 4)], [0, 1])
    assert sorted(first.values()) == [0, 1]
    # a third worker appears: moving a problem there saves nothing, so both stay home
    assert r.assign([_Group("a", 4), _Group("b", 4)], [0, 1, 2]) == first


def test_length_router_without_history_balances_counts():
    where = _LengthAwareRouter(latency=LAT, max_len=512).assign([_Group(i, 2) for i in range(6)], [0, 1, 2])
    assert sorted(list(where.values()).count(w) for w in range(3)) == [2, 2, 2]


def test_router_state_round_trips():
    r = _LengthAwareRouter(latency=LAT, max_len=4096)
    r.observe(1, [10, 20])
    r.assign([_Group(1, 2)], [0, 1])
    back = _LengthAwareRouter(latency=LAT, max_len=4096)
    back.load_state_dict(r.state_dict())
    assert back.predict(1) == r.predict(1) and back.home == r.home


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="unknown router 'fastest'"):
        make_router("fastest", latency=LAT, max_len=10)
    with pytest.raises(ValueError, match="no live workers"):
        _RoundRobinRouter().assign([_Group(1, 1)], [])
    with pytest.raises(ValueError, match="appears twice"):
        _RoundRobinRouter().assign([_Group(1, 1), _Group(1, 2)], [0])
