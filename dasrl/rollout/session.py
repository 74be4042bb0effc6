"""RolloutSession: what an RL loop calls once per training step.

    session = RolloutSession(model, tokenizer, SessionConfig())
    for step in range(steps):
        rollouts = session.generate(prompts, sampling=SamplingParams(temperature=0.8), max_new_tokens=256)
        ... rewards, policy update ...
        session.end_step(rewards)      # history upkeep runs in the background during the next update

Samples of the same prompt (GRPO's G samples) share a problem id (the prompt-token hash unless given);
a sample's seed comes from (run seed, step, problem, sample index), so a spec-on and a spec-off run of
the same loop see the same random numbers and produce the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Hashable, Sequence

from dasrl.atomic import write_json
from dasrl.drafter.base import Drafter, problem_key
from dasrl.drafter.store import DraftStore, StoreConfig
from dasrl.engine.engine import Completion, EngineConfig, SpecEngine, StepInfo
from dasrl.engine.sampling import SamplingParams
from dasrl.policy.base import NoSpeculation
from dasrl.policy.allowance import ForwardAllowance, allowance_for
from dasrl.policy.budget import make_policy
from dasrl.policy.latency import LatencyModel

CPU_LATENCY = LatencyModel(c_base=0.05, c_tok=0.0025)
"""SmolLM2-135M fp32 forwards on this project's 2-core machine (DESIGN.md); `dasrl calibrate` measures yours."""


@dataclass(frozen=True)
class SessionConfig:
    """How a RolloutSession generates and keeps history."""

    speculate: bool = True
    """Draft from history and verify (False = plain decoding, the baseline)."""
    policy: str = "das"
    """Budget policy: none | fixed | unbounded | das | optimal | confidence."""
    policy_kw: tuple[tuple[str, object], ...] = ()
    """Keyword arguments of the policy's constructor as (name, value) pairs, e.g. (("limit", 24),)."""
    store: StoreConfig = StoreConfig()
    """The history drafter's scope, window and decay."""
    seed: int = 0
    """Run seed; sample seeds derive from (seed, step, problem, sample index)."""
    background_upkeep: bool = True
    """Run end_step's drafter upkeep in a background thread (joined by the next generate)."""
    engine: EngineConfig = EngineConfig()
    """Engine settings (context limit, threads)."""
    latency: str | None = None
    """latency.json from `dasrl calibrate`; None = the CPU figures measured here (50 ms + 2.5 ms/token)."""
    draft_allowance: int | None = None
    """Draft tokens per forward for the whole batch; None = c_base / c_tok of the latency model."""


@dataclass
class Rollout:
    """One sample of one step."""

    problem_id: Hashable
    sample: int
    seed: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    forwards: int
    drafted: int
    accepted: int


@dataclass
class StepSummary:
    step: int
    rollout_s: float
    """Wall seconds of generate()."""
    upkeep_wait_s: float
    """Seconds generate() waited for the previous end_step's background upkeep (critical path)."""
    upkeep_s: float = 0.0
    """Seconds the previous end_step's upkeep took in all."""
    forwards: int = 0
    row_forwards: int = 0
    """Forwards summed over requests (a forward with 8 live rows counts 8)."""
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    batch_curve: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since start, live rows) per engine step: the effective batch over decoding time."""

    @property
    def accepted_per_forward(self) -> float:
        """Tokens a request gets per verification forward it takes part in (1.0 without speculation)."""
        return self.new_tokens / max(self.row_forwards, 1)


def sample_seed(run_seed: int, step: int, problem_id: Hashable, sample: int) -> int:
    """A 63-bit seed that depends only on (run seed, step, problem, sample index)."""
    key = json.dumps([run_seed, step, str(problem_id), sample]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def sample_indices(problem_ids: Sequence[Hashable]) -> list[int]:
    """Each request's index among the samples of its problem, in order: [a, a, b, a] -> [0, 1, 0, 2]."""
    counter: Counter = Counter()
    out = []
    for pid in problem_ids:
        out.append(counter[pid])
        counter[pid] += 1
    return out


