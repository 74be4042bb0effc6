"""The paper's closed form and the ablation policies: tools of the lab's simulator and experiments, not of
the library (whose one policy is the priced session policy, `dasrl.policy.make_policy`).

The closed form (DAS, arXiv 2511.13841; derived in docs/policy.md): with request i's expected length l_i,
capacity k_i and efficiency alpha_i, the step time is least at the N_fwd where
c_base = c_tok * sum_{l_i > N_fwd} k_i / (alpha_i (1 - k_i + k_i N_fwd / l_i)), and then
p_i* = -(l_i / alpha_i) ln(1 - k_i (1 - N_fwd / l_i)) for l_i > N_fwd, else 0.

Registry (`make_lab_policy`): the library's das / fixed / none, plus `classes` (DAS's class caps, unpriced:
the paper's policy as its simulator replays it), `unbounded`, `optimal` and `confidence`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from dasrl.drafter import Draft, DraftBatch
from dasrl.policy import (GPU_LATENCY, POLICIES, ClassCaps, LatencyModel, LengthClassifier, LengthConfig, PolicyBase,
                          RequestState, make_policy)

def _params(l, k, alpha):
    l = np.atleast_1d(np.asarray(l, dtype=np.float64))
    k = np.broadcast_to(np.asarray(k, dtype=np.float64), l.shape)
    a = np.broadcast_to(np.asarray(alpha, dtype=np.float64), l.shape)
    for name, v in (("l", l), ("k", k), ("alpha", a)):
        bad = ~np.isfinite(v) | (v < 0 if name == "l" else v <= 0)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{name}[{i}] = {v[i]!r} must be finite and {'>= 0' if name == 'l' else '> 0'}")
    return l, k, a


def marginal_sum(n_fwd: float, *, l, k, alpha) -> float:
    """sum_{l_i > N} k_i / (alpha_i (1 - k_i + k_i N / l_i)): minus d(sum p_i*)/dN_fwd (inf past the floor)."""
    l, k, a = _params(l, k, alpha)
    live = l > n_fwd
    if not live.any():
        return 0.0
    den = 1.0 - k[live] + k[live] * n_fwd / l[live]
    if np.any(den <= 0):
        return math.inf
    return float(np.sum(k[live] / (a[live] * den)))


def solve_n_fwd(*, l, k, alpha, c_base: float, c_tok: float, n_min: float = 1.0, tol: float = 1e-9) -> float:
    """The N_fwd of the optimum: where c_base - c_tok * marginal_sum(N) changes sign (the step time is convex
    in it), in [max(n_min, floor), max l]; below floor = max_i l_i (1 - 1/k_i) no budget suffices."""
    l, k, a = _params(l, k, alpha)
    if c_base < 0 or c_tok < 0:
        raise ValueError(f"c_base and c_tok must be >= 0, got c_base={c_base}, c_tok={c_tok}")
    if l.size == 0 or l.max() <= 0:
        return 0.0
    hi = float(l.max())
    if c_tok == 0:  # drafting is free: go to the floor
        c_tok, c_base = 1.0, 0.0
    floor = float(np.max(np.where(k > 1, l * (1 - 1 / k), 0.0)))
    lo = max(float(n_min), floor)
    if lo >= hi:
        return hi

    def h(n: float) -> float:
        return c_base - c_tok * marginal_sum(n, l=l, k=k, alpha=a)

    if h(hi * (1 - 1e-12)) < 0:  # even the longest request's first drafted token costs more than it saves
        return hi
    if lo > floor and h(lo) >= 0:
        return lo
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if h(mid) < 0 else (lo, mid)
        if hi - lo <= tol * max(1.0, hi):
            break
    return hi


def optimal_budgets(*, l, k, alpha, n_fwd: float) -> np.ndarray:
    """p_i* = -(l_i/alpha_i) ln(1 - k_i (1 - N_fwd/l_i)) where l_i > N_fwd, else 0 (total draft tokens)."""
    l, k, a = _params(l, k, alpha)
    out = np.zeros_like(l)
    live = l > n_fwd
    arg = 1.0 - k[live] * (1.0 - n_fwd / l[live])
    with np.errstate(divide="ignore"):
        out[live] = np.where(arg > 0, -(l[live] / a[live]) * np.log(np.maximum(arg, 1e-300)), np.inf)
    return out


@dataclass(frozen=True)
class AcceptancePrior:
    """Prior of the per-problem (k, alpha) estimate and how strongly it holds."""

    k: float = 1.25
    """Capacity: drafts cover at most 1/k of a response (0.8 by default)."""
    alpha: float = 0.625
    """Efficiency: alpha/k accepted tokens per drafted token at small budgets (0.5 by default; alpha <= k)."""
    strength: float = 2.0
    """Weight of the prior, in pseudo-observations of one finished request."""
    history: int = 64
    """Most recent finished requests kept per problem."""
    max_problems: int = 65536
    """Problems whose observations are kept: the most recently recorded (LengthConfig.max_problems)."""

    def __post_init__(self) -> None:
        if not (self.k >= 1 and 0 < self.alpha <= self.k and self.strength >= 0 and self.history >= 1
                and self.max_problems >= 1):
            raise ValueError(f"need k >= 1, 0 < alpha <= k, strength >= 0, history >= 1, max_problems >= 1; "
                             f"got {self}")


_LOGK = np.linspace(0.0, math.log(20.0), 48)
_LOGA = np.linspace(math.log(0.02), math.log(50.0), 64)


class AcceptanceStats:
    """Per-problem (drafted/length, accepted/length) of finished requests; `estimate` fits (k, alpha) of
    accepted/l = (1 - exp(-alpha * drafted/l)) / k by least squares on a log grid, pulled to the prior."""

    def __init__(self, prior: AcceptancePrior = AcceptancePrior()) -> None:
        self.prior = prior
        self._obs: dict[Hashable, list[tuple[float, float]]] = {}  # in order of last record (lists: see length.py)
        self._est: dict[Hashable, tuple[float, float]] = {}

    def record(self, problem_id: Hashable, *, length: int, drafted: int, accepted: int) -> None:
        if length <= 0 or drafted <= 0:
            return  # nothing learnt about drafting
        if accepted < 0 or accepted > drafted:
            raise ValueError(f"accepted={accepted} must be in [0, drafted={drafted}] (problem {problem_id!r})")
        obs = self._obs.pop(problem_id, None) or []
        obs.append((drafted / length, min(accepted / length, 1.0)))
        del obs[:-self.prior.history]
        self._obs[problem_id] = obs  # now the most recent
        self._est.pop(problem_id, None)
        while len(self._obs) > self.prior.max_problems:
            oldest = next(iter(self._obs))
            del self._obs[oldest]
            self._est.pop(oldest, None)

    def estimate(self, problem_id: Hashable) -> tuple[float, float]:
        """(k, alpha) of the problem; the prior for a problem never seen."""
        if problem_id in self._est:
            return self._est[problem_id]
        obs = self._obs.get(problem_id)
        pr = self.prior
        if not obs:
            return pr.k, pr.alpha
        xy = np.asarray(obs)
        lk, la = _LOGK[:, None, None], _LOGA[None, :, None]
        pred = (1.0 - np.exp(-np.exp(la) * xy[None, None, :, 0])) / np.exp(lk)
        sse = np.sum((pred - xy[None, None, :, 1]) ** 2, axis=2)
        # A prior worth `strength` requests with typical residual 0.1.
        pen = pr.strength * 0.01 * ((_LOGK[:, None] - math.log(pr.k)) ** 2 + (_LOGA[None, :] - math.log(pr.alpha)) ** 2)
        loss = np.where(_LOGA[None, :] <= _LOGK[:, None] + 1e-12, sse + pen, np.inf)  # alpha <= k: accepted <= drafted
        i, j = np.unravel_index(int(np.argmin(loss)), loss.shape)
        self._est[problem_id] = (float(math.exp(_LOGK[i])), float(math.exp(_LOGA[j])))
        return self._est[problem_id]

    def state_dict(self) -> dict:
        return {"problems": [[pid, [list(o) for o in d]] for pid, d in self._obs.items()]}

    def load_state_dict(self, state: dict) -> None:
        obs = {}
        for i, entry in enumerate(state.get("problems", [])):
            try:
                pid, pts = entry
                obs[pid] = [(float(x), float(y)) for x, y in pts][-self.prior.history:]
            except (TypeError, ValueError):
                raise ValueError(f"acceptance state: problems[{i}] must be [problem_id, [[x, y], ...]]") from None
        self._obs, self._est = dict(list(obs.items())[-self.prior.max_problems:]), {}


class HistoryPolicy(PolicyBase):
    """A policy that learns the lengths of finished requests: those gone from the states passed to `budgets`,
    or passed to `finish(state)` / left at `end_step()`."""

    def __init__(self, *, lengths: LengthClassifier | None = None, length_config: LengthConfig = LengthConfig(),
                 max_len: int | None = None) -> None:
        self._fixed_max = max_len is not None
        self.lengths = lengths if lengths is not None else LengthClassifier(length_config, max_len=max_len or 16384)
        self._live: dict[Hashable, RequestState] = {}
        self._done: set[Hashable] = set()

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
        ids = {s.req_id for s in states}
        for rid in [r for r in self._live if r not in ids]:
            self.finish(self._live[rid])
        for s in states:
            self._live[s.req_id] = s
        if states and not self._fixed_max:
            self.lengths.set_max_len(max(s.max_new_tokens for s in states))
        return self._budgets(states)

    def _budgets(self, states: Sequence[RequestState]) -> list[int]:
        raise NotImplementedError


class ClassPolicy(HistoryPolicy):
    """DAS's class caps unpriced (`classes`): each request's cap is that of its length class, the class
    re-estimated every step from the partial length (equal caps: every row the cap, none classified)."""

    def __init__(self, caps: ClassCaps = ClassCaps(), **kw) -> None:
        super().__init__(**kw)
        self.caps = caps

    def _budgets(self, states: Sequence[RequestState]) -> list[int]:
        uniform = self.caps.uniform()
        if uniform is not None:
            return [uniform] * len(states)
        out = []
        for s in states:
            cls = self.lengths.classify(s.problem_id, s.generated)
            s.classes.append(cls)
            out.append(int(getattr(self.caps, cls)))
        return out


class UnboundedBudget(PolicyBase):
    """The paper's ablation: every request drafts as far as the drafter's match goes (capped at
    `limit`, which only bounds the forward's width)."""

    def __init__(self, limit: int = 256) -> None:
        if limit < 1:
            raise ValueError(f"unbounded limit must be >= 1, got {limit}")
        self.limit = limit

    def budgets(self, states: Sequence[RequestState]) -> list[int]:
        return [self.limit] * len(states)


class OptimalPolicy(HistoryPolicy):
    """The closed form turned into per-step caps: with l_i the expected remaining length of each live
    request (its problem's history conditioned on the length reached), (k_i, alpha_i) its problem's
    estimate, solve N_fwd, and give each request p_i*/N_fwd draft tokens per forward (at most `limit`)."""

    def __init__(self, latency: LatencyModel = GPU_LATENCY, *, limit: int = 32,
                 acceptance: AcceptanceStats | None = None, prior: AcceptancePrior = AcceptancePrior(), **kw) -> None:
        super().__init__(**kw)
        if limit < 0:
            raise ValueError(f"optimal limit must be >= 0, got {limit}")
        self.latency, self.limit = latency, limit
        self.acceptance = acceptance if acceptance is not None else AcceptanceStats(prior)

    def _learn(self, state: RequestState) -> None:
        super()._learn(state)
        self.acceptance.record(state.problem_id, length=state.generated, drafted=state.drafted,
                               accepted=state.accepted)

    def _budgets(self, states: Sequence[RequestState]) -> list[int]:
        if not states:
            return []
        rem = np.array([max(1.0, min(self.lengths.expected_length(s.problem_id, s.generated),
                                     float(s.max_new_tokens)) - s.generated) for s in states])
        ka = np.array([self.acceptance.estimate(s.problem_id) for s in states])
        n = solve_n_fwd(l=rem, k=ka[:, 0], alpha=ka[:, 1], c_base=self.latency.c_base, c_tok=self.latency.c_tok)
        p = optimal_budgets(l=rem, k=ka[:, 0], alpha=ka[:, 1], n_fwd=n)
        per_fwd = np.where(p > 0, np.ceil(np.minimum(p / max(n, 1.0), self.limit)), 0)
        return [int(x) for x in per_fwd]


class ConfidencePolicy(PolicyBase):
    """Draft up to `cap`, then cut every node whose path probability is below `threshold` (and its
    subtree), like vLLM 0.34's adaptive verification."""

    trims = True

    def __init__(self, threshold: float = 0.3, cap: int = 16) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"confidence threshold must be in [0, 1], got {threshold}")
        if cap < 0:
            raise ValueError(f"confidence cap must be >= 0, got {cap}")
        self.threshold, self.cap = threshold, cap

    def budgets(self, states: Sequence[RequestState]) -> list[int]:
        return [self.cap] * len(states)

    def trim(self, states: Sequence[RequestState], drafts: DraftBatch) -> DraftBatch:
        return DraftBatch.from_drafts([trim_draft(d, self.threshold) for d in drafts.drafts()])


