"""Trace-driven simulator: how long would these rollouts take with this drafter and policy?

Each RL step of the trace is replayed. Every response is "generated" by the target = its recorded
tokens; a draft token is accepted iff it equals the recorded token at its position (for tree drafts, the
matching child is followed), which is exactly what lossless verification with a position-keyed sampler
does; the target's own token follows the accepted run. Every forward costs the LatencyModel's prediction
for its tokens (rows + draft tokens) and KV reads (sum of row contexts); a row's first forward is its
prefill, as in the engine: its prompt's tokens, nothing cached, no draft. Drafts come from the engine's own
propose -> cap -> trim path (dasrl.policy.propose). The drafter sees what a real one would: the window of
earlier steps and the tokens of in-flight siblings as they are verified.

Batching: `static` runs waves of max_batch requests, each wave until its last request finishes;
`continuous` refills a finished row's slot at the next forward.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable, Sequence

import numpy as np

from dasrl.drafter import Draft, DraftBatch, Drafter, DraftStore, StoreConfig
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


# ------------------------------------------------------------------------------ drafters


class _Persistent:
    """One drafter object for the whole trace (history drafters, n-gram)."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter

    def for_step(self, futures: dict) -> object:
        return self.drafter


class _Oracle:
    """A fresh oracle per step, told the recorded responses."""

    def for_step(self, futures: dict) -> object:
        return OracleDrafter(futures)


class _NoDrafter:
    def for_step(self, futures: dict) -> None:
        return None


def _store(mode: str, *, windowed: bool = True) -> Callable[[SimConfig], _Persistent]:
    """A DraftStore; windowed=False keeps every past rollout at full weight (one ever-growing global
    tree, as ArcticInference's / vLLM's `suffix` cache does)."""
    def make(cfg: SimConfig) -> _Persistent:
        sc = replace(cfg.store, mode=mode) if windowed else replace(cfg.store, mode=mode, window=0, decay=1.0)
        return _Persistent(DraftStore(sc))
    return make


DRAFTERS: dict[str, Callable[[SimConfig], object]] = {
    "das": _store("problem+request"),
    "problem": _store("problem"),
    "global": _store("global", windowed=False),
    "global-window": _store("global"),
    "ngram": lambda cfg: _Persistent(NGramDrafter()),
    "oracle": lambda cfg: _Oracle(),
    "none": lambda cfg: _NoDrafter(),
}


def make_drafter(name: str, cfg: SimConfig):
    try:
        return DRAFTERS[name](cfg)
    except KeyError:
        raise ValueError(f"unknown drafter {name!r}; valid drafters: {', '.join(DRAFTERS)}") from None


# ------------------------------------------------------------------------------- results


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
    """Seconds this process spent proposing drafts (budgets, drafter, trim) and feeding the drafter the
    emitted tokens: the CPU work a serving engine does between two forwards (fastreplay measures it)."""
    shapes: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(rows, tokens, cached context tokens read, those of the drafting rows) of every forward, in order:
    what a latency model prices (LatencyModel.price)."""

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


# ------------------------------------------------------------------------------- replay


def replay_targets(batch: DraftBatch, recorded: np.ndarray, start: np.ndarray, gen: np.ndarray,
                   length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The target at every input of a replayed batch, for the engine's accept rule (dasrl.engine.accepted_counts):
    row b's recorded continuation is recorded[start[b] + gen[b] : start[b] + length[b]]; the input of a node at
    depth d (the pending token: d = -1) targets its token at d + 1, -1 past its end. Returns (targets, starts)."""
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


def accepted_length(draft: Draft, target: np.ndarray) -> int:
    """Draft tokens accepted against the recorded continuation `target` (the engine's rule)."""
    one, batch = np.zeros(1, np.int64), DraftBatch.from_drafts([draft])
    targets, starts = replay_targets(batch, np.asarray(target), one, one, np.array([len(target)]))
    return int(accepted_counts(batch, targets, starts)[0])


def _downsample(points: list[tuple[float, int]], n: int = 200) -> list[tuple[float, int]]:
    if len(points) <= n:
        return points
    idx = np.linspace(0, len(points) - 1, n).round().astype(int)
    return [points[i] for i in idx]


