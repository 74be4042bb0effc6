"""The budget-policy protocol (docs/policy.md) and the state of a live request it reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Protocol, Sequence, runtime_checkable

from dasrl.drafter.base import DraftBatch

if TYPE_CHECKING:
    from dasrl.policy.latency import LatencyModel
    from dasrl.policy.length import LengthClassifier


@dataclass
class RequestState:
    """What a policy may know about a live request at the start of a step (the engine updates it in place)."""

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
    """What the engine and a RolloutSession ask of a policy (PolicyBase gives the unpriced defaults)."""

    trims: bool  # whether trim() may change drafts (the engine skips it when False)
    latency: LatencyModel | None  # what drafts are priced with (the session refits it online); None: unpriced
    lengths: LengthClassifier | None  # the length history the session feeds with recorded rollouts, if any

    def budgets(self, states: Sequence[RequestState]) -> list[int]:
        """The draft cap of each live request this step (0 = plain decoding for that row)."""

    def trim(self, states: Sequence[RequestState], drafts: DraftBatch) -> DraftBatch:
        """Cut proposed drafts further, on the flat batch."""

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
    """Defaults: drafts kept as proposed, nothing priced, learnt, kept per request or saved."""

    trims = False
    latency = None
    lengths = None

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
