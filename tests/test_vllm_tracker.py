"""BatchDrafter: the vLLM proposer's bookkeeping on hand-made input batches (no vLLM needed).

A `Batch` below plays vLLM's InputBatch: request ids in row order, prompt lengths, one token row per
request (prompt + output so far), and the tokens each request got this engine step.
"""

from __future__ import annotations

import numpy as np
import pytest

from dasrl.integrations.vllm import BatchDrafter, VLLMDrafterConfig
from dasrl.integrations.vllm.clock import StepClock
from dasrl.integrations.vllm.tracker import _accepted, acceptance_cap
from dasrl.policy.base import RequestState
from dasrl.policy.latency import LatencyModel

P = [1, 2, 3, 4]  # a prompt
Q = [9, 8, 7]  # another prompt
R1 = [10, 11, 12, 13, 14, 15, 16, 17]  # a response to P


class Batch:
    """Requests in the batch, in row order, with their rows."""

    def __init__(self, width: int = 64) -> None:
        self.width = width
        self.rows: dict[str, list[int]] = {}
        self.prompt: dict[str, int] = {}

    def add(self, rid: str, prompt: list[int]) -> None:
        self.rows[rid], self.prompt[rid] = list(prompt), len(prompt)

    def drop(self, rid: str) -> None:
        del self.rows[rid]

    def step(self, drafter: BatchDrafter, new: dict[str, list[int]]) -> dict[str, list[int]]:
        """Append `new` tokens to those rows (rows not in `new` are mid-prefill), then propose."""
        for rid, toks in new.items():
            self.rows[rid].extend(toks)
        ids = list(self.rows)
        buf = np.zeros((len(ids), self.width), np.int32)
        for i, rid in enumerate(ids):
            buf[i, :len(self.rows[rid])] = self.rows[rid]
        drafts = drafter.propose(req_ids=ids, prompt_lens=[self.prompt[r] for r in ids], token_rows=buf,
                                 num_tokens=[len(self.rows[r]) for r in ids], sampled=[new.get(r, []) for r in ids])
        return dict(zip(ids, drafts))


def drafter(**kw) -> BatchDrafter:
    k = kw.pop("k", 8)
    # latency_floor off: these tests work the acceptance floor by hand (the latency floor has its own)
    return BatchDrafter(VLLMDrafterConfig(**{"policy": "fixed", "max_spec_factor": 0.0, "latency_floor": False, **kw}),
                        num_speculative_tokens=k, max_model_len=64)


def run_to_end(d: BatchDrafter, b: Batch, rid: str, response: list[int]) -> None:
    for t in response[1:]:
        b.step(d, {rid: [t]})


def test_history_of_the_previous_step_drafts_the_next():
    d, b = drafter(), Batch()
    b.add("a", P)
    b.step(d, {"a": [R1[0]]})
    run_to_end(d, b, "a", R1)
    b.drop("a")  # finished: vLLM removes it from the batch and says nothing
    assert d.stats.steps == 0 and d.stats.finished == 0  # not known to be finished until the batch drains
    b.add("b", P)
    drafts = b.step(d, {"b": [R1[0]]})
    assert d.stats.steps == 1 and d.stats.finished == 1 and d.store.step == 1
    assert drafts["b"] == R1[1:]  # the whole rest of the previous rollout (capped at k=8)


def test_siblings_draft_for_each_other_within_a_step():
    d, b = drafter(), Batch()
    b.add("a", P)
    b.add("b", P)
    b.step(d, {"a": R1[:5], "b": R1[:1]})  # a is ahead (e.g. accepted drafts)
    drafts = b.step(d, {"b": R1[1:2]})
    assert drafts["b"] == R1[2:5]  # a's continuation, up to where a is
    assert d.store.num_shards == 1


def test_other_problems_do_not_leak():
    d, b = drafter(), Batch()
    b.add("a", P)
    b.step(d, {"a": R1})
    b.drop("a")
    b.add("q", Q)
    drafts = b.step(d, {"q": [R1[0]]})
    assert drafts["q"] == [] and d.store.num_shards == 2


def test_prefilling_rows_get_no_draft_and_no_tokens():
    d, b = drafter(), Batch()
    b.add("a", P)
    drafts = b.step(d, {})  # prompt still being prefilled (chunked prefill)
    assert drafts == {"a": []} and d.stats.started == 0 and d.num_live == 1


def test_a_preempted_request_continues_without_ending_the_step():
    d, b = drafter(), Batch()
    b.add("a", P)
    b.add("b", P)
    d_step(d, b, {"a": R1[:3], "b": R1[:2]}, {"a", "b"})
    b.drop("a")  # preempted: leaves the batch while b runs; vLLM still holds it
    d_step(d, b, {"b": R1[2:3]}, {"a", "b"})
    b.add("a", P)  # resumed with the same id: its row is prompt + everything so far
    b.rows["a"] = P + R1[:3]
    drafts = d_step(d, b, {"a": R1[3:4], "b": R1[3:4]}, {"a", "b"})
    assert d.stats.steps == 0 and d.stats.started == 2 and d.stats.finished == 0
    assert d.store._live["a"].output == R1[:4]  # nothing fed twice
    assert drafts["a"] == []  # nothing ahead of either sibling yet


