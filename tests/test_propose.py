"""The shared propose -> cap -> trim path (dasrl.policy.propose), by hand."""

from __future__ import annotations

import numpy as np
import pytest

from dasrl.drafter.base import Draft
from dasrl.policy.base import FixedBudget, PolicyBase, RequestState
from dasrl.policy.propose import propose
from support.drafters import Fixed


class PerRow(PolicyBase):
    def __init__(self, caps):
        self.caps = caps

    def budgets(self, states):
        return list(self.caps)


class Halve(PerRow):
    trims = True

    def trim(self, states, drafts):
        return drafts.capped(drafts.lengths // 2)


def states(n):
    return [RequestState(req_id=i, problem_id="p", prompt_len=3, max_new_tokens=100) for i in range(n)]


def test_caps_are_min_of_budget_and_room_and_bind_the_drafter():
    d = Fixed({0: [1, 2, 3, 4, 5], 1: [6, 7, 8], 2: [9, 9]})
    out = propose(d, PerRow([4, 8, 2]), states(3), [0, 1, 2], room=[2, 8, -1], vocab_size=10)
    assert d.budgets == [[2, 8, 0]]  # min(budget, room), never negative
    assert out.offsets.tolist() == [0, 2, 5, 5]
    assert out.tokens.tolist() == [1, 2, 6, 7, 8]


def test_trim_runs_only_for_trimming_policies_and_is_capped():
    d = Fixed({0: [1, 2, 3, 4], 1: [5, 6]})
    assert propose(d, Halve([4, 1]), states(2), [0, 1], room=[9, 9]).lengths.tolist() == [2, 1]
    assert propose(d, PerRow([4, 1]), states(2), [0, 1], room=[9, 9]).lengths.tolist() == [4, 1]


def test_no_drafter_or_no_budget_drafts_nothing():
    d = Fixed({0: [1]})
    assert len(propose(None, FixedBudget(3), states(1), [0], room=[5])) == 1
    assert propose(d, FixedBudget(0), states(1), [0], room=[5]).lengths.tolist() == [0]
    assert d.budgets == []  # the drafter is not asked when every cap is 0


def test_bad_values_are_named():
    d = Fixed({0: [1], 1: [12]})
    with pytest.raises(ValueError, match=r"request 1 .*outside \[0, 10\) \(token 12\)"):
        propose(d, FixedBudget(2), states(2), [0, 1], room=[5, 5], vocab_size=10)
    assert propose(d, FixedBudget(2), states(2), [0, 1], room=[5, 5]).tokens.tolist() == [1, 12]  # no vocab: no check
    with pytest.raises(ValueError, match="returned 1 budgets for 2"):
        propose(d, PerRow([1]), states(2), [0, 1], room=[5, 5])
    with pytest.raises(ValueError, match="2 states, 1 req_ids"):
        propose(d, FixedBudget(1), states(2), [0], room=[5, 5])


def test_a_draft_prefix_by_hand():
    # A tree in best-first order: 5 <- root, 6 <- 5, 7 <- root, 8 <- 6. Its first three nodes are a tree.
    d = Draft(np.array([5, 6, 7, 8], np.int32), np.array([-1, 0, -1, 1], np.int32), np.array([.9, .8, .1, .7]), 3)
    p = d.prefix(3)
    assert p.tokens.tolist() == [5, 6, 7] and p.parents.tolist() == [-1, 0, -1] and p.match_len == 3
    assert d.prefix(4) is d and d.prefix(9) is d and len(d.prefix(0)) == 0


def test_drafter_base_derives_the_batch_calls_from_the_per_request_ones():
    """A drafter with only propose/observe (PromptLookup) gets propose_flat / observe_batch from DrafterBase:
    the flat batch holds exactly its Drafts, and observe_batch is observe per request."""
    from dasrl.drafter.base import Drafter, DraftBatch
    from support.drafters import PromptLookup

    a, b = PromptLookup(), PromptLookup()
    assert isinstance(a, Drafter)
    for d in (a, b):
        d.start("x", None, [1, 2, 3, 1, 2])
        d.start("y", None, [5, 6, 5])
    a.observe_batch(["x", "y"], [[3], [6]])
    b.observe("x", [3])
    b.observe("y", [6])
    flat = a.propose_flat(["x", "y"], [2, 2])
    per = b.propose(["x", "y"], [2, 2])
    assert isinstance(flat, DraftBatch) and flat.lengths.tolist() == [len(d) for d in per] == [2, 2]
    assert [flat.draft(i).tokens.tolist() for i in range(2)] == [d.tokens.tolist() for d in per] == [[1, 2], [5, 6]]


def test_engine_refuses_a_drafter_without_the_protocol():
    """An object with only propose/observe (no batch calls) is refused with a TypeError naming its type,
    before any work starts."""
    import pytest

    from dasrl.engine.engine import SpecEngine

    class Partial:
        def start(self, *a): ...
        def propose(self, *a): ...
        def observe(self, *a): ...
        def finish(self, *a): ...
        def abort(self, *a): ...
        def end_step(self): ...

    with pytest.raises(TypeError, match="Partial lacks the Drafter protocol"):
        SpecEngine.generate(object.__new__(SpecEngine), [[1, 2]], drafter=Partial())
