"""A per-forward draft allowance that goes where the makespan is.

The packed forward costs t_fwd = c_base + c_tok * (rows + drafted tokens): a drafted token costs c_tok
whoever drafts it, and it saves time only if it is accepted *and* its row is on the step's critical
path (the step ends when its longest request does). So the allowance (about c_base / c_tok tokens per
forward: drafting that doubles the forward at most) is split by the distribution-aware rule:

1. each row's best draft: its class cap from the wrapped policy, clipped to what its acceptance justifies
   (below);
2. the critical path: the most forwards any row still needs drafting its best,
   H = max_i remaining_i / E(best_i, p_i), with E(k, p) = 1 + p + ... + p^k the expected tokens per
   forward and remaining_i the predicted remaining length (the wrapped policy's length history
   conditioned on the partial length; without one, the partial length itself);
3. each row drafts only what keeps it within H (the shortest k with remaining_i / E(k, p_i) <= H): a
   row that finishes within the critical path anyway drafts nothing, the critical row drafts its best;
4. in order of remaining_i / E(best_i, p_i), longest first, until the allowance is spent.

Step 3 is what the probe of docs/benchmarks.md ("Engine: where a DAS step's time goes") measured: on the
long-tail set it drafted 42% fewer tokens than every row drafting its best, for 5% less rollout time.

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
from dasrl.policy.length import LengthConfig
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


def tokens_per_forward(k, p) -> np.ndarray:
    """Expected tokens a row emits per forward drafting a chain of k at per-token acceptance p:
    1 + p + ... + p^k (the accepted prefix plus the recovered or bonus token)."""
    k, p = np.asarray(k, np.float64), np.clip(np.asarray(p, np.float64), 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        geo = (1.0 - p ** (k + 1)) / (1.0 - p)
    return np.where(p >= 1.0, k + 1, geo)


def pace_draft(remaining, p, *, horizon: float, most) -> np.ndarray:
    """Per row, the shortest draft (at most `most`) with which its `remaining` tokens take no more than
    `horizon` forwards: a row that finishes within the critical path anyway drafts nothing."""
    remaining, most = np.asarray(remaining, np.float64), np.asarray(most, np.int64)
    p = np.clip(np.asarray(p, np.float64), 0.0, 1.0)
    need = remaining / max(horizon, 1e-9)  # [B] tokens per forward the row must make
    out = np.zeros(len(need), np.int64)
    for i, (n, q, m) in enumerate(zip(need, p, most)):
        if n <= 1.0 or m <= 0:
            continue
        if q >= 1.0:
            k = math.ceil(n - 1.0)
        elif 1.0 - (1.0 - q) * n <= 0.0 or q <= 0.0:
            k = m  # out of reach: its best
        else:  # 1 + q + ... + q^k >= n  <=>  q^(k+1) <= 1 - (1 - q) n
            k = math.ceil(math.log(1.0 - (1.0 - q) * n) / math.log(q) - 1.0 - 1e-9)
        out[i] = min(max(k, 0), m)
    return out


class ForwardAllowance:
    """Wraps a policy: its caps, leveled to the critical path and spent critical row first, within
    `max_tokens` per forward."""

    def __init__(self, inner: BudgetPolicy, max_tokens: int, *, latency: LatencyModel | None = None,
                 prior_p: float = 0.6, prior_tokens: float = 8.0,
                 max_problems: int = LengthConfig.max_problems) -> None:
        if max_tokens < 0:
            raise ValueError(f"draft allowance must be >= 0, got {max_tokens}")
        if not 0.0 < prior_p < 1.0 or prior_tokens < 0:
            raise ValueError(f"need 0 < prior_p < 1 and prior_tokens >= 0, got {prior_p}, {prior_tokens}")
        if max_problems < 1:
            raise ValueError(f"max_problems must be >= 1, got {max_problems}")
        self.inner, self.max_tokens, self.latency = inner, max_tokens, latency
        self.prior_p, self.prior_tokens, self.max_problems = prior_p, prior_tokens, max_problems
        self.spent: Counter = Counter()
        """Drafted tokens per length class since the last take_spent()."""
        self._seen: dict[Hashable, tuple[int, int, str]] = {}  # req -> (drafted, accepted, last class)
        self._row: dict[Hashable, tuple[int, int]] = {}  # req -> (accepted, rejections)
        self._problem: dict[Hashable, tuple[int, int]] = {}  # problem -> (accepted, rejections), all steps;
        # in order of last update, at most max_problems (the first is forgotten)

    # ------------------------------------------------------------------ the split
    def budgets(self, states: Sequence[RequestState]) -> list[int]:
        for s in states:
            self._account(s)
        caps = np.asarray(self.inner.budgets(states), np.int64).clip(min=0)  # [B] class caps
        if not states:
            return []
        p = np.array([self._p(s) for s in states])  # [B] per-token acceptance
        best = caps
        if self.latency is not None:
            t_fwd = self._t_fwd(len(states))
            best = np.minimum(caps, [justified_length(x, t_fwd=t_fwd, c_tok=self.latency.c_tok) for x in p])
        remaining = np.maximum(self._remaining(states), 1.0)  # [B] predicted tokens still to come
        at_best = remaining / tokens_per_forward(best, p)  # [B] forwards each row needs drafting its best
        need = pace_draft(remaining, p, horizon=float(at_best.max()), most=best)  # [B]
        out = [0] * len(states)
        left = self.max_tokens
        for i in np.argsort(-at_best, kind="stable"):  # the critical row first
            if left <= 0:
                break
            out[i] = int(min(need[i], left))
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
            pa, pr = self._problem.pop(s.problem_id, (0, 0))
            self._problem[s.problem_id] = (pa + a, pr + rejected)
            if len(self._problem) > self.max_problems:
                del self._problem[next(iter(self._problem))]
        self._seen[s.req_id] = (s.drafted, s.accepted, cls)

    def finish(self, state: RequestState) -> None:
        """The request left the batch: count its last step's drafts; the wrapped policy learns from it."""
        self._account(state)
        self._seen.pop(state.req_id, None)
        self._row.pop(state.req_id, None)
        self.inner.finish(state)

    def abort(self, state: RequestState) -> None:
        """The request's generation failed: forget it (its partial drafts count nowhere)."""
        self._seen.pop(state.req_id, None)
        self._row.pop(state.req_id, None)
        self.inner.abort(state)

    def take_spent(self) -> dict[str, int]:
        """Drafted tokens per length class since the last call (and reset)."""
        out, self.spent = dict(self.spent), Counter()
        return out

    def end_step(self) -> None:
        self._seen.clear()
        self._row.clear()
        self.inner.end_step()

    @property
    def trims(self) -> bool:
        return getattr(self.inner, "trims", True)

    def trim(self, states: Sequence[RequestState], drafts: list[Draft]) -> list[Draft]:
        return self.inner.trim(states, drafts)

    def __getattr__(self, name):  # lengths / acceptance / caps of the wrapped policy
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