def test_step_after_n_departures_restarts_requests_in_flight():
    d, b = drafter(step_requests=2), Batch()
    for rid in ("a", "b", "c"):
        b.add(rid, P)
    b.step(d, {"a": R1, "b": R1, "c": R1[:2]})
    b.drop("a")
    b.drop("b")
    drafts = b.step(d, {"c": R1[2:3]})
    assert d.stats.steps == 1 and d.stats.finished == 2 and d.stats.restarted == 1
    assert drafts["c"] == R1[3:]  # c re-started from its row; a and b are history now
    assert d.store._live["c"].output == R1[:3]


def test_caps_by_k_and_by_the_context_limit():
    d, b = drafter(k=3), Batch()
    b.add("a", P)
    b.step(d, {"a": R1})
    b.drop("a")
    b.add("b", P)
    assert b.step(d, {"b": R1[:1]})["b"] == R1[1:4]
    tight = BatchDrafter(VLLMDrafterConfig(policy="fixed", max_spec_factor=0.0), num_speculative_tokens=8,
                         max_model_len=len(P) + 4)
    b2 = Batch()
    b2.add("a", P)
    b2.step(tight, {"a": R1[:3]})
    b2.drop("a")
    b2.add("b", P)
    # 4 tokens in the row, limit 8: room for 3 more positions, minus the target's own token
    assert b2.step(tight, {"b": R1[:1]})["b"] == R1[1:3]


def test_drafts_are_capped_by_the_match_length():
    d, b = drafter(max_spec_factor=1.0), Batch()
    b.add("a", P)
    b.step(d, {"a": R1})
    b.drop("a")
    b.add("b", Q)  # another prompt whose output happens to start like a's: a 1-token match
    b.add("c", P)  # a's problem: the whole context (5 tokens) matches
    d2 = b.step(d, {"b": [R1[0]], "c": [R1[0]]})
    assert d2["b"] == [] and d2["c"] == R1[1:6]
    g, b3 = drafter(max_spec_factor=1.0, mode="global"), Batch()
    b3.add("a", P)
    b3.step(g, {"a": R1})
    b3.drop("a")
    b3.add("b", Q)
    assert b3.step(g, {"b": [R1[0]]})["b"] == R1[1:2]  # a 1-token match drafts 1 token


def test_das_policy_caps_by_length_class():
    # Class caps alone (acceptance never caps or lifts here; see the acceptance tests below).
    # No history at all: medium class, cap 4 (a sibling 6 tokens ahead offers more).
    d, b = drafter(policy="das", k=8, caps=(0, 4, 24), acceptance_floor=0.0, trust_acceptance=2.0), Batch()
    b.add("a", P)
    b.add("b", P)
    b.step(d, {"a": R1[:7], "b": R1[:1]})
    assert b.step(d, {"b": R1[1:2]})["b"] == R1[2:6]
    b.drop("a")
    b.drop("b")
    # Its problem's rollouts were short (7 and 2 of up to 60 tokens): short class, no draft despite a match.
    b.add("c", P)
    assert b.step(d, {"c": R1[:1]})["c"] == []
    assert d.policy.lengths.lengths(d._reqs["c"].state.problem_id).tolist() == [7, 2]
    # A long rollout (40 >= 0.6 x 60): the long class drafts up to k.
    long = list(range(100, 140))
    d2, b2 = drafter(policy="das", k=8, caps=(0, 4, 24), acceptance_floor=0.0, trust_acceptance=2.0), Batch()
    b2.add("a", Q)
    b2.step(d2, {"a": long})
    b2.drop("a")
    b2.add("b", Q)
    assert b2.step(d2, {"b": long[:1]})["b"] == long[1:9]


def test_accepted_tokens_are_counted():
    assert _accepted([5, 6, 7], [5, 6, 9]) == 2
    assert _accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert _accepted([5, 6, 7], [4]) == 0 and _accepted([], [4]) == 0
    d, b = drafter(), Batch()
    b.add("a", P)
    b.step(d, {"a": R1})
    b.drop("a")
    b.add("b", P)
    b.step(d, {"b": R1[:1]})  # drafts R1[1:]
    b.step(d, {"b": R1[1:4] + [99]})  # 3 accepted, then the target differs
    assert d.stats.accepted == 3 and d._reqs["b"].state.accepted == 3
    assert d.stats.calls == 3 and d.stats.propose_s > 0  # the drafter's own time, for the bench rows


