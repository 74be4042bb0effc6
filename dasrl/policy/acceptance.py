"""The one acceptance estimate of the speculation policy: a per-token acceptance rate per row and problem.

A verified chain gives its accepted tokens and, unless accepted whole, one rejection: p = accepted / (accepted +
rejections), a geometric rate (accepted / drafted would say 0.39 for p = 0.9 at 20 tokens). A row's counts are
pulled to its problem's, the problem's to the run's and the run's to a prior, by `prior_tokens` pseudo-tokens
each (a problem never drafted starts from what drafting has been worth in this run). A problem's counts decay
at every step end and a row's at every forward it does not draft in, so a problem or row that stopped drafting
drifts back and probes again: the policy being trained changes what it writes, and text turns repetitive late
in a long sample. The counts live in arrays, a slot per row and per problem (slot 0: none, all zeros), so the
policy reads and ages a whole batch's at once.
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

import numpy as np


class _Slots:
    """Keys -> slots of per-key arrays (`_Slots(first, a=np.float64)` has `.a`), a freed slot reused and zeroed
    when next taken; slots below `first` belong to no key. `version` changes whenever a key gains or loses its
    slot (a cached key -> slot map is stale)."""

    makes = False
    """Whether `slots` gives a key without one a new slot."""

    def __init__(self, first: int, **fields: type) -> None:
        self.of: dict[Hashable, int] = {}
        self._fields, self._first = fields, first
        self._free: list[int] = []
        self._next = first
        self.version = 0
        self._last: tuple[object, int, np.ndarray] | None = None  # the last slots() call: (keys, version, slots)
        for name, dt in fields.items():
            setattr(self, name, np.zeros(16, dt))

    def add(self, key: Hashable) -> int:
        if self._free:
            s = self._free.pop()
        else:
            s = self._next
            self._next += 1
        for name in self._fields:
            arr = getattr(self, name)
            if s >= len(arr):
                arr = np.concatenate([arr, np.zeros(len(arr), arr.dtype)])
                setattr(self, name, arr)
            arr[s] = 0
        self.of[key] = s
        self.version += 1
        return s

    def drop(self, key: Hashable) -> None:
        s = self.of.pop(key, None)
        if s is not None:
            self._free.append(s)
            self.version += 1

    def clear(self) -> None:
        self.of.clear()
        self._free.clear()
        self._next = self._first
        self.version += 1

    def slots(self, keys: Sequence[Hashable]) -> np.ndarray:
        """[B] the slot of each key (`first` - 1 where it has none, unless the class `makes` one). The same keys
        list object as the last call (the caller promises it unchanged) with no slot made or freed since gets the
        same array: a batch's slots cost no Python per row."""
        c = self._last
        if c is not None and c[0] is keys and c[1] == self.version:
            return c[2]
        get, none = self.of.get, self._first - 1
        out = np.fromiter((get(k, none) for k in keys), np.int64, len(keys))
        if self.makes:
            for i in np.flatnonzero(out < 0).tolist():
                out[i] = self.of.get(keys[i], -1)
                if out[i] < 0:  # a key twice in one batch takes one slot
                    out[i] = self.add(keys[i])
        self._last = (keys, self.version, out)
        return out


def _pulled(a: np.ndarray, r: np.ndarray, toward, w: float) -> np.ndarray:
    """(a + toward * w) / (a + r + w): counts pulled to the rate `toward` by w pseudo-tokens (`toward` if none)."""
    den = a + r + w
    if w > 0:  # den > 0 everywhere
        return (a + toward * w) / den
    return np.where(den > 0, (a + toward * w) / np.where(den > 0, den, 1.0), toward)


