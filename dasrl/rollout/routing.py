"""Routing one step's problems to rollout workers (docs/distributed.md, "Routing").

All samples of a problem go to one worker, so its drafter history stays local (no shared draft server). The
length-aware router predicts each worker's step time from the problems' length histories and places problems
longest-first where the predicted time grows least (LPT), so predicted-long problems are interleaved across
workers; round-robin and random routing (also problem-grouped) are the baselines.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence

import numpy as np

from dasrl.policy.latency import LatencyModel
from dasrl.policy.length import LengthClassifier, LengthConfig


@dataclass(frozen=True)
class _Group:
    """The samples of one problem in this step."""

    problem_id: Hashable
    samples: int  # requests of this problem in the step


class _Router(Protocol):
    name: str

    def assign(self, groups: Sequence[_Group], workers: Sequence[int]) -> dict[Hashable, int]:
        """Worker id of each problem (every sample of a problem goes to the same worker)."""

    def observe(self, problem_id: Hashable, lengths: Sequence[int]) -> None:
        """Output lengths of a problem's finished samples (the next steps' predictions)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def _check(groups: Sequence[_Group], workers: Sequence[int]) -> None:
    if not workers:
        raise ValueError("no live workers to route to")
    seen = set()
    for g in groups:
        if g.samples < 1:
            raise ValueError(f"problem {g.problem_id!r}: samples must be >= 1, got {g.samples}")
        if g.problem_id in seen:
            raise ValueError(f"problem {g.problem_id!r} appears twice; give each problem one Group")
        seen.add(g.problem_id)