def test_bad_input_names_the_request():
    d, b = drafter(), Batch()
    b.add("a", P)
    with pytest.raises(ValueError, match=r"'a'.*async_scheduling=False"):
        b.step(d, {"a": [-1]})
    with pytest.raises(ValueError, match="duplicate request ids"):
        d.propose(req_ids=["x", "x"], prompt_lens=[1, 1], token_rows=np.ones((2, 4), np.int32), num_tokens=[2, 2],
                  sampled=[[1], [1]])
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        BatchDrafter(num_speculative_tokens=0, max_model_len=64)


def test_config_from_additional_config():
    assert VLLMDrafterConfig.from_dict(None) == VLLMDrafterConfig()
    c = VLLMDrafterConfig.from_dict({"window": 4, "caps": [0, 2, 8], "policy": "fixed"})
    assert c.window == 4 and c.caps == (0, 2, 8) and c.store_config().window == 4
    with pytest.raises(ValueError, match="windw"):
        VLLMDrafterConfig.from_dict({"windw": 4})
    with pytest.raises(ValueError, match="'greedy'"):
        VLLMDrafterConfig.from_dict({"policy": "greedy"})
    with pytest.raises(ValueError, match="store mode 'tree'"):
        VLLMDrafterConfig(mode="tree")
    with pytest.raises(TypeError, match="must be a dict"):
        VLLMDrafterConfig.from_dict([("window", 4)])



# ------------------------------------------------------------------ acceptance-aware caps (das policy)

def test_acceptance_cap_by_hand():
    # the longest L <= k with a**L >= floor
    assert acceptance_cap(0.5, 0.2, 8) == 2  # 0.5, 0.25 (0.125 < 0.2)
    assert acceptance_cap(0.8, 0.2, 8) == 7  # 0.8**7 = 0.2097, 0.8**8 = 0.1678
    assert acceptance_cap(0.8, 0.2, 3) == 3  # clipped to k
    assert acceptance_cap(0.2, 0.2, 8) == 1 and acceptance_cap(0.1, 0.2, 8) == 0
    assert acceptance_cap(1.0, 0.2, 8) == 8 and acceptance_cap(0.3, 0.0, 8) == 8  # floor 0: off


def test_low_acceptance_stops_drafting_then_probes():
    """A request whose drafts are always rejected at their first token: its acceptance estimate
    (0 + 8 * 1.0) / (resolved + 8) falls step by step and so does its cap, down to 0 but for probes.
    (History H; the request emits every other token of H, so its context always matches H -- a draft
    exists -- and the draft's first token is always wrong.)"""
    H = list(range(100, 200))
    d = BatchDrafter(VLLMDrafterConfig(policy="das", caps=(8, 8, 8), max_spec_factor=0.0, probe_every=16,
                                       latency_floor=False),
                     num_speculative_tokens=4, max_model_len=512)
    b = Batch(width=256)
    b.add("h", P)
    b.step(d, {"h": H})
    b.drop("h")
    b.add("r", P)
    lens = [len(b.step(d, {"r": H[:1]})["r"])]  # nothing verified yet anywhere: acceptance 1.0, cap k
    for i in range(1, 45):
        drafts = b.step(d, {"r": [H[2 * i]]})  # the draft said H[2i-1]: rejected at its first token
        lens.append(len(drafts["r"]))
    # resolved after call n: 4, 7, 9, 11, 12, ... -> estimate 8/12 = .667 (cap 3), 8/15 = .533 (2),
    # 8/17 = .47 (2), 8/19 = .42 (1), 8/20 = .40 (1), ... 8/40 = 0.2 (1), then 8/41 < 0.2: 0.
    assert lens[:6] == [4, 3, 2, 2, 1, 1]
    resolved = [0, 4, 7, 9, 11] + [11 + j for j in range(1, 40)]  # verified drafted tokens at call i
    first_zero = next(i for i, n in enumerate(lens) if n == 0)
    assert resolved[first_zero - 1] == 32 and resolved[first_zero] == 33  # 8/40 = 0.2: 1; 8/41 < 0.2: 0
    # stopped: from then on only 1-token probes, exactly at the request's 16th, 32nd, ... engine step
    req = d._reqs["r"]
    later = lens[first_zero:]
    assert set(later) <= {0, 1} and 1 in later
    probes = [first_zero + j for j, n in enumerate(later) if n == 1]
    assert all((i + 1) % 16 == 0 for i in probes), probes  # forwards == call index + 1 here
    assert req.accepted == 0 and d.acceptance("r") < 0.2


