"""Rollout workers on a Ray cluster: `DistributedRolloutSession`, RolloutSession's interface over N actors.

    from dasrl.integrations.ray import init_local
    init_local()                                            # or ray.init(address=...) for a cluster
    session = DistributedRolloutSession("HuggingFaceTB/SmolLM2-135M-Instruct", DistributedConfig(workers=4))
    for step in range(steps):
        rollouts = session.generate(prompts, sampling=SamplingParams(temperature=0.8), max_new_tokens=512)
        ...                                                 # rewards, policy update
        session.set_weights(model.state_dict())             # the new policy, to every worker
        session.end_step()

All samples of a problem go to one worker (dasrl.rollout.routing), which holds its drafter shard: no shared
draft server. Seeds come from (run seed, step, problem, sample index), so a request gives the same tokens on
any worker: a dead worker's requests re-run on the survivors with the outputs they would have had, each
exactly once, and a replacement takes its place for the next step. A local Ray started here listens on
127.0.0.1 only (docs/distributed.md, "Network exposure").
"""

from __future__ import annotations

import copy
import ipaddress
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Hashable, Sequence

from dasrl._extras import require

require("engine", "dasrl.integrations.ray")

from dasrl.atomic import MAX_JSON_BYTES, read_json, write_json
from dasrl.drafter.base import problem_key
from dasrl.engine.sampling import SamplingParams
from dasrl.policy.latency import CPU_LATENCY, LatencyModel
from dasrl.rollout.routing import ROUTERS, groups_of, make_router
from dasrl.rollout.session import Rollout, SessionConfig, StepSummary, sample_indices, sample_seed


__all__ = ["is_loopback", "init_local", "DistributedConfig", "RolloutWorker", "DistributedRolloutSession"]

def _ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("distributed rollouts need Ray: pip install 'dasrl[ray]'") from e
    return ray


_LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback address (what a dual-stack socket on 127.0.0.1 reports)."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def init_local(**kwargs) -> None:
    """Start a local Ray whose every service listens on 127.0.0.1 only (kwargs go to ray.init). Ray 2.60 turns
    a loopback `_node_ip_address` into the routable address unless ray_constants.ENABLE_RAY_CLUSTER is False,
    so the flag is held False during ray.init, and the node IP is checked after (docs/distributed.md)."""
    ray = _ray()
    for key in ("address", "_node_ip_address"):
        if kwargs.get(key) is not None:
            raise ValueError(f"init_local starts a loopback-only local Ray: {key}={kwargs[key]!r} is not allowed")
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialised; init_local starts a fresh local instance")
    kwargs.setdefault("include_dashboard", False)  # the dashboard is a web server nobody here needs
    from ray._private import ray_constants

    saved, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        ray.init(_node_ip_address=_LOOPBACK, **kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):
        ray.shutdown()
        raise RuntimeError(f"Ray {ray.__version__} bound its node to {node_ip}, not loopback: refusing to run "
                           f"a local cluster that listens beyond this machine")


