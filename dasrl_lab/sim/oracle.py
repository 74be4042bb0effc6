"""The history oracle: the headroom every history drafter is measured against (issue 35 item 1).

At every position it drafts, among every occurrence of the context's longest match in each source (the
problem's window with in-flight siblings, the request's own text, every problem's rollouts), the one whose
continuation agrees longest with what the request will emit, exactly that agreeing prefix: a bound for any
drafter that picks a source and an occurrence by the same match rule on the same history (not for one that
matches differently). Its history: a DraftStore of das's config with the cross-problem source on.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Hashable, Mapping, Sequence

import numpy as np

from dasrl.drafter import (Cursor, DraftBatch, DraftStore, StoreConfig, SuffixIndex, best_continuation_batch,
                           budget_array, token_array)


class HistoryOracle:
    """Implements the Drafter protocol; `expect()` tells it the responses of the requests it will see."""

    def __init__(self, config: StoreConfig) -> None:
        self.store = DraftStore(replace(config, mode="problem+request", cross_problem=True))
        self._future: dict[Hashable, np.ndarray] = {}
        self._own: dict[Hashable, Cursor] = {}  # the request's own text: a one-sequence index
        self._pos: dict[Hashable, int] = {}  # output tokens observed

    def expect(self, futures: Mapping[Hashable, Sequence[int] | np.ndarray]) -> None:
        """The full response each request id will emit (replaces what was told before)."""
        self._future = {k: np.asarray(v, np.int32) for k, v in futures.items()}

    def start(self, req_id: Hashable, problem_id: Hashable | None, prompt_ids: Sequence[int]) -> None:
        if req_id not in self._future:
            raise KeyError(f"the oracle was not told the response of request {req_id!r} (expect())")
        self.store.start(req_id, problem_id, prompt_ids)
        own = SuffixIndex()
        own.add_unchecked(0, np.zeros(0, np.int32), 1.0)
        cur = own.cursor(self.store.config.params.max_match, 0)
        cur.feed(token_array(prompt_ids))
        self._own[req_id], self._pos[req_id] = cur, 0

    def propose(self, req_ids, budgets):
        return self.propose_flat(req_ids, budgets).drafts()

    def propose_flat(self, req_ids: Sequence[Hashable], budgets: Sequence[int]) -> DraftBatch:
        b = budget_array(req_ids, budgets)  # [n] int64
        futures = [self._future[r][self._pos[r]:self._pos[r] + int(k)] for r, k in zip(req_ids, b.tolist())]
        offsets = np.zeros(len(futures) + 1, np.int64)  # [n+1]
        np.cumsum([f.size for f in futures], out=offsets[1:])
        flat = np.concatenate(futures) if futures else np.zeros(0, np.int32)  # [total]
        n = np.maximum(self.store.best_continuation(req_ids, flat, offsets),
                       best_continuation_batch([self._own[r] for r in req_ids], flat, offsets))  # [n]
        keep = np.concatenate([np.arange(a, a + k) for a, k in zip(offsets[:-1].tolist(), n.tolist())]
                              ) if len(futures) else np.zeros(0, np.int64)
        out_off = np.zeros(len(futures) + 1, np.int64)
        np.cumsum(n, out=out_off[1:])
        parents = (np.arange(out_off[-1]) - np.repeat(out_off[:-1], n) - 1).astype(np.int32)  # chains
        return DraftBatch(flat[keep.astype(np.int64)].astype(np.int32), parents, np.ones(int(out_off[-1])),
                          out_off, n.astype(np.int64))

    def observe(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        self.observe_batch([req_id], [tokens])

    def observe_batch(self, req_ids: Sequence[Hashable], token_lists: Sequence[Sequence[int]]) -> None:
        self.store.observe_batch(req_ids, token_lists)
        for r, t in zip(req_ids, token_lists):
            arr = token_array(t)
            self._own[r].feed(arr)
            self._pos[r] += arr.size

    def finish(self, req_id: Hashable) -> None:
        self.store.finish(req_id)
        del self._own[req_id], self._pos[req_id]

    def abort(self, req_id: Hashable) -> None:
        self.store.abort(req_id)
        del self._own[req_id], self._pos[req_id]

    def end_step(self) -> None:
        self.store.end_step()
