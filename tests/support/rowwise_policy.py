"""The speculation policy's pricing and acceptance estimate as they were before their state moved into arrays
(dasrl/policy/allowance.py, acceptance.py at 1a7647e): dicts keyed by request and problem, every row's
bookkeeping one at a time, the class caps and the length history a policy of their own that the pricing wraps
(dasrl/policy/budget.py, HistoryPolicy and DASPolicy, at 71f939c). The oracle the batched policy must agree
with, row for row and float for float (tests/test_policy_rows.py, tests/test_vllm_rows.py)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Hashable, Sequence

import numpy as np

from dasrl.drafter.base import DraftBatch
from dasrl.policy.allowance import _CALIB_PRIOR, ClassCaps
from dasrl.policy.base import RequestState
from dasrl.policy.latency import LatencyModel
from dasrl.policy.length import LengthClassifier, LengthConfig


class RowwiseClasses:
    """DAS's class caps with the length history they learn (HistoryPolicy + DASPolicy as they were): each
    request's cap that of its length class; a request is finished when it disappears from the states passed to
    `budgets`, or by `finish(state)` / `end_step()`."""

    trims = False

    def __init__(self, caps: ClassCaps = ClassCaps(), *, lengths: LengthClassifier | None = None,
                 length_config: LengthConfig = LengthConfig()) -> None:
        self.caps = caps
        self.lengths = lengths if lengths is not None else LengthClassifier(length_config)
        self._live: dict[Hashable, RequestState] = {}
        self._done: set[Hashable] = set()

    @property
    def lazy_classes(self) -> bool:
        """Equal caps: `budgets` classifies nobody; the allowance classifies the rows that draft."""
        return self.caps.short == self.caps.medium == self.caps.long

    def classify(self, s: RequestState) -> str:
        cls = self.lengths.classify(s.problem_id, s.generated)
        s.classes.append(cls)
        return cls

    def budgets(self, states: Sequence[RequestState]) -> list[int]:
        ids = {s.req_id for s in states}
        for rid in [r for r in self._live if r not in ids]:
            self.finish(self._live[rid])
        for s in states:
            self._live[s.req_id] = s
        if states:
            self.lengths.set_max_len(max(s.max_new_tokens for s in states))
        if self.lazy_classes:
            return [int(self.caps.long)] * len(states)
        return [int(getattr(self.caps, self.classify(s))) for s in states]

    def finish(self, state: RequestState) -> None:
        if state.req_id in self._done:
            return
        self._done.add(state.req_id)
        self._live.pop(state.req_id, None)
        self.lengths.record(state.problem_id, state.generated)

    def abort(self, state: RequestState) -> None:
        self._live.pop(state.req_id, None)

    def end_step(self) -> None:
        for s in list(self._live.values()):
            self.finish(s)
        self._done.clear()


class RowwiseAcceptance:
    """Per-token acceptance rates of live rows and of problems (at most `max_problems`, the most recently
    updated kept)."""

    def __init__(self, *, prior_p: float = 0.6, prior_tokens: float = 8.0, decay: float = 0.5,
                 row_decay: float = 0.99, max_problems: int = 65536) -> None:
        if not 0.0 < prior_p < 1.0 or prior_tokens < 0:
            raise ValueError(f"need 0 < prior_p < 1 and prior_tokens >= 0, got {prior_p}, {prior_tokens}")
        if not 0.0 <= decay <= 1.0 or not 0.0 <= row_decay <= 1.0:
            raise ValueError(f"acceptance decays must be in [0, 1], got decay={decay}, row_decay={row_decay}")
        if max_problems < 1:
            raise ValueError(f"max_problems must be >= 1, got {max_problems}")
        self.prior_p, self.prior_tokens, self.decay, self.max_problems = prior_p, prior_tokens, decay, max_problems
        self.row_decay = row_decay
        self._row: dict[Hashable, tuple[float, float]] = {}  # req -> (accepted, rejections), decayed while idle
        self._problem: dict[Hashable, tuple[float, float]] = {}  # problem -> (accepted, rejections), decayed;
        # in order of last update (the first is forgotten past max_problems)
        self._run = [0.0, 0.0]  # every problem's (accepted, rejections), decayed alike

    def rate(self, req_id: Hashable, problem_id: Hashable) -> float:
        w = self.prior_tokens
        a, r = self._run
        run = (a + self.prior_p * w) / (a + r + w) if a + r + w > 0 else self.prior_p
        a, r = self._problem.get(problem_id, (0, 0))
        problem = (a + run * w) / (a + r + w) if a + r + w > 0 else run
        a, r = self._row.get(req_id, (0, 0))
        return (a + problem * w) / (a + r + w) if a + r + w > 0 else problem

    def record(self, req_id: Hashable, problem_id: Hashable, *, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` tokens of which the first `accepted` were kept."""
        if drafted <= 0:
            return
        rejected = int(accepted < drafted)
        ra, rr = self._row.get(req_id, (0, 0))
        self._row[req_id] = (ra + accepted, rr + rejected)
        pa, pr = self._problem.pop(problem_id, (0, 0))
        self._problem[problem_id] = (pa + accepted, pr + rejected)  # now the most recent
        self._run = [self._run[0] + accepted, self._run[1] + rejected]
        if len(self._problem) > self.max_problems:
            del self._problem[next(iter(self._problem))]

    def idle(self, req_id: Hashable) -> None:
        """The row drafts nothing this forward: its own evidence ages (it will probe again)."""
        c = self._row.get(req_id)
        if c is not None:
            self._row[req_id] = (c[0] * self.row_decay, c[1] * self.row_decay)

    def forget_row(self, req_id: Hashable) -> None:
        self._row.pop(req_id, None)

    def end_step(self) -> None:
        """Rows are gone; every problem's counts decay."""
        self._row.clear()
        self._problem = {k: (a * self.decay, r * self.decay) for k, (a, r) in self._problem.items()}
        self._run = [c * self.decay for c in self._run]

    def state_dict(self) -> dict:
        return {"problems": [[pid, [a, r]] for pid, (a, r) in self._problem.items()], "run": list(self._run)}

    def load_state_dict(self, state: dict) -> None:
        problems = {}
        for i, entry in enumerate(state.get("problems", [])):
            try:
                pid, (a, r) = entry
                a, r = float(a), float(r)
            except (TypeError, ValueError):
                raise ValueError(f"acceptance state: problems[{i}] must be [problem_id, [accepted, rejections]]") from None
            if isinstance(pid, bool) or not isinstance(pid, (int, str)):
                raise ValueError(f"acceptance state: problems[{i}] problem id must be an int or a string, got {pid!r}")
            if not (math.isfinite(a) and math.isfinite(r) and a >= 0 and r >= 0):
                raise ValueError(f"acceptance state: problems[{i}] counts must be finite and >= 0, got {[a, r]}")
            problems[pid] = (a, r)
        run = state.get("run", [0.0, 0.0])
        try:
            run = [float(run[0]), float(run[1])] if len(run) == 2 else None
        except (TypeError, ValueError):
            run = None
        if run is None or not all(math.isfinite(c) and c >= 0 for c in run):
            raise ValueError(f"acceptance state: run must be [accepted, rejections] >= 0, got {state.get('run')!r}")
        self._problem, self._row = dict(list(problems.items())[-self.max_problems:]), {}
        self._run = run


