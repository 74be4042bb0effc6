"""RolloutSession: what an RL loop calls once per training step.

    session = RolloutSession(model, tokenizer, SessionConfig())
    for step in range(steps):
        rollouts = session.generate(prompts, sampling=SamplingParams(temperature=0.8), max_new_tokens=256)
        ... rewards, policy update ...
        session.end_step()             # history upkeep runs in the background during the next update

Samples of the same prompt (GRPO's G samples) share a problem id (the prompt-token hash unless given).
A sample's seed is sample_seed(run seed, step, problem, sample index), so spec-on and spec-off runs draw
the same numbers; the index must be unique per problem within a step (docs/sampling.md, "Seeds of a
rollout session"): the session numbers each problem's samples 0, 1, 2, ... over the step's generate
calls, or takes `samples=` (a batch split over processes); an index drawn twice in a step is refused.

Errors of the background upkeep (end_step's window roll) are raised, with their cause, by the next call
that needs the history (generate, record, end_step, stats, save); the session stays failed until load().
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import numbers
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Hashable, Protocol, Sequence, runtime_checkable

from dasrl._extras import require

require("engine", "dasrl.rollout.session (RolloutSession)")

import torch  # noqa: E402

from dasrl.atomic import Checkpoint
from dasrl.drafter.base import Drafter, problem_key
from dasrl.drafter.counting import CountingDrafter, with_counting
from dasrl.drafter.store import DraftStore, StoreConfig
from dasrl.engine.engine import Completion, EngineConfig, SpecEngine, StepInfo, model_lock
from dasrl.engine.rows import prompt_ids
from dasrl.engine.sampling import SamplingParams
from dasrl.policy.base import BudgetPolicy, FixedBudget
from dasrl.policy.factory import POLICIES, make_policy
from dasrl.policy.latency import LatencyModel, OnlineLatency, prior_for


@dataclass(frozen=True)
class SessionConfig:
    """How a RolloutSession generates and keeps history."""

    speculate: bool = True
    """Draft from history and verify (False = plain decoding, the baseline)."""
    policy: str = "das"
    """Speculation policy (dasrl.policy.make_policy): das (priced class caps) | fixed | none; any other policy
    object goes to RolloutSession(policy=...)."""
    policy_kw: tuple[tuple[str, object], ...] = ()
    """make_policy's keyword arguments as (name, value) pairs, e.g. (("caps", ClassCaps(0, 8, 24)),), (("k", 4),)."""
    store: StoreConfig = StoreConfig()
    """The history drafter's scope, window and decay."""
    counting: bool = True
    """Draft numbered patterns of a request's own output by counting (drafter/counting.py); needs one token
    per digit, and is off (with a warning) for a tokenizer without."""
    seed: int = 0
    """Run seed; sample seeds derive from (seed, step, problem, sample index)."""
    background_upkeep: bool = True
    """Run end_step's drafter upkeep in a background thread (joined by the next generate)."""
    engine: EngineConfig = EngineConfig()
    """Engine settings (context limit, threads)."""
    latency: str | None = None
    """latency.json from `dasrl calibrate` to price drafts from the start; None = the device's shipped prior
    (policy.latency.prior_for: CPU_LATENCY or GPU_LATENCY)."""
    fit_latency: bool = True
    """Refit the latency model online from this session's own forwards (policy.latency.OnlineLatency); the
    file or prior above prices only until the fit is trusted. False = price with it throughout."""
    draft_allowance: int | None = None
    """Most draft tokens per forward for the whole batch; None = no cap (each row's draft is priced)."""
    history: int = 100
    """Step summaries kept in `session.history` and in saves (the latest); older ones are folded into
    the totals stats() reports, so a long run's memory and session.json stay bounded."""

    def __post_init__(self) -> None:
        for name in ("speculate", "counting", "background_upkeep", "fit_latency"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SessionConfig: {name} must be True or False, got {getattr(self, name)!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"SessionConfig: unknown policy {self.policy!r}; valid policies: {', '.join(POLICIES)} "
                             f"(any other policy object goes to RolloutSession(policy=...))")
        kw = self.policy_kw
        if isinstance(kw, dict):  # the obvious spelling of keyword arguments: kept as sorted pairs (hashable)
            kw = tuple(sorted(kw.items()))
            object.__setattr__(self, "policy_kw", kw)
        if not (isinstance(kw, tuple) and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                              for p in kw)):
            raise TypeError(f"SessionConfig: policy_kw must be (name, value) pairs or a dict, got {kw!r}")
        named = {k for k, _ in kw} & {"latency", "max_tokens"}
        if named:
            raise ValueError(f"SessionConfig: give {sorted(named)} as latency= / draft_allowance=, not in policy_kw")
        for name, cls in (("store", StoreConfig), ("engine", EngineConfig)):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"SessionConfig: {name} must be a {cls.__name__}, got {getattr(self, name)!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"SessionConfig: seed must be an int in [0, 2**63), got {self.seed!r}")
        if self.latency is not None and not (isinstance(self.latency, (str, os.PathLike)) and str(self.latency)):
            raise TypeError(f"SessionConfig: latency must be a path to a latency.json or None, got {self.latency!r}")
        a = self.draft_allowance
        if a is not None and (isinstance(a, bool) or not isinstance(a, int) or a < 0):
            raise ValueError(f"SessionConfig: draft_allowance must be an int >= 0 or None, got {a!r}")
        if self.policy != "das" and (a is not None or self.latency is not None):
            raise ValueError(f"SessionConfig: draft_allowance and latency price the das policy; policy "
                             f"{self.policy!r} takes neither")
        h = self.history
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ValueError(f"SessionConfig: history must be an int >= 1, got {h!r}")
        if self.speculate:  # make_policy refuses a setting its policy does not take: now, not at the session
            make_policy(self.policy, **dict(kw))


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
    """One RL step's record, the one type both sessions keep in `history`: RolloutSession one per generate()
    call, DistributedRolloutSession one per step, its workers' records summed (the worker fields are its
    own; empty elsewhere). The totals of a bare engine call: StepSummary.of(engine.last_steps)."""

    step: int
    rollout_s: float  # wall seconds of generate() (distributed: the step's makespan across workers)
    upkeep_wait_s: float = 0.0  # seconds generate() waited for the previous end_step's background upkeep
    upkeep_s: float = 0.0  # seconds the previous end_step's upkeep took in all
    forwards: int = 0
    row_forwards: int = 0  # forwards summed over requests (a forward with 8 live rows counts 8)
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0  # seconds in the policy and the drafter, summed over forwards
    verify_s: float = 0.0  # seconds in sampling and verification, summed over forwards
    forward_s: float = 0.0  # seconds in the packed forwards
    batch_curve: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, live rows)
    drafted_by_class: dict[str, int] = field(default_factory=dict)  # per length class of the drafting row
    worker_s: dict[int, float] = field(default_factory=dict)  # distributed: each worker's rollout seconds
    worker_rows: dict[int, int] = field(default_factory=dict)  # distributed: requests each ran (re-runs too)
    rerun: int = 0  # distributed: requests re-run on another worker because theirs died
    dead: list[int] = field(default_factory=list)  # distributed: workers that died during the step

    @property
    def tokens_per_row_forward(self) -> float:
        """New tokens a request gets per forward it takes part in (1.0 without speculation)."""
        return self.new_tokens / max(self.row_forwards, 1)

    @classmethod
    def of(cls, infos: Sequence[StepInfo], step: int = 0, **given) -> "StepSummary":
        """The totals of one engine call from its forwards' StepInfo (SpecEngine.last_steps); `given` overrides."""
        kw = {name: sum(getattr(i, name) for i in infos) for name in _PER_FORWARD}
        kw.update(step=step, rollout_s=infos[-1].elapsed_s if infos else 0.0, forwards=len(infos),
                  batch_curve=[(i.elapsed_s, i.batch_size) for i in infos])
        return cls(**{**kw, **given})

    def add(self, share: "StepSummary") -> None:
        """Count another record's share of this step in (a distributed step sums its workers' records)."""
        for name in ("forwards", "row_forwards", *_PER_FORWARD):
            setattr(self, name, getattr(self, name) + getattr(share, name))
        for cls_name, n in share.drafted_by_class.items():
            self.drafted_by_class[cls_name] = self.drafted_by_class.get(cls_name, 0) + n


