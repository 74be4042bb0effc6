"""Length classes from rollout history: long / medium / short, updated from the partial length at run time.

A request's initial class is the argmax of the class counts of its problem's past lengths (a problem
never seen falls back to the pooled history of every problem). While it generates, the class is
`argmax_c P(c | L >= l, problem)`, estimated from the past lengths that reach at least l: the problem's own
plus `prior_weight` pseudo-counts of the pooled distribution (conditioned the same way). Once l passes
the short threshold the class cannot be short, and once it passes the long threshold it is long.

Class thresholds are quantiles of the pooled history (`q_short`, `q_long`); with too little history they
are fractions of the length limit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Hashable

import numpy as np

CLASSES = ("short", "medium", "long")


@dataclass(frozen=True)
class LengthConfig:
    """How lengths are kept and turned into classes."""

    history: int = 64
    """Most recent lengths kept per problem."""
    q_short: float = 0.5
    """Pooled-length quantile below which a length is short."""
    q_long: float = 0.9
    """Pooled-length quantile at or above which a length is long."""
    prior_weight: float = 1.0
    """Pseudo-counts of the pooled distribution mixed into each problem's counts."""
    min_pooled: int = 8
    """Pooled lengths needed before the quantile thresholds replace the fallback fractions."""
    fallback_short: float = 0.25
    """Short threshold as a fraction of max_len while history is thin."""
    fallback_long: float = 0.6
    """Long threshold as a fraction of max_len while history is thin."""

    def __post_init__(self) -> None:
        if self.history < 1:
            raise ValueError(f"history must be >= 1, got {self.history}")
        if not 0.0 < self.q_short < self.q_long < 1.0:
            raise ValueError(f"need 0 < q_short < q_long < 1, got q_short={self.q_short}, q_long={self.q_long}")
        if self.prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {self.prior_weight}")
        if not 0.0 < self.fallback_short < self.fallback_long <= 1.0:
            raise ValueError(f"need 0 < fallback_short < fallback_long <= 1, got {self.fallback_short}, "
                             f"{self.fallback_long}")


@dataclass(frozen=True)
class _Table:
    """Sorted lengths; suffix class counts and suffix sums for O(log n) conditioning on L >= l."""

    sorted: np.ndarray
    counts_from: np.ndarray
    """[n+1, 3]: class counts of sorted[i:]."""
    sums_from: np.ndarray
    """[n+1]: sum of sorted[i:]."""

    @property
    def n(self) -> int:
        return int(self.sorted.size)

    @staticmethod
    def build(lengths: np.ndarray, classify) -> "_Table":
        s = np.sort(lengths)
        onehot = np.zeros((s.size + 1, 3))
        if s.size:
            onehot[np.arange(s.size), classify(s)] = 1.0
        counts = np.cumsum(onehot[::-1], axis=0)[::-1]
        sums = np.concatenate([np.cumsum(s[::-1])[::-1], [0]]).astype(np.float64)
        return _Table(s, counts, sums)

    def counts(self, at_least: int) -> np.ndarray:
        return self.counts_from[int(np.searchsorted(self.sorted, at_least, "left"))]

    def mean_at_least(self, at_least: int) -> float | None:
        i = int(np.searchsorted(self.sorted, at_least, "left"))
        return None if i == self.n else float(self.sums_from[i] / (self.n - i))