def test_probes_are_per_problem_and_staggered():
    """Requests that stopped drafting: one 1-token probe per problem every probe_every calls, whatever
    the number of its siblings, and two problems probe on different calls."""
    H = list(range(100, 200))
    d = BatchDrafter(VLLMDrafterConfig(policy="das", caps=(8, 8, 8), max_spec_factor=0.0, probe_every=4,
                                       latency_floor=False, acceptance_floor=0.99),
                     num_speculative_tokens=4, max_model_len=512)
    d.stats.resolved = 10_000  # nothing ever accepted anywhere: every estimate ~0, every cap 0 but probes
    b = Batch(width=256)
    for rid in ("hp", "hq"):
        b.add(rid, P if rid == "hp" else Q)
    b.step(d, {"hp": H, "hq": H})
    b.drop("hp"), b.drop("hq")
    sib = {"p0": P, "p1": P, "p2": P, "q0": Q, "q1": Q}
    for rid, prompt in sib.items():
        b.add(rid, prompt)
    b.step(d, {rid: H[:1] for rid in sib})
    calls = []
    for i in range(1, 13):
        drafts = b.step(d, {rid: [H[i]] for rid in sib})
        calls.append({rid for rid, t in drafts.items() if t})
    assert all(len(c) <= 2 for c in calls)  # at most one probe per problem per call
    p_calls = [i for i, c in enumerate(calls) if c & {"p0", "p1", "p2"}]
    q_calls = [i for i, c in enumerate(calls) if c & {"q0", "q1"}]
    assert len(p_calls) == 3 and len(q_calls) == 3  # 12 calls / 4
    assert all(len(c & {"p0", "p1", "p2"}) <= 1 for c in calls)
    assert {b - a for a, b in zip(p_calls, p_calls[1:])} == {4} and not set(p_calls) & set(q_calls)


def test_high_acceptance_lifts_the_length_class_cap():
    """Greedy RL: every sample of a prompt is the same, drafts are all accepted. The das class policy
    alone gives a request of a short problem no draft; measured acceptance >= trust_acceptance lifts
    that to num_speculative_tokens (vLLM suffix's fixed cap), so das never drafts shorter than it."""
    def run(trust):
        d, b = drafter(policy="das", k=8, caps=(0, 4, 24), trust_acceptance=trust), Batch()
        b.add("a", P)
        b.step(d, {"a": R1})
        b.drop("a")
        b.add("b", P)
        return d, b, b.step(d, {"b": R1[:1]})["b"]
    _, _, capped = run(trust=2.0)
    assert capped == []  # short class (8 of up to 60 tokens): cap 0
    d, b, lifted = run(trust=0.8)
    assert lifted == R1[1:] and d.acceptance("b") == 1.0  # nothing rejected yet: trusted
    drafts = b.step(d, {"b": R1[1:] + [5]})  # all 7 accepted, then the target's own token
    assert d._reqs["b"].accepted == 7 and d.acceptance("b") == 1.0
    assert drafts["b"] == []  # past the end of the history: nothing to draft, not a cap


def test_acceptance_estimate_pools_the_problem_then_everyone():
    """Hand-worked two-level estimate, prior 8: each verified draft counted once."""
    d, b = drafter(policy="das", k=8, trust_acceptance=2.0, caps=(8, 8, 8)), Batch()
    b.add("a", P)
    b.step(d, {"a": R1})
    b.drop("a")
    b.add("x", P)
    b.add("y", P)
    b.add("q", Q)
    b.step(d, {"x": R1[:1], "y": R1[:1], "q": [R1[0]]})  # x, y draft R1[1:8] (7 tokens); q nothing
    b.step(d, {"x": R1[1:3] + [99], "y": [98]})  # x: 2 of 7 accepted; y: 0 of 7
    assert (d._reqs["x"].accepted, d._reqs["x"].resolved) == (2, 7)
    assert (d._reqs["y"].accepted, d._reqs["y"].resolved) == (0, 7)
    # q: its problem has no verified drafts, the other problem (P) 2 of 14: g = (2 + 8) / (14 + 8)
    assert d.acceptance("q") == pytest.approx(10 / 22)
    # y: its problem's other request x: (2 + 8 * 1.0) / (7 + 8) = 2/3 (no other problem has drafts)
    # then y itself: (0 + 8 * 2/3) / (7 + 8)
    assert d.acceptance("y") == pytest.approx((8 * (10 / 15)) / 15)


# ------------------------------------------------------------------ preemption (vLLM's `live` request ids)