_PER_FORWARD = ("new_tokens", "drafted", "accepted", "draft_s", "verify_s", "forward_s")  # summed over StepInfo


@runtime_checkable
class Session(Protocol):
    """What an RL loop calls, one object per run: RolloutSession, or DistributedRolloutSession over Ray actors."""

    def generate(self, prompts: Sequence[Sequence[int]], *, problem_ids: Sequence[Hashable] | None = None,
                 seeds: Sequence[int] | None = None, samples: Sequence[int] | None = None,
                 sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 256,
                 stop_token_ids: Sequence[int] | None = None, stop_lines: Sequence[str] = ()) -> list[Rollout]:
        """One step's batch (or part of it): one Rollout per prompt, in order."""

    def end_step(self) -> None:
        """The RL step is over: its rollouts become drafting history."""

    def stats(self) -> dict:
        """Totals over the run."""

    def save(self, folder: str | os.PathLike) -> None:
        """The drafting history and policy statistics, crash-safe, no pickle."""

    def load(self, folder: str | os.PathLike) -> None:
        """Restore a save (all or nothing)."""

    def close(self) -> None:
        """Release what the session holds (threads, actors)."""


def sample_seed(run_seed: int, step: int, problem_id: Hashable, sample: int) -> int:
    """A 63-bit seed that depends only on (run seed, step, problem, sample index)."""
    key = json.dumps([run_seed, step, str(problem_id), sample]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def _next_samples(drawn: dict[Hashable, set[int]], problem_ids: Sequence[Hashable]) -> list[int]:
    """Each request's sample index, the next of its problem after those `drawn` this step and in this call:
    {a: {0, 1}}, [a, b, a] -> [2, 0, 3]. Does not change `drawn`."""
    nxt = {pid: max(ks) + 1 for pid, ks in drawn.items() if ks}
    out = []
    for pid in problem_ids:
        out.append(nxt.get(pid, 0))
        nxt[pid] = out[-1] + 1
    return out


def sample_indices(drawn: dict[Hashable, set[int]], pids: Sequence[Hashable], given: Sequence[int] | None,
                   step: int) -> list[int]:
    """Each request's sample index (given, or _next_samples), none drawn before in this step nor twice in this
    call. Does not change `drawn`."""
    if given is None:
        return _next_samples(drawn, pids)
    out = list(given)
    if len(out) != len(pids):
        raise ValueError(f"{len(pids)} prompts but {len(out)} sample indices")
    seen: set = set()
    for i, (pid, k) in enumerate(zip(pids, out)):
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"sample indices must be ints >= 0, got {k!r}")
        k = int(k)
        if k in drawn.get(pid, ()) or (pid, k) in seen:
            raise ValueError(f"sample index {k} of problem {pid!r} is drawn twice in step {step}: "
                             f"its seed would repeat (give each sample of a problem its own index)")
        seen.add((pid, k))
        out[i] = k
    return out