def trim_draft(d: Draft, threshold: float) -> Draft:
    """Keep the nodes with path probability >= threshold whose ancestors are all kept; reindex parents."""
    if len(d) == 0:
        return d
    keep = np.zeros(len(d), bool)
    for i in range(len(d)):
        par = int(d.parents[i])
        keep[i] = d.probs[i] >= threshold and (par < 0 or keep[par])
    if keep.all():
        return d
    if not keep.any():
        return Draft.empty()
    new_index = np.cumsum(keep) - 1
    parents = np.where(d.parents[keep] < 0, -1, new_index[np.maximum(d.parents[keep], 0)]).astype(np.int32)
    return Draft(d.tokens[keep], parents, d.probs[keep], d.match_len)


LAB_POLICIES: dict[str, type] = {"classes": ClassPolicy, "unbounded": UnboundedBudget, "optimal": OptimalPolicy,
                                 "confidence": ConfidencePolicy}
ALL_POLICIES = (*POLICIES, *LAB_POLICIES)
"""Every policy name the lab's tools take: the library's (das = the priced session policy) and the lab's."""


def make_lab_policy(name: str, *, latency: LatencyModel | None = None, **kw):
    """A policy by name: the library's through `dasrl.policy.make_policy` (das priced by `latency`), the lab's
    by constructor (keyword arguments go to it; `optimal` takes `latency` too)."""
    if name in POLICIES:
        return make_policy(name, latency=latency, **kw)
    try:
        cls = LAB_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(ALL_POLICIES)}") from None
    if name == "optimal" and latency is not None:
        kw.setdefault("latency", latency)
    try:
        return cls(**kw)
    except TypeError as e:
        raise ValueError(f"policy {name!r}: bad arguments {sorted(kw)} ({e})") from None
