"""BatchDrafter: the vLLM proposer's bookkeeping on hand-made input batches (no vLLM needed).

A `Batch` below plays vLLM's InputBatch: request ids in row order, prompt lengths, one token row per
request (prompt + output so far), and the tokens each request got this engine step.
"""

from __future__ import annotations

import numpy as np
import pytest

from dasrl.integrations.vllm import BatchDrafter, VLLMDrafterConfig
from dasrl.integrations.vllm.tracker import _accepted

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
    return BatchDrafter(VLLMDrafterConfig(**{"policy": "fixed", "max_spec_factor": 0.0, **kw}),
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
    b.step(d, {"a": R1[:3], "b": R1[:2]})
    b.drop("a")  # preempted: leaves the batch while b runs
    b.step(d, {"b": R1[2:3]})
    b.add("a", P)  # resumed with the same id: its row is prompt + everything so far
    b.rows["a"] = P + R1[:3]
    drafts = b.step(d, {"a": R1[3:4], "b": R1[3:4]})
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
    # No history at all: medium class, cap 4 (a sibling 6 tokens ahead offers more).
    d, b = drafter(policy="das", k=8), Batch()
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
    d2, b2 = drafter(policy="das", k=8), Batch()
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