class _RoundRobinRouter:
    """Problems in arrival order to workers in turn (the turn carries over between steps)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = 0

    def assign(self, groups: Sequence[_Group], workers: Sequence[int]) -> dict[Hashable, int]:
        _check(groups, workers)
        first, self._turn = self._turn, self._turn + len(groups)
        return {g.problem_id: workers[(first + i) % len(workers)] for i, g in enumerate(groups)}

    def observe(self, problem_id: Hashable, lengths: Sequence[int]) -> None:
        pass

    def state_dict(self) -> dict:
        return {"turn": self._turn}

    def load_state_dict(self, state: dict) -> None:
        self._turn = int(state.get("turn", 0))


class _RandomRouter:
    """Each problem to a uniformly random worker (seeded)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def assign(self, groups: Sequence[_Group], workers: Sequence[int]) -> dict[Hashable, int]:
        _check(groups, workers)
        picks = self._rng.integers(0, len(workers), size=len(groups))
        return {g.problem_id: workers[int(i)] for g, i in zip(groups, picks)}

    def observe(self, problem_id: Hashable, lengths: Sequence[int]) -> None:
        pass

    def state_dict(self) -> dict:
        return {"rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        if "rng" in state:
            self._rng.bit_generator.state = state["rng"]


class _LengthAwareRouter:
    """Longest-predicted-first onto the worker whose predicted step time, `c_base * E[longest of its samples] +
    c_tok * E[its tokens]`, grows least. A problem's length distribution is its history mixed with `prior`
    pseudo-samples of the pooled one (a problem seen a few times still carries the pool's runaway tail); a
    worker's longest has CDF prod_p F_p(x)^n_p, so piling many short problems on one worker raises it too. A
    problem stays on the worker holding its history unless that costs more than `affinity_slack` (default 1.0:
    losing the history costs more than a fine balance gains, measured in the simulator)."""

    name = "length"

    def __init__(self, *, latency: LatencyModel, max_len: int, affinity_slack: float = 1.0, prior: float = 4.0,
                 grid: int = 128, lengths: LengthConfig = LengthConfig()) -> None:
        if affinity_slack < 0 or prior < 0 or grid < 2:
            raise ValueError(f"need affinity_slack >= 0, prior >= 0, grid >= 2; got {affinity_slack}, {prior}, "
                             f"{grid}")
        self.latency, self.affinity_slack, self.prior, self.grid = latency, affinity_slack, prior, grid
        self.lengths = LengthClassifier(lengths, max_len=max_len)
        self.home: dict[Hashable, int] = {}

    def _log_cdf(self, problem_id: Hashable, xs: np.ndarray, pooled: np.ndarray) -> tuple[np.ndarray, float]:
        """(log F_p on the grid, mean length) of one problem."""
        own = np.sort(self.lengths.lengths(problem_id))
        if own.size == 0 and pooled.size == 0:
            f = (xs >= xs[-1] / 2).astype(np.float64)  # nothing known: every sample at half the limit
            return np.log(np.maximum(f, 1e-300)), float(xs[-1] / 2)
        f_own = np.searchsorted(own, xs, side="right") / max(own.size, 1)
        f_pool = np.searchsorted(pooled, xs, side="right") / max(pooled.size, 1)
        w_own, w_pool = float(own.size), self.prior if pooled.size else 0.0
        f = (w_own * f_own + w_pool * f_pool) / (w_own + w_pool)
        mean = (w_own * (own.mean() if own.size else 0.0) + w_pool * (pooled.mean() if pooled.size else 0.0)) / (
            w_own + w_pool)
        return np.log(np.maximum(f, 1e-300)), float(mean)

    def _time(self, log_cdf: np.ndarray, tokens: float, dx: float) -> float:
        longest = float(np.sum(1.0 - np.exp(log_cdf)) * dx)  # E[max] = integral of P(max > x)
        return self.latency.c_base * longest + self.latency.c_tok * tokens

    def predict(self, problem_id: Hashable, samples: int = 1) -> tuple[float, float]:
        """(expected longest of `samples` samples, expected tokens of them) for this problem."""
        xs, dx, pooled = self._grid()
        log_f, mean = self._log_cdf(problem_id, xs, pooled)
        return float(np.sum(1.0 - np.exp(samples * log_f)) * dx), samples * mean

    def _grid(self) -> tuple[np.ndarray, float, np.ndarray]:
        pooled = np.sort(self.lengths.pooled())
        top = max(self.lengths.max_len, int(pooled[-1]) if pooled.size else 0)
        xs = np.linspace(0.0, top, self.grid + 1)[:-1]  # left edges: P(max > x) over [x, x + dx)
        return xs, top / self.grid, pooled

    def assign(self, groups: Sequence[_Group], workers: Sequence[int]) -> dict[Hashable, int]:
        _check(groups, workers)
        xs, dx, pooled = self._grid()
        parts = {g.problem_id: self._log_cdf(g.problem_id, xs, pooled) for g in groups}
        solo = {g.problem_id: self._time(g.samples * parts[g.problem_id][0], 0.0, dx) for g in groups}
        order = sorted(groups, key=lambda g: (-solo[g.problem_id], -g.samples * parts[g.problem_id][1]))
        log_cdf = {w: np.zeros_like(xs) for w in workers}  # log P(longest <= x) of each worker's samples
        tokens = {w: 0.0 for w in workers}
        out = {}
        for g in order:
            lf, mean = parts[g.problem_id]
            after = {w: self._time(log_cdf[w] + g.samples * lf, tokens[w] + g.samples * mean, dx) for w in workers}
            before = {w: self._time(log_cdf[w], tokens[w], dx) for w in workers}
            # the makespan is the slowest worker's: place where the resulting time is least
            best = min(workers, key=lambda w: (after[w], before[w], w))
            home = self.home.get(g.problem_id)
            if home in after and after[home] <= after[best] * (1.0 + self.affinity_slack):
                best = home
            out[g.problem_id] = best
            log_cdf[best] = log_cdf[best] + g.samples * lf
            tokens[best] += g.samples * mean
        self.home.update(out)
        return out

    def observe(self, problem_id: Hashable, lengths: Sequence[int]) -> None:
        for n in lengths:
            self.lengths.record(problem_id, int(n))

    def state_dict(self) -> dict:
        return {"lengths": self.lengths.state_dict(), "home": [[k, v] for k, v in self.home.items()]}

    def load_state_dict(self, state: dict) -> None:
        if "lengths" in state:
            self.lengths.load_state_dict(state["lengths"])
        self.home = {k: int(v) for k, v in state.get("home", [])}


ROUTERS = ("length", "round_robin", "random")


def make_router(name: str, *, latency: LatencyModel, max_len: int, seed: int = 0,
                affinity_slack: float = 1.0) -> _Router:
    """A router by name: length | round_robin | random."""
    makers = {
        "length": lambda: _LengthAwareRouter(latency=latency, max_len=max_len, affinity_slack=affinity_slack),
        "round_robin": _RoundRobinRouter,
        "random": lambda: _RandomRouter(seed),
    }
    if name not in makers:
        raise ValueError(f"unknown router {name!r}; valid routers: {', '.join(ROUTERS)}")
    return makers[name]()


def groups_of(problem_ids: Sequence[Hashable]) -> list[_Group]:
    """One Group per distinct problem, in order of first appearance."""
    return [_Group(pid, n) for pid, n in Counter(problem_ids).items()]