class RolloutSession:
    """See the module docstring. `drafter` (optional) replaces the DraftStore that `config.store`
    describes with any object behind the Drafter protocol (n-gram, oracle, a custom drafter); it may also
    be reassigned between steps (`session.drafter = ...`, e.g. a fresh oracle per step). Only a DraftStore
    is saved by save() and counted in stats()."""

    def __init__(self, model, tokenizer, config: SessionConfig = SessionConfig(), *,
                 drafter: Drafter | None = None) -> None:
        if drafter is not None and not config.speculate:
            raise ValueError("a drafter was given but config.speculate is False: nothing would use it")
        self.config = config
        self.engine = SpecEngine(model, tokenizer, config.engine)
        self.drafter: Drafter | None = drafter if drafter is not None else (
            DraftStore(config.store) if config.speculate else None)
        self.policy = NoSpeculation()
        if config.speculate:
            latency = LatencyModel.load(config.latency) if config.latency else CPU_LATENCY
            allowance = config.draft_allowance if config.draft_allowance is not None else allowance_for(latency)
            self.policy = ForwardAllowance(make_policy(config.policy, **dict(config.policy_kw)), allowance)
        self.step = 0
        self.history: list[StepSummary] = []
        self._upkeep: threading.Thread | None = None
        self._upkeep_s = 0.0

    # ------------------------------------------------------------------ the step
    def generate(self, prompts: Sequence[Sequence[int]], *, problem_ids: Sequence[Hashable] | None = None,
                 seeds: Sequence[int] | None = None, sampling: SamplingParams = SamplingParams(),
                 max_new_tokens: int = 256, stop_token_ids: Sequence[int] | None = None,
                 on_step=None) -> list[Rollout]:
        """Generate one training step's batch (all samples of all prompts)."""
        if len(prompts) == 0:
            raise ValueError("generate() needs at least one prompt")
        pids = list(problem_ids) if problem_ids is not None else [problem_key(p) for p in prompts]
        if len(pids) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(pids)} problem ids")
        samples = sample_indices(pids)
        if seeds is None:
            seeds = [sample_seed(self.config.seed, self.step, pid, k) for pid, k in zip(pids, samples)]
        t0 = time.perf_counter()
        wait = self._join_upkeep()
        curve: list[tuple[float, int]] = []

        def record(info: StepInfo) -> None:
            curve.append((info.elapsed_s, info.batch_size))
            if on_step is not None:
                on_step(info)

        outs: list[Completion] = self.engine.generate(
            prompts, seeds=seeds, sampling=sampling, drafter=self.drafter, policy=self.policy,
            max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, problem_ids=pids,
            req_ids=[(self.step, i) for i in range(len(prompts))], on_step=record)
        run = self.engine.last_run
        self.history.append(StepSummary(
            step=self.step, rollout_s=time.perf_counter() - t0, upkeep_wait_s=wait, upkeep_s=self._upkeep_s,
            forwards=run.forwards, row_forwards=sum(c.forwards for c in outs), new_tokens=run.new_tokens, drafted=run.drafted, accepted=run.accepted,
            batch_curve=curve))
        return [Rollout(problem_id=pid, sample=k, seed=int(seed), prompt_ids=list(c.prompt_ids),
                        completion_ids=list(c.token_ids), logprobs=list(c.logprobs), finish_reason=c.finish_reason,
                        forwards=c.forwards, drafted=c.drafted, accepted=c.accepted)
                for pid, k, seed, c in zip(pids, samples, seeds, outs)]

    @property
    def store(self) -> DraftStore | None:
        """The history drafter when it is a DraftStore (None for other drafters and without speculation)."""
        return self.drafter if isinstance(self.drafter, DraftStore) else None

    @store.setter
    def store(self, value: DraftStore | None) -> None:
        self.drafter = value

    def record(self, rollouts: Sequence[Rollout]) -> None:
        """Take this step's rollouts as if this session had generated them, without generating: a
        DraftStore indexes them and the policy's length history counts them (its acceptance statistics do
        not: nothing was drafted); then call end_step(). For
        loops that run a session only on some steps but keep its history complete. Its drafter must have
        no live requests."""
        self._join_upkeep()
        store = self.store
        lengths = getattr(self.policy, "lengths", None)
        for r in rollouts:
            if store is not None:
                store.add_rollout(r.problem_id, r.prompt_ids, r.completion_ids)
            if lengths is not None:
                lengths.record(r.problem_id, len(r.completion_ids))

    def end_step(self) -> None:
        """The step's rollouts are final: fold them into the window and roll it (in the background)."""
        self._join_upkeep()
        self.step += 1

        def upkeep() -> None:
            t = time.perf_counter()
            if self.drafter is not None:
                self.drafter.end_step()
            end = getattr(self.policy, "end_step", None)
            if end is not None:
                end()
            self._upkeep_s = time.perf_counter() - t

        if self.config.background_upkeep:
            self._upkeep = threading.Thread(target=upkeep, name="dasrl-upkeep", daemon=True)
            self._upkeep.start()
        else:
            upkeep()

    def _join_upkeep(self) -> float:
        if self._upkeep is None:
            return 0.0
        t = time.perf_counter()
        self._upkeep.join()
        self._upkeep = None
        return time.perf_counter() - t

    # ----------------------------------------------------------------- reporting
    def stats(self) -> dict:
        h = self.history
        return {"steps": len(h), "rollout_s": sum(s.rollout_s for s in h),
                "forwards": sum(s.forwards for s in h), "new_tokens": sum(s.new_tokens for s in h),
                "drafted": sum(s.drafted for s in h), "accepted": sum(s.accepted for s in h),
                "upkeep_wait_s": sum(s.upkeep_wait_s for s in h), "upkeep_s": sum(s.upkeep_s for s in h),
                "store_tokens": self.store.num_tokens if self.store else 0,
                "store_bytes": self.store.bytes_used() if self.store else 0}

    # ---------------------------------------------------------------- persistence
    def save(self, folder: str | os.PathLike) -> None:
        """Session state without pickle: the drafter window (npz + JSON), length and acceptance
        statistics and counters (JSON)."""
        self._join_upkeep()
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if self.store is not None:
            self.store.save(folder / "store")
        state = {"format": "dasrl-session/1", "step": self.step, "config": _jsonable(asdict(self.config)),
                 "history": [_jsonable(asdict(s)) for s in self.history]}
        for name in ("lengths", "acceptance"):
            part = getattr(self.policy, name, None)
            if part is not None:
                state[name] = part.state_dict()
        write_json(folder / "session.json", state)

    def load(self, folder: str | os.PathLike) -> None:
        """Restore what save() wrote into this session (same model; the config may differ)."""
        folder = Path(folder)
        try:
            state = json.loads((folder / "session.json").read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read a session from {folder}: {e}") from None
        if state.get("format") != "dasrl-session/1":
            raise ValueError(f"{folder / 'session.json'}: not a dasrl session (format {state.get('format')!r})")
        self._join_upkeep()
        self.step = int(state["step"])
        self.history = [StepSummary(**{**h, "batch_curve": [tuple(x) for x in h["batch_curve"]]})
                        for h in state["history"]]
        if self.store is not None and (folder / "store" / "store.json").exists():
            self.store = DraftStore.load(folder / "store", self.config.store)
        for name in ("lengths", "acceptance"):
            part = getattr(self.policy, name, None)
            if part is not None and name in state:
                part.load_state_dict(state[name])


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else str(obj)
