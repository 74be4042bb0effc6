"""The budget-policy protocol (what the engine and a RolloutSession ask of a policy, per step and per request:
docs/policy.md) and the state of a live request it reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Protocol, Sequence, runtime_checkable

from dasrl.drafter.base import DraftBatch

if TYPE_CHECKING:
    from dasrl.policy.latency import LatencyModel
    from dasrl.policy.length import LengthClassifier


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
    """What the engine and a RolloutSession ask of a policy (ForwardAllowance, the das policy, is one;
    PolicyBase gives every other policy the unpriced defaults)."""

    trims: bool
    """Whether trim() may change drafts (the engine skips it when False)."""
    latency: "LatencyModel | None"
    """The model drafts are priced with (the session refits it online); None: unpriced."""
    lengths: "LengthClassifier | None"
    """The length history the session feeds with recorded rollouts; None: the policy keeps none."""

    def budgets(self, states: Sequence[RequestState]) -> list[int]:
        """The draft cap of each live request this step (0 = plain decoding for that row)."""

    def trim(self, states: Sequence[RequestState], drafts: DraftBatch) -> DraftBatch:
        """Cut proposed drafts further, on the flat batch (identity for most policies)."""

    def finish(self, state: RequestState) -> None:
        """The request completed (its final state)."""

    def abort(self, state: RequestState) -> None:
        """The request's generation failed: forget it without learning from it."""

    def end_step(self) -> None:
        """The RL step is over."""

    def take_spent(self) -> dict[str, int]:
        """Drafted tokens per length class since the last call (and reset)."""

    def parts(self) -> dict[str, object]:
        """The learnt state a session saves, by name (each with state_dict / load_state_dict)."""


class PolicyBase:
    """Defaults: keep drafts as proposed; nothing learnt from finished requests, nothing kept per request,
    nothing priced (a BudgetPolicy with no latency model, no length history and no saved parts)."""

    trims = False
    """Whether trim() may change drafts (the engine skips it when False)."""
    latency = None
    """No latency model: drafts are not priced."""
    lengths = None
    """No length history."""

    def take_spent(self) -> dict[str, int]:
        return {}

    def parts(self) -> dict[str, object]:
        return {}

    def trim(self, states: Sequence[RequestState], drafts: DraftBatch) -> DraftBatch:
        return drafts

    def finish(self, state: RequestState) -> None:
        pass

    def abort(self, state: RequestState) -> None:
        pass

    def end_step(self) -> None:
        pass


class FixedBudget(PolicyBase):
    """The same cap k for every request, every step (k = 0: plain decoding)."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"fixed budget must be >= 0, got {k}")
        self.k = k

    def budgets(self, states: Sequence[RequestState]) -> list[int]:
        return [self.k] * len(states)
