"""`dasrl whatif`: what would speculative decoding, and which drafter, do to these recorded rollouts?

Every method replays the same recorded steps through simulator.replay_step, every row of a step in one
packed forward. Two kinds of figures (docs/whatif.md): hardware-independent ones at one equal draft cap K,
and predicted seconds per step under each latency profile, each method at its own defaults (`das` under the
session's policy and `das-vllm` under the vLLM proposer's, whose drafting depends on the profile, are replayed
once per profile).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from dasrl_lab.drafters.arctic import ArcticDrafter, arctic_status
from dasrl.drafter import DraftStore, StoreConfig, digit_tokens
from dasrl.integrations.vllm import VLLMDrafterConfig
from dasrl.policy import FixedBudget, ForwardAllowance, LatencyModel, make_policy
from dasrl.rollout import SessionConfig, history_drafter
from dasrl_lab.trace import Response
from dasrl_lab.sim.profiles import Profile
from dasrl_lab.sim.oracle import HistoryOracle
from dasrl_lab.sim.simulator import StepStats, group_steps, replay_step, request_ids
from dasrl_lab.sim.proposer_replay import ProposerReplay
from dasrl_lab.sim.vllm_baselines import VLLM_SUFFIX, VLLM_SUFFIX_TOKENS, VLLMNGramDrafter

FORMAT = "dasrl.whatif/1"
METHODS = ("das", "das-vllm", "das-suffix", "global", "suffix", "ngram", "oracle", "none")
VLLM_DAS = VLLMDrafterConfig()
"""`das-vllm`: the DASProposer at its defaults, as `speculative_config={"method": "custom_class", ...}` builds it."""


@dataclass(frozen=True)
class WhatifConfig:
    cap: int = 16
    """K: the equal draft cap of the hardware-independent replay."""
    methods: tuple[str, ...] = METHODS
    store: StoreConfig = SessionConfig().store
    """The das drafters' history settings (the session's defaults)."""

    def __post_init__(self) -> None:
        if self.cap < 1:
            raise ValueError(f"draft cap K must be >= 1, got {self.cap}")
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise ValueError(f"unknown method(s) {', '.join(map(repr, bad)) or '(none given)'}; "
                             f"valid: {', '.join(METHODS)}")


def make_drafter(method: str, cfg: WhatifConfig, tokenizer, *, latency: LatencyModel | None = None,
                 lengths: tuple[int, int] = (0, 0)):
    """The drafter of `method`, fresh (its history starts empty). das-vllm: the proposer priced by `latency`
    (None: fixed K), for prompts and responses of at most `lengths` tokens."""
    if method == "das":  # the session's drafter: the DraftStore wrapped in counting drafts where the tokenizer allows
        return history_drafter(replace(SessionConfig(), store=cfg.store), tokenizer)
    if method == "das-vllm":  # the vLLM proposer itself, fed as vLLM's runner feeds it
        digits = None
        if VLLM_DAS.counting and tokenizer is not None:
            try:  # as the proposer reads vLLM's tokenizer: no digit tokens, no counting
                digits = digit_tokens(tokenizer)
            except ValueError:
                pass
        return ProposerReplay(VLLM_DAS if latency is not None else replace(VLLM_DAS, policy="fixed"), k=cfg.cap,
                              max_prompt=lengths[0], max_new=lengths[1], latency=latency, digits=digits)
    if method == "das-suffix":
        return DraftStore(cfg.store)
    if method == "global":  # one ever-growing index of every problem's history, as vLLM's / arctic's suffix cache
        return DraftStore(replace(cfg.store, mode="global", window=0, decay=1.0))
    if method == "suffix":
        return ArcticDrafter(VLLM_SUFFIX)
    if method == "ngram":
        return VLLMNGramDrafter()
    if method == "oracle":  # the headroom: the best continuation the same history holds (dasrl_lab.sim.oracle)
        return HistoryOracle(cfg.store)
    return None


def session_policy(latency) -> ForwardAllowance:
    """The session's policy (make_policy("das")), priced by a LatencyModel in hand."""
    return make_policy("das", latency=latency)