class _Prices:
    """The per-row price table of `priced_draft`, built once and asked for several shares."""

    def __init__(self, p, most, *, row, kv, c_tok: float) -> None:
        p = np.clip(np.atleast_1d(np.asarray(p, np.float64)), 0.0, 1.0)
        most = np.broadcast_to(np.asarray(most, np.int64), p.shape).clip(min=0)
        self.shape = p.shape
        d = np.arange(int(min(most.max(initial=0), MAX_PRICED)) + 1)  # [D]
        self.drafts = (d > 0)[None, :]  # [1, D] the lengths that draft at all
        row, kv = (np.broadcast_to(np.asarray(x, np.float64), p.shape)[:, None] for x in (row, kv))
        self.cost = row + c_tok * d[None, :] + kv * self.drafts  # [B, D] seconds per forward, no share
        self.e = tokens_per_forward(d[None, :], p[:, None])  # [B, D] expected tokens per forward
        self.allowed = d[None, :] <= most[:, None]  # [B, D]

    def best(self, share, fixed=0.0) -> np.ndarray:
        """[B] the cheapest d per row when it carries `share` of every forward and `fixed` of one it drafts in
        (each a scalar or [B])."""
        if self.cost.shape[1] == 1:  # nobody may draft
            return np.zeros(self.shape, np.int64)
        share, fixed = (x if np.ndim(x) == 0 else np.asarray(x, np.float64)[:, None] for x in (share, fixed))
        cost = share + self.cost + fixed * self.drafts  # [B, D]
        per_token = np.where(self.allowed, cost / self.e, np.inf)  # [B, D]
        return np.argmin(per_token, axis=1).astype(np.int64)  # ties: the shorter draft


