"""A per-forward draft allowance: drafted tokens are not free when the forward's cost grows with its
width (t_fwd = c_base + c_tok * tokens). The engine's forward is [rows, 1 + longest draft], so a draft
costs its row's padding in every other row too: the allowance caps the draft width at
max_tokens // live rows. With a full batch nobody drafts; as the batch collapses to its stragglers, they
draft ever longer — speculation goes where the makespan is."""

from __future__ import annotations

from typing import Sequence

from dasrl.drafter.base import Draft
from dasrl.policy.base import BudgetPolicy, RequestState
from dasrl.policy.latency import LatencyModel

def allowance_for(latency: LatencyModel, *, overhead: float = 1.0) -> int:
    """Draft tokens per forward that cost at most `overhead` x the forward's base cost."""
    if latency.c_tok <= 0:
        return 1 << 20
    return max(1, int(overhead * latency.c_base / latency.c_tok))


class ForwardAllowance:
    """Wraps a policy: its caps, clipped to the width the allowance pays for at this batch size."""

    def __init__(self, inner: BudgetPolicy, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"draft allowance must be >= 0, got {max_tokens}")
        self.inner, self.max_tokens = inner, max_tokens

    def budgets(self, states: Sequence[RequestState]) -> list[int]:
        caps = list(self.inner.budgets(states))
        width = self.max_tokens // max(len(states), 1)
        return [min(c, width) for c in caps]

    def trim(self, states: Sequence[RequestState], drafts: list[Draft]) -> list[Draft]:
        return self.inner.trim(states, drafts)

    def __getattr__(self, name):  # finish / end_step / lengths / acceptance of the wrapped policy
        return getattr(self.inner, name)
