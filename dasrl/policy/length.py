"""Length classes from rollout history: long / medium / short, updated from the partial length at run time
(docs/policy.md "Length classes"): argmax_c P(c | L >= generated, problem), the problem's past lengths plus
`prior_weight` pseudo-counts of the pooled ones, the thresholds quantiles of the pooled history.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Hashable

import numpy as np

_MAX_LENGTH = 2**20
"""Longest length a saved history may hold (1M tokens): the pooled table's size follows the longest length, so a
crafted save's 2**40 would allocate without bound."""


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
    max_problems: int = 65536
    """Problems whose history is kept: the most recently recorded (the state, and a save, stay bounded
    however many distinct problems a run sees; 65,536 covers every problem of the usual RL prompt sets)."""
    min_pooled: int = 8
    """Pooled lengths needed before the quantile thresholds replace the fallback fractions."""
    fallback_short: float = 0.25
    """Short threshold as a fraction of max_len while history is thin."""
    fallback_long: float = 0.6
    """Long threshold as a fraction of max_len while history is thin."""

    def __post_init__(self) -> None:
        if self.history < 1:
            raise ValueError(f"history must be >= 1, got {self.history}")
        if isinstance(self.max_problems, bool) or not isinstance(self.max_problems, int) or self.max_problems < 1:
            raise ValueError(f"max_problems must be an int >= 1, got {self.max_problems!r}")
        if not 0.0 < self.q_short < self.q_long < 1.0:
            raise ValueError(f"need 0 < q_short < q_long < 1, got q_short={self.q_short}, q_long={self.q_long}")
        if self.prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {self.prior_weight}")
        if not 0.0 < self.fallback_short < self.fallback_long <= 1.0:
            raise ValueError(f"need 0 < fallback_short < fallback_long <= 1, got {self.fallback_short}, "
                             f"{self.fallback_long}")


class _Table:
    """One problem's lengths, sorted, with suffix sums: counts and means of L >= l in O(log n)."""

    def __init__(self, lengths) -> None:
        # Python lists and bisect: the policy asks this for every live row at every step, and numpy's
        # per-call overhead on a few dozen values was most of a budgets() call.
        self.sorted = sorted(int(x) for x in lengths)
        self.sums_from = list(itertools.accumulate(reversed(self.sorted), initial=0))[::-1]  # [n+1] sum of sorted[i:]
        self.n = len(self.sorted)

    def count_from(self, at_least: int) -> int:
        return self.n - bisect.bisect_left(self.sorted, at_least)


class _Pooled:
    """Every kept length, as two Fenwick trees over the length value (counts and sums): counts, sums and order
    statistics in O(log of the longest length), whatever the number of problems."""

    def __init__(self) -> None:
        self.size, self.n = 1, 0
        self.hist = [0]  # count of each value
        self.cnt, self.tot = [0, 0], [0, 0]  # Fenwick trees, 1-based
        self._memo: dict[int, int] = {}  # count_from answers since the last add

    def add(self, value: int, k: int = 1) -> None:
        self._memo.clear()
        if value >= self.size:
            self._grow(value)
        self.hist[value] += k
        self.n += k
        i = value + 1
        while i <= self.size:
            self.cnt[i] += k
            self.tot[i] += k * value
            i += i & -i

    def _grow(self, value: int) -> None:
        old, self.size = self.hist, 1 << max(int(value).bit_length(), 10)
        self.hist, self.cnt, self.tot, self.n = [0] * self.size, [0] * (self.size + 1), [0] * (self.size + 1), 0
        for v, c in enumerate(old):
            if c:
                self.add(v, c)

    def _below(self, x: int) -> tuple[int, int]:
        """(count, sum) of the values < x."""
        i, c, t = min(max(int(x), 0), self.size), 0, 0
        while i > 0:
            c += self.cnt[i]
            t += self.tot[i]
            i -= i & -i
        return c, t

    def count_from(self, at_least: int) -> int:
        c = self._memo.get(at_least)  # the class thresholds are asked for every row at every step
        if c is None:
            c = self._memo[at_least] = self.n - self._below(at_least)[0]
        return c

    def sum_from(self, at_least: int) -> int:
        return self._below(1 << 62)[1] - self._below(at_least)[1]

    def kth(self, k: int) -> int:
        """The k-th smallest value (0-based)."""
        pos, step = 0, self.size
        while step:
            if pos + step <= self.size and self.cnt[pos + step] <= k:
                pos += step
                k -= self.cnt[pos]
            step >>= 1
        return pos

    def quantile(self, q: float) -> float:
        """np.quantile(values, q) (its default 'linear' method, the same arithmetic)."""
        pos = (self.n - 1) * q
        i = int(np.floor(pos))
        a, b, t = self.kth(i), self.kth(min(i + 1, self.n - 1)), pos - i
        return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t