MAX_PRICED = 256
"""Longest draft priced (the engine's widest draft is far below; p near 1 would otherwise price 1024)."""


def priced_draft(p, most, *, share, row, kv, c_tok: float) -> np.ndarray:
    """Per row, the draft length d in [0, most] with the fewest expected seconds per emitted token,
    (share + row + c_tok * d + [d > 0] * kv) / E(d, p): `share` the part of the forward's fixed cost the
    row carries, `row` its own cost per forward (its token and its KV read), `kv` the extra cost of feeding
    it more than one token. All [B] (or scalars)."""
    return _Prices(p, most, row=row, kv=kv, c_tok=c_tok).best(share)


def tokens_per_forward(k, p) -> np.ndarray:
    """Expected tokens a row emits per forward drafting a chain of k at per-token acceptance p:
    1 + p + ... + p^k (the accepted prefix plus the recovered or bonus token)."""
    k, p = np.asarray(k, np.float64), np.clip(np.asarray(p, np.float64), 0.0, 1.0)
    one = p >= 1.0
    geo = (1.0 - p ** (k + 1)) / np.where(one, 1.0, 1.0 - p)  # p = 1 is taken below (no 0 / 0 to silence)
    return np.where(one, k + 1, geo)


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


class RowwiseAllowance:
    """Wraps a policy: each row's draft under its cap priced (module docstring); with `max_tokens`, the
    drafts of a forward capped and spent critical row first."""

    def __init__(self, inner: RowwiseClasses, max_tokens: int | None = None, *, latency: LatencyModel | None = None,
                 acceptance: RowwiseAcceptance | None = None) -> None:
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"draft allowance must be >= 0, got {max_tokens}")
        self.inner, self.max_tokens, self.latency = inner, max_tokens, latency
        self.acceptance = acceptance if acceptance is not None else RowwiseAcceptance()
        """The per-token acceptance estimate of rows and problems (the policy's only one)."""
        self.lengths = inner.lengths
        """The wrapped policy's length history (predicts each row's remaining length)."""
        self._price: dict[Hashable, tuple[float, float, float]] = {}  # req -> (share, row, kv) this forward
        self._expected: dict[Hashable, float] = {}  # req -> expected accepted tokens of its pending draft
        self._calib = [0.0, 0.0]  # accepted tokens, expected ones (path probabilities) of verified drafts
        self.spent: Counter = Counter()
        """Drafted tokens per length class since the last take_spent()."""
        self._seen: dict[Hashable, tuple[int, int, str]] = {}  # req -> (drafted, accepted, last class)

    # ------------------------------------------------------------------ the split
    def budgets(self, states: Sequence[RequestState]) -> list[int]:
        for s in states:
            self._account(s)
        caps = np.asarray(self.inner.budgets(states), np.int64).clip(min=0)  # [B] class caps
        if not states:
            return []
        p = np.array([self._p(s) for s in states])  # [B] per-token acceptance
        remaining = np.maximum(self._remaining(states), 1.0)  # [B] predicted tokens still to come
        if self.latency is None:  # unpriced: every row its cap, leveled to the critical path
            best = caps
            need = pace_draft(remaining, p, horizon=float((remaining / tokens_per_forward(best, p)).max()), most=best)
        else:
            best, need = self._priced(states, caps, p, remaining)
        if self.max_tokens is None:
            out = np.asarray(need, np.int64).tolist()
        else:  # the forward's drafts capped: spent critical row first
            at_best = remaining / tokens_per_forward(best, p)  # [B] forwards each row needs drafting its best
            out, left = [0] * len(states), self.max_tokens
            for i in np.argsort(-at_best, kind="stable"):
                if left <= 0:
                    break
                out[i] = int(min(need[i], left))
                left -= out[i]
        lazy = self.inner.lazy_classes
        for s, k in zip(states, out):  # the class each drafting row drafts under this step
            if not k:
                self.acceptance.idle(s.req_id)
                continue
            cls = self.inner.classify(s) if lazy else s.classes[-1] if s.classes else "none"
            self._seen[s.req_id] = (*self._seen[s.req_id][:2], cls)
        return out

    def _priced(self, states, caps, p, remaining) -> tuple[np.ndarray, np.ndarray]:
        """([B] each row's priced draft, [B] what it drafts): rows off the critical group carry c_base / B
        (any of the B live rows may turn out to be the last) and the whole c_draft; the group's m rows share
        c_base and c_draft (they draft together) and draft what keeps them within the critical path
        (module docstring)."""
        lat = self.latency
        ctx = np.array([s.prompt_len + s.generated for s in states], np.float64)  # [B] context lengths
        row, kv = lat.c_tok + lat.c_other * ctx, lat.c_draft_kv * ctx  # [B] own cost, extra cost of drafting
        prices = _Prices(p, caps, row=row, kv=kv, c_tok=lat.c_tok)
        spread = lat.c_base / len(states)
        solo = prices.best(spread, lat.c_draft)  # [B]
        at_solo = remaining / tokens_per_forward(solo, p)  # [B] forwards drafting for itself
        m = 1
        while True:
            crit = prices.best(lat.c_base / m, lat.c_draft / m)  # [B]
            horizon = float((remaining / tokens_per_forward(crit, p)).max())
            group = at_solo > horizon * (1 + 1e-9)  # [B] rows that would outlast the critical path alone
            if max(int(group.sum()), 1) <= m:
                break
            m = int(group.sum())
        share = np.where(group, lat.c_base / m, spread)  # [B]
        extra = kv + np.where(group, lat.c_draft / m, lat.c_draft)  # [B]
        self._price = {st.req_id: (float(a), float(b), float(c)) for st, a, b, c in zip(states, share, row, extra)}
        best = np.where(group, crit, solo)
        return best, np.where(group, pace_draft(remaining, p, horizon=horizon, most=crit), solo)

    def acceptance_rate(self, state: RequestState) -> float:
        """The per-token acceptance rate the row's drafts are expected to have (see the module docstring)."""
        return self._p(state)

    def _remaining(self, states: Sequence[RequestState]) -> np.ndarray:
        lengths = self.lengths
        return np.array([min(lengths.expected_length(s.problem_id, s.generated), s.max_new_tokens) - s.generated
                         for s in states], np.float64)

    def _p(self, s: RequestState) -> float:
        return self.acceptance.rate(s.req_id, s.problem_id)

    # ------------------------------------------------------------------ bookkeeping
    def _account(self, s: RequestState) -> None:
        """Fold in what the row's last step drafted and accepted (budgets() runs once per engine step)."""
        drafted, accepted, cls = self._seen.get(s.req_id, (0, 0, "none"))
        d, a = s.drafted - drafted, s.accepted - accepted
        if d > 0:
            self.spent[cls] += d
            x = self._expected.pop(s.req_id, None)
            if x is not None:
                self._calib[0] += a
                self._calib[1] += x
            self.acceptance.record(s.req_id, s.problem_id, drafted=d, accepted=a)
        self._seen[s.req_id] = (s.drafted, s.accepted, cls)

    def finish(self, state: RequestState) -> None:
        """The request left the batch: count its last step's drafts; the wrapped policy learns from it."""
        self._account(state)
        self._seen.pop(state.req_id, None)
        self.acceptance.forget_row(state.req_id)
        self.inner.finish(state)

    def abort(self, state: RequestState) -> None:
        """The request's generation failed: forget it (its partial drafts count nowhere)."""
        self._seen.pop(state.req_id, None)
        self._expected.pop(state.req_id, None)
        self.acceptance.forget_row(state.req_id)
        self.inner.abort(state)

    def take_spent(self) -> dict[str, int]:
        """Drafted tokens per length class since the last call (and reset)."""
        out, self.spent = dict(self.spent), Counter()
        return out

    def end_step(self) -> None:
        self._seen.clear()
        self.acceptance.end_step()  # problems decay: one that stopped drafting is probed again later
        self._calib = [c * self.acceptance.decay for c in self._calib]
        self._expected.clear()
        self.inner.end_step()

    @property
    def trims(self) -> bool:
        return self.latency is not None or self.inner.trims

    def trim(self, states: Sequence[RequestState], drafts: DraftBatch) -> DraftBatch:
        """The wrapped policy's trim, then each draft cut to the prefix with the fewest expected seconds per
        emitted token, node i accepted with probability its path probability x the calibration (accepted /
        expected over the verified drafts): a draft as long as the cap but sure only of its first tokens
        keeps those."""
        drafts = self.inner.trim(states, drafts) if self.inner.trims else drafts
        if self.latency is None:
            return drafts
        a, x = self._calib
        calib = (a + _CALIB_PRIOR) / (x + _CALIB_PRIOR)
        q = np.minimum(drafts.probs * calib, 1.0)  # [T] P(node accepted); prefixes of best-first trees are trees
        keep = drafts.lengths.copy()  # [B] nodes each row keeps
        priced = np.array([s.req_id in self._price for s in states], bool) & (keep > 0)  # [B]
        if not priced.any():
            return drafts
        rows = np.flatnonzero(priced)  # [R] the rows to cut
        price = np.array([self._price[states[b].req_id] for b in rows.tolist()], np.float64).reshape(-1, 3)  # [R, 3]
        share, row, kv = price[:, :1], price[:, 1:2], price[:, 2:3]  # [R, 1] each
        width = int(keep[rows].max())
        n = np.arange(width + 1)[None, :]  # [1, W+1] kept nodes
        qs = np.zeros((len(rows), width + 1))  # [R, W+1] column j+1: node j's acceptance, 0 past the draft
        node_row, node_idx = drafts.node_rows()
        at = np.searchsorted(rows, node_row)  # [T] each node's place among the cut rows (where it is one)
        mine = priced[node_row]
        qs[at[mine], node_idx[mine] + 1] = q[mine]
        cost = (share + row + self.latency.c_tok * n + kv * (n > 0)) / (1.0 + np.cumsum(qs, axis=1))  # [R, W+1]
        cost[n > keep[rows][:, None]] = np.inf  # past a row's draft
        keep[rows] = np.argmin(cost, axis=1)  # ties: the shorter prefix
        for b in rows[keep[rows] > 0].tolist():  # the raw path probabilities each kept draft expects accepted
            lo = int(drafts.offsets[b])
            self._expected[states[b].req_id] = float(q[lo:lo + keep[b]].sum() / calib)
        return drafts.capped(keep)

    def parts(self) -> dict[str, object]:
        """The learnt state a session saves, by name (each with state_dict / load_state_dict): the acceptance
        estimate and the wrapped policy's length history when it keeps one."""
        return {"acceptance_rate": self.acceptance, "lengths": self.lengths}