def history_drafter(config: SessionConfig, tokenizer) -> Drafter:
    """The drafter a speculating session builds: a DraftStore, in counting drafts when config.counting."""
    store = DraftStore(config.store)
    return with_counting(store, tokenizer) if config.counting else store


def speculation_policy(config: SessionConfig, device: str = "cpu") -> BudgetPolicy:
    """The policy a speculating session drafts under: make_policy(config.policy), priced by config.latency
    (or the device's prior), at most config.draft_allowance draft tokens per forward."""
    kw = dict(config.policy_kw)
    if config.policy == "das":
        kw.update(latency=LatencyModel.load(config.latency) if config.latency else prior_for(device),
                  max_tokens=config.draft_allowance)
    return make_policy(config.policy, **kw)


class RolloutSession:
    """See the module docstring. `drafter` replaces the DraftStore of `config.store` with any Drafter (and
    may be reassigned between steps); only a DraftStore is saved and counted in stats(). `policy` replaces
    the one `config.policy` names with any BudgetPolicy."""

    def __init__(self, model, tokenizer, config: SessionConfig = SessionConfig(), *,
                 drafter: Drafter | None = None, policy: BudgetPolicy | None = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"RolloutSession needs the model to roll out (a Hugging Face causal LM, a "
                            f"torch.nn.Module), got {type(model).__name__}")
        if not isinstance(config, SessionConfig):
            raise TypeError(f"config must be a SessionConfig, got {type(config).__name__}")
        for name, given in (("drafter", drafter), ("policy", policy)):
            if given is not None and not config.speculate:
                raise ValueError(f"a {name} was given but config.speculate is False: nothing would use it")
        if policy is not None and not isinstance(policy, BudgetPolicy):
            raise TypeError(f"policy must be a BudgetPolicy (budgets, trim, finish, abort, end_step, latency, "
                            f"lengths, take_spent, parts), got {type(policy).__name__}")
        self.config = config
        self.engine = SpecEngine(model, tokenizer, config.engine)
        self.drafter: Drafter | None = drafter if drafter is not None else (
            history_drafter(config, tokenizer) if config.speculate else None)
        device = self.engine.lm_head.weight.device.type
        self.policy: BudgetPolicy | None = policy if policy is not None else (
            speculation_policy(config, device) if config.speculate else None)  # None: plain decoding
        # the online fit of this session's forward cost, which prices the policy's drafts (None: the prior does)
        self.latency: OnlineLatency | None = OnlineLatency(self.policy.latency) \
            if self.policy is not None and self.policy.latency is not None and config.fit_latency else None
        self.step = 0
        self.history: list[StepSummary] = []
        self._folded = dict.fromkeys(_TOTALS, 0)  # stats() totals of the summaries dropped from history
        self._drawn: dict[Hashable, set[int]] = {}  # sample indices of each problem drawn this step
        self._issued = 0  # request ids given out this step (generate numbers them on over its calls)
        self._upkeep: threading.Thread | None = None
        self._upkeep_s = 0.0
        self._failed: BaseException | None = None  # what the last upkeep raised (cleared by load)
        self._closed = False

    # ------------------------------------------------------------------ the step
    def generate(self, prompts: Sequence[Sequence[int]], *, problem_ids: Sequence[Hashable] | None = None,
                 seeds: Sequence[int] | None = None, samples: Sequence[int] | None = None,
                 sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 256,
                 stop_token_ids: Sequence[int] | None = None, stop_lines: Sequence[str] = (),
                 on_step=None) -> list[Rollout]:
        """Generate (part of) one training step's batch. `samples`: each request's sample index within its
        problem for this step (module docstring), None = the next unused; `seeds` overrides the derived ones."""
        self._check_open("generate")
        if isinstance(prompts, (str, bytes)):
            raise TypeError("generate() takes a list of prompts (token-id lists), got a string")
        if len(prompts) == 0:
            raise ValueError("generate() needs at least one prompt")
        for i, p in enumerate(prompts):  # before problem_key hashes them (its int() error says nothing)
            prompt_ids(i, p)
        pids = list(problem_ids) if problem_ids is not None else [problem_key(p) for p in prompts]
        if len(pids) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(pids)} problem ids")
        _check_problem_ids(pids)
        with model_lock(self.engine.model):
            return self._generate(prompts, pids, seeds, samples, sampling, max_new_tokens, stop_token_ids,
                                  stop_lines, on_step)

    def _generate(self, prompts, pids, seeds, samples, sampling, max_new_tokens, stop_token_ids, stop_lines,
                  on_step) -> list[Rollout]:
        """generate() under the model's lock, held from the draw of the sample indices to the step summary so
        that no two calls draw the same seeds; a call that raises releases its indices (a retry draws the
        same seeds, as a rerun would)."""
        t0 = time.perf_counter()
        wait = self._join_upkeep()
        samples = sample_indices(self._drawn, pids, samples, self.step)
        if seeds is None:
            seeds = [sample_seed(self.config.seed, self.step, pid, k) for pid, k in zip(pids, samples)]
        timer = self.latency.timer(self.policy) if self.latency is not None else None

        def record(info: StepInfo) -> None:
            if timer is not None:  # each decoding forward, timed end to end, reprices the policy
                timer(info)
            if on_step is not None:
                on_step(info)

        reserved = [(pid, k) for pid, k in zip(pids, samples)]
        for pid, k in reserved:
            self._drawn.setdefault(pid, set()).add(k)
        # Request ids run on over the step's calls: a drafter or a policy that keys its per-request state
        # by id (the length history skips an id it saw finish) must not see one id twice in a step.
        first, self._issued = self._issued, self._issued + len(prompts)
        try:
            outs: list[Completion] = self.engine.generate(
                prompts, seeds=seeds, sampling=sampling, drafter=self.drafter,
                policy=self.policy or FixedBudget(0),
                max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, stop_lines=stop_lines,
                problem_ids=pids, req_ids=[(self.step, first + i) for i in range(len(prompts))], on_step=record)
        except BaseException:
            for pid, k in reserved:
                self._drawn[pid].discard(k)
            raise
        self._append(StepSummary.of(
            self.engine.last_steps, step=self.step, rollout_s=time.perf_counter() - t0, upkeep_wait_s=wait,
            upkeep_s=self._upkeep_s, row_forwards=sum(c.forwards for c in outs),
            drafted_by_class=self.policy.take_spent() if self.policy is not None else {}))
        return [Rollout(problem_id=pid, sample=k, seed=int(seed), prompt_ids=list(c.prompt_ids),
                        completion_ids=list(c.token_ids), logprobs=list(c.logprobs), finish_reason=c.finish_reason,
                        forwards=c.forwards, drafted=c.drafted, accepted=c.accepted)
                for pid, k, seed, c in zip(pids, samples, seeds, outs)]

    def _append(self, summary: StepSummary) -> None:
        """Add a step summary; beyond config.history the oldest is folded into the stats() totals."""
        self.history.append(summary)
        while len(self.history) > self.config.history:
            old = self.history.pop(0)
            for name in _TOTALS:
                self._folded[name] += 1 if name == "steps" else getattr(old, name)

    @property
    def store(self) -> DraftStore | None:
        """The history drafter when it is a DraftStore, counting or not (else None)."""
        d = self.drafter.inner if isinstance(self.drafter, CountingDrafter) else self.drafter
        return d if isinstance(d, DraftStore) else None

    @store.setter
    def store(self, value: DraftStore | None) -> None:
        if isinstance(self.drafter, CountingDrafter) and value is not None:
            self.drafter.inner = value
        else:
            self.drafter = value

    def record(self, rollouts: Sequence[Rollout]) -> None:
        """Take this step's rollouts as if this session had generated them (a DraftStore indexes them, the
        policy's length history counts them), for loops that run a session only on some steps; then call
        end_step(). Its drafter must have no live requests. Their sample indices count as drawn."""
        self._check_open("record")
        if isinstance(rollouts, (str, bytes)) or not isinstance(rollouts, Sequence):
            raise TypeError(f"record() takes a list of Rollout objects, got {type(rollouts).__name__}")
        for i, r in enumerate(rollouts):
            if not isinstance(r, Rollout):
                raise TypeError(f"record(): item {i} is a {type(r).__name__}, not a Rollout")
        _check_problem_ids([r.problem_id for r in rollouts])
        self._join_upkeep()
        store = self.store
        lengths = self.policy.lengths if self.policy is not None else None
        for r in rollouts:
            self._drawn.setdefault(r.problem_id, set()).add(r.sample)
            if store is not None:
                store.add_rollout(r.problem_id, r.prompt_ids, r.completion_ids)
            if lengths is not None:
                lengths.record(r.problem_id, len(r.completion_ids))

    def end_step(self) -> None:
        """The step's rollouts are final: fold them into the window and roll it (in the background)."""
        self._check_open("end_step")
        self._join_upkeep()
        self.step += 1
        self._drawn, self._issued = {}, 0
        step = self.step

        def upkeep() -> None:
            t = time.perf_counter()
            try:
                if self.drafter is not None:
                    self.drafter.end_step()
                if self.policy is not None:
                    self.policy.end_step()
            except BaseException as e:  # kept for the caller: a thread's exception would only be printed
                e.add_note(f"(in the upkeep of end_step() before step {step})")
                self._failed = e
            self._upkeep_s = time.perf_counter() - t

        if self.config.background_upkeep:
            self._upkeep = threading.Thread(target=upkeep, name="dasrl-upkeep", daemon=True)
            self._upkeep.start()
        else:
            upkeep()
            self._join_upkeep()

    def _join_upkeep(self, *, check: bool = True) -> float:
        """Wait for the background upkeep; with check, raise what it raised (until load())."""
        t = time.perf_counter()
        if self._upkeep is not None:
            self._upkeep.join()
            self._upkeep = None
        if check and self._failed is not None:
            raise RuntimeError(f"the session's history upkeep failed ({type(self._failed).__name__}: "
                               f"{self._failed}); its draft window is half rolled: load() a save or start a "
                               f"new session") from self._failed
        return time.perf_counter() - t

    def close(self) -> None:
        """Join the background upkeep and free the draft store's native indexes now (at interpreter exit
        nanobind reports a reachable store as leaked); an upkeep failure is still raised. Idempotent."""
        try:
            self._join_upkeep()
        finally:
            if self.store is not None:
                self.store.close()
            self._closed = True

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise RuntimeError(f"{call}(): this RolloutSession is closed (close() freed its history); make a new "
                               f"one, and load() a save into it to go on")

    def __enter__(self) -> "RolloutSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- reporting
    def stats(self) -> dict:
        """Totals over every generate() call (folded summaries included), the store after the last upkeep."""
        self._check_open("stats")
        self._join_upkeep()
        tot = {name: self._folded[name] + (len(self.history) if name == "steps" else
                                           sum(getattr(s, name) for s in self.history)) for name in _TOTALS}
        return {**tot,
                "store_tokens": self.store.num_tokens if self.store else 0,
                "store_bytes": self.store.bytes_used() if self.store else 0,
                "counted_drafts": self.drafter.counted if isinstance(self.drafter, CountingDrafter) else 0,
                "latency": self.latency.report() if self.latency is not None else None}

    # ---------------------------------------------------------------- persistence
    def save(self, folder: str | os.PathLike) -> None:
        """One crash-safe checkpoint (dasrl.atomic.Checkpoint): session.json (step, policy statistics, step
        summaries and folded totals, the store's fields) + session-<hash>.npz (the store's arrays). A
        symlink at `folder` is followed."""
        self._check_open("save")  # a closed session's store is empty: saving it would overwrite a good save
        self._join_upkeep()
        folder = _folder_arg(folder, "save")
        state = {"format": _SESSION_FORMAT, "step": self.step, "config": _jsonable(asdict(self.config)),
                 "history": [_jsonable(asdict(s)) for s in self.history], "folded": dict(self._folded),
                 "store": None}
        for name, part in (self.policy.parts() if self.policy is not None else {}).items():
            state[name] = part.state_dict()
        arrays = None
        if self.store is not None:
            state["store"], arrays = self.store.state()
        Checkpoint(folder, "session", "session").save(state, arrays)

    def load(self, folder: str | os.PathLike) -> None:
        """Restore what save() wrote (same model; the config may differ), all or nothing: everything is
        validated (into a new DraftStore and throwaway policy copies) before anything is assigned. A save
        without a store into a session with one, or the other way round, warns. Clears a failed upkeep."""
        self._check_open("load")
        ckpt = Checkpoint(_folder_arg(folder, "load"), "session", "session")
        with ckpt.reading(_SESSION_FORMAT) as state:
            self._load_state(ckpt, state)

    def _load_state(self, ckpt: Checkpoint, state: dict) -> None:
        src = ckpt.manifest
        unknown = sorted(set(state) - _SESSION_KEYS)
        if unknown:
            raise ValueError(f"{src}: unknown field(s) {unknown}")
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= _MAX_STEP:
            raise ValueError(f"{src}: field 'step' must be an int in [0, {_MAX_STEP}], got {step!r}")
        history = _history_from(state.get("history"), src)
        folded = state.get("folded")
        if not (isinstance(folded, dict) and set(folded) == set(_TOTALS) and all(map(_is_number, folded.values()))):
            raise ValueError(f"{src}: field 'folded' must be an object of numbers with keys {sorted(_TOTALS)}, "
                             f"got {folded!r}")
        self._join_upkeep(check=False)
        store, saved = None, state.get("store")
        if saved is not None and not isinstance(saved, dict):
            raise ValueError(f"{src}: field 'store' must be null or an object, got {saved!r}")
        if saved is None and self.store is not None:
            warnings.warn(f"{src}: the saved session has no draft store; this session keeps the draft store "
                          f"it has", stacklevel=3)
        elif saved is not None and self.store is None:
            warnings.warn(f"{src}: the saved draft store is not loaded: this session has no DraftStore", stacklevel=3)
        elif saved is not None:
            store = DraftStore.from_state(saved, ckpt, state, self.config.store)
        parts = []
        for name, part in (self.policy.parts() if self.policy is not None else {}).items():
            if name not in state:
                continue
            if not isinstance(state[name], dict):
                raise ValueError(f"{src}: field {name!r} must be a JSON object, got {type(state[name]).__name__}")
            try:
                copy.copy(part).load_state_dict(state[name])  # validate on a throwaway copy
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                raise ValueError(f"{src}: field {name!r}: {e}") from None
            parts.append((part, state[name]))
        # everything passed: assign
        self.step, self.history, self._folded, self._drawn, self._failed = step, history, folded, {}, None
        self._issued = 0
        if store is not None:
            self.store = store
        for part, sd in parts:
            part.load_state_dict(sd)  # validated above: cannot fail now


