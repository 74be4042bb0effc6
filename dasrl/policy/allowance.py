"""A per-forward draft allowance that goes where the makespan is.

The packed forward costs t_fwd = c_base + c_tok * (rows + drafted tokens): a drafted token costs c_tok
whoever drafts it, and it saves time only if it is accepted *and* its row is on the step's critical
path (the step ends when its longest request does). So the allowance (about c_base / c_tok tokens per
forward: drafting that doubles the forward at most) is split by the distribution-aware rule:

1. rank the live rows by predicted remaining length, longest first (the wrapped policy's length history
   conditioned on the partial length; without one, the partial length itself);
2. each row, in that order, takes its class cap from the wrapped policy, clipped to what its acceptance
   justifies and to what is left of the allowance.

What acceptance justifies: with a per-token acceptance rate p, the j-th drafted token is accepted with
probability p^j and, on the critical path, saves a forward (t_fwd); it costs c_tok. It pays while
p^j * t_fwd >= c_tok, i.e. for j <= ln(c_tok / t_fwd) / ln(p). p is estimated as a geometric rate: a
verified chain gives its accepted tokens and, unless it was accepted whole, one rejection, so
p = accepted / (accepted + rejections) (accepted / drafted would understate it badly for long drafts:
0.39 for p = 0.9 at 20 tokens). The row's own counts are pulled to its problem's, and those to a prior,
by a few pseudo-tokens each.

The spending is logged per length class (`spent`: drafted tokens per class since the last `take_spent`).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Hashable, Sequence

import numpy as np

from dasrl.drafter.base import Draft
from dasrl.policy.base import BudgetPolicy, RequestState
from dasrl.policy.latency import LatencyModel


def allowance_for(latency: LatencyModel, *, overhead: float = 1.0) -> int:
    """Draft tokens per forward that cost at most `overhead` x the forward's base cost."""
    if latency.c_tok <= 0:
        return 1 << 20
    return max(1, int(overhead * latency.c_base / latency.c_tok))


def justified_length(p: float, *, t_fwd: float, c_tok: float) -> int:
    """Longest chain worth drafting at per-token acceptance p: max j with p^j * t_fwd >= c_tok."""
    if c_tok <= 0 or p >= 1.0:
        return 1 << 20
    if p <= 0.0 or t_fwd <= c_tok:
        return 0
    return int(math.log(c_tok / t_fwd) / math.log(p))


class ForwardAllowance:
    """Wraps a policy: its caps, spent longest-predicted row first, within `max_tokens` per forward."""

    def __init__(self, inner: BudgetPolicy, max_tokens: int, *, latency: LatencyModel | None = None,
                 prior_p: float = 0.6, prior_tokens: float = 8.0) -> None:
        if max_tokens < 0:
            raise ValueError(f"draft allowance must be >= 0, got {max_tokens}")
        if not 0.0 < prior_p < 1.0 or prior_tokens < 0:
            raise ValueError(f"need 0 < prior_p < 1 and prior_tokens >= 0, got {prior_p}, {prior_tokens}")
        self.inner, self.max_tokens, self.latency = inner, max_tokens, latency
        self.prior_p, self.prior_tokens = prior_p, prior_tokens
        self.spent: Counter = Counter()
        """Drafted tokens per length class since the last take_spent()."""
        self._seen: dict[Hashable, tuple[int, int, str]] = {}  # req -> (drafted, accepted, last class)
        self._row: dict[Hashable, tuple[int, int]] = {}  # req -> (accepted, rejections)
        self._problem: dict[Hashable, tuple[int, int]] = {}  # problem -> (accepted, rejections), all steps

    # ------------------------------------------------------------------ the split
    def budgets(self, states: Sequence[RequestState]) -> list[int]:
        for s in states:
            self._account(s)
        caps = list(self.inner.budgets(states))
        if not states:
            return caps
        order = np.argsort(-self._remaining(states), kind="stable")  # longest predicted first
        t_fwd = self._t_fwd(len(states))
        out = [0] * len(states)
        left = self.max_tokens
        for i in order:
            if left <= 0:
                break
            s = states[i]
            give = min(int(caps[i]), left)
            if self.latency is not None and give > 0:
                give = min(give, justified_length(self._p(s), t_fwd=t_fwd, c_tok=self.latency.c_tok))
            out[i] = max(give, 0)
            left -= out[i]
        for s in states:  # the class each row drafts under this step
            self._seen[s.req_id] = (*self._seen[s.req_id][:2], s.classes[-1] if s.classes else "none")
        return out

    def acceptance_rate(self, state: RequestState) -> float:
        """The per-token acceptance rate the row's drafts are expected to have (see the module docstring)."""
        return self._p(state)

    def _remaining(self, states: Sequence[RequestState]) -> np.ndarray:
        lengths = getattr(self.inner, "lengths", None)
        if lengths is None:
            return np.array([s.generated for s in states], np.float64)
        return np.array([min(lengths.expected_length(s.problem_id, s.generated), s.max_new_tokens) - s.generated
                         for s in states], np.float64)

    def _t_fwd(self, rows: int) -> float:
        lat = self.latency
        return 0.0 if lat is None else lat.c_base + lat.c_tok * rows

    def _p(self, s: RequestState) -> float:
        w = self.prior_tokens
        a, r = self._problem.get(s.problem_id, (0, 0))
        problem = (a + self.prior_p * w) / (a + r + w) if a + r + w > 0 else self.prior_p
        a, r = self._row.get(s.req_id, (0, 0))
        return (a + problem * w) / (a + r + w) if a + r + w > 0 else problem

    # ------------------------------------------------------------------ bookkeeping
    def _account(self, s: RequestState) -> None:
        """Fold in what the row's last step drafted and accepted (budgets() runs once per engine step)."""
        drafted, accepted, cls = self._seen.get(s.req_id, (0, 0, "none"))
        d, a = s.drafted - drafted, s.accepted - accepted
        if d > 0:
            self.spent[cls] += d
            rejected = int(a < d)  # a chain is accepted up to its first rejection
            ra, rr = self._row.get(s.req_id, (0, 0))
            self._row[s.req_id] = (ra + a, rr + rejected)
            pa, pr = self._problem.get(s.problem_id, (0, 0))
            self._problem[s.problem_id] = (pa + a, pr + rejected)
        self._seen[s.req_id] = (s.drafted, s.accepted, cls)

    def finish(self, state: RequestState) -> None:
        """The request left the batch: count its last step's drafts; the wrapped policy learns from it."""
        self._account(state)
        self._seen.pop(state.req_id, None)
        self._row.pop(state.req_id, None)
        fin = getattr(self.inner, "finish", None)
        if fin is not None:
            fin(state)

    def take_spent(self) -> dict[str, int]:
        """Drafted tokens per length class since the last call (and reset)."""
        out, self.spent = dict(self.spent), Counter()
        return out

    def end_step(self) -> None:
        self._seen.clear()
        self._row.clear()
        end = getattr(self.inner, "end_step", None)
        if end is not None:
            end()

    @property
    def trims(self) -> bool:
        return getattr(self.inner, "trims", True)

    def trim(self, states: Sequence[RequestState], drafts: list[Draft]) -> list[Draft]:
        return self.inner.trim(states, drafts)

    def __getattr__(self, name):  # lengths / acceptance / caps of the wrapped policy
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
