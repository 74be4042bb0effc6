"""The vLLM proposer's bookkeeping as it was before its state moved into arrays (dasrl/integrations/vllm/
tracker.py at 1a7647e): a _Req object per request, its rows fed, counted and drafted one at a time, priced by the
row-by-row policy (support.rowwise_policy). The oracle the batched BatchDrafter must agree with, draft for draft
and counter for counter (tests/test_vllm_rows.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

import numpy as np

from dasrl.drafter.base import DraftBatch, problem_key
from dasrl.drafter.store import DraftStore
from dasrl.engine.verify import accepted_counts
from dasrl.integrations.vllm.config import VLLMDrafterConfig
from dasrl.integrations.vllm.tracker import DrafterStats, StepClock, match_capped
from dasrl.policy.base import BudgetPolicy, RequestState
from dasrl.policy.factory import make_policy
from dasrl.policy.latency import LatencyModel, prior_for
from support.rowwise_policy import RowwiseAllowance, RowwiseClasses


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


def rowwise_policy(config: VLLMDrafterConfig, k: int) -> BudgetPolicy:
    """proposer_policy with the row-by-row allowance (das) in place of the batched one."""
    if config.policy == "das":
        latency = LatencyModel.load(config.latency) if config.latency else prior_for("cpu")
        return RowwiseAllowance(RowwiseClasses(caps=config.caps), latency=latency)
    return make_policy(config.policy, **({"k": k} if config.policy == "fixed" else {}))


@dataclass
class _Req:
    prompt_len: int
    state: RequestState
    """What the policy reads (module docstring); replaced by a fresh one at a step boundary."""
    handle: object = None
    """vLLM's state object of this request (`live[rid]` when `live` is a mapping): identity = same request."""
    seen: int = 0
    """Row tokens already fed to the store (0 = not started in the store yet)."""
    draft: list[int] = field(default_factory=list)
    """The draft proposed at the last call whose verification is not seen yet (the next row shows it)."""