_SESSION_FORMAT = "dasrl-session/2"
_MAX_STEP = 10**9  # largest step a saved session may be at (the checksum is unkeyed: anyone can write 10**30)
_SESSION_KEYS = {"format", "step", "config", "history", "folded", "store", "lengths", "acceptance_rate", "data",
                 "sha256"}
_TOTALS = ("steps", "rollout_s", "forwards", "new_tokens", "drafted", "accepted", "upkeep_wait_s", "upkeep_s")


def _check_problem_ids(pids: Sequence[Hashable]) -> None:
    """Problem ids key dicts and seeds: each must be hashable (a list is not)."""
    for i, pid in enumerate(pids):
        try:
            hash(pid)
        except TypeError:
            raise TypeError(f"problem id {i} is a {type(pid).__name__} ({pid!r:.60}), which is not hashable: give "
                            f"problem ids as ints, strings or tuples") from None


def _folder_arg(folder: str | os.PathLike, call: str) -> Path:
    """A save's folder: a non-empty path (an empty one would mean the current folder), a symlink followed."""
    if not isinstance(folder, (str, os.PathLike)) or not str(folder).strip():
        raise ValueError(f"{call}() needs a folder path, got {folder!r}")
    path = Path(folder)
    return path.resolve() if path.is_symlink() else path