@dataclass
class Replay:
    """One method's replay: per-step simulator stats and the step's longest response."""

    method: str
    label: str
    steps: list[StepStats]
    longest: list[int]
    seconds: float = 0.0
    """Wall seconds the replay took (not a figure of the method)."""
    cpu_seconds: float = 0.0
    """CPU seconds of the process during the replay."""

    def price(self, profile: Profile) -> list[float]:
        """Predicted seconds of each step under `profile` (its forwards priced one by one)."""
        shapes = [np.asarray(st.shapes, np.float64).reshape(-1, 4) for st in self.steps]
        return [float(np.sum(profile.latency.predict(s[:, 1], s[:, 2], s[:, 3]))) if len(s) else 0.0 for s in shapes]

    def figures(self, first: int = 0) -> dict:
        sts, longest = self.steps[first:], self.longest[first:]
        tok, rf = sum(s.tokens for s in sts), sum(s.row_forwards for s in sts)
        drafted, acc = sum(s.proposed for s in sts), sum(s.accepted for s in sts)
        return {"tokens_per_forward": tok / rf if rf else 0.0,
                "critical_tokens_per_forward": sum(longest) / max(sum(s.forwards for s in sts), 1),
                "acceptance": acc / drafted if drafted else 0.0,
                "wasted_per_token": (drafted - acc) / tok if tok else 0.0,
                "drafted": drafted, "accepted": acc, "tokens": tok, "forwards": sum(s.forwards for s in sts)}


def replay(steps: Sequence[tuple[int, list[Response]]], *, method: str, policy, cfg: WhatifConfig, tokenizer,
           label: str, latency: LatencyModel | None = None, progress: Callable[[int], None] | None = None) -> Replay:
    """`method`'s drafter under `policy` over the steps in order, every row in one packed forward (das-vllm:
    priced by `latency`, under FixedBudget(K): the proposer sets its own budgets)."""
    t0, c0 = time.perf_counter(), time.process_time()
    max_new = max(len(r.response_ids) for _, rs in steps for r in rs)
    max_prompt = max(len(r.prompt_ids) for _, rs in steps for r in rs)
    drafter = make_drafter(method, cfg, tokenizer, latency=latency, lengths=(max_prompt, max_new))
    out = []
    for i, (step, rs) in enumerate(steps):
        if isinstance(drafter, HistoryOracle):
            drafter.expect(dict(zip(request_ids(step, len(rs)), (r.response_ids for r in rs))))
        out.append(replay_step(drafter, policy, step, rs, max_new_tokens=max_new))
        if isinstance(drafter, ProposerReplay):  # the proposer's calls alone, not the replay's token table
            out[-1].host_s = drafter.take_host_s()
        if progress:
            progress(i)
    return Replay(method, label, out, [max(len(r.response_ids) for r in rs) for _, rs in steps],
                  time.perf_counter() - t0, time.process_time() - c0)


OWN_FIGURES = ("tokens_per_forward", "critical_tokens_per_forward", "acceptance", "wasted_per_token")
"""What a row reports of each profile's own-defaults replay (the session's policy drafts per profile)."""


