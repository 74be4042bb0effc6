"""DAS's length-class policy: each request's draft cap is that of its length class (long / medium / short),
the class re-estimated every step from its problem's history and its partial length. The session prices
what a row drafts below its cap (allowance.py); `dasrl.policy.make_policy` builds the two together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

from dasrl.policy.base import PolicyBase, RequestState
from dasrl.policy.length import CLASSES, LengthClassifier, LengthConfig


class HistoryPolicy(PolicyBase):
    """A policy that learns the lengths of finished requests (LengthClassifier). A request is finished
    when it disappears from the states passed to `budgets`, or when `finish(state)` / `end_step()` is
    called explicitly (the simulator does; the engine may)."""

    def __init__(self, *, lengths: LengthClassifier | None = None, length_config: LengthConfig = LengthConfig(),
                 max_len: int | None = None) -> None:
        self._fixed_max = max_len is not None
        self.lengths = lengths if lengths is not None else LengthClassifier(length_config, max_len=max_len or 16384)
        self._live: dict[Hashable, RequestState] = {}
        self._done: set[Hashable] = set()

    def _track(self, states: Sequence[RequestState]) -> None:
        ids = {s.req_id for s in states}
        for rid in [r for r in self._live if r not in ids]:
            self.finish(self._live[rid])
        for s in states:
            self._live[s.req_id] = s
        if states and not self._fixed_max:
            self.lengths.set_max_len(max(s.max_new_tokens for s in states))

    def finish(self, state: RequestState) -> None:
        """Learn from a finished request (once per request id and step)."""
        if state.req_id in self._done:
            return
        self._done.add(state.req_id)
        self._live.pop(state.req_id, None)
        self._learn(state)

    def _learn(self, state: RequestState) -> None:
        self.lengths.record(state.problem_id, state.generated)

    def abort(self, state: RequestState) -> None:
        """Forget a request whose generation failed: nothing learnt, and its id may run again this step."""
        self._live.pop(state.req_id, None)

    def end_step(self) -> None:
        for s in list(self._live.values()):
            self.finish(s)
        self._done.clear()

    def budgets(self, states: Sequence[RequestState]) -> list[int]:
        self._track(states)
        return self._budgets(states)

    def track_max_len(self, max_new_tokens: int) -> None:
        """What `budgets` learns of a batch whose caller finishes or aborts each request itself (none is
        finished by its absence): the length limit, `max_new_tokens` the batch's largest."""
        if not self._fixed_max:
            self.lengths.set_max_len(max_new_tokens)

    def _budgets(self, states: Sequence[RequestState]) -> list[int]:
        raise NotImplementedError


@dataclass(frozen=True)
class ClassCaps:
    """Draft cap per length class (the DAS policy). The session's pricing (dasrl/policy/allowance.py) decides
    what a row drafts below its cap, so the caps are equal by default (the paper's 0 / 4 / 24 against equal
    caps: docs/whatif.md)."""

    short: int = 24
    """Cap of requests predicted short."""
    medium: int = 24
    """Cap of requests predicted medium."""
    long: int = 24
    """Cap of requests predicted long."""

    def __post_init__(self) -> None:
        for c in CLASSES:
            if getattr(self, c) < 0:
                raise ValueError(f"cap for class {c!r} must be >= 0, got {getattr(self, c)}")


class DASPolicy(HistoryPolicy):
    """Distribution-aware: each request's cap is that of its length class, the class re-estimated every
    step from the partial length (see LengthClassifier)."""

    def __init__(self, caps: ClassCaps = ClassCaps(), **kw) -> None:
        super().__init__(**kw)
        self.caps = caps

    @property
    def lazy_classes(self) -> bool:
        """Equal caps: a row's class sets nothing, so `budgets` leaves it to `classify`, which the priced
        policy asks only for the rows that draft (their spending is logged by class; the classes of a large
        batch were most of a budgets() call)."""
        return self.caps.short == self.caps.medium == self.caps.long

    def uniform_cap(self) -> int | None:
        """The cap every row gets whatever its state (equal class caps), else None."""
        return int(self.caps.long) if self.lazy_classes else None

    def classify(self, s: RequestState) -> str:
        """The row's class now (appended to its classes)."""
        cls = self.lengths.classify(s.problem_id, s.generated)
        s.classes.append(cls)
        return cls

    def _budgets(self, states: Sequence[RequestState]) -> list[int]:
        if self.lazy_classes:
            return [int(self.caps.long)] * len(states)
        return [int(getattr(self.caps, self.classify(s))) for s in states]