@dataclass(frozen=True)
class DistributedConfig:
    """How a DistributedRolloutSession spreads a step over Ray actors."""

    workers: int = 2
    """Rollout actors (each holds one engine and its problems' drafter history)."""
    router: str = "length"
    """Problem routing: length (predicted-makespan LPT) | round_robin | random."""
    cpus_per_worker: float = 1.0
    """Ray CPUs each actor reserves (also its torch threads, at least 1)."""
    gpus_per_worker: float = 0.0
    """Ray GPUs each actor reserves."""
    affinity_slack: float = 1.0
    """A problem stays on its history's worker unless its predicted time exceeds the best by this fraction."""
    replace_dead: bool = True
    """Start a fresh actor in a dead one's place after the step."""
    session: SessionConfig = SessionConfig()
    """What each worker's RolloutSession does (speculation, policy, store, seed)."""
    latency: LatencyModel = CPU_LATENCY
    """Forward cost the router predicts worker time with."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; valid routers: {', '.join(ROUTERS)}")
        if self.cpus_per_worker <= 0 or self.gpus_per_worker < 0:
            raise ValueError(f"cpus_per_worker must be > 0 and gpus_per_worker >= 0, got "
                             f"{self.cpus_per_worker} and {self.gpus_per_worker}")


class RolloutWorker:
    """The actor body: one RolloutSession on its own model copy (wrapped with ray.remote at runtime)."""

    def __init__(self, model: str, config: SessionConfig, dtype: str = "float32") -> None:
        """`model`: a folder or hub id for from_pretrained; on CUDA when the actor sees a device."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from dasrl.rollout.session import RolloutSession

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
        m.to("cuda" if torch.cuda.is_available() else "cpu").eval()
        self.session = RolloutSession(m, self.tokenizer, config)

    def generate(self, prompts, *, problem_ids, seeds, samples, sampling, max_new_tokens, stop_token_ids, stop_lines):
        rollouts = self.session.generate(prompts, problem_ids=problem_ids, seeds=seeds, samples=samples,
                                         sampling=sampling, max_new_tokens=max_new_tokens,
                                         stop_token_ids=stop_token_ids, stop_lines=stop_lines)
        return rollouts, self.session.history[-1]

    def end_step(self) -> None:
        self.session.end_step()

    def set_weights(self, state_dict) -> None:
        # strict; the driver checks keys and shapes first, since torch copies the matching tensors before it raises
        self.session.engine.model.load_state_dict(state_dict, strict=True)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.session.engine.model.state_dict().items()}

    def stats(self) -> dict:
        return self.session.stats()

    def save(self, folder: str) -> None:
        self.session.save(folder)

    def check_load(self, folder: str) -> None:
        """Raise what load(folder) would, changing nothing (loaded into a throwaway session on this model)."""
        from dasrl.rollout.session import RolloutSession

        RolloutSession(self.session.engine.model, self.tokenizer, self.session.config).load(folder)

    def load(self, folder: str) -> None:
        self.session.load(folder)

    def pid(self) -> int:
        return os.getpid()


def _gather(ray, refs: dict[int, object], what: str) -> None:
    """Wait for every worker's call; a ValueError naming each worker that raised and why."""
    errors = []
    for w, ref in refs.items():
        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            errors.append(f"worker {w}: {type(e.cause).__name__}: {e.cause}")
    if errors:
        raise ValueError(f"{what}: " + "; ".join(errors))