def test_a_paused_request_is_not_finished_when_the_rest_of_the_batch_turns_over():
    """vLLM preempts `a` under KV pressure; `b` finishes; a waiting request `c` of the same generate call
    is scheduled while `a` is out. vLLM still holds `a` (runner.requests): no step boundary, `a` is not
    finished, and when it comes back it continues with its history."""
    def scenario(with_live):
        d, b = drafter(), Batch()
        live = {"a", "b"}
        b.add("a", P)
        b.add("b", P)
        b.step(d, {"a": R1[:3], "b": R1[:2]})
        b.drop("a")  # preempted
        d_step(d, b, {"b": R1[2:3]}, live if with_live else None)
        b.drop("b")
        live.discard("b")  # finished: vLLM popped it
        b.add("c", Q)
        live.add("c")
        d_step(d, b, {"c": [7]}, live if with_live else None)
        b.add("a", P)  # resumed: its row is prompt + everything so far
        b.rows["a"] = P + R1[:3]
        d_step(d, b, {"a": R1[3:4], "c": [8]}, live if with_live else None)
        return d
    d = scenario(with_live=True)
    assert d.stats.steps == 0 and d.stats.finished == 1 and d.stats.restarted == 0 and d.stats.paused >= 2
    assert set(d._reqs) == {"a", "c"}  # b finished (its rollout is history now); a only paused
    assert d.store._live["a"].output == R1[:4]  # its history kept, nothing fed twice
    # Without `live` the batch looked drained when c arrived: a false RL-step boundary finished a's
    # 3-token partial rollout into the window and a was re-started from its row on return.
    old = scenario(with_live=False)
    assert old.stats.steps == 1 and old.stats.finished == 2 and old.stats.started == 4


def d_step(d, b, new, live):
    """Batch.step with vLLM's held request ids."""
    for rid, toks in new.items():
        b.rows[rid].extend(toks)
    ids = list(b.rows)
    buf = np.zeros((len(ids), b.width), np.int32)
    for i, rid in enumerate(ids):
        buf[i, :len(b.rows[rid])] = b.rows[rid]
    out = d.propose(req_ids=ids, prompt_lens=[b.prompt[r] for r in ids], token_rows=buf,
                    num_tokens=[len(b.rows[r]) for r in ids], sampled=[new.get(r, []) for r in ids], live=live)
    return dict(zip(ids, out))


def test_the_step_ends_when_vllm_has_finished_every_request():
    d, b = drafter(), Batch()
    b.add("a", P)
    b.add("b", P)
    d_step(d, b, {"a": R1, "b": R1[:2]}, {"a", "b"})
    b.drop("a")
    b.drop("b")  # both out of the batch; b only paused
    b.add("c", P)
    d_step(d, b, {"c": R1[:1]}, {"b", "c"})
    assert d.stats.steps == 0  # b is still held by vLLM: the step has not drained
    b.drop("c")
    b.add("e", P)
    drafts = d_step(d, b, {"e": R1[:1]}, {"e"})  # vLLM finished b and c (aborted b): drained now
    assert d.stats.steps == 1 and d.stats.finished == 3 and drafts["e"] == R1[1:]


def test_paused_requests_do_not_count_as_departures_in_step_requests_mode():
    d, b = drafter(step_requests=1), Batch()
    b.add("a", P)
    b.add("b", P)
    d_step(d, b, {"a": R1[:2], "b": R1[:2]}, {"a", "b"})
    b.drop("a")  # preempted
    d_step(d, b, {"b": R1[2:3]}, {"a", "b"})
    assert d.stats.steps == 0
    b.drop("b")  # finished
    b.add("c", P)
    d_step(d, b, {"c": R1[:1]}, {"a", "c"})
    assert d.stats.steps == 1 and d.stats.finished == 1  # only b; a re-started later from its row
    assert "a" in d._reqs


# ------------------------------------------------------------------ DASProposer without vLLM

def vllm_config(**dasrl):
    from types import SimpleNamespace as NS

    return NS(speculative_config=NS(num_speculative_tokens=4), additional_config={"dasrl": dasrl},
              model_config=NS(max_model_len=64, get_vocab_size=lambda: 256))


def input_batch(rows, generators=None):
    """The fields of vLLM 0.32's InputBatch that DASProposer reads (v1/worker/gpu_input_batch.py)."""
    from types import SimpleNamespace as NS

    ids = list(rows)
    buf = np.zeros((len(ids), 64), np.int32)
    for i, rid in enumerate(ids):
        buf[i, :len(rows[rid])] = rows[rid]
    nb = NS(req_ids=ids, num_prompt_tokens=np.array([len(P)] * len(ids)), token_ids_cpu=buf,
            num_tokens_no_spec=np.array([len(rows[r]) for r in ids]))
    if generators is not None:
        nb.generators = generators
    return nb


def test_proposer_warns_once_or_refuses_on_seeded_requests(caplog):
    from dasrl.integrations.vllm import DASProposer

    p = DASProposer(vllm_config())
    def ours():  # the proposer's own records (importing vLLM logs its own warnings, e.g. Triton's CPU backend)
        return [r for r in caplog.records if r.name == "dasrl.integrations.vllm.proposer"]

    p.check_seeded(input_batch({"a": P}))  # an InputBatch without the field: no-op
    p.check_seeded(input_batch({"a": P}, generators={}))  # no seeded request: nothing
    assert not ours()
    with caplog.at_level("WARNING"):
        p.check_seeded(input_batch({"a": P}, generators={0: object()}))
        p.check_seeded(input_batch({"a": P}, generators={0: object()}))
    assert len(ours()) == 1 and "seed" in ours()[0].getMessage() and "distribution" in ours()[0].getMessage()
    strict = DASProposer(vllm_config(on_seeded="error"))
    with pytest.raises(ValueError, match="per-request seed"):
        strict.check_seeded(input_batch({"a": P}, generators={0: object()}))
    DASProposer(vllm_config(on_seeded="ignore")).check_seeded(input_batch({"a": P}, generators={0: object()}))
    with pytest.raises(ValueError, match="'never'"):
        VLLMDrafterConfig(on_seeded="never")