class LengthClassifier:
    """Records response lengths per problem and classifies requests (see the module docstring)."""

    def __init__(self, config: LengthConfig = LengthConfig(), *, max_len: int = 16384) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.config = config
        self.max_len = int(max_len)
        self._lengths: dict[Hashable, deque[int]] = {}
        self._version, self._built = 0, -1
        self._tables: dict[Hashable, _Table] = {}
        self._pooled_table: _Table | None = None
        self._thr: tuple[int, int] | None = None

    # ---------------------------------------------------------------- history
    def set_max_len(self, max_len: int) -> None:
        if int(max_len) != self.max_len:
            self.max_len = int(max_len)
            self._version += 1

    def record(self, problem_id: Hashable, length: int) -> None:
        """A response of this problem finished with `length` output tokens."""
        length = int(length)
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length} for problem {problem_id!r}")
        self._lengths.setdefault(problem_id, deque(maxlen=self.config.history)).append(length)
        self._version += 1

    def lengths(self, problem_id: Hashable) -> np.ndarray:
        return np.asarray(self._lengths.get(problem_id, ()), dtype=np.int64)

    def pooled(self) -> np.ndarray:
        if not self._lengths:
            return np.zeros(0, np.int64)
        return np.concatenate([np.asarray(d, np.int64) for d in self._lengths.values()])

    def _fresh(self) -> None:
        if self._built != self._version:
            self._tables, self._thr, self._built = {}, None, self._version
            self._pooled_table = None

    def thresholds(self) -> tuple[int, int]:
        """(short_below, long_from): a length l is short if l < short_below, long if l >= long_from."""
        self._fresh()
        if self._thr is None:
            pooled = self.pooled()
            c = self.config
            if len(pooled) >= c.min_pooled:
                lo = int(np.ceil(np.quantile(pooled, c.q_short)))
                hi = int(np.ceil(np.quantile(pooled, c.q_long)))
            else:
                lo, hi = int(c.fallback_short * self.max_len), int(c.fallback_long * self.max_len)
            lo = max(lo, 1)
            self._thr = (lo, max(hi, lo + 1))
        return self._thr

    def class_of_length(self, length) -> np.ndarray | str:
        lo, hi = self.thresholds()
        idx = np.where(np.asarray(length) < lo, 0, np.where(np.asarray(length) >= hi, 2, 1))
        return CLASSES[int(idx)] if idx.ndim == 0 else idx

    def _table(self, problem_id: Hashable | None) -> _Table:
        """Sorted lengths with suffix class counts and sums (problem None = pooled), rebuilt lazily."""
        self._fresh()
        if problem_id is None:
            if self._pooled_table is None:
                self._pooled_table = _Table.build(self.pooled(), self.class_of_length)
            return self._pooled_table
        if problem_id not in self._tables:
            self._tables[problem_id] = _Table.build(self.lengths(problem_id), self.class_of_length)
        return self._tables[problem_id]

    # --------------------------------------------------------------- classify
    def probabilities(self, problem_id: Hashable, generated: int = 0) -> np.ndarray:
        """P(class | L >= generated, problem) as [short, medium, long]."""
        own = self._table(problem_id).counts(generated)
        pooled = self._table(None).counts(generated)
        n_pooled = pooled.sum()
        total = own + (self.config.prior_weight * pooled / n_pooled if n_pooled else 0.0)
        if total.sum() == 0:
            _, hi = self.thresholds()
            # Past everything seen: long. No history at all: medium until the fallback long threshold.
            cls = 2 if generated >= hi or self._table(None).n else 1
            out = np.zeros(3)
            out[cls] = 1.0
            return out
        return total / total.sum()

    def initial_class(self, problem_id: Hashable) -> str:
        return self.classify(problem_id, 0)

    def classify(self, problem_id: Hashable, generated: int = 0) -> str:
        """argmax_c P(c | L >= generated, problem); ties go to the longer class."""
        p = self.probabilities(problem_id, generated)
        return CLASSES[2 - int(np.argmax(p[::-1]))]

    def expected_length(self, problem_id: Hashable, generated: int = 0) -> float:
        """E[L | L >= generated] from the problem's history (pooled if it has none that long), capped at
        max_len; with no history at all, the midpoint between generated and max_len."""
        for t in (self._table(problem_id), self._table(None)):
            m = t.mean_at_least(generated)
            if m is not None:
                return float(min(m, self.max_len))
        return float(generated + self.max_len) / 2.0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """JSON-able: problem ids must be ints or strings."""
        return {"max_len": self.max_len,
                "problems": [[pid, list(d)] for pid, d in self._lengths.items()]}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "problems" not in state:
            raise ValueError("length state: expected a dict with a 'problems' list")
        lengths: dict[Hashable, deque[int]] = {}
        for i, entry in enumerate(state["problems"]):
            if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], list)):
                raise ValueError(f"length state: problems[{i}] must be [problem_id, [lengths...]], got {entry!r}")
            pid, ls = entry
            if any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in ls):
                raise ValueError(f"length state: problems[{i}] (problem {pid!r}) has a length that is not an "
                                 f"int >= 0")
            lengths[pid] = deque(ls, maxlen=self.config.history)
        self.max_len = int(state.get("max_len", self.max_len))
        self._lengths = lengths
        self._version += 1