@dataclass
class ModelResult:
    """Every method on one recorded set of rollouts (one CHAMP model, one user source)."""

    model: str
    at_cap: dict[str, Replay] = field(default_factory=dict)
    """Hardware-independent replays, every drafter at the cap K."""
    own: dict[tuple[str, str], Replay] = field(default_factory=dict)
    """(method, profile) -> the replay of the method at its own defaults under that profile."""

    def rows(self, profiles: Sequence[Profile], cfg: WhatifConfig) -> list[dict]:
        out = []
        for m, rep in self.at_cap.items():
            fig, later = rep.figures(), rep.figures(1)
            per_step = {p.name: self.own[(m, p.name)].price(p) for p in profiles}
            host = {p.name: [st.host_s for st in self.own[(m, p.name)].steps] for p in profiles}
            at_cap = {p.name: rep.price(p) for p in profiles}
            out.append({
                "model": self.model, "drafter": m, "cap": cfg.cap,
                "tokens_per_forward": round(fig["tokens_per_forward"], 4),
                "tokens_per_forward_from_step2": round(later["tokens_per_forward"], 4),
                "critical_tokens_per_forward": round(fig["critical_tokens_per_forward"], 4),
                "critical_tokens_per_forward_from_step2": round(later["critical_tokens_per_forward"], 4),
                "acceptance": round(fig["acceptance"], 4), "wasted_per_token": round(fig["wasted_per_token"], 4),
                "own_defaults": OWN_DEFAULTS[m].format(cap=cfg.cap),
                "predicted_s_per_step": {k: round(_mean(v[1:] or v), 4) for k, v in per_step.items()},
                "host_s_per_step": {k: round(_mean(v[1:] or v), 4) for k, v in host.items()},
                "own_figures": {p.name: {k: round(v, 4) for k, v in self.own[(m, p.name)].figures().items()
                                         if k in OWN_FIGURES} for p in profiles},
                "replay_s": {"at_cap": round(rep.seconds, 1),
                             **{p.name: round(self.own[(m, p.name)].seconds, 1) for p in profiles
                                if self.own[(m, p.name)] is not rep}},
                "replay_cpu_s": {"at_cap": round(rep.cpu_seconds, 1),
                                 **{p.name: round(self.own[(m, p.name)].cpu_seconds, 1) for p in profiles
                                    if self.own[(m, p.name)] is not rep}},
                "predicted_s_per_step_at_cap": {k: round(_mean(v[1:] or v), 4) for k, v in at_cap.items()},
                "steps": [{"step": st.step, "tokens_per_forward": round(st.tokens / max(st.row_forwards, 1), 4),
                           "acceptance": round(st.accepted / st.proposed, 4) if st.proposed else 0.0,
                           "forwards": st.forwards, "longest": rep.longest[i],
                           "predicted_s": {k: round(v[i], 4) for k, v in per_step.items()},
                           "host_s": {k: round(v[i], 4) for k, v in host.items()}}
                          for i, st in enumerate(rep.steps)],
            })
        return out


OWN_DEFAULTS = {
    "das": "session policy (DAS classes in the per-forward allowance of each profile), counting drafts",
    "das-vllm": "the vLLM proposer's drafter and policy at its defaults (counting drafts), K = {cap}",
    "das-suffix": "per-problem suffix index, fixed cap {cap}",
    "global": "one unwindowed index over all problems, fixed cap {cap}",
    "suffix": f"vLLM suffix defaults (arctic-inference, depth 24, {VLLM_SUFFIX_TOKENS} tokens, factor 1.0, "
              "p >= 0.1, 10000 cached)",
    "ngram": "vLLM ngram defaults (n = 5, earliest match), {cap} tokens",
    "oracle": "the history oracle (best continuation of each source's longest match, das's window), cap {cap}",
    "none": "plain decoding",
}


def _mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if len(xs) else 0.0


def plan(cfg: WhatifConfig, profiles: Sequence[Profile]) -> list[tuple[str, str, str, object]]:
    """(kind, method, profile or '', policy) of every replay one source needs; without profiles, the
    equal-cap replays only (nothing is priced)."""
    out = [("cap", m, "", FixedBudget(0 if m == "none" else cfg.cap)) for m in cfg.methods]
    for m in cfg.methods if profiles else ():
        if m == "das":
            out += [("own", m, p.name, session_policy(p.latency)) for p in profiles]
        elif m == "das-vllm":  # the proposer priced by the profile sets its budgets (within K)
            out += [("own", m, p.name, FixedBudget(cfg.cap)) for p in profiles]
        elif m == "suffix" and cfg.cap != VLLM_SUFFIX_TOKENS:
            out.append(("own", m, "", FixedBudget(VLLM_SUFFIX_TOKENS)))
    return out


def default_jobs() -> int:
    """Worker processes for run_all: the cores this process may run on (`taskset -c 1` gives 1)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


_TASKS: list = []
"""run_all's tasks, read by its forked workers (inherited, not sent: the steps hold millions of tokens)."""


def _latency(method: str, profile: str, profiles: Sequence[Profile]) -> LatencyModel | None:
    """What prices das-vllm's own-defaults replay under `profile` (None: its cap replay, and other methods)."""
    return next((p.latency for p in profiles if p.name == profile), None) if method == "das-vllm" else None