_SUMMARY_FIELDS = {f.name: f for f in fields(StepSummary)}


def _history_from(raw, src: Path) -> list[StepSummary]:
    """StepSummary list from session.json's 'history', every field type-checked."""
    if not isinstance(raw, list):
        raise ValueError(f"{src}: field 'history' must be a list, got {type(raw).__name__}")
    out = []
    for i, h in enumerate(raw):
        where = f"{src}: history[{i}]"
        if not isinstance(h, dict):
            raise ValueError(f"{where} must be a JSON object, got {type(h).__name__}")
        unknown = set(h) - set(_SUMMARY_FIELDS)
        missing = {"step", "rollout_s", "upkeep_wait_s"} - set(h)
        if unknown or missing:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)} / missing field(s) {sorted(missing)}")
        kw = {}
        for k, v in h.items():
            kind = str(_SUMMARY_FIELDS[k].type)  # an annotation string (postponed annotations)
            if kind == "list[tuple[float, int]]":
                if not isinstance(v, list) or not all(
                        isinstance(x, list) and len(x) == 2 and all(_is_number(y) for y in x) for x in v):
                    raise ValueError(f"{where}: {k!r} must be a list of [seconds, rows] pairs")
                v = [(float(x[0]), int(x[1])) for x in v]
            elif kind.startswith("dict"):
                if not isinstance(v, dict) or not all(_is_number(y) for y in v.values()):
                    raise ValueError(f"{where}: field {k!r} must be an object of numbers, got {v!r}")
                if kind.startswith("dict[int"):  # worker ids, which JSON keeps as strings
                    try:
                        v = {int(x): y for x, y in v.items()}
                    except ValueError:
                        raise ValueError(f"{where}: field {k!r} must be keyed by worker ids, got {v!r}") from None
            elif kind == "list[int]":
                if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                    raise ValueError(f"{where}: field {k!r} must be a list of worker ids, got {v!r}")
            elif kind in ("int", "float"):
                if not _is_number(v) or (kind == "int" and not isinstance(v, int)):
                    raise ValueError(f"{where}: field {k!r} must be {'an int' if kind == 'int' else 'a number'}, "
                                     f"got {v!r}")
            kw[k] = v
        out.append(StepSummary(**kw))
    return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else str(obj)