def test_proposer_passes_the_runners_held_requests():
    """propose_batch reads the runner's `requests` (vLLM keeps preempted requests there): a request
    absent from the batch but held by the runner is paused, not finished."""
    from types import SimpleNamespace as NS

    from dasrl.integrations.vllm import DASProposer

    p = DASProposer(vllm_config())
    runner = NS(requests={"a": NS(sampling_params=NS(max_tokens=32)), "b": NS(sampling_params=NS(max_tokens=32))})
    p.bind(runner)
    p.propose_batch(input_batch({"a": P + R1[:2], "b": P + R1[:2]}), [[R1[0]], [R1[0]]])
    p.propose_batch(input_batch({"b": P + R1[:3]}), [[R1[2]]])  # a preempted
    del runner.requests["b"]
    runner.requests["c"] = NS(sampling_params=NS(max_tokens=32))
    p.propose_batch(input_batch({"c": P + R1[:1]}), [[R1[0]]])
    assert p.drafter.stats.steps == 0 and "a" in p.drafter._reqs and p.drafter.stats.paused == 2


# ------------------------------------------------------------------ the vLLM bench's config (no vLLM run)

def test_bench_compares_without_per_request_seeds_by_default():
    from dataclasses import asdict

    from dasrl.bench.vllm_bench import VLLMBenchConfig

    cfg = VLLMBenchConfig(temperature=1.0)
    assert cfg.seeded is False and asdict(cfg)["seeded"] is False  # what vllm_run reads
    assert VLLMBenchConfig(temperature=1.0, seeded=True).seeded


