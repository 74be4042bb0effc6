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
