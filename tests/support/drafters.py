"""Test drafters shared by the library's tests and the lab's."""

from __future__ import annotations

import numpy as np

from dasrl.drafter import Draft, DrafterBase, check_budgets


class Fixed(DrafterBase):
    """A drafter that proposes a fixed chain per request, ignoring its budget (the path must cap it); `budgets`
    records the budgets of each call."""

    def __init__(self, chains: dict) -> None:
        self.chains, self.budgets = chains, []

    def propose(self, req_ids, budgets):
        self.budgets.append(list(budgets))
        return [Draft.chain(self.chains[r]) for r in req_ids]


class Oracle(DrafterBase):
    """Drafts each request's given continuation from where the request stands: `futures[req_id]`, the completion
    the target will emit (every draft right: the upper bound of any drafter), or a corrupted copy (some drafts
    wrong: rejections). The library's exactness tests draft with it; the lab has its own OracleDrafter."""

    def __init__(self, futures) -> None:
        self.futures = {k: np.asarray(v, dtype=np.int32) for k, v in futures.items()}
        self.pos: dict = {}

    def start(self, req_id, problem_id, prompt_ids) -> None:
        if req_id not in self.futures:
            raise KeyError(f"oracle has no continuation for request {req_id!r}")
        self.pos[req_id] = 0

    def propose(self, req_ids, budgets):
        check_budgets(req_ids, budgets)
        return [Draft.chain(self.futures[r][self.pos[r]:self.pos[r] + int(b)], match_len=self.pos[r])
                for r, b in zip(req_ids, budgets)]

    def observe(self, req_id, tokens) -> None:
        self.pos[req_id] += len(tokens)

    def finish(self, req_id) -> None:
        del self.pos[req_id]

    abort = finish

    def end_step(self) -> None:
        pass


class PromptLookup(DrafterBase):
    """n-gram prompt lookup, the tests' pure-Python drafter with drafts sometimes right, sometimes wrong, and
    no native core: match the request's last n tokens (n from max_n down to min_n) in its own prompt and
    output, and draft what followed the latest earlier occurrence. (The lab's comparison drafter of this kind
    is dasrl_lab/drafters/baselines.py's NGramDrafter; the library's tests may not import the lab.)"""

    def __init__(self, *, min_n: int = 2, max_n: int = 5) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._ctx: dict = {}

    def start(self, req_id, problem_id, prompt_ids) -> None:
        if req_id in self._ctx:
            raise KeyError(f"request {req_id!r} already started")
        self._ctx[req_id] = [int(t) for t in prompt_ids]

    def _context(self, req_id) -> list[int]:
        try:
            return self._ctx[req_id]
        except KeyError:
            raise KeyError(f"unknown request id {req_id!r}") from None

    def propose(self, req_ids, budgets):
        check_budgets(req_ids, budgets)
        return [self._propose_one(np.asarray(self._context(r), dtype=np.int64), int(b)) for r, b in zip(req_ids, budgets)]

    def _propose_one(self, arr: np.ndarray, budget: int) -> Draft:
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1) if budget else ():
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # windows[i] = arr[i:i+n]
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return Draft.chain(arr[start:start + budget], match_len=n)
        return Draft.empty()

    def observe(self, req_id, tokens) -> None:
        self._context(req_id).extend(int(t) for t in tokens)

    def finish(self, req_id) -> None:
        self._context(req_id)
        del self._ctx[req_id]

    abort = finish

    def end_step(self) -> None:
        pass