class LengthClassifier:
    """Records response lengths per problem (of the `config.max_problems` recorded most recently) and classifies
    requests."""

    def __init__(self, config: LengthConfig = LengthConfig(), *, max_len: int = 16384) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.config = config
        self.max_len = int(max_len)
        self._lengths: dict[Hashable, list[int]] = {}  # in order of last record: the first is evicted
        # (lists, not deques: a deque costs a 0.5 KB block however short, and most problems have few lengths)
        self._pooled = _Pooled()
        self._tables: dict[Hashable, _Table] = {}
        self._thr: tuple[int, int] | None = None
        self.version = 0  # changes whenever the history or max_len does (a cached span may be stale)

    def set_max_len(self, max_len: int) -> None:
        if int(max_len) != self.max_len:
            self.max_len = int(max_len)
            self._thr = None
            self.version += 1

    def record(self, problem_id: Hashable, length: int) -> None:
        """A response of this problem finished with `length` output tokens."""
        length = int(length)
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length} for problem {problem_id!r}")
        d = self._lengths.pop(problem_id, None) or []
        d.append(length)
        self._pooled.add(length)
        if len(d) > self.config.history:
            self._pooled.add(d.pop(0), -1)  # pushed out of the problem's history
        self._lengths[problem_id] = d  # now the most recent
        self._tables.pop(problem_id, None)
        self._thr = None
        self.version += 1
        while len(self._lengths) > self.config.max_problems:  # the least recent problem is forgotten
            old = next(iter(self._lengths))
            for x in self._lengths.pop(old):
                self._pooled.add(x, -1)
            self._tables.pop(old, None)

    @property
    def num_problems(self) -> int:
        """Problems with a length history (at most config.max_problems)."""
        return len(self._lengths)

    def lengths(self, problem_id: Hashable) -> np.ndarray:
        return np.asarray(self._lengths.get(problem_id, ()), dtype=np.int64)

    def pooled(self) -> np.ndarray:
        if not self._lengths:
            return np.zeros(0, np.int64)
        return np.concatenate([np.asarray(d, np.int64) for d in self._lengths.values()])

    def thresholds(self) -> tuple[int, int]:
        """(short_below, long_from): a length l is short if l < short_below, long if l >= long_from."""
        if self._thr is None:
            c = self.config
            if self._pooled.n >= max(c.min_pooled, 1):
                lo = int(np.ceil(self._pooled.quantile(c.q_short)))
                hi = int(np.ceil(self._pooled.quantile(c.q_long)))
            else:
                lo, hi = int(c.fallback_short * self.max_len), int(c.fallback_long * self.max_len)
            lo = max(lo, 1)
            self._thr = (lo, max(hi, lo + 1))
        return self._thr

    def _table(self, problem_id: Hashable | None) -> _Table | _Pooled:
        """The problem's lengths (None: the pooled ones), as counts and sums of L >= l."""
        if problem_id is None:
            return self._pooled
        t = self._tables.get(problem_id)
        if t is None:
            if len(self._tables) >= 4096:  # a cache of cheap tables (<= history lengths each): keep it small
                self._tables.clear()
            t = self._tables[problem_id] = _Table(self._lengths.get(problem_id, ()))
        return t

    def _counts(self, table: _Table | _Pooled, at_least: int) -> tuple[int, int, int]:
        """(short, medium, long) counts of the lengths >= at_least."""
        lo, hi = self.thresholds()
        ge = table.count_from(at_least)
        ge_lo = table.count_from(lo) if lo > at_least else ge
        ge_hi = table.count_from(hi) if hi > at_least else ge
        return ge - ge_lo, ge_lo - ge_hi, ge_hi

    def probabilities(self, problem_id: Hashable, generated: int = 0) -> np.ndarray:
        """P(class | L >= generated, problem) as [short, medium, long]."""
        return np.array(self._probabilities(problem_id, generated))

    def _probabilities(self, problem_id: Hashable, generated: int) -> tuple[float, float, float]:
        own = self._counts(self._table(problem_id), generated)
        pooled = self._counts(self._pooled, generated)
        n_pooled = sum(pooled)
        w = self.config.prior_weight / n_pooled if n_pooled else 0.0
        total = (own[0] + w * pooled[0], own[1] + w * pooled[1], own[2] + w * pooled[2])
        z = total[0] + total[1] + total[2]
        if z == 0:
            _, hi = self.thresholds()
            # Past everything seen: long. No history at all: medium until the fallback long threshold.
            cls = 2 if generated >= hi or self._pooled.n else 1
            return tuple(float(c == cls) for c in range(3))
        return total[0] / z, total[1] / z, total[2] / z

    def classify(self, problem_id: Hashable, generated: int = 0) -> str:
        """argmax_c P(c | L >= generated, problem); ties go to the longer class."""
        short, medium, long = self._probabilities(problem_id, generated)
        return "long" if long >= medium and long >= short else "medium" if medium >= short else "short"

    def classify_span(self, problem_id: Hashable, generated: int = 0) -> tuple[str, int]:
        """(classify(problem_id, generated), last): the same class for every generated' in [generated, last]
        while `version` stays (the counts of lengths >= generated', the problem's and the pooled, and which
        side of each threshold generated' is on, stay those at generated)."""
        g = int(generated)
        lo, hi = self.thresholds()
        last = min(lo - 1 if g < lo else 1 << 62, hi - 1 if g < hi else 1 << 62)
        t = self._table(problem_id)
        k = bisect.bisect_left(t.sorted, g)
        if k < t.n:
            last = min(last, t.sorted[k])
        p = self._pooled
        n = p.count_from(g)
        if n:
            last = min(last, p.kth(p.n - n))
        return self.classify(problem_id, g), last

    def expected_length(self, problem_id: Hashable, generated: int = 0) -> float:
        """E[L | L >= generated] from the problem's history (pooled if it has none that long), capped at
        max_len; with no history at all, the midpoint between generated and max_len."""
        return self.expected_span(problem_id, generated)[0]

    def expected_span(self, problem_id: Hashable, generated: int = 0) -> tuple[float, int]:
        """(expected_length(problem_id, generated), last): the same value for every generated' in [generated, last]
        while `version` stays (`last`: the smallest length >= generated; with no history at all, generated)."""
        t = self._table(problem_id)
        k = bisect.bisect_left(t.sorted, generated)
        if k < t.n:
            return float(min(t.sums_from[k] / (t.n - k), self.max_len)), t.sorted[k]
        p = self._pooled
        n = p.count_from(generated)
        if n:
            return float(min(p.sum_from(generated) / n, self.max_len)), p.kth(p.n - n)
        return float(generated + self.max_len) / 2.0, int(generated)

    def state_dict(self) -> dict:
        """JSON-able: problem ids must be ints or strings."""
        return {"max_len": self.max_len,
                "problems": [[pid, list(d)] for pid, d in self._lengths.items()]}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "problems" not in state:
            raise ValueError("length state: expected a dict with a 'problems' list")
        lengths: dict[Hashable, list[int]] = {}
        for i, entry in enumerate(state["problems"]):
            if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], list)):
                raise ValueError(f"length state: problems[{i}] must be [problem_id, [lengths...]], got {entry!r}")
            pid, ls = entry
            if any(not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= _MAX_LENGTH for x in ls):
                raise ValueError(f"length state: problems[{i}] (problem {pid!r}) has a length that is not an "
                                 f"int in [0, {_MAX_LENGTH}]")
            lengths[pid] = ls[len(ls) - self.config.history:] if len(ls) > self.config.history else list(ls)
        max_len = state.get("max_len", self.max_len)
        if not isinstance(max_len, int) or isinstance(max_len, bool) or not 1 <= max_len <= _MAX_LENGTH:
            raise ValueError(f"length state: max_len must be an int in [1, {_MAX_LENGTH}], got {max_len!r}")
        self.max_len = max_len
        keep = list(lengths.items())[-self.config.max_problems:]  # the most recent (a save's order is theirs)
        self._lengths, self._pooled, self._tables, self._thr = dict(keep), _Pooled(), {}, None
        self.version += 1
        for _, d in keep:
            for x in d:
                self._pooled.add(x)