def test_bench_modules_import_one_way():
    """vllm_bench.py (parent) imports vllm_run.py (child entry point); vllm_run.py imports nothing of vllm_bench."""
    import ast
    from pathlib import Path

    import dasrl.bench.vllm_run as child

    tree = ast.parse(Path(child.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "dasrl.bench.vllm_bench" not in imported, imported


# ------------------------------------------------------------------ the latency floor (StepClock)

class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_step_clock_fits_the_line_from_the_time_between_calls():
    now = FakeTime()
    clock = StepClock(window=64, min_samples=32, now=now)
    clock.tick(10)
    for i in range(40):
        n = 10 + (i % 20)  # the step after this call computes n tokens
        now.t += 0.075 + 0.005 * (10 + ((i - 1) % 20) if i else 10)  # the step just ended: its own tokens
        clock.tick(n)
    lat = clock.model()
    assert lat is not None and abs(lat.c_base - 0.075) < 1e-9 and abs(lat.c_tok - 0.005) < 1e-9


def test_step_clock_skips_prefill_steps_and_needs_enough_spread():
    now = FakeTime()
    clock = StepClock(window=64, min_samples=32, now=now)
    for _ in range(40):  # every step 4 tokens: no spread, no fit
        clock.tick(4)
        now.t += 0.1
    assert clock.num_samples == 39 and clock.model() is None
    clock.skip()  # the step since the last call prefilled: not recorded
    now.t += 5.0
    clock.tick(4)
    assert clock.num_samples == 39
    now.t += 0.1
    clock.tick(None)  # closes a 4-token step (recorded); the next step's tokens are unknown
    now.t += 7.0
    clock.tick(4)  # so this one is not recorded
    assert clock.num_samples == 40
    with pytest.raises(ValueError, match="min_samples"):
        StepClock(window=8, min_samples=16)


def test_latency_floor_by_hand():
    """c_base 75 ms, c_tok 5 ms (CPU-like), 40 rows: t = 275 ms. Off the makespan a draft token must
    keep the batch's tokens per second: a**L >= 40 * 5 / 275 = 0.727; a long-class request, alone in its
    class, its own time per token: a**L >= (1 + a) * 5 / 275; with n long rows drafting, n times that.
    With 2 rows left (t = 85 ms) the first is 2 * 5 / 85 = 0.118."""
    d = drafter(policy="das", k=8)
    lat = LatencyModel(0.075, 0.005)
    medium, long_ = RequestState("m", 0, 10, 100), RequestState("l", 0, 10, 100)
    medium.classes.append("medium")
    long_.classes.append("long")
    assert abs(d._floor(lat, 0.4, 40, medium) - 40 * 0.005 / 0.275) < 1e-12
    assert acceptance_cap(0.4, d._floor(lat, 0.4, 40, medium), 8) == 0  # a = 0.4 does not pay at 40 rows
    assert abs(d._floor(lat, 0.4, 40, long_) - 1.4 * 0.005 / 0.275) < 1e-12
    assert acceptance_cap(0.4, d._floor(lat, 0.4, 40, long_), 8) == 4  # .4**4 = .0256 >= .02545 > .4**5
    assert acceptance_cap(0.4, d._floor(lat, 0.4, 2, medium), 8) == 2  # tail: .16 >= .118 > .064
    assert d._floor(None, 0.4, 40, medium) == d.config.acceptance_floor  # no fit yet
    # 10 long rows drafting beside it: each token they add slows all ten: 1.4 * 10 * 5 / 275 = 0.2545
    assert abs(d._floor(lat, 0.4, 40, long_, longs=10) - 14 * 0.005 / 0.275) < 1e-12
    assert acceptance_cap(0.4, d._floor(lat, 0.4, 40, long_, longs=10), 8) == 1  # .4 >= .2545 > .16
    assert acceptance_cap(0.17, d._floor(lat, 0.17, 40, long_, longs=10), 8) == 0  # T = 1-like: no draft


def test_propose_times_each_step_with_its_own_tokens():
    """The drafter's own clock, fed by propose calls 10 ms + 1 ms per computed token apart (one per row
    plus its draft): the fit recovers exactly that line, and the prefill step is not in it."""
    d, b = drafter(policy="das", k=4, caps=(4, 4, 4), trust_acceptance=2.0, latency_floor=True), Batch(width=256)
    now = FakeTime()
    d.clock = StepClock(window=64, min_samples=32, now=now)
    H = list(range(100, 200))
    b.add("h", P)
    b.step(d, {"h": H})
    b.drop("h")
    b.add("r", P)
    now.t += 3.0  # r's prefill: not a sample
    prev = 1 + len(b.step(d, {"r": H[:1]})["r"])
    lens = set()
    for i in range(1, 45):
        now.t += 0.010 + 0.001 * prev
        drafts = b.step(d, {"r": [H[2 * i]]})  # every draft rejected at its first token: caps fall
        prev = 1 + len(drafts["r"])
        lens.add(prev)
    lat = d.clock.model()
    assert len(lens) > 1 and d.clock.num_samples == 44
    assert lat is not None and abs(lat.c_base - 0.010) < 1e-9 and abs(lat.c_tok - 0.001) < 1e-9


# ------------------------------------------------------------------ servers: batches that never drain, overlapping steps

def live_step(d, b, new, live):
    """d_step with vLLM's held requests as the runner's dict (id -> its request-state object)."""
    return d_step(d, b, new, {rid: live[rid] for rid in live})


def test_a_server_that_never_drains_tracks_only_what_vllm_holds():
    """Requests arrive while others run, 4 at a time, 300 in all: the batch never drains. Finished
    requests are history at once and leave tracking (the proposer's cost stays that of the batch), and
    the window still rolls every max_step_requests finished requests."""
    def serve(d, n=300):
        b, live, most = Batch(), {}, 0
        for i in range(n):
            rid = f"r{i}"
            b.add(rid, P if i % 2 else Q)
            live[rid] = object()
            live_step(d, b, {rid: R1[:1], **{r: [R1[len(b.rows[r]) - b.prompt[r]]] for r in b.rows if r != rid}},
                      live)
            most = max(most, d.num_live)
            if len(b.rows) == 4:  # the oldest finishes
                old = next(iter(b.rows))
                b.drop(old)
                del live[old]
        return most
    d = drafter()
    assert serve(d) <= 4 and d.stats.finished == 296 and d.stats.steps == 0  # default bound: 4096
    d = drafter(max_step_requests=50)
    assert serve(d) <= 4 and d.stats.steps == 296 // 50 and d.store.step == d.stats.steps


def test_a_reused_request_id_starts_a_new_request():
    """vLLM may see an id again for another request (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION, an agent's
    next turn under VeRL's full_determinism). Its tokens must not be spliced onto the old request."""
    d, b = drafter(), Batch()
    live = {"a": object(), "h": object()}
    b.add("a", P)
    b.add("h", Q)
    live_step(d, b, {"a": R1[:3], "h": [5]}, live)
    b.drop("a")
    del live["a"]
    live_step(d, b, {"h": [6]}, live)  # a finished; h keeps the batch from draining
    turn2 = P + R1[:3] + [40, 41]  # the same id, the conversation's next turn: a longer prompt
    b.add("a", turn2)
    live["a"] = object()
    live_step(d, b, {"a": [42], "h": [7]}, live)
    assert d.store._live["a"].output == [42] and d.stats.reused == 0  # departed first: simply a new start
    # Reused in consecutive calls (never absent), same prompt length, a longer row: only vLLM's
    # request-state object tells them apart.
    other = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    assert len(other) == len(turn2)
    b.rows["a"], b.prompt["a"] = other + [50, 51, 52, 53, 54], len(other)
    live["a"] = object()
    live_step(d, b, {"a": [55], "h": [8]}, live)
    assert d.stats.reused == 1 and d.store._live["a"].output == [50, 51, 52, 53, 54, 55]
    assert d.stats.finished == 2  # the first a, and its second incarnation


def test_a_failing_step_is_skipped_warned_once_and_counted(caplog):
    """An exception inside the drafter must not reach vLLM's runner: no drafts for that step, one
    warning naming the exception, each failure counted; the next good step drafts again."""
    from types import SimpleNamespace as NS

    from dasrl.integrations.vllm import DASProposer

    p = DASProposer(vllm_config(policy="fixed", max_spec_factor=0.0))
    live = {"h": NS(sampling_params=NS(max_tokens=32))}
    p.bind(NS(requests=live))
    p.propose_batch(input_batch({"h": P + R1}), [[R1[-1]]])
    del live["h"]
    live["a"] = NS(sampling_params=NS(max_tokens=32))
    with caplog.at_level("WARNING"):
        for _ in range(2):  # a placeholder token (-1) in the row: the tracker raises ValueError
            assert p.propose_batch(input_batch({"a": P + [R1[0], -1]}), [[-1]]) == [[]]
    ours = [r for r in caplog.records if r.name == "dasrl.integrations.vllm.proposer"]
    assert len(ours) == 1 and "ValueError" in ours[0].getMessage() and p.stats()["errors"] == 2
    assert p.propose_batch(input_batch({"a": P + R1[:1]}), [[R1[0]]]) == [R1[1:5]]  # k = 4


def test_overlapping_steps_roll_the_window_at_the_callers_signal():
    """An async server: step 2's requests of problem P arrive while step 1's request of Q still runs, and
    the batch drains in the middle of step 2 (an agent waiting on a tool). With the caller's end_step
    (collective_rpc) the window rolls exactly there: rollouts finished before the signal are step 1's,
    q (in flight across it) is step 2's, nothing fed twice, and the drain infers no boundary."""
    d, b = drafter(mode="problem", window=1), Batch()
    live = {}
    for rid, prompt in (("a1", P), ("a2", P), ("q", Q)):
        b.add(rid, prompt)
        live[rid] = object()
    H = list(range(100, 140))
    live_step(d, b, {"a1": R1[:4], "a2": R1[:4], "q": H[:2]}, live)
    live_step(d, b, {"a1": R1[4:], "a2": R1[4:], "q": H[2:4]}, live)  # a1, a2 get their last tokens
    d.end_step()  # the trainer took step 1's rollouts; vLLM's runner drops a1, a2 only at its next step
    assert d.store.step == 0  # not yet: a1 and a2 cannot be told from requests in flight until then
    for rid in ("a1", "a2"):
        b.drop(rid)
        del live[rid]
    b.add("b1", P)
    live["b1"] = object()
    drafts = live_step(d, b, {"b1": R1[:1], "q": H[4:6]}, live)
    assert d.stats.finished == 2 and d.store.step == 1  # a1, a2 finished into step 1, then the roll
    assert drafts["b1"] == R1[1:] and d.stats.restarted == 1  # history of step 1; q re-started from its row
    live_step(d, b, {"b1": [], "q": H[6:8]}, live)
    assert d.store._live["q"].output == H[:8]
    live_step(d, b, {"b1": R1[1:], "q": H[8:40]}, live)
    for rid in ("b1", "q"):
        b.drop(rid)
        del live[rid]
    b.add("t", Q)  # drained, then a new request: no inferred boundary once the caller sends them
    live["t"] = object()
    live_step(d, b, {"t": H[:1]}, live)
    assert d.stats.steps == 1 and d.store.step == 1
    d.end_step()  # window 1: step 1's rollouts (a1, a2) leave, step 2's (b1, q) are the history
    d2 = drafter(explicit_steps=True)  # a caller that sends every boundary, from the first step on
    b2 = Batch()
    b2.add("x", P)
    live_step(d2, b2, {"x": R1}, {"x": 1})
    b2.drop("x")
    b2.add("y", P)
    live_step(d2, b2, {"y": R1[:1]}, {"y": 2})  # drained: no inferred boundary
    assert d2.stats.finished == 1 and d2.stats.steps == 0
    b.add("b2", P)
    b.add("q2", Q)
    live["b2"], live["q2"] = object(), object()
    drafts = live_step(d, b, {"b2": R1[:1], "q2": H[:1], "t": H[1:2]}, live)
    assert drafts["q2"] == H[1:9] and drafts["b2"] == R1[1:]  # b1 and q are step 2's rollouts
    assert d.store.num_tokens == len(P + R1) + len(Q + H)  # the window holds b1 and q only
