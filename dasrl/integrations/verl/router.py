"""`DASLoadBalancer`: VeRL 0.9's `GlobalRequestLoadBalancer`, routing by problem and predicted length
(docs/verl.md). Every sample of a problem (the hash of its prompt: VeRL's uid is re-drawn every step) goes to
one server for the phase, where its history and siblings are; a new problem goes to the server with the least
predicted outstanding work, or back to its previous server unless that one's work exceeds the least by
`affinity_slack`. Turned on by `actor_rollout_ref.rollout.router_config_path` (router.yaml).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any

from verl.workers.rollout.router import DEFAULT_ROUTING_CACHE_SIZE, GlobalRequestLoadBalancer

from dasrl.drafter.base import problem_key
from dasrl.policy.length import LengthClassifier, LengthConfig


__all__ = ["RouterConfig", "DASLoadBalancer"]


@dataclass(frozen=True)
class RouterConfig:
    """The YAML fields DASLoadBalancer reads (besides router_class)."""

    affinity_slack: float = 0.25
    """Keep a problem on its last server unless that one's predicted work exceeds the least by this fraction."""
    history: int = 64
    """Service times kept per problem."""
    default_seconds: float = 1.0
    """Predicted seconds of a request when no problem has finished yet."""

    def __post_init__(self) -> None:
        if self.affinity_slack < 0 or self.history < 1 or self.default_seconds <= 0:
            raise ValueError(f"need affinity_slack >= 0, history >= 1, default_seconds > 0; got "
                             f"{self.affinity_slack}, {self.history}, {self.default_seconds}")

    @classmethod
    def from_yaml(cls, config: dict | None) -> "RouterConfig":
        known = {f.name for f in fields(cls)}
        config = dict(config or {})
        config.pop("router_class", None)
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"router config: unknown field(s) {unknown}; valid fields: {sorted(known)}")
        return cls(**config)


class DASLoadBalancer(GlobalRequestLoadBalancer):
    """See the module docstring. Runs as a Ray actor created by VeRL (`servers, yaml_config`)."""

    def __init__(self, servers: dict[str, Any], config: dict | None = None,
                 max_cache_size: int = DEFAULT_ROUTING_CACHE_SIZE) -> None:
        super().__init__(servers=servers, max_cache_size=max_cache_size)
        self.config = RouterConfig.from_yaml(config)
        self._seconds = LengthClassifier(LengthConfig(history=self.config.history), max_len=10**9)  # in ms
        self._phase: dict[int, str] = {}  # problem -> server, this phase
        self._home: dict[int, str] = {}  # problem -> server that last ran it
        self._work: dict[str, float] = {sid: 0.0 for sid in servers}  # predicted outstanding seconds
        self._open: dict[str, tuple[int, str, float, float]] = {}  # request -> (problem, server, t0, cost)

    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids"]

    def require_release_fields(self) -> list[str]:
        return ["request_id"]

    def predicted_seconds(self, problem: int) -> float:
        own = self._seconds.lengths(problem)
        pool = own if own.size else self._seconds.pooled()
        return float(pool.mean()) / 1000.0 if pool.size else self.config.default_seconds

    def _place(self, problem: int, cost: float) -> str:
        live = list(self._inflight_requests)
        if not live:
            raise RuntimeError("No available servers in load balancer")
        best = min(live, key=lambda s: (self._work.get(s, 0.0), self._inflight_requests[s], s))
        home = self._home.get(problem)
        least = self._work.get(best, 0.0) + cost
        if home in self._inflight_requests and self._work.get(home, 0.0) + cost <= least * (1 + self.config.affinity_slack):
            best = home
        return best

    def acquire_server(self, request_id: str, prompt_ids: list[int] | None = None, **extra):
        if prompt_ids is None or request_id in self._request_id_to_server:  # multi-turn: sticky request
            return super().acquire_server(request_id)
        problem = problem_key(prompt_ids)
        cost = self.predicted_seconds(problem)
        sid = self._phase.get(problem)
        if sid not in self._inflight_requests:
            sid = self._place(problem, cost)
            self._phase[problem] = self._home[problem] = sid
        self._request_id_to_server[request_id] = sid
        self._inflight_requests[sid] += 1
        self._work[sid] = self._work.get(sid, 0.0) + cost
        self._open[request_id] = (problem, sid, time.monotonic(), cost)
        return sid, self._servers[sid]

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        super().release_server(server_id, request_id)
        entry = self._open.pop(request_id, None) if request_id is not None else None
        if entry is None:
            return
        problem, sid, t0, cost = entry
        self._work[sid] = max(0.0, self._work.get(sid, 0.0) - cost)
        self._seconds.record(problem, int(round((time.monotonic() - t0) * 1000)))

    def clear_sticky_cache(self) -> dict:
        self._phase.clear()  # a new phase may place problems afresh (homes are kept)
        return super().clear_sticky_cache()

    def add_servers(self, servers: dict[str, Any]) -> None:
        super().add_servers(servers)
        for sid in servers:
            self._work.setdefault(sid, 0.0)

    def remove_servers(self, server_ids: list[str]) -> None:
        super().remove_servers(server_ids)
        gone = set(server_ids)
        for sid in gone:
            self._work.pop(sid, None)
        self._phase = {p: s for p, s in self._phase.items() if s not in gone}

    def get_status(self) -> dict:
        status = super().get_status()
        status.update(predicted_work_s=dict(self._work), problems_this_phase=len(self._phase))
        return status
