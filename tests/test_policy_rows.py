"""The priced policy with its state in arrays (ForwardAllowance, AcceptanceRate) against the row-by-row
spec it replaced (support.rowwise_policy): the same budgets, trims, spending, calibration and acceptance
state, float for float, over random runs -- through `budgets(states)` and through `budgets_rows` (the vLLM
proposer's path, which may settle a step with `nothing_pays` before pricing)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dasrl.drafter.base import Draft, DraftBatch
from dasrl.integrations.vllm.tracker import match_capped
from dasrl.policy.allowance import ClassCaps, ForwardAllowance, RowBatch, _pace_draft
from dasrl.policy.base import RequestState
from dasrl.policy.latency import LatencyModel
from dasrl.policy.length import LengthClassifier, LengthConfig
from support.rowwise_policy import RowwiseAllowance, RowwiseClasses
from support.rowwise_policy import pace_draft as rowwise_pace


def _latency(draw) -> LatencyModel | None:
    kind = draw(st.sampled_from(["h100", "cpu", "random", "none"]))
    if kind == "none":
        return None
    if kind == "h100":  # the 7B-H100 profile's shape: c_tok / c_base ~ 0.004, nothing per drafting forward
        return LatencyModel(0.00628, 2.38e-5, 2.14e-8)
    if kind == "cpu":
        return LatencyModel(0.06, 0.0025, 2e-6, 1e-6, 0.02)
    c_base = draw(st.floats(1e-4, 0.1))
    return LatencyModel(c_base, c_base * draw(st.floats(1e-5, 0.3)), draw(st.floats(0, 1e-5)),
                        draw(st.floats(0, 1e-5)), draw(st.floats(0, 0.05)))


class Twin:
    """The same run on the batched policy and on the row-by-row spec, states kept apart (the policy appends
    classes to the states it sees)."""

    def __init__(self, latency, caps, lengths, max_tokens, batched: bool) -> None:
        self.new = ForwardAllowance(caps, max_tokens, latency=latency, lengths=lengths())
        self.old = RowwiseAllowance(RowwiseClasses(caps, lengths=lengths()), max_tokens, latency=latency)
        self.batched = batched
        self.live: dict = {}  # key -> (new state, old state)
        self.serial = 0

    def start(self, problem, prompt_len, max_new, generated=0):
        self.serial += 1
        key = ("r", self.serial)
        s = RequestState(key, problem, prompt_len, max_new, generated=generated)
        self.live[key] = (s, copy.deepcopy(s))
        return key

    def budgets(self):
        pairs = list(self.live.values())
        new_states, old_states = [p[0] for p in pairs], [p[1] for p in pairs]
        want = self.old.budgets(old_states)
        if self.batched:
            got = self.new.budgets_rows(RowBatch.of(new_states)).tolist()
        else:
            got = self.new.budgets(new_states)
        assert got == want
        return want

    def trim(self, keys, drafts, factor):
        """The proposer's cut: each draft to factor x its match length (vLLM's max_spec_factor), then trimmed."""
        pairs = [self.live[k] for k in keys]
        want = self.old.trim([p[1] for p in pairs], match_capped(drafts, factor))
        if self.batched:
            at = {k: i for i, k in enumerate(self.live)}
            got = self.new.trim_rows(np.array([at[k] for k in keys], np.int64), drafts, factor)
        else:
            got = self.new.trim([p[0] for p in pairs], match_capped(drafts, factor)).lengths
        assert got.tolist() == want.lengths.tolist()
        return want

    def update(self, key, **kw):
        for s in self.live[key]:
            for k, v in kw.items():
                setattr(s, k, getattr(s, k) + v)

    def finish(self, key):
        a, b = self.live.pop(key)
        self.new.finish(a)
        self.old.finish(b)

    def abort(self, key):
        a, b = self.live.pop(key)
        self.new.abort(a)
        self.old.abort(b)

    def end_step(self):
        if self.batched:  # the proposer's discipline: requests in flight are aborted, carry on as new ones
            carried = []
            for key in list(self.live):
                s = self.live[key][0]
                carried.append((s.problem_id, s.prompt_len, s.max_new_tokens, s.generated))
                self.abort(key)
        self.new.end_step()
        self.old.end_step()
        if self.batched:
            for c in carried:
                self.start(*c)

    def check(self):
        n, o = self.new, self.old
        assert n._calib == o._calib
        assert n._expected == o._expected
        assert n.take_spent() == o.take_spent()
        assert n.acceptance.state_dict() == {"problems": [[k, [float(a), float(r)]] for k, (a, r) in
                                                          o.acceptance._problem.items()], "run": o.acceptance._run}
        for a, b in self.live.values():
            assert n.acceptance_rate(a) == o.acceptance_rate(b)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_array_policy_equals_the_row_by_row_spec(data):
    draw = data.draw
    latency = _latency(draw)
    batched = draw(st.booleans())
    equal = batched or draw(st.booleans())
    k = draw(st.sampled_from([24, 24, 0, 3, 16]))
    caps = ClassCaps(k, k, k) if equal else ClassCaps(*draw(st.tuples(*[st.integers(0, 12)] * 3)))
    cfg = LengthConfig(history=draw(st.integers(1, 8)), min_pooled=draw(st.integers(1, 8)))
    lengths = lambda: LengthClassifier(cfg, max_len=400)  # noqa: E731
    max_tokens = None if batched else draw(st.sampled_from([None, None, 5, 40]))
    factor = draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.5]))
    t = Twin(latency, caps, lengths, max_tokens, batched)
    problems = draw(st.integers(1, 4))
    # some history first, so that lengths, classes and acceptance differ by problem
    for _ in range(draw(st.integers(0, 12))):
        k = t.start(draw(st.integers(0, problems - 1)), 10, 400, generated=draw(st.integers(1, 300)))
        t.finish(k)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    for _ in range(draw(st.integers(1, 4))):
        t.start(draw(st.integers(0, problems - 1)), draw(st.integers(1, 40)), draw(st.sampled_from([60, 400])))
    for step in range(draw(st.integers(1, 25))):
        if not t.live:
            break
        budgets = t.budgets()
        keys = list(t.live)
        drafting = [k for k, b in zip(keys, budgets) if b > 0]
        if drafting:
            drafts = DraftBatch.from_drafts([Draft.chain(np.arange(b), np.sort(rng.random(b))[::-1] ** 0.5,
                                                         match_len=int(rng.integers(0, 12))) for b in budgets if b > 0])
            trimmed = t.trim(drafting, drafts, factor) if (latency is not None) else drafts
            for k, n in zip(drafting, trimmed.lengths.tolist()):
                acc = int(rng.integers(0, n + 1))
                t.update(k, drafted=n, accepted=acc, generated=acc)
        for k in keys:
            t.update(k, generated=1, forwards=1)
        op = draw(st.sampled_from(["none", "none", "finish", "abort", "join", "end"]))
        if op == "finish" and t.live:
            t.finish(draw(st.sampled_from(list(t.live))))
        elif op == "abort" and t.live:
            t.abort(draw(st.sampled_from(list(t.live))))
        elif op == "join":
            t.start(draw(st.integers(0, problems - 1)), draw(st.integers(1, 40)), 400)
        elif op == "end":
            t.end_step()
        for k in [k for k, (s, _) in t.live.items() if s.generated >= s.max_new_tokens]:
            t.finish(k)
        t.check()
    event(f"settled before pricing: {t.new.skipped > 0}")
    event(f"drafted: {t.new.acceptance.problems.version > 0}")


def test_a_large_batch_at_gpu_prices_is_settled_before_pricing():
    """At B = 256 alike rows on the 7B-H100 profile and a low acceptance nothing pays: `nothing_pays` says so
    (no price table built) and the budgets are the spec's zeros; a lone straggler still drafts."""
    lat = LatencyModel(0.00628, 2.38e-5, 2.14e-8)
    lengths = LengthClassifier(max_len=400)
    for _ in range(8):
        lengths.record("p", 200)
    pol = ForwardAllowance(latency=lat, lengths=lengths)
    for i in range(8):  # this problem's drafts were rejected: p = 0.15
        pol.acceptance.record(("old", i), "p", drafted=8, accepted=0)
    states = [RequestState(("r", i), "p", 60, 400, generated=50) for i in range(256)]
    assert pol.budgets_rows(RowBatch.of(states)).tolist() == [0] * 256 and pol.skipped == 1
    states.append(RequestState(("late", 0), "p", 60, 400, generated=0))  # 50 tokens behind the rest
    out = pol.budgets_rows(RowBatch.of(states))
    assert out[-1] > 0 and pol.skipped == 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 500), st.floats(0, 1), st.integers(0, 30)), min_size=1, max_size=20),
       st.floats(0.5, 600))
