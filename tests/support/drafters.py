"""Test drafters shared by the library's tests and the lab's."""

from __future__ import annotations

from dasrl.drafter import Draft, DrafterBase


class Fixed(DrafterBase):
    """A drafter that proposes a fixed chain per request, ignoring its budget (the path must cap it); `budgets`
    records the budgets of each call."""

    def __init__(self, chains: dict) -> None:
        self.chains, self.budgets = chains, []

    def propose(self, req_ids, budgets):
        self.budgets.append(list(budgets))
        return [Draft.chain(self.chains[r]) for r in req_ids]
