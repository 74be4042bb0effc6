"""BatchDrafter: the DAS drafter driven by what vLLM's model runner shows a proposer, one call per engine step.

vLLM shows only this step's batch (ids, prompt lengths, token rows, the tokens just sampled) and never says
that a request finished; the tracker turns that view into a DraftStore's start / observe / finish: paused,
departed and reused ids, and when the window rolls, as docs/vllm.md ("Finished requests and RL steps inside
vLLM") tells. Draft caps: the policy's budget (dasrl.policy.make_policy, priced by vLLM's own step cost:
StepClock) within num_speculative_tokens, max_model_len and max_tokens; each draft is cut to max_spec_factor x
its match length, then trimmed by the policy. State is kept in arrays, a slot per request, and the host work is
native calls over vLLM's token buffer; tests/test_vllm_rows.py holds it to the row-by-row tracker it replaced,
draft for draft. Numpy and the native core: no vLLM import.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from itertools import repeat
from typing import Callable, Collection, Mapping, Sequence

import numpy as np

from dasrl import _core
from dasrl.drafter.base import DraftBatch, problem_key
from dasrl.drafter.counting import MAX_PERIOD, WINDOW, counted
from dasrl.drafter.store import DraftStore
from dasrl.drafter.suffix import TokenError
from dasrl.integrations.vllm.config import VLLMDrafterConfig
from dasrl.policy.allowance import ForwardAllowance, RowBatch
from dasrl.policy.base import FixedBudget, RequestState
from dasrl.policy.factory import make_policy
from dasrl.policy.latency import LatencyModel, OnlineLatency, prior_for


@dataclass
class DrafterStats:
    """Counters since construction (an accepted token is a draft token that the next call finds in the row)."""

    steps: int = 0
    started: int = 0
    finished: int = 0
    restarted: int = 0
    proposals: int = 0
    drafted: int = 0
    accepted: int = 0
    resolved: int = 0  # drafted tokens whose verification was seen (not still in flight, nor lost)
    paused: int = 0  # times a request vLLM still held (preempted or unscheduled) was absent from the batch
    calls: int = 0  # one per vLLM step that reached the proposer
    reused: int = 0  # known request ids that came back as another request
    counted: int = 0  # drafts that continued a numbered pattern by counting (drafter/counting.py)
    errors: int = 0  # steps whose drafting failed and was skipped (DASProposer.propose_batch)
    propose_s: float = 0.0  # the drafter's own cost: on the forward's core when vLLM runs on a CPU

    def as_dict(self) -> dict:
        return dict(vars(self), acceptance=self.accepted / self.resolved if self.resolved else 0.0)


class StepClock:
    """vLLM's step cost as a LatencyModel fitted inside the proposer (docs/vllm.md, `latency_floor`): vLLM calls
    the proposer right after each forward, so the time between two calls is one step, whose tokens and context
    the tracker knows. Prefill steps and steps across an RL step boundary are not recorded."""

    def __init__(self, prior: LatencyModel, *, window: int = 256, min_samples: int = 32, refit_every: int = 32,
                 now: Callable[[], float] = time.perf_counter) -> None:
        # vLLM's rows cost their tokens only: the dasrl engine's drafting terms would be scaled into every fit
        prior = replace(prior, c_draft_kv=0.0, c_draft=0.0)
        self.fit = OnlineLatency(prior, window=window, min_samples=min_samples, refit_every=refit_every)
        self._now = now
        self._pending: tuple[float, int, int, int] | None = None  # (t, rows, drafted, kv) of the open step

    def tick(self, rows_next: int | None, drafted_next: int = 0, kv_next: int = 0) -> None:
        """A proposer call: record the step since the last call, open the next (`rows_next` None: unrecorded)."""
        t = self._now()
        if self._pending is not None:
            t0, rows, drafted, kv = self._pending
            self.fit.record(rows + drafted, kv, 0, t - t0, rows=rows)
        self._pending = None if rows_next is None else (t, int(rows_next), int(drafted_next), int(kv_next))

    def skip(self) -> None:
        """Leave the step since the last call unrecorded (prefill, step boundary)."""
        self._pending = None

    @property
    def num_samples(self) -> int:
        return self.fit.num_samples

    def model(self) -> LatencyModel:
        return self.fit.model()


_NONE = np.zeros(0)


def match_capped(batch: DraftBatch, factor: float) -> DraftBatch:
    """Each draft cut to `factor` x its match length (vLLM's max_spec_factor rule); factor <= 0: uncut."""
    return batch if factor <= 0 else batch.capped((factor * batch.match_len).astype(np.int64))


def proposer_policy(config: VLLMDrafterConfig, k: int, device: str) -> ForwardAllowance | FixedBudget:
    """The session's policy: das priced by the latency file or the prior of vLLM's device type, or fixed k."""
    if config.policy == "das":
        latency = LatencyModel.load(config.latency) if config.latency else prior_for(device)
        return make_policy("das", latency=latency, caps=config.caps)
    return make_policy(config.policy, **({"k": k} if config.policy == "fixed" else {}))


class _Rows:
    """Per-request state, a slot per request. int64: prompt length, tokens fed to the store (`seen`, 0: not
    started there), generated tokens, forwards, drafted and accepted tokens, max_tokens, the pending draft's
    length and id() of vLLM's state object; the pending drafts `draft[s, :dlen[s]]`; objects: the id, its
    RequestState (synced when handed out), vLLM's state object."""

    INTS = ("plen", "seen", "gen", "fwd", "drafted", "accepted", "max_new", "dlen", "hid")
    OBJECTS = ("rids", "state", "handle")

    def __init__(self, k: int) -> None:
        self.cap = 0  # slots handed out so far, free ones included
        self.draft = np.zeros((0, k), np.int32)
        for f in self.INTS:
            setattr(self, f, np.zeros(0, np.int64))
        for f in self.OBJECTS:
            setattr(self, f, np.full(0, None, object))
        self._free: list[int] = []

    def add(self) -> int:
        if self._free:
            return self._free.pop()
        s = self.cap
        if s >= len(self.plen):  # full: every array doubles
            for f in self.INTS + self.OBJECTS + ("draft",):
                old = getattr(self, f)
                new = np.full((max(16, 2 * s),) + old.shape[1:], None if old.dtype == object else 0, old.dtype)
                new[:s] = old
                setattr(self, f, new)
        self.cap += 1
        return s

    def free(self, s: int) -> None:
        self.rids[s] = self.state[s] = self.handle[s] = None
        self._free.append(s)

    def synced(self, s: int) -> RequestState:
        st = self.state[s]
        st.generated, st.forwards = int(self.gen[s]), int(self.fwd[s])
        st.drafted, st.accepted = int(self.drafted[s]), int(self.accepted[s])
        return st


class BatchDrafter:
    """See the module docstring."""

    def __init__(self, config: VLLMDrafterConfig = VLLMDrafterConfig(), *, num_speculative_tokens: int,
                 max_model_len: int, device: str, vocab_size: int | None = None,
                 digits: np.ndarray | None = None) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.config, self.k, self.max_model_len = config, int(num_speculative_tokens), int(max_model_len)
        self.store = DraftStore(config.store_config(vocab_size))
        self.device = device  # vLLM's DeviceConfig.device_type: whose latency prior prices drafts
        self.digits = digits  # [10] the digits' token ids: counting drafts (None: off)
        self.policy = proposer_policy(config, self.k, device)
        self.stats = DrafterStats()
        self.clock = StepClock(self.policy.latency or prior_for(device), window=config.latency_window)
        self._rows = _Rows(self.k)
        self._slot: dict[str, int] = {}  # requests vLLM holds (in the batch, or paused) -> slot, in arrival order
        self._held: tuple | None = None  # _held_rows() cached; None: changed
        self._batch: tuple[list, np.ndarray] | None = None  # (ids, slots) of the last call; None: one came or went
        self._serial = 0  # the policy's request key is (vLLM's id, serial): a reused id is another request
        self._finished_since_step = 0
        self.explicit = config.explicit_steps  # True once the caller ended a step: no boundary is inferred
        self._signalled = False  # end_step() was called: the window rolls at the next call, after its departures

    @property
    def latency(self) -> LatencyModel | None:
        """The model the policy prices drafts with (None: the fixed policy prices nothing)."""
        return self.policy.latency

    @property
    def _reqs(self) -> dict[str, RequestState]:
        """The tracked requests' states (synced), by id: for inspection."""
        return {rid: self._rows.synced(s) for rid, s in self._slot.items()}

    def _state(self, rid: str, problem: object, prompt_len: int, max_new: int, generated: int = 0) -> RequestState:
        self._serial += 1
        return RequestState((rid, self._serial), problem, prompt_len, max_new, generated=generated)

    # ---------------------------------------------------------------- steps
    def end_step(self) -> None:
        """The caller closes the RL step: the window rolls at the next call (vLLM's runner drops a request
        finished in its last step only when the next step begins), and no boundary is inferred from now on."""
        self.explicit = self._signalled = True

    def _roll(self) -> None:
        self._signalled = False
        r = self._rows
        for s in self._slot.values():  # in flight across the boundary: neither finished nor the new step's yet
            st = r.state[s]
            self.policy.abort(st)
            r.state[s] = self._state(st.req_id[0], st.problem_id, st.prompt_len, st.max_new_tokens, int(r.gen[s]))
            r.fwd[s] = r.drafted[s] = r.accepted[s] = 0
            if r.seen[s]:  # the store drops them at end_step: re-started from their rows
                r.seen[s] = r.dlen[s] = 0
                self.stats.restarted += 1
        self._held = None
        self.store.end_step()
        self.policy.end_step()
        self._finished_since_step = 0
        self.stats.steps += 1

    def _boundary(self, new_ids: bool) -> bool:
        n = self._finished_since_step
        if self.explicit or not n:
            return False
        if self.config.step_requests:
            return n >= self.config.step_requests
        drained = new_ids and not self._slot  # every known request departed; a new one arrives
        return drained or 0 < self.config.max_step_requests <= n

    def _depart(self, rid: str, learn: bool = True) -> None:
        """vLLM no longer holds the request: its rollout joins the history (`learn`), or is dropped."""
        s = self._slot.pop(rid)
        self._held = self._batch = None
        r = self._rows
        state, seen = r.synced(s), r.seen[s]
        r.free(s)
        if not (seen and learn):  # dropped, or left before its first token: nothing to learn from
            if seen:
                self.store.abort(rid)
            self.policy.abort(state)
            return
        self.store.finish(rid)
        self.policy.finish(state)
        self.stats.finished += 1
        self._finished_since_step += 1

    def forget(self) -> None:
        """Drop every tracked request unlearned (after a failed call, so that nothing half done leaks into later
        steps); vLLM's requests re-start from their rows at the next call."""
        for rid in list(self._slot):
            self._depart(rid, learn=False)

    # -------------------------------------------------------------- propose
    def propose(self, *, req_ids: Sequence[str], prompt_lens: Sequence[int], token_rows: np.ndarray,
                num_tokens: Sequence[int], sampled: Sequence[Sequence[int]],
                max_new_tokens: Sequence[int] | Callable[[str], int] | None = None,
                live: Collection[str] | None = None) -> list[list[int]]:
        """Drafts for the batch, one list per row: row i is request req_ids[i], whose tokens are
        token_rows[i, :num_tokens[i]] (the first prompt_lens[i] its prompt); sampled[i] are the tokens it just
        got (empty while its prompt is prefilled: no draft). `max_new_tokens`: each row's max_tokens, or a
        function of the id asked once per new request (None: the context limit). `live`: every id vLLM still
        holds (the runner's `requests`: an absent one is paused, not finished); as a mapping, its values tell a
        reused id from the same request; None: every absent request has departed."""
        start = time.perf_counter()
        try:
            return self._propose(req_ids, prompt_lens, token_rows, num_tokens, sampled, max_new_tokens, live)
        finally:
            self.stats.calls += 1
            self.stats.propose_s += time.perf_counter() - start

    def _propose(self, req_ids, prompt_lens, token_rows, num_tokens, sampled, max_new_tokens, live) -> list[list[int]]:
        n_rows = len(req_ids)
        for name, seq in (("prompt_lens", prompt_lens), ("num_tokens", num_tokens), ("sampled", sampled)):
            if len(seq) < n_rows:
                raise ValueError(f"{name} has {len(seq)} entries for {n_rows} requests")
        req_ids = list(req_ids)
        tracked, r, last = self._slot, self._rows, self._batch
        if last is not None and last[0] == req_ids:  # the last call's rows (vLLM's usual step): checked then
            slots = last[1].copy()  # [n]
        else:
            slots = np.fromiter(map(tracked.get, req_ids, repeat(-1)), np.int64, n_rows)  # [n] -1: not tracked
            if len(set(req_ids)) != n_rows:
                raise ValueError(f"duplicate request ids in the batch: {sorted(req_ids)}")
        plens = np.asarray(prompt_lens[:n_rows], np.int64)  # [n]
        ntok = np.asarray(num_tokens[:n_rows], np.int64)  # [n]
        n_new = int(np.count_nonzero(slots < 0))
        if len(tracked) != n_rows - n_new:  # some tracked request is absent: departed unless vLLM holds it
            present = set(req_ids)
            held = live if live is None or isinstance(live, (Mapping, set, frozenset)) else set(live)
            for rid in [t for t in tracked if t not in present and (held is None or t not in held)]:
                self._depart(rid)
        if n_new < n_rows:  # a known id whose row does not fit its request: another request under the id
            other = (plens != r.plen[slots]) | (ntok < r.seen[slots])  # [n] (a new id's slot -1 reads another's)
            if isinstance(live, Mapping):
                other |= np.fromiter(map(id, map(live.get, req_ids)), np.int64, n_rows) != r.hid[slots]
            if n_new:
                other &= slots >= 0
            for i in np.flatnonzero(other).tolist():
                self.stats.reused += 1
                self._depart(req_ids[i])
                slots[i] = -1
            n_new = int(np.count_nonzero(slots < 0))
        self.stats.paused += len(tracked) - (n_rows - n_new)
        if n_new:  # the step just computed prefilled them: its token count is unknown
            self.clock.skip()
        if self._signalled or self._boundary(n_new > 0):
            self._roll()

        every = all(sampled[:n_rows])  # no row in (chunked) prefill
        has = None if every else np.fromiter(map(len, sampled[:n_rows]), np.int64, n_rows) > 0
        self._check(req_ids, slots, plens, ntok, has, token_rows, n_new)
        for i in (np.flatnonzero(slots < 0).tolist() if n_new else ()):
            rid, plen = req_ids[i], int(plens[i])
            cap = max_new_tokens(rid) if callable(max_new_tokens) else \
                self.max_model_len - plen if max_new_tokens is None else max_new_tokens[i]
            cap = max(int(cap), 1)
            s = r.add()
            r.rids[s], r.handle[s] = rid, live.get(rid) if isinstance(live, Mapping) else None
            r.state[s] = self._state(rid, problem_key(token_rows[i, :plen]), plen, cap)
            r.plen[s], r.max_new[s], r.hid[s] = plen, cap, id(r.handle[s])
            r.seen[s] = r.gen[s] = r.fwd[s] = r.drafted[s] = r.accepted[s] = r.dlen[s] = 0
            tracked[rid] = slots[i] = s
            self._held = None
        self._batch = (req_ids, slots.copy())  # every row tracked now

        drafts: list[list[int]] = [[] for _ in range(n_rows)]
        rows = np.arange(n_rows) if every else np.flatnonzero(has)  # [R] batch rows that may draft
        if not len(rows):
            self.clock.tick(None)
            return drafts
        rs, n = (slots, ntok) if every else (slots[rows], ntok[rows])  # [R] their slots and tokens
        old = r.seen[rs]  # [R] tokens fed so far
        for j in (np.flatnonzero(old == 0).tolist() if not old.all() else ()):  # first tokens: start in the store
            s, i = rs[j], rows[j]
            self.store.start(r.rids[s], r.state[s].problem_id, token_rows[i, :r.plen[s]])
            r.seen[s] = old[j] = r.plen[s]
            self.stats.started += 1
        self._feed(req_ids, rows, rs, old, n, token_rows)
        drafted = self._draft(rows, rs, self._caps(rs, n), drafts, token_rows, n)
        self.clock.tick(len(rows) if every else None, drafted, int(n.sum()))  # rows in prefill: next step unknown
        return drafts

    def _check(self, req_ids, slots, plens, ntok, has, token_rows, n_new: int) -> None:
        """Raise at the first bad row what the row-by-row tracker raised there: a new request with no prompt
        token, more tokens than its row holds or fewer than were fed (a negative token id: _feed)."""
        width = token_rows.shape[1]
        if not n_new and (not len(ntok) or int(ntok.max()) <= width):  # known rows, reuse checked: n >= seen
            return
        new = slots < 0
        known = np.flatnonzero(~new)
        seen = plens.copy()  # [n] tokens fed once the row is started (the prompt, if not yet)
        seen[known] = np.maximum(self._rows.seen[slots[known]], plens[known])
        has = np.ones(len(ntok), bool) if has is None else has
        bad_plen, bad_width = new & (plens < 1), has & (ntok > width)
        bad = np.flatnonzero(bad_plen | bad_width | (has & (ntok < seen)))
        if not len(bad):
            return
        i = int(bad[0])
        rid = req_ids[i]
        if bad_plen[i]:
            raise ValueError(f"request {rid!r}: prompt length {int(plens[i])} (vLLM gave no prompt tokens)")
        if bad_width[i]:
            raise ValueError(f"request {rid!r}: {int(ntok[i])} tokens but the token row holds {width}")
        raise ValueError(f"request {rid!r}: {int(ntok[i])} tokens, fewer than the {int(seen[i])} already fed")

    def _feed(self, req_ids, rows: np.ndarray, rs: np.ndarray, old: np.ndarray, n: np.ndarray,
              token_rows: np.ndarray) -> None:
        """Advance the rows (batch rows `rows`, slots `rs`, `old` tokens fed) to `n` tokens: index their new
        tokens in one native call and count what the step kept of each verified draft in another (drafted and
        accepted move together, as in the engine)."""
        r = self._rows
        count = n - old  # [R] new tokens
        if int(count.min()) > 0:  # every row got tokens (the usual step)
            fr, fs, fc, fo, fn = rows, rs, count, old, n
        else:
            fed = np.flatnonzero(count > 0)
            if not len(fed):
                return
            fr, fs, fc, fo, fn = rows[fed], rs[fed], count[fed], old[fed], n[fed]
        try:
            self.store.observe_rows(r.rids[fs].tolist(), token_rows, fr, fo, fc)
        except TokenError as e:
            if e.token >= 0 or e.row is None:
                raise
            i = int(fr[e.row])
            new = np.asarray(token_rows[i, int(fo[e.row]):int(fo[e.row] + fc[e.row])])
            raise ValueError(f"request {req_ids[i]!r}: token id {int(new.min())} in vLLM's token row "
                             f"(placeholders of async scheduling?); run vLLM with async_scheduling=False") from None
        r.gen[fs] = fn - r.plen[fs]
        r.fwd[fs] += 1
        r.seen[fs] = fn
        pending = r.dlen[fs]
        n_pending = int(np.count_nonzero(pending))  # rows whose last draft the step just run verified
        if not n_pending:
            return
        if n_pending == len(fs):  # every row drafted
            vs, dl, vr, vo, vc = fs, pending, fr, fo, fc
        else:
            v = np.flatnonzero(pending)
            vs, dl, vr, vo, vc = fs[v], pending[v], fr[v], fo[v], fc[v]
        try:
            acc = _core.accepted_rows(r.draft[vs], dl, token_rows, vr, vo, vc)
        except TypeError:  # a token table of another dtype (the store reads any): its rows' k + 1 tokens, copied
            cols = np.minimum(vo[:, None] + np.arange(self.k + 1), token_rows.shape[1] - 1)  # [V, k + 1]
            table = np.asarray(token_rows)[vr[:, None], cols].astype(np.int64)  # [V, k + 1]
            acc = _core.accepted_rows(r.draft[vs], dl, table, np.arange(len(vs)), np.zeros(len(vs), np.int64),
                                      np.minimum(vc, self.k + 1))
        r.drafted[vs] += dl
        r.accepted[vs] += acc
        self.stats.accepted += int(acc.sum())
        self.stats.resolved += int(dl.sum())
        r.dlen[vs] = 0

    def _held_rows(self) -> tuple[np.ndarray | slice, list, list, np.ndarray]:
        """(slots, or the slice of them, request keys, problems, each slot's place) of the held requests."""
        if self._held is None:
            r = self._rows
            slots = np.fromiter(self._slot.values(), np.int64, len(self._slot))
            states = r.state[slots].tolist()
            place = np.zeros(r.cap, np.int64)
            place[slots] = np.arange(len(slots))
            # slots 0..n-1 in order: the arrays' first n entries are the batch (views, read before any change)
            self._held = (slice(0, len(slots)) if np.array_equal(slots, np.arange(len(slots))) else slots,
                          [s.req_id for s in states], [s.problem_id for s in states], place)
        return self._held

    def _caps(self, rs: np.ndarray, n: np.ndarray) -> np.ndarray:
        """[R] each row's draft cap: the policy's budget within k, the context limit and its max_tokens."""
        lat = self.clock.model() if self.config.latency_floor and self.latency is not None else None
        if lat is not None and lat is not self.policy.latency:  # a refit (bounded cadence: OnlineLatency)
            self.policy.latency = lat  # the draft allowance stays the session's (None: priced per row)
        # The policy sees every request vLLM holds: a paused one is not finished (it would learn from it).
        r, pol = self._rows, self.policy
        if isinstance(pol, FixedBudget):  # fixed k, no speculation: every row alike, nothing kept per row
            budget = np.full(len(rs), pol.k, np.int64)
        else:
            held, keys, problems, place = self._held_rows()
            if pol.caps.uniform() is not None:  # equal class caps: the rows as arrays
                budget = pol.budgets_rows(RowBatch(keys, problems, r.plen[held], r.max_new[held], r.gen[held],
                                                   r.drafted[held], r.accepted[held]))[place[rs]]
            else:  # each row's class sets its cap: the rows one by one
                states = [r.synced(s) for s in np.arange(r.cap)[held].tolist()]
                for st in states:
                    st.classes.clear()  # the policy appends one class per call: keep only this call's
                budget = np.asarray(pol.budgets(states), np.int64)[place[rs]]
        room = np.minimum(self.max_model_len - n, r.max_new[rs] - r.gen[rs]) - 1  # the target adds one
        return np.maximum(np.minimum(np.minimum(room, budget), self.k), 0)

    def _draft(self, rows: np.ndarray, rs: np.ndarray, caps: np.ndarray, drafts: list[list[int]],
               token_rows: np.ndarray, n: np.ndarray) -> int:
        """Propose for the rows with a cap (counting drafts where a row's last tokens are a numbered pattern),
        cut to max_spec_factor x the match and trimmed by the policy, into `drafts` (kept until their
        verification shows). Returns the tokens drafted."""
        n_on = int(np.count_nonzero(caps))
        if not n_on:
            return 0
        r, pol = self._rows, self.policy
        if n_on == len(caps):  # every row drafts
            on, ds, caps_on = slice(None), rs, caps
        else:
            on = np.flatnonzero(caps)
            ds, caps_on = rs[on], caps[on]
        out = self.store.propose_flat(r.rids[ds].tolist(), caps_on)
        if self.digits is not None:  # counting drafts: each row's last tokens, read in vLLM's token rows
            rr, ends = rows[on], n[on]  # [D] their batch rows and lengths
            starts = np.maximum(ends - WINDOW, 0)  # [D]
            try:
                periods = _core.count_periods_rows(token_rows, rr, starts, ends - starts, self.digits, MAX_PERIOD)
            except TypeError:  # a token table of another dtype or layout (the store reads any): read as a copy
                periods = _core.count_periods_rows(np.ascontiguousarray(token_rows, np.int64), rr, starts,
                                                   ends - starts, self.digits, MAX_PERIOD)
            if periods.any():
                out, c = counted(out, lambda j: np.asarray(token_rows[rr[j], starts[j]:ends[j]]), periods, caps_on,
                                 self.digits, MAX_PERIOD)
                self.stats.counted += c
        factor = self.config.max_spec_factor
        if not pol.trims:  # cut to max_spec_factor x the match (0: not cut)
            keep = out.lengths if factor <= 0 else _core.cut_chains(
                out.probs, out.offsets, out.match_len, float(factor), None, _NONE, _NONE, _NONE, 0.0, 1.0)[0]
        elif pol._batch is not None and pol._batch[0].keys is self._held_rows()[1]:  # the batch it just priced
            keep = pol.trim_rows(self._held_rows()[3][ds], out, factor)
        else:
            out = pol.trim([r.synced(s) for s in ds.tolist()], match_capped(out, factor))
            keep = out.lengths
        r.dlen[ds] = keep
        total = int(keep.sum())
        starts = out.offsets[:-1]
        if total:  # kept until their verification shows
            _core.scatter_rows(r.draft, ds, out.tokens, starts, keep)
        self.stats.proposals += int(np.count_nonzero(keep))
        self.stats.drafted += total
        toks = out.tokens.tolist()
        for i, lo, k in zip(rows[on].tolist(), starts.tolist(), keep.tolist()):
            drafts[i] = toks[lo:lo + k]
        return total

    @property
    def num_live(self) -> int:
        return len(self._slot)