def test_pace_draft_equals_the_row_by_row_loop(rows, horizon):
    """(_pace_draft loops over the rows that may draft only; the native split repeats it: the spec test above)"""
    rem, p, most = (np.array(x) for x in zip(*rows))
    assert _pace_draft(rem, p, horizon=horizon, most=most).tolist() == rowwise_pace(rem, p, horizon=horizon, most=most).tolist()


def test_budgets_rows_needs_equal_class_caps():
    pol = ForwardAllowance(ClassCaps(0, 4, 8))
    with pytest.raises(TypeError, match="equal class caps"):
        pol.budgets_rows(RowBatch.of([RequestState("a", "p", 3, 10)]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4), st.integers(1, 9), st.integers(0, 9)), max_size=12),
       st.integers(1, 4))
def test_record_batch_is_record_one_by_one(batch, max_problems):
    """AcceptanceRate.record_batch (the allowance's per-step fold) equals record() row after row, forgotten
    problems (past max_problems) included."""
    from dasrl.policy.acceptance import AcceptanceRate
    from support.rowwise_policy import RowwiseAcceptance

    new, old = AcceptanceRate(max_problems=max_problems), RowwiseAcceptance(max_problems=max_problems)
    for acc in (new, old):  # some history, decayed (non-integer counts)
        acc.record("h", 0, drafted=5, accepted=3)
        acc.end_step()
    seen = set()
    batch = [b for b in batch if not (b[0] in seen or seen.add(b[0]))]  # a batch's rows are distinct
    rows = [(f"r{r}", p, d, min(a, d)) for r, p, d, a in batch]
    new.record_batch([r for r, *_ in rows], [p for _, p, _, _ in rows], np.array([d for *_, d, _ in rows], np.int64),
                     np.array([a for *_, a in rows], np.int64))
    for r, p, d, a in rows:
        old.record(r, p, drafted=d, accepted=a)
    assert new.state_dict() == {"problems": [[k, [float(a), float(r)]] for k, (a, r) in old._problem.items()],
                                "run": old._run}
    for r, p, *_ in rows:
        assert new.rate(r, p) == old.rate(r, p)
