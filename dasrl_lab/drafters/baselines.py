"""The lab's two baseline drafters behind the library's drafter protocol: n-gram prompt lookup and the oracle.

Reference points for a drafter, not replacements for DAS's: `NGramDrafter` drafts from the request's own prompt
and output only (no history, no store), and `OracleDrafter`, told each request's true completion, drafts it
exactly: the upper bound any drafter can reach (the lab's simulator, benches and experiments measure against
both). Either goes where a drafter goes, e.g. `RolloutSession(..., drafter=NGramDrafter())`. The global
suffix drafter (the ArcticInference / vLLM `suffix` behaviour) is the library's `DraftStore(mode="global")`.
The library's tests draft with their own (tests/support/drafters.py: they may not import the lab).
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

import numpy as np

from dasrl.drafter import Draft, DrafterBase, check_budgets


class NGramDrafter(DrafterBase):
    """Prompt lookup in the manner of vLLM's `ngram` method: match the last n tokens (n from max_n down to
    min_n) against the request's own prompt and output, and propose what followed the most recent earlier
    occurrence (vLLM's follows the earliest)."""

    def __init__(self, *, min_n: int = 2, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._ctx: dict[Hashable, list[int]] = {}

    def start(self, req_id: Hashable, problem_id: Hashable | None, prompt_ids: Sequence[int]) -> None:
        if req_id in self._ctx:
            raise KeyError(f"request {req_id!r} already started")
        self._ctx[req_id] = [int(t) for t in prompt_ids]

    def _context(self, req_id: Hashable) -> list[int]:
        try:
            return self._ctx[req_id]
        except KeyError:
            raise KeyError(f"unknown request id {req_id!r}") from None

    def propose(self, req_ids: Sequence[Hashable], budgets: Sequence[int]) -> list[Draft]:
        check_budgets(req_ids, budgets)
        return [self._propose_one(self._context(r), int(b)) for r, b in zip(req_ids, budgets)]

    def _propose_one(self, ctx: list[int], budget: int) -> Draft:
        if budget == 0:
            return Draft.empty()
        arr = np.asarray(ctx, dtype=np.int64)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            # windows[i] = arr[i:i+n]; an occurrence must end before the last token.
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return Draft.chain(arr[start : start + budget], match_len=n)
        return Draft.empty()

    def observe(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        self._context(req_id).extend(int(t) for t in tokens)

    def finish(self, req_id: Hashable) -> None:
        self._context(req_id)
        del self._ctx[req_id]

    def abort(self, req_id: Hashable) -> None:
        self.finish(req_id)  # nothing is learnt from a finished request either

    def end_step(self) -> None:
        pass


class OracleDrafter(DrafterBase):
    """Knows each request's true continuation: the upper bound of any drafter (for simulations and
    benchmarks). `futures[req_id]` is the full completion the target will emit."""

    def __init__(self, futures: Mapping[Hashable, Sequence[int]]) -> None:
        self._future = {k: np.asarray(v, dtype=np.int32) for k, v in futures.items()}
        self._pos: dict[Hashable, int] = {}

    def start(self, req_id: Hashable, problem_id: Hashable | None, prompt_ids: Sequence[int]) -> None:
        if req_id not in self._future:
            raise KeyError(f"oracle has no continuation for request {req_id!r}")
        self._pos[req_id] = 0

    def _at(self, req_id: Hashable) -> int:
        try:
            return self._pos[req_id]
        except KeyError:
            raise KeyError(f"unknown request id {req_id!r}") from None

    def propose(self, req_ids: Sequence[Hashable], budgets: Sequence[int]) -> list[Draft]:
        check_budgets(req_ids, budgets)
        out = []
        for r, b in zip(req_ids, budgets):
            pos = self._at(r)
            out.append(Draft.chain(self._future[r][pos : pos + int(b)], match_len=pos))
        return out

    def observe(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        self._pos[req_id] = self._at(req_id) + len(tokens)

    def finish(self, req_id: Hashable) -> None:
        self._at(req_id)
        del self._pos[req_id]

    def abort(self, req_id: Hashable) -> None:
        self.finish(req_id)  # nothing is learnt from a finished request either

    def end_step(self) -> None:
        pass