class AcceptanceRate:
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
        self.rows = _Slots(1, a=np.float64, r=np.float64)  # req -> (accepted, rejections), decayed while idle
        # problem -> (accepted, rejections), decayed; in order of last update (the first forgotten past max_problems)
        self.problems = _Slots(1, a=np.float64, r=np.float64)
        self._run = [0.0, 0.0]  # every problem's (accepted, rejections), decayed alike

    def rate(self, req_id: Hashable, problem_id: Hashable) -> float:
        return float(self.rates(self.rows.slots([req_id]), self.problems.slots([problem_id]))[0])

    def rates(self, row_slots: np.ndarray, problem_slots: np.ndarray) -> np.ndarray:
        """[B] the rate of each row: row_slots from `rows.slots(req_ids)`, problem_slots from
        `problems.slots(problem_ids)`."""
        w = self.prior_tokens
        a, r = self._run
        run = (a + self.prior_p * w) / (a + r + w) if a + r + w > 0 else self.prior_p
        problem = _pulled(self.problems.a[problem_slots], self.problems.r[problem_slots], run, w)
        return _pulled(self.rows.a[row_slots], self.rows.r[row_slots], problem, w)

    def record(self, req_id: Hashable, problem_id: Hashable, *, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` tokens of which the first `accepted` were kept."""
        if drafted > 0:
            self.record_batch([req_id], [problem_id], np.array([drafted], np.int64), np.array([accepted], np.int64))

    def record_batch(self, req_ids: Sequence[Hashable], problem_ids: Sequence[Hashable], drafted: np.ndarray,
                     accepted: np.ndarray) -> None:
        """A verified draft of drafted[i] > 0 tokens of which the first accepted[i] were kept, for each row i
        in turn ([n] arrays)."""
        rej = (accepted < drafted).astype(np.int64)  # [n]
        rows, probs = self.rows, self.problems
        at = list(map(rows.of.get, req_ids))
        if None in at:
            at = [rows.of.get(k) or rows.add(k) for k in req_ids]
        if len(set(at)) == len(at):  # distinct rows (a batch's): one add each
            rows.a[at] += accepted
            rows.r[at] += rej
        else:
            np.add.at(rows.a, at, accepted)
            np.add.at(rows.r, at, rej)
        of = probs.of
        acc, rj = accepted.tolist(), rej.tolist()
        sums: dict[int, list[float]] = {}  # slot -> its problem's counts, written back at the end
        for pid, a, r in zip(problem_ids, acc, rj):
            s = of.pop(pid, 0)  # re-inserted: now the most recent
            if s:
                of[pid] = s
            else:
                s = probs.add(pid)
                if len(of) > self.max_problems:  # the least recent is forgotten (its slot may come back zeroed)
                    first = next(iter(of))
                    sums.pop(of[first], None)
                    probs.drop(first)
            c = sums.get(s)
            if c is None:
                c = sums[s] = [float(probs.a[s]), float(probs.r[s])]
            c[0] += a  # in order, one by one: the same float sums as adding row after row
            c[1] += r
        pa, pr = probs.a, probs.r
        for s, (a, r) in sums.items():
            pa[s], pr[s] = a, r
        run_a, run_r = self._run
        for a, r in zip(acc, rj):
            run_a, run_r = run_a + a, run_r + r
        self._run = [run_a, run_r]

    def idle(self, req_id: Hashable) -> None:
        """The row drafts nothing this forward: its own evidence ages (it will probe again)."""
        self.idle_slots(self.rows.slots([req_id]))

    def idle_slots(self, row_slots: np.ndarray) -> None:
        """`idle` for the rows at these slots (distinct; slot 0, a row without counts, stays zero)."""
        self.rows.a[row_slots] *= self.row_decay
        self.rows.r[row_slots] *= self.row_decay

    def end_step(self) -> None:
        """Rows are gone; every problem's counts decay."""
        self.rows.clear()
        self.problems.a *= self.decay
        self.problems.r *= self.decay
        self._run = [c * self.decay for c in self._run]

    def state_dict(self) -> dict:
        p = self.problems
        return {"problems": [[pid, [float(p.a[s]), float(p.r[s])]] for pid, s in p.of.items()],
                "run": list(self._run)}

    def load_state_dict(self, state: dict) -> None:
        problems = {}
        for i, entry in enumerate(state.get("problems", [])):
            try:
                pid, (a, r) = entry
                a, r = float(a), float(r)
            except (TypeError, ValueError):
                raise ValueError(f"acceptance state: problems[{i}] must be "
                                 f"[problem_id, [accepted, rejections]]") from None
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
        self.rows.clear()
        self.problems.clear()
        for pid, (a, r) in list(problems.items())[-self.max_problems:]:
            s = self.problems.add(pid)
            self.problems.a[s], self.problems.r[s] = a, r
        self._run = run