def _check_weights(weights: dict, shapes: dict[str, tuple[int, ...]]) -> None:
    missing, unexpected = sorted(shapes.keys() - weights.keys()), sorted(weights.keys() - shapes.keys())
    wrong = [f"{k} {tuple(weights[k].shape)} (model: {shapes[k]})" for k in sorted(weights.keys() & shapes.keys())
             if tuple(weights[k].shape) != shapes[k]]
    if missing or unexpected or wrong:
        parts = [f"{name} {len(keys)}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
                 for name, keys in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", wrong)) if keys]
        raise ValueError("set_weights: the state dict does not match the model (" + "; ".join(parts) + ")")


class DistributedRolloutSession:
    """The Session protocol (generate / end_step / stats / save / load / close, with RolloutSession's
    arguments) over Ray actors."""

    def __init__(self, model: str, config: DistributedConfig = DistributedConfig(), *,
                 dtype: str = "float32") -> None:
        self._ray = ray = _ray()
        if not ray.is_initialized():
            init_local()
        self.model, self.config, self.dtype = str(model), config, dtype
        threads = max(1, int(config.cpus_per_worker))
        self._worker_session = replace(config.session, engine=replace(config.session.engine, num_threads=threads))
        self._actor_cls = ray.remote(num_cpus=config.cpus_per_worker, num_gpus=config.gpus_per_worker,
                                     max_restarts=0)(RolloutWorker)
        self._dead: set[int] = set()
        self._weights = None
        self._shapes: dict[str, tuple[int, ...]] | None = None  # the model's parameter shapes, asked once
        self.workers: dict[int, object] = {w: self._spawn() for w in range(config.workers)}
        ray.get([a.pid.remote() for a in self.workers.values()])  # fail here, not mid-step, if they can't start
        self.router = make_router(config.router, latency=config.latency, max_len=4096, seed=config.session.seed,
                                  affinity_slack=config.affinity_slack)
        self.step = 0
        self.history: list[StepSummary] = []  # per step: makespan, worker fields, the workers' counts summed
        self._drawn: dict[Hashable, set[int]] = {}  # sample indices of each problem drawn this step

    def _spawn(self):
        actor = self._actor_cls.remote(self.model, self._worker_session, self.dtype)
        if self._weights is not None:
            actor.set_weights.remote(self._weights)
        return actor

    def _each(self, method: str, *args) -> list:
        """Call `method` on every live worker and wait for all."""
        return self._ray.get([getattr(self.workers[w], method).remote(*args) for w in self.live_workers])

    @property
    def live_workers(self) -> list[int]:
        return [w for w in self.workers if w not in self._dead]

    def generate(self, prompts: Sequence[Sequence[int]], *, problem_ids: Sequence[Hashable] | None = None,
                 seeds: Sequence[int] | None = None, samples: Sequence[int] | None = None,
                 sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 256,
                 stop_token_ids: Sequence[int] | None = None, stop_lines: Sequence[str] = (),
                 on_dispatch: Callable[[dict[int, list[int]]], None] | None = None) -> list[Rollout]:
        """One step's batch across the workers, with RolloutSession.generate's arguments; rollouts in the order
        of `prompts`. `on_dispatch(worker -> request indices)` is called each time shares are sent out."""
        ray = self._ray
        if len(prompts) == 0:
            raise ValueError("generate() needs at least one prompt")
        prompts = [list(map(int, p)) for p in prompts]
        pids = list(problem_ids) if problem_ids is not None else [problem_key(p) for p in prompts]
        if len(pids) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(pids)} problem ids")
        if seeds is None:  # counted per problem over the step's calls and checked, as a session does
            samples = sample_indices(self._drawn, pids, samples, self.step)
            for pid, k in zip(pids, samples):
                self._drawn.setdefault(pid, set()).add(k)
            seeds = [sample_seed(self.config.session.seed, self.step, pid, k) for pid, k in zip(pids, samples)]
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        t0 = time.perf_counter()
        info = StepSummary(step=self.step, rollout_s=0.0)
        results: list[Rollout | None] = [None] * len(prompts)
        kw = dict(sampling=sampling, max_new_tokens=max_new_tokens, stop_lines=list(stop_lines),
                  stop_token_ids=list(stop_token_ids) if stop_token_ids is not None else None)
        pending: dict = {}  # ObjectRef -> (worker, request indices)

        def dispatch(todo: list[int]) -> None:
            live = self.live_workers
            if not live:
                raise RuntimeError(f"every rollout worker died during step {self.step}; "
                                   f"{len(todo)} of {len(prompts)} requests are unfinished")
            where = self.router.assign(groups_of([pids[i] for i in todo]), live)
            shares: dict[int, list[int]] = {}
            for i in todo:
                shares.setdefault(where[pids[i]], []).append(i)
            for w, idx in shares.items():
                share = None if samples is None else [int(samples[i]) for i in idx]
                ref = self.workers[w].generate.remote([prompts[i] for i in idx], problem_ids=[pids[i] for i in idx],
                                                      seeds=[int(seeds[i]) for i in idx], samples=share, **kw)
                pending[ref] = (w, idx)
            if on_dispatch is not None:
                on_dispatch({w: list(idx) for w, idx in shares.items()})

        dispatch(list(range(len(prompts))))
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            w, idx = pending.pop(ref)
            try:
                outs, summary = ray.get(ref)
            except ray.exceptions.RayActorError:  # the worker died: its share runs again elsewhere, now
                self._dead.add(w)
                info.dead.append(w)
                info.rerun += len(idx)
                dispatch(idx)
                continue
            for i, r in zip(idx, outs):
                results[i] = r
            info.worker_s[w] = info.worker_s.get(w, 0.0) + summary.rollout_s
            info.worker_rows[w] = info.worker_rows.get(w, 0) + len(outs)
            info.add(summary)
        info.rollout_s = time.perf_counter() - t0
        self.history.append(info)
        lengths: dict[Hashable, list[int]] = {}
        for pid, r in zip(pids, results):
            lengths.setdefault(pid, []).append(len(r.completion_ids))
        for pid, ls in lengths.items():
            self.router.observe(pid, ls)
        return results  # type: ignore[return-value]

    def set_weights(self, state_dict) -> None:
        """Load new policy weights into every worker (and later replacements). A state dict whose keys or shapes
        are not the model's is refused before any worker changes."""
        weights = {k: v.detach().cpu() for k, v in state_dict.items()}
        if self._shapes is None:
            self._shapes = self._ray.get(self.workers[self.live_workers[0]].weight_shapes.remote())
        _check_weights(weights, self._shapes)
        self._weights = self._ray.put(weights)
        self._each("set_weights", self._weights)

    def end_step(self) -> None:
        """The step's rollouts are final: every worker rolls its window; dead workers are replaced."""
        for w in self.live_workers:
            try:
                self._ray.get(self.workers[w].end_step.remote())
            except self._ray.exceptions.RayActorError:
                self._dead.add(w)
        if self.config.replace_dead:
            for w in sorted(self._dead):
                self.workers[w] = self._spawn()
            self._dead.clear()
        self.step += 1
        self._drawn = {}

    def stats(self) -> dict:
        per = self._each("stats")
        keys = ("forwards", "new_tokens", "drafted", "accepted", "store_tokens", "store_bytes")
        out = {k: sum(p[k] for p in per) for k in keys}
        out.update(steps=len(self.history), rollout_s=sum(h.rollout_s for h in self.history),
                   rerun=sum(h.rerun for h in self.history), workers=len(self.live_workers))
        return out

    def save(self, folder: str | os.PathLike) -> None:
        """Each worker's session under worker-<i>/ (the folder must be visible to the workers: one node or a
        shared filesystem), the driver's step and routing state in distributed.json."""
        folder = Path(folder).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        self._ray.get([self.workers[w].save.remote(str(folder / f"worker-{w}")) for w in self.live_workers])
        write_json(folder / "distributed.json", {"format": "dasrl-distributed/1", "step": self.step,
                                                  "workers": len(self.workers), "router": self.config.router,
                                                  "routing": self.router.state_dict()})

    def load(self, folder: str | os.PathLike) -> None:
        folder = Path(folder).resolve()
        src = folder / "distributed.json"
        try:
            state = read_json(src, MAX_JSON_BYTES)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read a distributed session from {folder}: {e}") from None
        if not isinstance(state, dict) or state.get("format") != "dasrl-distributed/1":
            raise ValueError(f"{src}: not a dasrl distributed session "
                             f"(format {state.get('format') if isinstance(state, dict) else state!r})")
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{src}: field 'step' must be an int >= 0, got {step!r}")
        router = self.router
        if state.get("router") == self.config.router:
            router = copy.deepcopy(self.router)  # loaded on a copy: a bad routing state changes nothing
            try:
                router.load_state_dict(state["routing"])
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"{src}: field 'routing': {type(e).__name__}: {e}") from None
        parts = {w: str(folder / f"worker-{w}") for w in self.live_workers if (folder / f"worker-{w}").is_dir()}
        # all or nothing: every part is first loaded into a throwaway session on its worker
        _gather(self._ray, {w: self.workers[w].check_load.remote(p) for w, p in parts.items()}, f"{folder}: not loaded")
        _gather(self._ray, {w: self.workers[w].load.remote(p) for w, p in parts.items()}, f"{folder}: loaded in part")
        self.step, self.router, self._drawn = step, router, {}

    def close(self) -> None:
        """Stop the actors (the Ray runtime stays up)."""
        for a in self.workers.values():
            self._ray.kill(a)
        self.workers.clear()

    shutdown = close

    def __enter__(self) -> "DistributedRolloutSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