class RowwiseTracker:
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
        self.policy = rowwise_policy(config, self.k)
        self.stats = DrafterStats()
        self.clock = StepClock(self.policy.latency or prior_for("cpu"), window=config.latency_window)
        self._reqs: dict[str, _Req] = {}
        """Requests vLLM holds: in the batch, or paused (absent from it but still in `live`)."""
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
        for req in self._reqs.values():  # in flight across the boundary: neither finished nor the new step's yet
            s = req.state
            self.policy.abort(s)
            req.state = self._state(s.req_id[0], s.problem_id, s.prompt_len, s.max_new_tokens, s.generated)
            if req.seen:  # the store drops them at end_step: re-started from their rows
                req.seen, req.draft = 0, []
                self.stats.restarted += 1
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
        drained = new_ids and not self._reqs  # every known request departed; a new one arrives
        return drained or 0 < self.config.max_step_requests <= n

    def _depart(self, rid: str) -> None:
        """vLLM no longer holds the request (finished or aborted): its rollout joins the history now."""
        req = self._reqs.pop(rid)
        if not req.seen:  # left before its first token: nothing to learn from
            self.policy.abort(req.state)
            return
        self.store.finish(rid)
        self.policy.finish(req.state)
        self.stats.finished += 1
        self._finished_since_step += 1

    def forget(self) -> None:
        """Drop every tracked request without learning from it (after a failed call: whatever it left half
        done cannot leak into later steps); vLLM's requests are re-started from their rows next call."""
        for rid, req in self._reqs.items():
            if req.seen:
                self.store.abort(rid)
            self.policy.abort(req.state)
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
        fed: list[tuple[str, np.ndarray]] = []  # rows with new tokens
        verified: list[tuple[_Req, np.ndarray]] = []  # rows whose last draft the step just run verified
        for i, rid in enumerate(req_ids):
            req = self._reqs.get(rid)
            if req is None:
                plen = int(prompt_lens[i])
                if plen < 1:
                    raise ValueError(f"request {rid!r}: prompt length {plen} (vLLM gave no prompt tokens)")
                cap = int(max_new_tokens[i]) if max_new_tokens is not None else self.max_model_len - plen
                state = self._state(rid, problem_key(token_rows[i, :plen]), plen, max(cap, 1))
                req = _Req(plen, state, handle=live.get(rid) if isinstance(live, Mapping) else None)
                self._reqs[rid] = req
            if len(sampled[i]) == 0:
                continue  # partial prefill
            new = self._feed(rid, req, token_rows[i], int(num_tokens[i]))
            if new is not None:
                fed.append((rid, new))
                if req.draft:
                    verified.append((req, new))
            rows.append(i)
        if fed:  # one native call for the batch's new tokens (a failed call forgets every request anyway)
            self.store.observe_batch([rid for rid, _ in fed], [new for _, new in fed])
        self._resolve(verified)

        drafts: list[list[int]] = [[] for _ in range(n_rows)]
        if not rows:
            self.clock.tick(None)
            return drafts
        caps = self._caps([req_ids[i] for i in rows], [int(num_tokens[i]) for i in rows])
        drafting = [i for i, c in zip(rows, caps) if c > 0]
        if drafting:
            ids = [req_ids[i] for i in drafting]
            out = match_capped(self.store.propose_flat(ids, [c for c in caps if c > 0]), self.config.max_spec_factor)
            if self.policy.trims:
                out = self.policy.trim([self._reqs[rid].state for rid in ids], out)
            for i, rid, d in zip(drafting, ids, out.drafts()):
                drafts[i] = self._reqs[rid].draft = d.tokens.tolist()
                if drafts[i]:
                    self.stats.proposals += 1
                    self.stats.drafted += len(drafts[i])
        prefilling = len(rows) < n_rows  # rows still in (chunked) prefill: the next step's tokens unknown
        self.clock.tick(None if prefilling else sum(1 + len(drafts[i]) for i in rows),
                        sum(int(num_tokens[i]) for i in rows))
        return drafts

    @staticmethod
    def _same(req: _Req, rid: str, prompt_len: int, n: int, live: Collection[str] | None) -> bool:
        """Whether batch row (rid, prompt_len, n tokens) is still the tracked request `req`."""
        if isinstance(live, Mapping) and live.get(rid) is not req.handle:
            return False
        return prompt_len == req.prompt_len and n >= req.seen

    def _feed(self, rid: str, req: _Req, row: np.ndarray, n: int) -> np.ndarray | None:
        """Start tracking the row (its first call) and advance it to n tokens; returns its new tokens (None:
        none since the last step), which the caller indexes for the whole batch at once."""
        if n > row.shape[0]:
            raise ValueError(f"request {rid!r}: {n} tokens but the token row holds {row.shape[0]}")
        if not req.seen:
            self.store.start(rid, req.state.problem_id, row[:req.prompt_len])
            req.seen = req.prompt_len
            self.stats.started += 1
        if n == req.seen:
            return None
        new = row[req.seen:n]
        if int(new.min()) < 0:
            raise ValueError(f"request {rid!r}: token id {int(new.min())} in vLLM's token row (placeholders "
                             f"of async scheduling?); run vLLM with async_scheduling=False")
        s = req.state
        s.generated = n - req.prompt_len
        s.forwards += 1
        req.seen = n
        return new

    def _resolve(self, verified: list[tuple[_Req, np.ndarray]]) -> None:
        """Count what the step just run kept of each verified draft (one accept-rule call for the batch):
        drafted and accepted move together, as in the engine."""
        if not verified:
            return
        for (req, _), acc in zip(verified, _accepted([r.draft for r, _ in verified], [n for _, n in verified]).tolist()):
            s = req.state
            s.drafted += len(req.draft)
            s.accepted += acc
            self.stats.accepted += acc
            self.stats.resolved += len(req.draft)
            req.draft = []

    def _caps(self, rids: list[str], num_tokens: list[int]) -> list[int]:
        """Each row's draft cap: the policy's budget within k, the context limit and its max_tokens."""
        lat = self.clock.model() if self.config.latency_floor and self.latency is not None else None
        if lat is not None and lat is not self.policy.latency:  # a refit (bounded cadence: OnlineLatency)
            self.policy.latency = lat  # the draft allowance stays the session's (None: priced per row)
        # The policy sees every request vLLM holds: a paused one is not finished (it would learn from it).
        states = [req.state for req in self._reqs.values()]
        for s in states:
            s.classes.clear()  # the policy appends one class per call: keep only this call's
        by_id = dict(zip((s.req_id for s in states), self.policy.budgets(states)))
        out = []
        for rid, n in zip(rids, num_tokens):
            s = self._reqs[rid].state
            room = min(self.max_model_len - n, s.max_new_tokens - s.generated) - 1  # the target adds one
            out.append(max(0, min(self.k, room, by_id[s.req_id])))
        return out

    @property
    def num_live(self) -> int:
        return len(self._reqs)
