"""The budget-policy protocol and the state of a live request it reads.

The engine asks the policy once per step for the draft cap of every live request, proposes drafts
capped by it, and then lets the policy trim the drafts (a confidence policy cuts low-probability tails).
A request that completes is passed to `finish` (a policy may learn from it); one whose generation failed
to `abort` (forgotten: its output is partial). `end_step` ends the RL step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Protocol, Sequence, runtime_checkable

from dasrl.drafter.base import Draft


@dataclass
class RequestState:
    """What a policy may know about a live request at the start of a step (mutable: the engine updates
    it in place after every step)."""

    req_id: Hashable
    problem_id: Hashable
    prompt_len: int
    max_new_tokens: int
    generated: int = 0
    """Output tokens emitted so far."""
    forwards: int = 0
    """Verification forwards this request took part in."""
    drafted: int = 0
    """Draft tokens proposed to it so far (after capping and trimming)."""
    accepted: int = 0
    """Draft tokens accepted so far."""
    classes: list[str] = field(default_factory=list)
    """Length class the policy gave it, per step (for stats; policies that classify append here)."""


@runtime_checkable
class BudgetPolicy(Protocol):
    trims: bool
    """Whether trim() may change drafts (the engine skips it when False)."""

    def budgets(self, states: Sequence[RequestState]) -> list[int]:
        """The draft cap of each live request this step (0 = plain decoding for that row)."""

    def trim(self, states: Sequence[RequestState], drafts: list[Draft]) -> list[Draft]:
        """Cut proposed drafts further (identity for most policies)."""

    def finish(self, state: RequestState) -> None:
        """The request completed (its final state)."""

    def abort(self, state: RequestState) -> None:
        """The request's generation failed: forget it without learning from it."""

    def end_step(self) -> None:
        """The RL step is over."""


class PolicyBase:
    """Defaults: keep drafts as proposed; nothing learnt from finished requests, nothing kept per request."""

    trims = False
    """Whether trim() may change drafts (the engine skips it when False)."""

    def trim(self, states: Sequence[RequestState], drafts: list[Draft]) -> list[Draft]:
        return drafts

    def finish(self, state: RequestState) -> None:
        pass

    def abort(self, state: RequestState) -> None:
        pass

    def end_step(self) -> None:
        pass


class NoSpeculation(PolicyBase):
    """Plain decoding: no row ever drafts."""

    def budgets(self, states: Sequence[RequestState]) -> list[int]:
        return [0] * len(states)


class FixedBudget(PolicyBase):
    """The same cap k for every request, every step."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"fixed budget must be >= 0, got {k}")
        self.k = k

    def budgets(self, states: Sequence[RequestState]) -> list[int]:
        return [self.k] * len(states)