class Simulator:
    """Replays steps of responses with one drafter and one policy (both persist across steps)."""

    def __init__(self, *, drafter: str | Drafter = "das", policy: str | BudgetPolicy = "das",
                 config: SimConfig = SimConfig(), policy_kw: dict | None = None, label: str | None = None) -> None:
        """`drafter`: a name from DRAFTERS, or any Drafter object, used for every step (its own window and
        history rules apply; SimConfig.store does not). `policy`: a make_lab_policy name (with `policy_kw`; das is priced by SimConfig.latency) or
        a policy object (e.g. a session's ForwardAllowance, to replay what that session decided). `label`
        names the drafter in the result (default: the name, or the object's class name)."""
        self.config = config
        if isinstance(drafter, str):
            self.drafter_name, self.drafters = label or drafter, make_drafter(drafter, config)
        else:
            self.drafter_name, self.drafters = label or type(drafter).__name__, _Persistent(drafter)
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
        cfg, lat = self.config, self.config.latency
        rids = [(step, i) for i in range(len(responses))]
        targets = [np.asarray(r.response_ids, np.int32) for r in responses]
        drafter = self.drafters.for_step(dict(zip(rids, targets)))
        states = [RequestState(rid, r.problem_id, len(r.prompt_ids), max_new_tokens)
                  for rid, r in zip(rids, responses)]
        limit = cfg.max_batch or len(responses)
        queue, live = deque(range(len(responses))), []
        st = StepStats(step=step)
        points = []
        while queue or live:
            if cfg.batch_mode == "continuous" or not live:
                while queue and len(live) < limit:
                    i = queue.popleft()
                    if drafter is not None:
                        drafter.start(rids[i], responses[i].problem_id, responses[i].prompt_ids)
                    live.append(i)
            # requests with an empty response finish without a forward
            for i in [i for i in live if targets[i].size == 0]:
                self._finish(drafter, states[i])
                live.remove(i)
            if not live:
                continue
            live_states = [states[i] for i in live]
            drafts = self._drafts(drafter, live, live_states, max_new_tokens)
            n_tok = kv = draft_kv = 0
            done = []
            for i, s, d in zip(live, live_states, drafts):
                tgt = targets[i][s.generated:]
                a = accepted_length(d, tgt)
                emit = tgt[: min(a + 1, tgt.size)]
                if s.generated == 0:  # the row's prefill: its prompt goes through the forward, nothing cached
                    n_tok += s.prompt_len + len(d)
                else:
                    n_tok += 1 + len(d)
                    cached = s.prompt_len + s.generated - 1  # all but the pending token, as the engine
                    kv += cached
                    draft_kv += cached if len(d) else 0
                s.generated += emit.size
                s.forwards += 1
                s.drafted += len(d)
                s.accepted += a
                st.proposed += len(d)
                st.accepted += a
                if drafter is not None:
                    drafter.observe(rids[i], emit)
                if s.generated >= targets[i].size:
                    done.append(i)
            shape = (len(live), n_tok, kv, draft_kv)
            dt = lat.price(shape)
            st.shapes.append(shape)
            points.append((st.makespan, len(live)))
            st.batch_time += dt * len(live)
            st.makespan += dt
            st.forwards += 1
            st.row_forwards += len(live)
            ended = set(done)
            for k in reversed([k for k, i in enumerate(live) if i in ended]):  # as the engine: swap-remove, last first
                self._finish(drafter, states[live[k]])
                last = live.pop()
                if k < len(live):
                    live[k] = last
        st.tokens = int(sum(t.size for t in targets))
        st.timeline = _downsample(points)
        if drafter is not None:
            drafter.end_step()
        if hasattr(self.policy, "end_step"):
            self.policy.end_step()
        return st

    def record(self, step: int, responses: Sequence[Response]) -> None:
        """Take a step's responses into history without replaying them, as RolloutSession.record() and
        end_step() do: a DraftStore (or a drafter wrapping one) indexes them, the policy's length history
        counts them, then both end the step (acceptance statistics learn nothing: nothing was drafted)."""
        drafter = self.drafters.for_step({})
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

    def _drafts(self, drafter, live: list[int], states: list[RequestState], max_new: int) -> list[Draft]:
        """The engine's own propose -> cap -> trim path; a row's room is its length limit minus the
        pending token, and 0 at its prefill (the engine drafts nothing in the prompt's forward)."""
        if not any(s.generated for s in states):  # the prefill forward: the engine asks no policy there
            return [Draft.empty()] * len(states)
        room = [max_new - s.generated - 1 if s.generated else 0 for s in states]
        return propose(drafter, self.policy, states, [s.req_id for s in states], room).drafts()

    def _finish(self, drafter, state: RequestState) -> None:
        if drafter is not None:
            drafter.finish(state.req_id)
        if hasattr(self.policy, "finish"):
            self.policy.finish(state)


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
