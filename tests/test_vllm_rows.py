"""BatchDrafter (the vLLM proposer's bookkeeping in arrays, native feed and cut) against the row-by-row tracker it
replaced (support.rowwise_tracker, over the row-by-row policy): the same drafts for every row of every call and
the same counters, over random runs of vLLM-like batches -- siblings re-sampling a history, requests joining
mid-step (a partial prefill first), leaving, paused while vLLM holds them, ids reused, RL step boundaries signalled
or inferred, token tables of another dtype -- and the native kernels against the numpy they repeat."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dasrl import _core
from dasrl.integrations.vllm import BatchDrafter, VLLMDrafterConfig
from dasrl.policy.latency import LatencyModel
from support.rowwise_tracker import RowwiseTracker, _accepted

_DIR = Path(tempfile.mkdtemp())
LATENCY = {"h100": LatencyModel(0.00628, 2.38e-5, 2.14e-8), "cpu": LatencyModel(0.06, 0.0025, 2e-6, 1e-6, 0.02)}
for _name, _lat in LATENCY.items():
    _lat.save(_DIR / f"{_name}.json")


class Handle:
    """vLLM's per-request state object (identity tells a reused id from the same request)."""


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_the_array_tracker_equals_the_row_by_row_tracker(data):
    draw = data.draw
    policy = draw(st.sampled_from(["das", "das", "fixed"]))
    cfg = {"policy": policy, "latency_floor": False, "max_spec_factor": draw(st.sampled_from([0.0, 1.0, 2.0])),
           "cross_problem": draw(st.booleans())}
    if policy == "das":
        cfg["latency"] = str(_DIR / f"{draw(st.sampled_from(sorted(LATENCY)))}.json")
    if draw(st.booleans()):
        cfg["max_step_requests"] = draw(st.integers(1, 6))
    k = draw(st.sampled_from([3, 8]))
    width = 90
    new = BatchDrafter(VLLMDrafterConfig.from_dict(cfg), num_speculative_tokens=k, max_model_len=width, device="cpu")
    old = RowwiseTracker(VLLMDrafterConfig.from_dict(cfg), num_speculative_tokens=k, max_model_len=width)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    prompts = [rng.integers(1, 50, int(rng.integers(2, 8))).tolist() for _ in range(3)]
    answers = [rng.integers(1, 50, 40).tolist() for _ in range(3)]
    live: dict[str, dict] = {}  # rid -> {prompt, truth, out, handle, prefill}
    serial = 0
    with_live = draw(st.sampled_from(["mapping", "set", "none"]))
    for call in range(draw(st.integers(3, 40))):
        # the batch: requests join (a prefill step first, sometimes), some are paused (held, not scheduled)
        for _ in range(draw(st.integers(0, 3)) if len(live) < 10 else 0):
            serial += 1
            reuse = [r for r in ("x0", "x1") if r not in live]
            rid = reuse[0] if reuse and draw(st.booleans()) else f"r{serial}"
            j = int(rng.integers(0, 3))
            truth = list(answers[j])
            truth[int(rng.integers(0, 40))] = int(rng.integers(1, 50))
            live[rid] = {"prompt": prompts[j], "truth": truth, "out": [], "handle": Handle(),
                         "prefill": draw(st.booleans())}
        ids = [r for r in live if not (live[r]["out"] and draw(st.integers(0, 9)) == 0)]  # ~1 in 10 paused
        if not ids:
            continue
        buf = np.zeros((len(ids), width), np.int32)
        sampled, plens, ntok = [], [], []
        for i, rid in enumerate(ids):
            q = live[rid]
            if q["prefill"]:  # the prompt is being prefilled: nothing sampled yet
                q["prefill"] = False
                row = q["prompt"]
                sampled.append([])
            else:
                if not q["out"]:
                    q["out"] = [q["truth"][0]]
                    q["new"] = list(q["out"])
                row = q["prompt"] + q["out"]
                sampled.append(q.pop("new", [q["out"][-1]]))
            buf[i, :len(row)] = row
            plens.append(len(q["prompt"]))
            ntok.append(len(row))
        if draw(st.integers(0, 3)) == 0:  # a token table of another dtype: the native calls' fallbacks
            buf = buf.astype(np.int16)
        holder = {r: live[r]["handle"] for r in live}
        kw = dict(req_ids=ids, prompt_lens=plens, token_rows=buf, num_tokens=ntok, sampled=sampled,
                  live=holder if with_live == "mapping" else set(holder) if with_live == "set" else None)
        if draw(st.booleans()):
            kw["max_new_tokens"] = [60] * len(ids)
        got = new.propose(**kw)
        want = old.propose(**kw)
        assert got == want, call
        # verification: each row emits its draft's agreeing prefix and one more token
        for rid, draft, s in zip(ids, got, sampled):
            q = live[rid]
            if not s:
                continue
            g = len(q["out"])
            a = 0
            while a < len(draft) and g + a < len(q["truth"]) and draft[a] == q["truth"][g + a]:
                a += 1
            emitted = q["truth"][g:g + a + 1]
            q["out"] += emitted
            q["new"] = emitted
        for rid in [r for r in live if len(live[r]["out"]) >= len(live[r]["truth"]) or len(live[r]["prompt"]) +
                    len(live[r]["out"]) >= width - k - 2]:
            del live[rid]  # finished: vLLM drops it
        if draw(st.integers(0, 7)) == 0:
            new.end_step()
            old.end_step()
    a, b = new.stats.as_dict(), old.stats.as_dict()
    a.pop("propose_s"), b.pop("propose_s")
    for name in ("steps", "reused", "paused", "accepted", "restarted"):
        event(f"{name} > 0: {a[name] > 0}")
    assert a == b
    assert new.num_live == old.num_live and set(new._reqs) == set(old._reqs)
    for rid, s in new._reqs.items():
        t = old._reqs[rid].state
        assert (s.generated, s.forwards, s.drafted, s.accepted, s.max_new_tokens) == \
            (t.generated, t.forwards, t.drafted, t.accepted, t.max_new_tokens)
    if policy == "das":
        assert new.policy.take_spent() == old.policy.take_spent()
        assert new.policy._calib == old.policy._calib and new.policy._expected == old.policy._expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=8), st.lists(st.integers(0, 3), min_size=1, max_size=10)),
                min_size=1, max_size=12))
def test_native_accept_counts_equal_the_engines_rule(rows):
    """accepted_rows (native) against _accepted (the engine's accept rule)."""
    k = 8
    drafts = np.zeros((len(rows), k), np.int32)
    buf = np.zeros((len(rows), 30), np.int32)
    for j, (d, new) in enumerate(rows):
        drafts[j, :len(d)] = d
        buf[j, 5:5 + len(new)] = new
    dlen = np.array([len(d) for d, _ in rows], np.int64)
    idx, start = np.arange(len(rows), dtype=np.int64), np.full(len(rows), 5, np.int64)
    count = np.array([len(n) for _, n in rows], np.int64)
    want = _accepted([d for d, _ in rows], [np.array(n) for _, n in rows]).tolist()
    assert _core.accepted_rows(drafts, dlen, buf, idx, start, count).tolist() == want


def test_native_sum_is_numpys():
    """cut_chains sums a kept draft's probabilities as numpy does (pairwise, in blocks): the same float."""
    rng = np.random.default_rng(0)
    for n in list(range(0, 140)) + [255, 256, 300, 1000]:
        for _ in range(20):
            x = rng.random(n) ** rng.uniform(0.1, 3)
            assert _core.numpy_sum(x) == x.sum(), n
