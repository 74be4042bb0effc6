"""Trace-driven simulator: how long would these rollouts take with this drafter and policy?

Each step is replayed as the engine would run it, the recorded tokens standing in for the target
(docs/simulator.md); every forward is priced by a LatencyModel.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable, Sequence

import numpy as np

from dasrl.drafter import DraftBatch, Drafter, DraftStore, StoreConfig
from dasrl.engine import accepted_counts, depths
from dasrl.policy import GPU_LATENCY, BudgetPolicy, LatencyModel, RequestState, propose
from dasrl_lab.trace import Response
from dasrl_lab.drafters.baselines import NGramDrafter, OracleDrafter
from dasrl_lab.policies import make_lab_policy

BATCH_MODES = ("static", "continuous")


@dataclass(frozen=True)
class SimConfig:
    """How the replay batches requests and prices forwards."""

    latency: LatencyModel = GPU_LATENCY
    """Forward cost model (seconds); default: the library's GPU prior, the assumed Qwen2.5-7B / H100 profile."""
    batch_mode: str = "static"
    """static: waves of max_batch until the wave's last request ends; continuous: refill freed rows."""
    max_batch: int = 0
    """Rows per forward at most (0 = every response of the step at once)."""
    max_new_tokens: int | None = None
    """Length limit a draft may not cross (None = the longest response of the trace)."""
    store: StoreConfig = StoreConfig()
    """The history drafters' settings, the engine's own StoreConfig (its mode is set per drafter name;
    `global` keeps every step at full weight)."""
    warmup: int = 0
    """Leading steps replayed (to fill history) but left out of the totals."""

    def __post_init__(self) -> None:
        if self.batch_mode not in BATCH_MODES:
            raise ValueError(f"unknown batch mode {self.batch_mode!r}; valid modes: {', '.join(BATCH_MODES)}")
        if self.max_batch < 0:
            raise ValueError(f"max_batch must be >= 0 (0 = unlimited), got {self.max_batch}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not isinstance(self.store, StoreConfig):
            raise ValueError(f"store must be a StoreConfig, got {self.store!r}")


# A drafter name -> (SimConfig -> for_step), where for_step(the step's recorded responses by request id) is
# the drafter of that step: one object for the whole trace, but a fresh oracle per step.
ForStep = Callable[[dict], object]


def _persistent(drafter) -> ForStep:
    return lambda futures: drafter


def _store(mode: str, *, windowed: bool = True) -> Callable[[SimConfig], ForStep]:
    """A DraftStore; windowed=False keeps every past rollout at full weight (one ever-growing global
    tree, as ArcticInference's / vLLM's `suffix` cache does)."""
    def make(cfg: SimConfig) -> ForStep:
        sc = replace(cfg.store, mode=mode) if windowed else replace(cfg.store, mode=mode, window=0, decay=1.0)
        return _persistent(DraftStore(sc))
    return make


DRAFTERS: dict[str, Callable[[SimConfig], ForStep]] = {
    "das": _store("problem+request"),
    "problem": _store("problem"),
    "global": _store("global", windowed=False),
    "global-window": _store("global"),
    "ngram": lambda cfg: _persistent(NGramDrafter()),
    "oracle": lambda cfg: OracleDrafter,
    "none": lambda cfg: lambda futures: None,
}


def make_drafter(name: str, cfg: SimConfig):
    try:
        return DRAFTERS[name](cfg)
    except KeyError:
        raise ValueError(f"unknown drafter {name!r}; valid drafters: {', '.join(DRAFTERS)}") from None


@dataclass
class StepStats:
    """Totals of one replayed step (or of a whole run)."""

    step: int
    makespan: float = 0.0
    """Seconds from the first forward to the last."""
    forwards: int = 0
    """Batched forward passes."""
    row_forwards: int = 0
    """Sum over forwards of the rows in it."""
    tokens: int = 0
    """Output tokens generated."""
    proposed: int = 0
    """Draft tokens sent to verification."""
    accepted: int = 0
    """Draft tokens accepted."""
    batch_time: float = 0.0
    """Integral of live rows over decoding time (row-seconds)."""
    timeline: list[tuple[float, int]] = field(default_factory=list)
    """(time, live rows) at each forward, downsampled."""
    host_s: float = 0.0
    """Seconds spent proposing drafts and observing tokens: the CPU work between two forwards."""
    shapes: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(rows, tokens, cached context tokens read, those of the drafting rows) of every forward, in order."""

    @property
    def accepted_per_row_forward(self) -> float:
        """Mean accepted draft tokens per row-forward."""
        return self.accepted / self.row_forwards if self.row_forwards else 0.0

    @property
    def effective_batch(self) -> float:
        """Time-weighted mean of live rows."""
        return self.batch_time / self.makespan if self.makespan else 0.0

    def add(self, other: "StepStats") -> None:
        for f in ("makespan", "forwards", "row_forwards", "tokens", "proposed", "accepted", "batch_time"):
            setattr(self, f, getattr(self, f) + getattr(other, f))

    def to_dict(self, timeline: bool = False) -> dict:
        d = asdict(self)
        d.pop("shapes")
        if not timeline:
            d.pop("timeline")
        d["accepted_per_row_forward"] = self.accepted_per_row_forward
        d["effective_batch"] = self.effective_batch
        return d


@dataclass
class SimResult:
    drafter: str
    policy: str
    steps: list[StepStats]
    total: StepStats

    def to_dict(self) -> dict:
        return {"drafter": self.drafter, "policy": self.policy, "total": self.total.to_dict(),
                "steps": [s.to_dict(timeline=True) for s in self.steps]}


def replay_targets(batch: DraftBatch, recorded: np.ndarray, start: np.ndarray, gen: np.ndarray,
                   length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(targets, starts) for dasrl.engine.accepted_counts: row b continues recorded[start[b] + gen[b] :
    start[b] + length[b]]; a node at depth d (the pending token: -1) targets its token d + 1, -1 past the end."""
    n = batch.lengths  # [B]
    starts = np.concatenate([[0], np.cumsum(n + 1)]).astype(np.int64)  # [B+1]
    row = np.repeat(np.arange(n.size), n + 1)  # [T+B] row of each input
    k = np.arange(int(starts[-1])) - starts[row]  # [T+B] input index within its row (0 = pending)
    depth = k.copy()  # chains: input k targets the token at depth k
    node_row, local = batch.node_rows()  # [T] each draft node's row and index within it
    for b in np.unique(node_row[batch.parents != local - 1]):  # rows whose draft is not a chain
        d = batch.draft(int(b))
        depth[starts[b] + 1: starts[b + 1]] = depths(d.parents) + 1
    pos = gen[row] + depth  # [T+B] index into the row's recorded response
    inside = pos < length[row]
    targets = np.where(inside, recorded[np.where(inside, start[row] + pos, 0)], -1)
    return targets, starts


def _downsample(points: list[tuple[float, int]], n: int = 200) -> list[tuple[float, int]]:
    if len(points) <= n:
        return points
    idx = np.linspace(0, len(points) - 1, n).round().astype(int)
    return [points[i] for i in idx]


def request_ids(step: int, n: int) -> list[tuple[int, int]]:
    """The request ids replay_step gives a step's n responses, in order."""
    return [(step, i) for i in range(n)]


def replay_step(drafter, policy: BudgetPolicy, step: int, responses: Sequence[Response], *, max_new_tokens: int,
                max_batch: int = 0, continuous: bool = False) -> StepStats:
    """The one replay loop (simulator, `dasrl whatif`, vLLM validation): requests `request_ids(step, n)`, at
    most `max_batch` live (0: all), freed rows refilled at the next forward when `continuous`, else waves.
    Each forward is the engine's (prefill first, then propose -> cap -> trim and its accept rule; finished
    rows swap-removed last first). Fills counts, shapes and host_s; the caller prices. Flat batches: CHAMP
    replays hold millions of tokens."""
    n = len(responses)
    rids = request_ids(step, n)
    targets = [np.asarray(r.response_ids, np.int32) for r in responses]
    tlen = np.array([t.size for t in targets], np.int64)  # [n]
    tstart = np.zeros(n, np.int64)  # [n] each response's offset in flat_tgt
    np.cumsum(tlen[:-1], out=tstart[1:])
    flat_tgt = np.concatenate(targets) if n else np.zeros(0, np.int32)
    states = [RequestState(rid, r.problem_id, len(r.prompt_ids), max_new_tokens) for rid, r in zip(rids, responses)]
    st = StepStats(step=step)
    queue, live = deque(range(n)), []
    while queue or live:
        if continuous or not live:
            while queue and len(live) < (max_batch or n):
                i = queue.popleft()
                if drafter is not None:
                    drafter.start(rids[i], responses[i].problem_id, responses[i].prompt_ids)
                live.append(i)
            for i in [i for i in live if tlen[i] == 0]:  # empty responses (only just added) finish without a forward
                _finish(drafter, policy, states[i])
                live.remove(i)
        if not live:
            continue
        idx = np.asarray(live)  # [B]
        lstates = [states[i] for i in live]
        gen = np.array([s.generated for s in lstates], np.int64)  # [B]
        if not gen.any():
            batch = DraftBatch.empty(len(live))
        else:
            room = np.where(gen > 0, max_new_tokens - gen - 1, 0).tolist()  # a row's limit less the pending token
            t0 = time.perf_counter()
            batch = propose(drafter, policy, lstates, [s.req_id for s in lstates], room)
            st.host_s += time.perf_counter() - t0
        lens = np.diff(batch.offsets)  # [B]
        acc = accepted_counts(batch, *replay_targets(batch, flat_tgt, tstart[idx], gen, tlen[idx]))  # [B]
        emit_n = np.minimum(acc + 1, tlen[idx] - gen)  # [B]
        plen = np.array([s.prompt_len for s in lstates], np.int64)  # [B]
        cached = np.where(gen > 0, plen + gen - 1, 0)  # [B] all but the pending token, as the engine
        n_tok = int(np.where(gen > 0, 1, plen).sum() + lens.sum())
        emits = [flat_tgt[tstart[i] + g: tstart[i] + g + e] for i, g, e in zip(live, gen.tolist(), emit_n.tolist())]
        for s, e, d, a in zip(lstates, emit_n.tolist(), lens.tolist(), acc.tolist()):
            s.generated += e
            s.forwards += 1
            s.drafted += d
            s.accepted += a
        st.proposed += int(lens.sum())
        st.accepted += int(acc.sum())
        if drafter is not None:
            t0 = time.perf_counter()
            drafter.observe_batch([rids[i] for i in live], emits)
            st.host_s += time.perf_counter() - t0
        st.shapes.append((len(live), n_tok, int(cached.sum()), int(cached[lens > 0].sum())))
        st.forwards += 1
        st.row_forwards += len(live)
        done = np.flatnonzero(gen + emit_n >= tlen[idx]).tolist()
        for k in reversed(done):  # as the engine: swap-remove, last first
            _finish(drafter, policy, states[live[k]])
            last = live.pop()
            if k < len(live):
                live[k] = last
    st.tokens = int(tlen.sum())
    if drafter is not None:
        drafter.end_step()
    policy.end_step()
    return st


def _finish(drafter, policy: BudgetPolicy, state: RequestState) -> None:
    if drafter is not None:
        drafter.finish(state.req_id)
    policy.finish(state)


class Simulator:
    """Replays steps of responses with one drafter and one policy (both persist across steps)."""

    def __init__(self, *, drafter: str | Drafter = "das", policy: str | BudgetPolicy = "das",
                 config: SimConfig = SimConfig(), policy_kw: dict | None = None, label: str | None = None) -> None:
        """`drafter`: a DRAFTERS name or a Drafter object kept for every step (SimConfig.store then does not
        apply). `policy`: a make_lab_policy name (with `policy_kw`) or a policy object (e.g. a session's).
        `label` names the drafter in the result (default: the name, or the object's class name)."""
        self.config = config
        if isinstance(drafter, str):
            self.drafter_name, self.for_step = label or drafter, make_drafter(drafter, config)
        else:
            self.drafter_name, self.for_step = label or type(drafter).__name__, _persistent(drafter)
        if isinstance(policy, str):
            self.policy_name, self.policy = policy, make_lab_policy(policy, latency=config.latency, **(policy_kw or {}))
        elif policy_kw:
            raise ValueError("policy_kw applies to a policy name, not to a policy object")
        else:
            self.policy_name, self.policy = type(policy).__name__, policy

    def run(self, steps: Iterable[tuple[int, Sequence[Response]]], *, max_new_tokens: int,
            progress: Callable[[int], None] | None = None) -> SimResult:
        out = []
        for i, (step, responses) in enumerate(steps):
            out.append(self.run_step(step, responses, max_new_tokens=max_new_tokens))
            if progress:
                progress(i)
        total = StepStats(step=-1)
        for s in out[self.config.warmup:]:
            total.add(s)
        return SimResult(self.drafter_name, self.policy_name, out, total)

    def run_step(self, step: int, responses: Sequence[Response], *, max_new_tokens: int) -> StepStats:
        """replay_step under this simulator's batching, each forward priced by its latency model."""
        cfg = self.config
        targets = {rid: np.asarray(r.response_ids, np.int32)
                   for rid, r in zip(request_ids(step, len(responses)), responses)}
        st = replay_step(self.for_step(targets), self.policy, step, responses, max_new_tokens=max_new_tokens,
                         max_batch=cfg.max_batch, continuous=cfg.batch_mode == "continuous")
        points = []
        for shape in st.shapes:
            dt = cfg.latency.price(shape)
            points.append((st.makespan, shape[0]))
            st.batch_time += dt * shape[0]
            st.makespan += dt
        st.timeline = _downsample(points)
        return st

    def record(self, step: int, responses: Sequence[Response]) -> None:
        """Take a step's responses into history without replaying them, as RolloutSession.record() and
        end_step() do (acceptance statistics learn nothing: nothing was drafted)."""
        drafter = self.for_step({})
        add = getattr(drafter, "add_rollout", None)  # a DraftStore, or a drafter wrapping one (counting)
        lengths = getattr(self.policy, "lengths", None)
        for r in responses:
            if add is not None:
                add(r.problem_id, r.prompt_ids.tolist(), r.response_ids.tolist())
            if lengths is not None:
                lengths.record(r.problem_id, len(r.response_ids))
        if drafter is not None:
            drafter.end_step()
        if hasattr(self.policy, "end_step"):
            self.policy.end_step()

def group_steps(responses: Sequence[Response]) -> list[tuple[int, list[Response]]]:
    out: dict[int, list[Response]] = {}
    for r in responses:
        out.setdefault(int(r.step), []).append(r)
    return sorted(out.items())


def simulate(responses: Sequence[Response], *, drafter: str = "das", policy: str = "das",
             config: SimConfig = SimConfig(), policy_kw: dict | None = None,
             progress: Callable[[int], None] | None = None) -> SimResult:
    """Replay responses (any order; grouped by step) with a drafter and policy."""
    steps = group_steps(responses)
    max_new = config.max_new_tokens or max((len(r.response_ids) for r in responses), default=1)
    sim = Simulator(drafter=drafter, policy=policy, config=config, policy_kw=policy_kw)
    return sim.run(steps, max_new_tokens=max_new, progress=progress)


def compare(responses: Sequence[Response], *, drafter: str = "das", policy: str = "das",
            config: SimConfig = SimConfig(), policy_kw: dict | None = None,
            progress: Callable[[int], None] | None = None) -> dict[str, SimResult]:
    """The run asked for, plus no speculation and the oracle drafter under the same policy (the limit)."""
    runs = {f"{drafter}/{policy}": (drafter, policy), "none": ("none", "none"), f"oracle/{policy}": ("oracle", policy)}
    return {label: simulate(responses, drafter=d, policy=p, config=config, policy_kw=policy_kw, progress=progress)
            for label, (d, p) in runs.items()}
