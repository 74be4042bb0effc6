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

Draft caps: min(policy cap, num_speculative_tokens, room left before max_model_len), and at most
max_spec_factor x the draft's match length. The das policy classifies each request by its problem's
past lengths and its length so far (DASPolicy), and follows measured acceptance (acceptance_cap,
BatchDrafter.acceptance): a request's acceptance estimate a (its own verified drafts, pulled towards
its problem's, pulled towards every request's) caps a draft at the longest L with a^L >=
acceptance_floor -- the chance that the L-th drafted token is reached and kept -- so a request whose
drafts are rarely accepted stops drafting (a 1-token probe of its problem every probe_every calls keeps
measuring); and at a >= trust_acceptance the length-class cap is lifted (draft up to
num_speculative_tokens, as vLLM's suffix method does), so greedy rollouts whose samples all agree are
not capped short. With latency_floor (the default) the floor itself comes from vLLM's step cost, fitted
by the drafter's StepClock from the time between calls: deep drafts for the long class and in the tail,
only well-accepted ones for a full batch where tokens are dear (BatchDrafter._floor).

Pure Python over numpy: no vLLM import, so it is tested on hand-made batches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

import numpy as np

from dasrl.drafter.base import problem_key
from dasrl.drafter.store import DraftStore
from dasrl.integrations.vllm.clock import StepClock
from dasrl.integrations.vllm.config import VLLMDrafterConfig
from dasrl.policy.base import RequestState
from dasrl.policy.latency import LatencyModel
from dasrl.policy.budget import ClassCaps, DASPolicy


@dataclass
class _Req:
    prompt_len: int
    state: RequestState
    handle: object = None
    """vLLM's state object of this request (`live[rid]` when `live` is a mapping): identity = same request."""
    seen: int = 0
    """Row tokens already fed to the store (0 = not started in the store yet)."""
    draft: list[int] = field(default_factory=list)
    """The draft proposed at the last call (to count accepted tokens)."""
    resolved: int = 0
    """Drafted tokens whose verification this drafter has seen (the next call's row shows them)."""
    accepted: int = 0
    """Of those, accepted."""


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
    """Wall seconds inside propose (indexing the new tokens, caps, drafting): the drafter's own cost,
    paid on the same core as the forward when vLLM runs on a CPU."""

    def as_dict(self) -> dict:
        d = dict(vars(self))
        d["acceptance"] = self.accepted / self.resolved if self.resolved else 0.0
        return d


def _accepted(draft: list[int], new: list[int]) -> int:
    """Draft tokens that verification kept: the common prefix of draft and new tokens, minus the
    target's own token that always follows."""
    n = 0
    for d, t in zip(draft, new[:-1]):
        if d != t:
            break
        n += 1
    return n


def acceptance_cap(a: float, floor: float, k: int) -> int:
    """The longest draft L <= k with a**L >= floor: under a per-token acceptance a, the L-th drafted
    token is reached and kept with probability a**L. floor <= 0 or a >= 1: k; a <= 0: 0.
    E.g. floor 0.2: a = 0.5 -> 2 (0.5, 0.25), a = 0.8 -> 7 (0.8**7 = 0.21), a = 0.1 -> 0."""
    if floor <= 0 or a >= 1:
        return k
    n, p = 0, a
    while n < k and p >= floor * (1 - 1e-12):
        n += 1
        p *= a
    return n


class BatchDrafter:
    """See the module docstring."""

    def __init__(self, config: VLLMDrafterConfig = VLLMDrafterConfig(), *, num_speculative_tokens: int,
                 max_model_len: int, vocab_size: int | None = None) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.config = config
        self.k = int(num_speculative_tokens)
        self.max_model_len = int(max_model_len)
        self.store = DraftStore(config.store_config(vocab_size))
        self.policy = DASPolicy(ClassCaps(*config.caps)) if config.policy == "das" else None
        self.stats = DrafterStats()
        self.clock = StepClock(window=config.latency_window)
        self._reqs: dict[str, _Req] = {}
        """Requests vLLM holds: in the batch, or paused (absent from it but still in `live`)."""
        self._finished_since_step = 0
        self.explicit = config.explicit_steps
        """True once the caller ended a step itself (end_step): from then on no boundary is inferred."""
        self._signalled = False
        """end_step() was called: the window rolls at the next call, after that call's departures."""
        self._probe_slot: dict[object, int] = {}
        """problem key -> its offset in the probe cycle (probes of different problems fall on different calls)."""
        self._problem_acc: dict[object, list[int]] = {}
        """problem key -> [accepted, resolved] over every request of the problem seen by this drafter."""

    # ---------------------------------------------------------------- steps
    def end_step(self) -> None:
        """The caller closes the RL step: rollouts finished so far are the step's, the window rolls at the
        next call -- vLLM's runner drops a request finished in its last step only when the next step
        begins, so only then can such a request be told from one in flight. From now on the caller owns
        the boundaries: none is inferred from the batch any more."""
        self.explicit = self._signalled = True

    def _roll(self) -> None:
        self._signalled = False
        self.store.end_step()
        if self.policy is not None:
            self.policy.end_step()
        for req in self._reqs.values():  # in flight across the boundary: the store dropped them
            if req.seen:
                req.seen, req.draft = 0, []
                self.stats.restarted += 1
        self._finished_since_step = 0
        self.stats.steps += 1

    def _boundary(self, new_ids: bool) -> bool:
        n = self._finished_since_step
        if self.explicit or not n:
            return False
        if self.config.step_requests:
            return n >= self.config.step_requests
        drained = new_ids and not self._reqs  # every known request departed; a new one arrives
        return drained or 0 < self.config.max_step_requests <= n

    def _depart(self, rid: str) -> None:
        """vLLM no longer holds the request (finished or aborted): its rollout joins the history now."""
        req = self._reqs.pop(rid)
        if req.seen:
            self.store.finish(rid)
            self.stats.finished += 1
            self._finished_since_step += 1
            if self.policy is not None:
                self.policy.finish(req.state)

    def forget(self) -> None:
        """Drop every tracked request without learning from it (after a failed call: whatever it left half
        done cannot leak into later steps); vLLM's requests are re-started from their rows next call."""
        for rid, req in self._reqs.items():
            if req.seen:
                self.store.abort(rid)
        self._reqs.clear()

    # -------------------------------------------------------------- propose
    def propose(self, *, req_ids: Sequence[str], prompt_lens: Sequence[int], token_rows: np.ndarray,
                num_tokens: Sequence[int], sampled: Sequence[Sequence[int]],
                max_new_tokens: Sequence[int] | None = None,
                live: Collection[str] | None = None) -> list[list[int]]:
        """Drafts for the batch: row i is request req_ids[i], whose tokens are token_rows[i, :num_tokens[i]]
        (the first prompt_lens[i] are its prompt); sampled[i] are the tokens it just got (empty while
        its prompt is still being prefilled: no draft). `live`: every request id vLLM still holds state
        for (the runner's `requests`), so that an absent one is known to be paused, not finished; as a
        mapping, its values tell a reused id from the same request; None = unknown (every absent request
        counts as departed). Returns one list of draft ids per row."""
        start = time.perf_counter()
        try:
            return self._propose(req_ids=req_ids, prompt_lens=prompt_lens, token_rows=token_rows,
                                 num_tokens=num_tokens, sampled=sampled, max_new_tokens=max_new_tokens, live=live)
        finally:
            self.stats.calls += 1
            self.stats.propose_s += time.perf_counter() - start

    def _propose(self, *, req_ids: Sequence[str], prompt_lens: Sequence[int], token_rows: np.ndarray,
                 num_tokens: Sequence[int], sampled: Sequence[Sequence[int]],
                 max_new_tokens: Sequence[int] | None, live: Collection[str] | None) -> list[list[int]]:
        n_rows = len(req_ids)
        for name, seq in (("prompt_lens", prompt_lens), ("num_tokens", num_tokens), ("sampled", sampled)):
            if len(seq) < n_rows:
                raise ValueError(f"{name} has {len(seq)} entries for {n_rows} requests")
        present = set(req_ids)
        if len(present) != n_rows:
            raise ValueError(f"duplicate request ids in the batch: {sorted(req_ids)}")
        held = present if live is None else present | set(live)
        for rid in [r for r in self._reqs if r not in held]:
            self._depart(rid)
        for i, rid in enumerate(req_ids):
            req = self._reqs.get(rid)
            if req is not None and not self._same(req, rid, int(prompt_lens[i]), int(num_tokens[i]), live):
                self.stats.reused += 1
                self._depart(rid)
        self.stats.paused += len(self._reqs.keys() - present)
        new_ids = any(r not in self._reqs for r in req_ids)
        if new_ids:  # the step just computed prefilled them: its token count is unknown
            self.clock.skip()
        if self._signalled or self._boundary(new_ids):
            self._roll()

        rows: list[int] = []
        for i, rid in enumerate(req_ids):
            req = self._reqs.get(rid)
            if req is None:
                plen = int(prompt_lens[i])
                if plen < 1:
                    raise ValueError(f"request {rid!r}: prompt length {plen} (vLLM gave no prompt tokens)")
                cap = int(max_new_tokens[i]) if max_new_tokens is not None else self.max_model_len - plen
                prompt = token_rows[i, :plen]
                req = _Req(plen, RequestState(rid, problem_key(prompt), plen, max(cap, 1)),
                           handle=live.get(rid) if isinstance(live, Mapping) else None)
                self._reqs[rid] = req
            if len(sampled[i]) == 0:
                continue  # partial prefill
            self._feed(rid, req, token_rows[i], int(num_tokens[i]))
            rows.append(i)

        drafts: list[list[int]] = [[] for _ in range(n_rows)]
        if not rows:
            self.clock.tick(None)
            return drafts
        caps = self._caps([req_ids[i] for i in rows], [int(num_tokens[i]) for i in rows])
        live = [(i, c) for i, c in zip(rows, caps) if c > 0]
        for req in (self._reqs[req_ids[i]] for i in rows):
            req.draft = []
        if live:
            out = self.store.propose([req_ids[i] for i, _ in live], [c for _, c in live])
            factor = self.config.max_spec_factor
            for (i, _), d in zip(live, out):
                toks = d.tokens.tolist()
                if factor > 0:
                    toks = toks[:int(factor * d.match_len)]
                drafts[i] = toks
                self._reqs[req_ids[i]].draft = toks
                if toks:
                    self.stats.proposals += 1
                    self.stats.drafted += len(toks)
                    self._reqs[req_ids[i]].state.drafted += len(toks)
        prefilling = len(rows) < n_rows  # rows still in (chunked) prefill: the next step's tokens unknown
        self.clock.tick(None if prefilling else sum(1 + len(drafts[i]) for i in rows))
        return drafts

    @staticmethod
    def _same(req: _Req, rid: str, prompt_len: int, n: int, live: Collection[str] | None) -> bool:
        """Whether batch row (rid, prompt_len, n tokens) is still the tracked request `req`."""
        if isinstance(live, Mapping) and live.get(rid) is not req.handle:
            return False
        return prompt_len == req.prompt_len and n >= req.seen

    def _feed(self, rid: str, req: _Req, row: np.ndarray, n: int) -> None:
        if n > row.shape[0]:
            raise ValueError(f"request {rid!r}: {n} tokens but the token row holds {row.shape[0]}")
        if not req.seen:
            self.store.start(rid, req.state.problem_id, row[:req.prompt_len])
            req.seen = req.prompt_len
            self.stats.started += 1
        if n == req.seen:
            return
        new = row[req.seen:n]
        if int(new.min()) < 0:
            raise ValueError(f"request {rid!r}: token id {int(new.min())} in vLLM's token row (placeholders "
                             f"of async scheduling?); run vLLM with async_scheduling=False")
        self.store.observe(rid, new)
        toks = new.tolist()
        acc = _accepted(req.draft, toks)
        self.stats.accepted += acc
        req.state.accepted += acc
        if req.draft:
            req.resolved += len(req.draft)
            req.accepted += acc
            self.stats.resolved += len(req.draft)
            counts = self._problem_acc.setdefault(req.state.problem_id, [0, 0])
            counts[0] += acc
            counts[1] += len(req.draft)
        req.state.generated = n - req.prompt_len
        req.state.forwards += 1
        req.seen = n

    def acceptance(self, rid: str) -> float:
        """Estimated per-token acceptance of request `rid`'s drafts, shrunk in two levels, each evidence
        counted once: the request's own verified drafts, plus `acceptance_prior` pseudo-tokens of its
        problem's other requests' estimate, which has as many pseudo-tokens of the other problems'
        (which start at 1.0: drafting starts optimistic). Prior 8, nothing seen anywhere: 1.0; the
        request 2 of 8 accepted, nothing else seen: (2 + 8 * 1.0) / (8 + 8) = 0.625."""
        w = self.config.acceptance_prior
        req = self._reqs[rid]
        pa, pr = self._problem_acc.get(req.state.problem_id, (0, 0))
        oa, orr = self.stats.accepted - pa, self.stats.resolved - pr  # other problems
        g = (oa + w) / (orr + w) if orr + w > 0 else 1.0
        pa, pr = pa - req.accepted, pr - req.resolved  # the problem's other requests
        prob = (pa + w * g) / (pr + w) if pr + w > 0 else g
        return (req.accepted + w * prob) / (req.resolved + w) if req.resolved + w > 0 else prob

    def _caps(self, rids: list[str], num_tokens: list[int]) -> list[int]:
        room = [max(0, self.max_model_len - n - 1) for n in num_tokens]
        if self.policy is None:
            return [min(self.k, r) for r in room]
        # The policy sees every live request (departed ones too: a preempted request is not finished).
        states = [req.state for req in self._reqs.values()]
        for s in states:
            s.classes.clear()  # the policy appends one class per call: keep only this call's
        by_id = dict(zip((s.req_id for s in states), self.policy.budgets(states)))
        cfg, out = self.config, []
        lat = self.clock.model() if cfg.latency_floor else None
        longs = sum(1 for rid in rids if self._reqs[rid].state.classes[-1:] == ["long"])
        probed: set = set()
        for rid, r in zip(rids, room):
            a = self.acceptance(rid)
            base = self.k if a >= cfg.trust_acceptance else by_id[rid]
            acc_cap = acceptance_cap(a, self._floor(lat, a, len(rids), self._reqs[rid].state, longs=longs), self.k)
            pid = self._reqs[rid].state.problem_id
            if acc_cap == 0 and pid not in probed and self._probe_due(pid):
                acc_cap = 1  # keep measuring: acceptance can come back (history grows, the policy drifts)
                probed.add(pid)
            out.append(min(self.k, r, base, acc_cap))
        return out

    def _probe_due(self, problem_id: object) -> bool:
        """Whether this call is the problem's probe call: one in every probe_every of the drafter's calls,
        staggered across problems. One probe per problem, not per request: the estimate every sibling
        drafts under pools the problem's verified tokens, and each probe costs a token in the step."""
        every = self.config.probe_every
        if not every:
            return False
        slot = self._probe_slot.setdefault(problem_id, len(self._probe_slot))
        return (self.stats.calls + slot) % every == 0

    def _floor(self, lat: LatencyModel | None, a: float, rows: int, state: RequestState, *, longs: int = 1) -> float:
        """Acceptance floor of one request's draft (see VLLMDrafterConfig.latency_floor): where the L-th
        drafted token, kept with probability a**L, still pays for what it adds to a step of t. A long-class
        request is on the makespan, but so are the other `longs` drafting beside it: each of their L-th
        tokens adds c_tok to the step all of them wait for."""
        if lat is None:
            return self.config.acceptance_floor
        t = lat.c_base + lat.c_tok * rows  # this step's cost before drafts
        if state.classes and state.classes[-1] == "long":  # on the makespan: the long rows' time per token
            return min(0.99, (1 + a) * max(1, longs) * lat.c_tok / t)
        return min(0.99, rows * lat.c_tok / t)  # off it: the batch's throughput

    @property
    def num_live(self) -> int:
        return len(self._reqs)
