"""BatchDrafter: the DAS drafter driven by what vLLM's model runner knows, one call per engine step.

vLLM tells a proposer only about the requests in this step's input batch: their ids, prompt lengths,
token rows (prompt + output so far) and the tokens just sampled. It never says that a request finished.
This class turns that view into the Drafter protocol of a DraftStore:

* a request id seen for the first time is `start`ed (problem key = hash of its prompt token ids, so GRPO
  siblings share a shard); the row tokens past what was already fed are `observe`d;
* a request that is no longer in the batch has *departed*: finished, aborted, or preempted (vLLM drops
  preempted requests from the batch and brings them back later with the same id). Its sequence stays
  indexed (in problem+request mode it keeps helping its siblings); if it comes back it simply continues.
  Departed requests are `finish`ed -- their rollout joins the problem's window -- at the step boundary;
* a step boundary (DraftStore.end_step: the window rolls) is, by default, the moment the batch has
  drained: every known request has departed and a new one arrives. With synchronous RL (one
  `LLM.generate` per training step) that is exactly one RL step. `step_requests=N` ends a step after
  every N departures instead (servers whose batch never drains); requests in flight across such a
  boundary are re-started from their current row.

Draft caps: min(policy cap, num_speculative_tokens, room left before max_model_len), and at most
max_spec_factor x the draft's match length. The das policy classifies each request by its problem's
past lengths and its length so far (DASPolicy).

Pure Python over numpy: no vLLM import, so it is tested on hand-made batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from dasrl.drafter.base import problem_key
from dasrl.drafter.store import DraftStore
from dasrl.integrations.vllm.config import VLLMDrafterConfig
from dasrl.policy.base import RequestState
from dasrl.policy.budget import ClassCaps, DASPolicy


@dataclass
class _Req:
    prompt_len: int
    state: RequestState
    seen: int = 0
    """Row tokens already fed to the store (0 = not started in the store yet)."""
    draft: list[int] = field(default_factory=list)
    """The draft proposed at the last call (to count accepted tokens)."""


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

    def as_dict(self) -> dict:
        d = dict(vars(self))
        d["acceptance"] = self.accepted / self.drafted if self.drafted else 0.0
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
        self._reqs: dict[str, _Req] = {}
        self._present: set[str] = set()
        self._departed_since_step = 0

    # ---------------------------------------------------------------- steps
    def end_step(self) -> None:
        """Close the RL step: departed requests feed their problem's window, the window rolls.
        Requests still in the batch stay and are re-started from their row at their next call."""
        for rid in [r for r in self._reqs if r not in self._present]:
            req = self._reqs.pop(rid)
            if req.seen:
                self.store.finish(rid)
                self.stats.finished += 1
                if self.policy is not None:
                    self.policy.finish(req.state)
        self.store.end_step()
        if self.policy is not None:
            self.policy.end_step()
        for req in self._reqs.values():  # in flight across the boundary: the store dropped them
            if req.seen:
                req.seen, req.draft = 0, []
                self.stats.restarted += 1
        self._departed_since_step = 0
        self.stats.steps += 1

    def _boundary(self, present: set[str], new_ids: bool) -> bool:
        if self.config.step_requests:
            return self._departed_since_step >= self.config.step_requests
        return new_ids and bool(self._reqs) and not (present & self._reqs.keys())

    # -------------------------------------------------------------- propose
    def propose(self, *, req_ids: Sequence[str], prompt_lens: Sequence[int], token_rows: np.ndarray,
                num_tokens: Sequence[int], sampled: Sequence[Sequence[int]],
                max_new_tokens: Sequence[int] | None = None) -> list[list[int]]:
        """Drafts for the batch: row i is request req_ids[i], whose tokens are token_rows[i, :num_tokens[i]]
        (the first prompt_lens[i] are its prompt); sampled[i] are the tokens it just got (empty while
        its prompt is still being prefilled: no draft). Returns one list of draft ids per row."""
        n_rows = len(req_ids)
        for name, seq in (("prompt_lens", prompt_lens), ("num_tokens", num_tokens), ("sampled", sampled)):
            if len(seq) < n_rows:
                raise ValueError(f"{name} has {len(seq)} entries for {n_rows} requests")
        present = set(req_ids)
        if len(present) != n_rows:
            raise ValueError(f"duplicate request ids in the batch: {sorted(req_ids)}")
        self._departed_since_step += len(self._present - present)
        if self._boundary(present, any(r not in self._reqs for r in req_ids)):
            self._present = present
            self.end_step()
        self._present = present

        rows: list[int] = []
        for i, rid in enumerate(req_ids):
            req = self._reqs.get(rid)
            if req is None:
                plen = int(prompt_lens[i])
                if plen < 1:
                    raise ValueError(f"request {rid!r}: prompt length {plen} (vLLM gave no prompt tokens)")
                cap = int(max_new_tokens[i]) if max_new_tokens is not None else self.max_model_len - plen
                prompt = token_rows[i, :plen]
                req = _Req(plen, RequestState(rid, problem_key(prompt), plen, max(cap, 1)))
                self._reqs[rid] = req
            if len(sampled[i]) == 0:
                continue  # partial prefill
            self._feed(rid, req, token_rows[i], int(num_tokens[i]))
            rows.append(i)

        drafts: list[list[int]] = [[] for _ in range(n_rows)]
        if not rows:
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
        return drafts

    def _feed(self, rid: str, req: _Req, row: np.ndarray, n: int) -> None:
        if n > row.shape[0]:
            raise ValueError(f"request {rid!r}: {n} tokens but the token row holds {row.shape[0]}")
        if not req.seen:
            self.store.start(rid, req.state.problem_id, row[:req.prompt_len])
            req.seen = req.prompt_len
            self.stats.started += 1
        if n < req.seen:
            raise ValueError(f"request {rid!r}: its row shrank from {req.seen} to {n} tokens (a reused "
                             f"request id?)")
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
        req.state.generated = n - req.prompt_len
        req.state.forwards += 1
        req.seen = n

    def _caps(self, rids: list[str], num_tokens: list[int]) -> list[int]:
        room = [max(0, self.max_model_len - n - 1) for n in num_tokens]
        if self.policy is None:
            return [min(self.k, r) for r in room]
        # The policy sees every live request (departed ones too: a preempted request is not finished).
        states = [req.state for req in self._reqs.values()]
        for s in states:
            s.classes.clear()  # the policy appends one class per call: keep only this call's
        by_id = dict(zip((s.req_id for s in states), self.policy.budgets(states)))
        return [min(self.k, r, by_id[rid]) for rid, r in zip(rids, room)]

    @property
    def num_live(self) -> int:
        return len(self._reqs)
