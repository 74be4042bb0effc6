"""Simulator.run_step for the one batching `dasrl whatif` uses (every row of the step in one packed forward),
with the per-row work done on the flat draft batch: CHAMP-sized replays (millions of tokens per drafter)
spend ~85 us per row-forward in Simulator.run_step's per-row numpy calls, a few here.

It must give the same StepStats as Simulator(config=SimConfig(max_batch=0, batch_mode="static")).run_step
(forwards, row-forwards, tokens, drafted, accepted and every forward shape): tests/lab/test_whatif.py checks it
for every whatif method. Semantics copied from there: one prefill forward (prompt tokens, no draft), the
engine's propose -> cap -> trim path, a tree draft followed by its matching child, finished rows
swap-removed last first.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from dasrl.drafter import DraftBatch
from dasrl.policy import RequestState
from dasrl.policy import propose
from dasrl_lab.trace import Response
from dasrl.engine import accepted_counts
from dasrl_lab.sim.simulator import StepStats, replay_targets


def _accepted(batch, rows_tgt_start: np.ndarray, gen: np.ndarray, tlen: np.ndarray, flat_tgt: np.ndarray) -> np.ndarray:
    """[B] accepted draft tokens of every row: the engine's rule on the recorded continuations."""
    return accepted_counts(batch, *replay_targets(batch, flat_tgt, rows_tgt_start, gen, tlen))


def request_ids(step: int, n: int) -> list[tuple[int, int]]:
    """The request ids run_step gives a step's n responses, in order."""
    return [(step, i) for i in range(n)]


def run_step(drafter, policy, step: int, responses: Sequence[Response], *, max_new_tokens: int) -> StepStats:
    n = len(responses)
    rids = request_ids(step, n)
    targets = [np.asarray(r.response_ids, np.int32) for r in responses]
    tlen = np.array([t.size for t in targets], np.int64)
    tstart = np.zeros(n, np.int64)
    np.cumsum(tlen[:-1], out=tstart[1:])
    flat_tgt = np.concatenate(targets) if n else np.zeros(0, np.int32)
    states = [RequestState(rid, r.problem_id, len(r.prompt_ids), max_new_tokens) for rid, r in zip(rids, responses)]
    st = StepStats(step=step)
    live = []
    for i in range(n):
        if drafter is not None:
            drafter.start(rids[i], responses[i].problem_id, responses[i].prompt_ids)
        live.append(i)
    for i in [i for i in live if tlen[i] == 0]:  # empty responses finish without a forward
        _finish(drafter, policy, states[i])
        live.remove(i)
    first = True
    while live:
        idx = np.asarray(live)
        gen = np.array([states[i].generated for i in live], np.int64)
        lstates = [states[i] for i in live]
        if first:  # the prefill forward: the engine asks no policy there
            batch = DraftBatch.empty(len(live))
        else:
            room = (max_new_tokens - gen - 1).tolist()
            t0 = time.perf_counter()
            batch = propose(drafter, policy, lstates, [s.req_id for s in lstates], room)
            st.host_s += time.perf_counter() - t0
        lens = np.diff(batch.offsets)
        acc = _accepted(batch, tstart[idx], gen, tlen[idx], flat_tgt)
        emit_n = np.minimum(acc + 1, tlen[idx] - gen)
        plen = np.array([s.prompt_len for s in lstates], np.int64)
        if first:
            n_tok, kv, dkv = int(plen.sum() + lens.sum()), 0, 0
        else:
            cached = plen + gen - 1
            n_tok, kv, dkv = int(len(live) + lens.sum()), int(cached.sum()), int(cached[lens > 0].sum())
        emits = [flat_tgt[tstart[i] + g: tstart[i] + g + e] for i, g, e in zip(live, gen.tolist(), emit_n.tolist())]
        for s, e, d, a in zip(lstates, emit_n.tolist(), lens.tolist(), acc.tolist()):
            s.generated += e
            s.forwards += 1
            s.drafted += d
            s.accepted += a
        st.proposed += int(lens.sum())
        st.accepted += int(acc.sum())
        if drafter is not None:
            t0 = time.perf_counter()
            drafter.observe_batch([rids[i] for i in live], emits)
            st.host_s += time.perf_counter() - t0
        st.shapes.append((len(live), n_tok, kv, dkv))
        st.forwards += 1
        st.row_forwards += len(live)
        done = np.flatnonzero(gen + emit_n >= tlen[idx]).tolist()
        for k in reversed(done):  # as the engine: swap-remove, last first
            _finish(drafter, policy, states[live[k]])
            last = live.pop()
            if k < len(live):
                live[k] = last
        first = False
    st.tokens = int(tlen.sum())
    if drafter is not None:
        drafter.end_step()
    policy.end_step()
    return st


def _finish(drafter, policy, state: RequestState) -> None:
    if drafter is not None:
        drafter.finish(state.req_id)
    policy.finish(state)
