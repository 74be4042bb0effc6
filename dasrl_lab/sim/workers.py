"""Many rollout workers in the simulator, routed by the Routers `DistributedRolloutSession` uses: each worker
replays its share with its own Simulator; a step takes as long as its slowest worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from dasrl.rollout import groups_of, make_router
from dasrl_lab.trace import Response
from dasrl_lab.sim.simulator import SimConfig, Simulator, group_steps


@dataclass
class RoutedStep:
    step: int
    makespan: float
    """Seconds until the slowest worker finishes."""
    worker_s: list[float] = field(default_factory=list)
    """Each worker's simulated step time."""
    worker_rows: list[int] = field(default_factory=list)
    """Requests each worker ran."""

    @property
    def imbalance(self) -> float:
        """Slowest worker over the mean worker (1.0 = perfectly balanced)."""
        mean = float(np.mean(self.worker_s)) if self.worker_s else 0.0
        return self.makespan / mean if mean > 0 else 1.0


@dataclass
class RoutedResult:
    router: str
    workers: int
    steps: list[RoutedStep]
    warmup: int

    @property
    def makespan(self) -> float:
        """Summed step makespans, warmup steps left out."""
        return float(sum(s.makespan for s in self.steps[self.warmup:]))

    def to_dict(self) -> dict:
        return {"router": self.router, "workers": self.workers, "makespan_s": self.makespan,
                "mean_imbalance": float(np.mean([s.imbalance for s in self.steps[self.warmup:]] or [1.0])),
                "steps": [{"step": s.step, "makespan_s": s.makespan, "imbalance": s.imbalance,
                           "worker_s": s.worker_s, "worker_rows": s.worker_rows} for s in self.steps]}


def simulate_routed(responses: Sequence[Response], *, workers: int, router: str, drafter: str = "das",
                    policy: str = "das", config: SimConfig = SimConfig(), seed: int = 0,
                    progress: Callable[[int], None] | None = None) -> RoutedResult:
    """Replay the trace's steps over `workers` simulated workers routed by `router`."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    max_new = config.max_new_tokens or max((len(r.response_ids) for r in responses), default=1)
    route = make_router(router, latency=config.latency, max_len=max_new, seed=seed)
    sims = [Simulator(drafter=drafter, policy=policy, config=config) for _ in range(workers)]
    out = []
    for i, (step, rs) in enumerate(group_steps(responses)):
        where = route.assign(groups_of([r.problem_id for r in rs]), list(range(workers)))
        shares = [[r for r in rs if where[r.problem_id] == w] for w in range(workers)]
        times = [sims[w].run_step(step, share, max_new_tokens=max_new).makespan if share else 0.0
                 for w, share in enumerate(shares)]
        out.append(RoutedStep(step, max(times), times, [len(s) for s in shares]))
        lengths: dict = {}
        for r in rs:
            lengths.setdefault(r.problem_id, []).append(len(r.response_ids))
        for pid, ls in lengths.items():
            route.observe(pid, ls)
        if progress:
            progress(i)
    return RoutedResult(router, workers, out, config.warmup)
