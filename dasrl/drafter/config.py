"""StoreConfig: how the history drafter (DraftStore) keeps and uses its history. Its own module: the
drafter's other modules import it without the store."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dasrl.drafter.base import MAX_TOKEN, DraftParams
from dasrl.drafter.suffix import TOKEN_LIMIT

MODES = ("problem", "problem+request", "global")


@dataclass(frozen=True)
class StoreConfig:
    """How the history drafter keeps and uses its history."""

    mode: str = "problem+request"
    """History scope: problem | problem+request | global."""
    window: int = 16
    """Training steps of history kept per problem (0 = keep every step)."""
    decay: float = 0.8
    """Weight factor per step of age: a rollout k steps old weighs decay**k."""
    live_weight: float = 1.0
    """Weight of live sequences (the request itself and its in-flight siblings), in [1e-100, 1e100]."""
    cross_problem: bool = True
    """Also draft from one index of every problem's finished rollouts in the window (evicted with it); the
    draft with the higher expected accepted length wins, so a problem's first visit drafts from the others'."""
    params: DraftParams = DraftParams()
    """Match length, minimum path probability and branching of drafts."""
    vocab_size: int | None = None
    """If set, token ids >= vocab_size are refused."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown store mode {self.mode!r}; valid modes: {', '.join(MODES)}")
        if not _is_int(self.window) or not 0 <= self.window < 2**31:
            raise ValueError(f"window must be an int >= 0 (0 = unlimited), got {self.window!r}")
        if not (_is_real(self.decay) and 0.0 < self.decay <= 1.0):
            raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")
        # Bounded so that live_weight * decay**age stays a normal double until the step is evicted
        # (store._MIN_STEP_WEIGHT): the weights of a draft's ratios never underflow to 0.
        if not (_is_real(self.live_weight) and 1e-100 <= self.live_weight <= 1e100):
            raise ValueError(f"live_weight must be in [1e-100, 1e100], got {self.live_weight!r}")
        if not isinstance(self.cross_problem, bool):
            raise ValueError(f"cross_problem must be a bool, got {self.cross_problem!r}")
        if not isinstance(self.params, DraftParams):
            raise ValueError(f"params must be a DraftParams, got {self.params!r}")
        if self.vocab_size is not None and (not _is_int(self.vocab_size) or not 1 <= self.vocab_size <= MAX_TOKEN + 1):
            raise ValueError(f"vocab_size must be None or an int in [1, 2^31], got {self.vocab_size!r}")

    @property
    def token_limit(self) -> int:
        """Token ids must be below this."""
        return TOKEN_LIMIT if self.vocab_size is None else self.vocab_size


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)