def _run_task(i: int) -> tuple[int, "Replay"]:
    steps, kind, m, prof, policy, cfg, tokenizer, label, latency = _TASKS[i]
    return i, replay(steps, method=m, policy=policy, cfg=cfg, tokenizer=tokenizer, label=label, latency=latency)


def run_all(named: Sequence[tuple[str, Sequence[Response]]], *, profiles: Sequence[Profile], cfg: WhatifConfig,
            tokenizer, jobs: int = 1, progress: Callable[[str, str, int, int], None] | None = None
            ) -> list[ModelResult]:
    """Every planned replay of every source. Replays are independent (each drafter and policy starts
    fresh), so with jobs > 1 they run in that many forked worker processes, the longest first; the
    figures do not depend on jobs. `progress(source, label, done, total)`: steps of a replay (jobs = 1) or
    replays of a source done (jobs > 1)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if "suffix" in cfg.methods and arctic_status() is not None:
        raise RuntimeError(f"method 'suffix' needs arctic-inference ({arctic_status()}): `make arctic-install`, "
                           f"or leave suffix out of --methods")
    tasks = []  # (source index, steps, kind, method, profile, policy, label)
    for src, (_, responses) in enumerate(named):
        steps = group_steps(responses)
        for kind, m, prof, policy in plan(cfg, profiles):
            label = f"{m}@{cfg.cap}" if kind == "cap" else f"{m} ({prof or 'defaults'})"
            tasks.append((src, steps, kind, m, prof, policy, label))
    reps: list[Replay | None] = [None] * len(tasks)
    if jobs == 1 or len(tasks) == 1:
        for i, (src, steps, kind, m, prof, policy, label) in enumerate(tasks):
            name = named[src][0]
            tick = ((lambda k, name=name, label=label, n=len(steps): progress(name, label, k + 1, n))
                    if progress else None)
            reps[i] = replay(steps, method=m, policy=policy, cfg=cfg, tokenizer=tokenizer, label=label,
                             latency=_latency(m, prof, profiles), progress=tick)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # a forked child must not use the parent's pool
        _TASKS[:] = [(steps, kind, m, prof, policy, cfg, tokenizer, label, _latency(m, prof, profiles))
                     for _, steps, kind, m, prof, policy, label in tasks]
        # the policy-priced and arctic replays take longest: started first, the pool ends together
        order = sorted(range(len(tasks)),
                       key=lambda i: (tasks[i][2] != "own", tasks[i][3] not in ("das", "das-vllm", "suffix")))
        done = [0] * len(named)
        try:  # an executor, not a Pool: a worker killed (OOM, SIGKILL) raises BrokenProcessPool here,
            # where Pool.imap_unordered lost its task and waited forever
            with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=multiprocessing.get_context("fork")) as pool:
                for future in as_completed([pool.submit(_run_task, i) for i in order]):
                    i, rep = future.result()
                    reps[i] = rep
                    src = tasks[i][0]
                    done[src] += 1
                    if progress:
                        progress(named[src][0], rep.label, done[src], sum(t[0] == src for t in tasks))
        finally:
            _TASKS.clear()
    out = [ModelResult(name) for name, _ in named]
    # in plan order: a method's own-defaults replays (for one profile, or all: prof "") replace its cap replay
    for (src, _, kind, m, prof, _, _), rep in zip(tasks, reps):
        if kind == "cap":
            out[src].at_cap[m] = rep
        out[src].own.update({(m, p.name): rep for p in profiles if prof in ("", p.name)})
    return out


def document(results: Sequence[ModelResult], *, profiles: Sequence[Profile], cfg: WhatifConfig, source: str,
             tokenizer_name: str, started: float, extra: dict | None = None) -> dict:
    rows = [r for res in results for r in res.rows(profiles, cfg)]
    return {"format": FORMAT, "source": source, "tokenizer": tokenizer_name, "cap": cfg.cap,
            "branching": cfg.store.params.branching, "methods": list(cfg.methods),
            "profiles": [p.to_dict() for p in profiles],
            "elapsed_s": round(time.perf_counter() - started, 1), **(extra or {}), "rows": rows}
