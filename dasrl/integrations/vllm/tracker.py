"""BatchDrafter: the DAS drafter driven by what vLLM's model runner knows, one call per engine step.

vLLM tells a proposer only about the requests in this step's input batch: their ids, prompt lengths,
token rows (prompt + output so far) and the tokens just sampled. It never says that a request finished.
This class turns that view into the Drafter protocol of a DraftStore:

* a request id seen for the first time is `start`ed (problem key = hash of its prompt token ids, so GRPO
  siblings share a shard); the row tokens past what was already fed are `observe`d;
* a request that is no longer in the batch is either *paused* (preempted under KV pressure, or running
  but not scheduled this step: vLLM drops it from the batch and brings it back later with the same id)
  or *departed* (finished or aborted). When the caller passes `live` -- the requests vLLM still holds
  state for (the model runner's `requests` dict: vLLM pops a request from it only when the scheduler
  reports it finished) -- the two are told apart exactly; without it every absent request counts as
  departed. A departed request is `finish`ed at once -- its rollout joins its problem's history -- and
  dropped from tracking, so the requests tracked are those vLLM holds, however long a server runs;
* a known id whose row no longer fits its request (another prompt length, a row shorter than what was
  fed, or, with `live` a mapping, another request-state object of vLLM's) is a *reused* id: the old
  request departs and the new one starts, instead of being spliced onto it;
* a step boundary (DraftStore.end_step: the window rolls) comes from the caller where it can send one
  (`end_step()`, e.g. `llm.collective_rpc(dasrl_end_step)`), taking effect at the next call, once the
  requests that finished before it have been seen leaving; from the first such signal on (or from the
  start with `explicit_steps`), no boundary is inferred. Until then: `step_requests=N` ends a step after every N finished requests; by default
  (0) a step ends when the batch has drained (every known request has departed and a new one arrives:
  one `LLM.generate` per RL step) or, for a server whose batch never drains, once `max_step_requests`
  requests finished since the last boundary. Requests in flight across a boundary are re-started from
  their current row.

Draft caps: the policy's budget, clipped to num_speculative_tokens and the room left before
max_model_len and max_tokens; each draft is then cut to max_spec_factor x its match length and trimmed by
the policy. The das policy is the session's own (`dasrl.policy.make_policy`):
ForwardAllowance's length classes (its problem's past lengths, its length so far) give upper bounds, and it
prices every row's draft with the latency model and its acceptance estimate, so a row
whose drafts stop paying stops drafting and the collapsed tail drafts deep (docs/policy.md, "Never
slower"). vLLM's own step cost prices it: the StepClock fits it from the time between calls and the
allowance gets each refit (a bounded cadence: between refits its drafts depend on the batch only).

The policy reads one RequestState per tracked request, kept as the engine keeps its own: `generated`
and `forwards` from the row, `drafted` and `accepted` when a draft's verification shows in the row (so
the two always move together, as after an engine step). A request that departs is `finish`ed; one that
never started, or that is dropped without finishing (forget), is `abort`ed. At a step boundary the
requests in flight are `abort`ed and carry on under a fresh state (their partial length is no finished
length), then the policy's `end_step` runs. States are keyed by (request id, serial): a reused vLLM id
is another request to the policy.

Per step the host work scales with what is drafted, not with the batch: what the tracker keeps of each request
is in arrays (a slot per request), the rows' new tokens are indexed straight from vLLM's token buffer and the
verified drafts counted in one native call each (dasrl/_core extend_rows, accepted_rows), the policy reads the
batch as arrays (ForwardAllowance.budgets_rows: a step where no row can pay is settled before any pricing) and
the drafts are cut (max_spec_factor, then the policy's trim) in one native call. tests/test_vllm_rows.py holds it
to the row-by-row tracker it replaced, draft for draft.

Numpy and the native core: no vLLM import, so it is tested on hand-made batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import repeat
from typing import Callable, Collection, Mapping, Sequence

import numpy as np

from dasrl import _core
from dasrl.drafter.base import DraftBatch, problem_key
from dasrl.drafter.store import DraftStore
from dasrl.drafter.suffix import TokenError
from dasrl.engine.verify import accepted_counts
from dasrl.integrations.vllm.clock import StepClock
from dasrl.integrations.vllm.config import VLLMDrafterConfig
from dasrl.policy.allowance import ForwardAllowance, RowBatch
from dasrl.policy.base import FixedBudget, RequestState
from dasrl.policy.factory import make_policy
from dasrl.policy.latency import LatencyModel, prior_for


@dataclass
class DrafterStats:
    """Counters since construction (drafted/accepted as seen by the drafter: an accepted token is a
    draft token that the next call finds in the row)."""

    steps: int = 0
    started: int = 0
    finished: int = 0
    restarted: int = 0
    proposals: int = 0
    drafted: int = 0
    accepted: int = 0
    resolved: int = 0
    """Drafted tokens whose verification was seen (drafted minus drafts still in flight or lost)."""
    paused: int = 0
    """Times a request vLLM still held (preempted or unscheduled) was absent from the batch."""
    calls: int = 0
    """Calls to propose (one per vLLM step that reached the proposer)."""
    reused: int = 0
    """Known request ids that came back as another request (the old one departed, the new one started)."""
    errors: int = 0
    """Steps in which drafting failed and was skipped (DASProposer.propose_batch)."""
    propose_s: float = 0.0
    """Wall seconds inside propose (indexing the new tokens, the policy, drafting): the drafter's own
    cost, paid on the same core as the forward when vLLM runs on a CPU."""

    def as_dict(self) -> dict:
        d = dict(vars(self))
        d["acceptance"] = self.accepted / self.resolved if self.resolved else 0.0
        return d


def _accepted(drafts: Sequence[list[int]], news: Sequence[np.ndarray]) -> np.ndarray:
    """[n] draft tokens that verification kept of each row's chain draft, by the engine's rule
    (dasrl.engine.accepted_counts), the whole step in one call: a row's inputs' targets are the tokens vLLM
    emitted but its last (the recovered or bonus token, compared with nothing); inputs past them were never
    verified (-1)."""
    batch = DraftBatch.chains(drafts)
    starts = batch.offsets + np.arange(len(drafts) + 1)  # [n+1] each row's len + 1 inputs
    targets = np.full(int(starts[-1]), -1, np.int64)  # [sum(len + 1)]
    for b, (d, new) in enumerate(zip(drafts, news)):
        seen = max(min(len(new) - 1, len(d) + 1), 0)
        targets[starts[b]:starts[b] + seen] = new[:seen]
    return accepted_counts(batch, targets, starts)


_NONE = np.zeros(0)
_ARANGE = np.arange(0)


def _arange(n: int) -> np.ndarray:
    """np.arange(n), shared (read only)."""
    global _ARANGE
    if len(_ARANGE) < n:
        _ARANGE = np.arange(max(n, 2 * len(_ARANGE)))
        _ARANGE.flags.writeable = False
    return _ARANGE[:n]


def match_capped(batch: DraftBatch, factor: float) -> DraftBatch:
    """Each draft cut to `factor` x its match length (vLLM's max_spec_factor rule); factor <= 0: uncut."""
    return batch if factor <= 0 else batch.capped((factor * batch.match_len).astype(np.int64))


def proposer_policy(config: VLLMDrafterConfig, k: int, device: str) -> ForwardAllowance | FixedBudget:
    """The session's policy (dasrl.policy.make_policy): das with these caps, priced by the latency file (or the
    prior of vLLM's device type, as the session prices with its model's device), or fixed: k for every request."""
    if config.policy == "das":
        latency = LatencyModel.load(config.latency) if config.latency else prior_for(device)
        return make_policy("das", latency=latency, caps=config.caps)
    return make_policy(config.policy, **({"k": k} if config.policy == "fixed" else {}))


def _accepted_in_rows(drafts: np.ndarray, lengths: np.ndarray, token_rows: np.ndarray, rows: np.ndarray,
                     starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`_accepted` on arrays, for the whole step at once: [n] leading tokens of each chain draft
    (drafts[j, :lengths[j]]) equal to the tokens vLLM emitted after it, token_rows[rows[j], starts[j]:
    starts[j] + counts[j]], the last of those compared with nothing."""
    n, k = drafts.shape
    if not n or not k:
        return np.zeros(n, np.int64)
    j = np.arange(k)  # [k]
    cols = np.minimum(starts[:, None] + j, token_rows.shape[1] - 1)  # [n, k] (past the row: never compared)
    seen = np.minimum(counts - 1, lengths)  # [n] draft tokens verification compared
    same = (drafts == token_rows[rows[:, None], cols]) & (j < seen[:, None])  # [n, k]
    return np.where(same.all(axis=1), k, same.argmin(axis=1)).astype(np.int64)


class _Rows:
    """What the drafter keeps of each request vLLM holds, in arrays, a slot per request: its prompt length,
    tokens fed to the store (`seen`, 0 = not started there yet), generated tokens, verification forwards,
    drafted and accepted tokens (what the policy reads, as the engine keeps them), its length limit and its
    pending draft (`draft[s, :dlen[s]]`, proposed at the last call, verified in the next row). Python lists
    keep its id, its RequestState (synced from the arrays when handed out) and vLLM's state object."""

    FIELDS = ("plen", "seen", "gen", "fwd", "drafted", "accepted", "max_new", "dlen", "hid")

    def __init__(self, k: int) -> None:
        self.k = k
        self.cap = 0
        self.draft = np.zeros((0, k), np.int32)
        for f in self.FIELDS:
            setattr(self, f, np.zeros(0, np.int64))
        self.rid: list[str | None] = []
        self.rids = np.zeros(0, object)
        """The ids again, as an array (gathered by slots)."""
        self.state: list[RequestState | None] = []
        self.handle: list[object] = []
        self._free: list[int] = []

    def add(self) -> int:
        if self._free:
            return self._free.pop()
        s = self.cap
        if s >= len(self.plen):
            size = max(16, 2 * len(self.plen))
            for f in self.FIELDS:
                a = np.zeros(size, np.int64)
                a[:s] = getattr(self, f)[:s]
                setattr(self, f, a)
            d = np.zeros((size, self.k), np.int32)
            d[:s] = self.draft[:s]
            self.draft = d
            ids = np.full(size, None, object)
            ids[:s] = self.rids[:s]
            self.rids = ids
        self.rid.append(None)
        self.state.append(None)
        self.handle.append(None)
        self.cap += 1
        return s

    def free(self, s: int) -> None:
        self.rid[s] = self.state[s] = self.handle[s] = self.rids[s] = None
        self._free.append(s)

    def synced(self, s: int) -> RequestState:
        """The request's RequestState, its counters brought up to date."""
        st = self.state[s]
        st.generated, st.forwards = int(self.gen[s]), int(self.fwd[s])
        st.drafted, st.accepted = int(self.drafted[s]), int(self.accepted[s])
        return st


@dataclass
class _ReqView:
    """One tracked request as the tracker sees it (`BatchDrafter._reqs`, for inspection)."""

    prompt_len: int
    state: RequestState
    handle: object
    seen: int
    draft: list[int]


class BatchDrafter:
    """See the module docstring."""

    def __init__(self, config: VLLMDrafterConfig = VLLMDrafterConfig(), *, num_speculative_tokens: int,
                 max_model_len: int, device: str, vocab_size: int | None = None) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.config = config
        self.k = int(num_speculative_tokens)
        self.max_model_len = int(max_model_len)
        self.store = DraftStore(config.store_config(vocab_size))
        self.device = device
        """vLLM's device type (DeviceConfig.device_type: "cuda", "cpu", ...): whose latency prior prices drafts."""
        self.policy = proposer_policy(config, self.k, device)
        self.stats = DrafterStats()
        self.clock = StepClock(self.policy.latency or prior_for(device), window=config.latency_window)
        self._rows = _Rows(self.k)
        self._slot: dict[str, int] = {}
        """Requests vLLM holds (in the batch, or paused: absent from it but still in `live`) -> their slot, in
        the order they came (the order the policy sees them)."""
        self._held: tuple | None = None
        """(slots, request keys, problems, each slot's place) of the held requests in order; None: changed."""
        self._serial = 0
        """States made so far: the policy's request key is (vLLM's id, serial)."""
        self._finished_since_step = 0
        self.explicit = config.explicit_steps
        """True once the caller ended a step itself (end_step): from then on no boundary is inferred."""
        self._signalled = False
        """end_step() was called: the window rolls at the next call, after that call's departures."""

    @property
    def latency(self) -> LatencyModel | None:
        """The model the policy prices drafts with (None: the fixed policy prices nothing)."""
        return self.policy.latency

    @property
    def _reqs(self) -> dict[str, _ReqView]:
        """The tracked requests, id -> a view of what the tracker keeps (its state synced)."""
        r = self._rows
        return {rid: _ReqView(int(r.plen[s]), r.synced(s), r.handle[s], int(r.seen[s]),
                              r.draft[s, :r.dlen[s]].tolist()) for rid, s in self._slot.items()}

    def _state(self, rid: str, problem: object, prompt_len: int, max_new_tokens: int, generated: int = 0) -> RequestState:
        self._serial += 1
        return RequestState((rid, self._serial), problem, prompt_len, max_new_tokens, generated=generated)

    # ---------------------------------------------------------------- steps
    def end_step(self) -> None:
        """The caller closes the RL step: rollouts finished so far are the step's, the window rolls at the
        next call -- vLLM's runner drops a request finished in its last step only when the next step
        begins, so only then can such a request be told from one in flight. From now on the caller owns
        the boundaries: none is inferred from the batch any more."""
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

    def _depart(self, rid: str) -> None:
        """vLLM no longer holds the request (finished or aborted): its rollout joins the history now."""
        s = self._slot.pop(rid)
        self._held = None
        r = self._rows
        state = r.synced(s)
        seen = r.seen[s]
        r.free(s)
        if not seen:  # left before its first token: nothing to learn from
            self.policy.abort(state)
            return
        self.store.finish(rid)
        self.policy.finish(state)
        self.stats.finished += 1
        self._finished_since_step += 1

    def forget(self) -> None:
        """Drop every tracked request without learning from it (after a failed call: whatever it left half
        done cannot leak into later steps); vLLM's requests are re-started from their rows next call."""
        r = self._rows
        for rid, s in self._slot.items():
            if r.seen[s]:
                self.store.abort(rid)
            self.policy.abort(r.synced(s))
            r.free(s)
        self._slot.clear()
        self._held = None

    # -------------------------------------------------------------- propose
    def propose(self, *, req_ids: Sequence[str], prompt_lens: Sequence[int], token_rows: np.ndarray,
                num_tokens: Sequence[int], sampled: Sequence[Sequence[int]],
                max_new_tokens: Sequence[int] | Callable[[str], int] | None = None,
                live: Collection[str] | None = None) -> list[list[int]]:
        """Drafts for the batch: row i is request req_ids[i], whose tokens are token_rows[i, :num_tokens[i]]
        (the first prompt_lens[i] are its prompt); sampled[i] are the tokens it just got (empty while
        its prompt is still being prefilled: no draft). `max_new_tokens`: each row's max_tokens, or a
        function of the request id asked once per new request (None: the context limit). `live`: every
        request id vLLM still holds state for (the runner's `requests`), so that an absent one is known to
        be paused, not finished; as a mapping, its values tell a reused id from the same request; None =
        unknown (every absent request counts as departed). Returns one list of draft ids per row."""
        start = time.perf_counter()
        try:
            return self._propose(req_ids=req_ids, prompt_lens=prompt_lens, token_rows=token_rows,
                                 num_tokens=num_tokens, sampled=sampled, max_new_tokens=max_new_tokens, live=live)
        finally:
            self.stats.calls += 1
            self.stats.propose_s += time.perf_counter() - start

    def _propose(self, *, req_ids: Sequence[str], prompt_lens: Sequence[int], token_rows: np.ndarray,
                 num_tokens: Sequence[int], sampled: Sequence[Sequence[int]],
                 max_new_tokens: Sequence[int] | Callable[[str], int] | None,
                 live: Collection[str] | None) -> list[list[int]]:
        n_rows = len(req_ids)
        for name, seq in (("prompt_lens", prompt_lens), ("num_tokens", num_tokens), ("sampled", sampled)):
            if len(seq) < n_rows:
                raise ValueError(f"{name} has {len(seq)} entries for {n_rows} requests")
        if not isinstance(req_ids, list):
            req_ids = list(req_ids)
        tracked, r = self._slot, self._rows
        slots = np.fromiter(map(tracked.get, req_ids, repeat(-1)), np.int64, n_rows)  # [n] -1: not tracked
        if len(set(req_ids)) != n_rows:
            raise ValueError(f"duplicate request ids in the batch: {sorted(req_ids)}")
        plens = np.asarray(prompt_lens[:n_rows], np.int64)  # [n]
        ntok = np.asarray(num_tokens[:n_rows], np.int64)  # [n]
        n_new = int(np.count_nonzero(slots < 0))
        if len(tracked) != n_rows - n_new:  # some tracked request is absent from the batch
            present = set(req_ids)
            held = live if live is None or isinstance(live, (Mapping, set, frozenset)) else set(live)
            for rid in [t for t in tracked if t not in present and (held is None or t not in held)]:
                self._depart(rid)
        known = np.flatnonzero(slots >= 0) if n_new else None  # [K] rows of tracked requests (None: all)
        ks = slots[known] if n_new else slots
        if len(ks):
            other = (plens[known] if n_new else plens) != r.plen[ks]  # [K] another request under the id
            other |= (ntok[known] if n_new else ntok) < r.seen[ks]
            if isinstance(live, Mapping):
                hid = np.fromiter(map(id, map(live.get, req_ids)), np.int64, n_rows)
                other |= (hid[known] if n_new else hid) != r.hid[ks]
            if np.count_nonzero(other):
                for i in (known[other] if n_new else np.flatnonzero(other)).tolist():
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
            if callable(max_new_tokens):
                cap = int(max_new_tokens(rid))
            else:
                cap = int(max_new_tokens[i]) if max_new_tokens is not None else self.max_model_len - plen
            s = r.add()
            r.rid[s], r.handle[s] = rid, live.get(rid) if isinstance(live, Mapping) else None
            r.rids[s] = rid
            r.state[s] = self._state(rid, problem_key(token_rows[i, :plen]), plen, max(cap, 1))
            r.plen[s], r.max_new[s], r.hid[s] = plen, max(cap, 1), id(r.handle[s])
            r.seen[s] = r.gen[s] = r.fwd[s] = r.drafted[s] = r.accepted[s] = r.dlen[s] = 0
            tracked[rid] = slots[i] = s
            self._held = None

        drafts: list[list[int]] = [[] for _ in range(n_rows)]
        rows = _arange(n_rows) if every else np.flatnonzero(has)  # [R] batch rows that may draft
        if not len(rows):
            self.clock.tick(None)
            return drafts
        rs = slots if every else slots[rows]  # [R]
        old = r.seen[rs]  # [R] tokens fed so far
        if not old.all():
            for j in np.flatnonzero(old == 0).tolist():  # first call with tokens: start in the store
                s, i = rs[j], rows[j]
                self.store.start(r.rid[s], r.state[s].problem_id, token_rows[i, :r.plen[s]])
                r.seen[s] = old[j] = r.plen[s]
                self.stats.started += 1
        self._feed(req_ids, rows, rs, old, ntok if every else ntok[rows], token_rows)
        caps = self._caps(rows, rs, ntok if every else ntok[rows])  # [R]
        drafted = self._draft(rows, rs, caps, drafts)
        self.clock.tick(len(rows) if every else None, drafted,  # rows in prefill: the next step's tokens unknown
                        int(ntok.sum() if every else ntok[rows].sum()))
        return drafts

    def _check(self, req_ids, slots, plens, ntok, has, token_rows, n_new: int) -> None:
        """The first bad row, in row order, raises what the row-by-row path raised there: a new request with
        no prompt token, more tokens than its row holds or than it was fed already (a negative token id among
        its new ones: _feed)."""
        r, width = self._rows, token_rows.shape[1]
        if not n_new and (not len(ntok) or int(ntok.max()) <= width):  # known rows, reuse checked: n >= seen
            return
        new = slots < 0
        seen = plens.copy()  # [n] tokens fed once the row is started (the prompt, if not yet)
        known = np.flatnonzero(~new)
        seen[known] = np.maximum(r.seen[slots[known]], plens[known])
        bad_plen = new & (plens < 1)
        if has is None:
            has = np.ones(len(ntok), bool)
        bad_width = has & (ntok > width)
        short = has & ~bad_width & (ntok < seen)
        if not (bad_plen | bad_width | short).any():
            return
        for i in np.flatnonzero(bad_plen | bad_width | short).tolist():
            rid = req_ids[i]
            if bad_plen[i]:
                raise ValueError(f"request {rid!r}: prompt length {int(plens[i])} (vLLM gave no prompt tokens)")
            if bad_width[i]:
                raise ValueError(f"request {rid!r}: {int(ntok[i])} tokens but the token row holds {width}")
            raise ValueError(f"request {rid!r}: {int(ntok[i])} tokens, fewer than the {int(seen[i])} already fed")

    def _feed(self, req_ids, rows: np.ndarray, rs: np.ndarray, old: np.ndarray, n: np.ndarray,
              token_rows: np.ndarray) -> None:
        """Advance the rows (batch rows `rows`, slots `rs`, `old` tokens fed so far) to `n` tokens: index every
        row's new tokens in one native call, and count what the step just run kept of each verified draft
        (one accept-rule call for the batch): drafted and accepted move together, as in the engine."""
        r = self._rows
        count = n - old  # [R] new tokens
        if int(count.min()) > 0:  # every row got tokens (the usual step)
            fed, fr, fs, fc, fo, fn = None, rows, rs, count, old, n
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
        if n_pending:
            if n_pending == len(fs):  # all of them (every row drafted)
                vs, dl, vr, vo, vc = fs, pending, fr, fo, fc
            else:
                v = np.flatnonzero(pending)
                vs, dl, vr, vo, vc = fs[v], pending[v], fr[v], fo[v], fc[v]
            try:
                acc = _core.accepted_rows(r.draft[vs], dl, token_rows, vr, vo, vc)
            except TypeError:  # token rows of another layout: the numpy rule
                acc = _accepted_in_rows(r.draft[vs], dl, np.asarray(token_rows), vr, vo, vc)
            r.drafted[vs] += dl
            r.accepted[vs] += acc
            self.stats.accepted += int(acc.sum())
            self.stats.resolved += int(dl.sum())
            r.dlen[vs] = 0

    def _held_rows(self) -> tuple[np.ndarray | slice, list, list, np.ndarray]:
        """(slots (or the slice of them), request keys, problems, each slot's place among them) of the held requests,
        in order."""
        if self._held is None:
            r = self._rows
            slots = np.fromiter(self._slot.values(), np.int64, len(self._slot))
            states = [r.state[s] for s in slots.tolist()]
            place = np.zeros(r.cap, np.int64)
            place[slots] = np.arange(len(slots))
            # slots 0..n-1 in order: the arrays' first n entries are the batch (views, read before any change)
            self._held = (slice(0, len(slots)) if np.array_equal(slots, np.arange(len(slots))) else slots,
                          [s.req_id for s in states], [s.problem_id for s in states], place)
        return self._held

    def _caps(self, rows: np.ndarray, rs: np.ndarray, n: np.ndarray) -> np.ndarray:
        """[R] each row's draft cap (batch rows `rows`, slots `rs`, `n` tokens each): the policy's budget within
        k, the context limit and its max_tokens."""
        lat = self.clock.model() if self.config.latency_floor and self.latency is not None else None
        if lat is not None and lat is not self.policy.latency:  # a refit (bounded cadence: OnlineLatency)
            self.policy.latency = lat  # the draft allowance stays the session's (None: priced per row)
        # The policy sees every request vLLM holds: a paused one is not finished (it would learn from it).
        r, pol = self._rows, self.policy
        if isinstance(pol, FixedBudget):  # fixed k, no speculation: every row alike, nothing kept per row
            budget = np.full(len(rows), pol.k, np.int64)
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

    def _draft(self, rows: np.ndarray, rs: np.ndarray, caps: np.ndarray, drafts: list[list[int]]) -> int:
        """Propose for the rows with a cap, cut to max_spec_factor x the match and trimmed by the policy; each
        row's draft goes to `drafts` and is kept until its verification shows. Returns the tokens drafted."""
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
        factor = self.config.max_spec_factor
        if not pol.trims:  # cut to max_spec_factor x the match (0: not cut)
            keep = out.lengths if factor <= 0 else \
                _core.cut_chains(out.probs, out.offsets, out.match_len, float(factor), None, _NONE, _NONE, _NONE, 0.0, 1.0)[0]
        elif pol._batch is not None and pol._batch[0].keys is self._held_rows()[1]:  # the batch the policy just priced: trimmed by row
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
