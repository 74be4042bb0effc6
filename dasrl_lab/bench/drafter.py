"""`dasrl bench drafter`'s workload and measurements: the native history drafter vs arctic-inference on an
RL-like workload (docs/benchmarks.md, "## Drafter": per problem a base response and rollouts that mutate
it; a fresh rollout decoded with exact-match verification)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from dasrl.drafter import DraftParams, Drafter, SuffixIndex, extend_batch
from dasrl.drafter import propose_flat as propose_flat_core

VOCAB, BASE_LEN, PROMPT_LEN, ROLLOUTS_PER_PROBLEM = 32_000, 4_000, 256, 16
MAX_BENCH_BUDGET = 4_096
"""Largest --budget (drafts are compared token by token against a 1,000-token truth)."""


@dataclass(frozen=True)
class DrafterBenchConfig:
    """What `dasrl bench drafter` measures."""

    corpus_sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    """Indexed tokens per run (the window)."""
    mutations: tuple[str, ...] = ("point", "span")
    """How rollouts differ from their problem's base response."""
    mutation_rate: float = 0.10
    """Fraction of positions mutated in each rollout."""
    budget: int = 16
    """Draft budget per step while decoding (1..MAX_BENCH_BUDGET)."""
    decode_tokens: int = 1_000
    """Tokens decoded per fresh rollout (per problem)."""
    batch: int = 256
    """Requests in the batched propose call."""
    seed: int = 0
    """Workload seed."""

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or not 1 <= self.budget <= MAX_BENCH_BUDGET:
            raise ValueError(f"budget must be an int in [1, {MAX_BENCH_BUDGET}], got {self.budget!r}")
        if not isinstance(self.batch, int) or not 1 <= self.batch <= 65_536:
            raise ValueError(f"batch must be an int in [1, 65536], got {self.batch!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2^63), got {self.seed!r}")


def mutate(base: np.ndarray, *, kind: str, rate: float, rng: np.random.Generator) -> np.ndarray:
    out = base.copy()
    if kind == "point":
        pos = rng.random(len(out)) < rate
        out[pos] = rng.integers(0, VOCAB, int(pos.sum()))
    elif kind == "span":
        budget = int(rate * len(out))
        while budget > 0:
            n = min(int(rng.integers(4, 33)), budget)
            at = int(rng.integers(0, len(out) - n))
            out[at : at + n] = rng.integers(0, VOCAB, n)
            budget -= n
    else:
        raise ValueError(f"unknown mutation {kind!r}; valid: point, span")
    return out


@dataclass
class Problem:
    prompt: np.ndarray
    history: list[np.ndarray]
    fresh: np.ndarray


def make_workload(corpus_tokens: int, *, kind: str, rate: float, seed: int) -> list[Problem]:
    rng = np.random.default_rng(seed)
    n_rollouts = max(1, round(corpus_tokens / (BASE_LEN + PROMPT_LEN)))
    problems = []
    while n_rollouts > 0:
        k = min(ROLLOUTS_PER_PROBLEM, n_rollouts)
        n_rollouts -= k
        prompt = rng.integers(0, VOCAB, PROMPT_LEN).astype(np.int32)
        base = rng.integers(0, VOCAB, BASE_LEN).astype(np.int32)
        history = [mutate(base, kind=kind, rate=rate, rng=rng) for _ in range(k)]
        problems.append(Problem(prompt, history, mutate(base, kind=kind, rate=rate, rng=rng)))
    return problems


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode(drafter: Drafter, problems: list[Problem], *, budget: int, tokens: int,
           on_request: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Decode each problem's fresh rollout with exact-match verification; time propose and observe."""
    spec_us, observe_s, observed, accepted, steps = [], 0.0, 0, 0, 0
    for i, prob in enumerate(problems):
        rid = f"fresh-{i}"
        drafter.start(rid, i, prob.prompt)
        truth, pos = prob.fresh[:tokens], 0
        while pos < len(truth):
            t0 = time.perf_counter()
            draft = drafter.propose([rid], [budget])[0]
            spec_us.append((time.perf_counter() - t0) * 1e6)
            n = 0
            while n < len(draft) and pos + n < len(truth) and draft.tokens[n] == truth[pos + n]:
                n += 1  # chain drafts: accept while equal
            emit = truth[pos : pos + n + 1]
            observe_s += _timed(lambda: drafter.observe(rid, emit))
            observed += len(emit)
            accepted += n
            steps += 1
            pos += len(emit)
        drafter.finish(rid)
        on_request()
    s = np.asarray(spec_us)
    return {"speculate_us_mean": float(s.mean()), "speculate_us_p50": float(np.median(s)),
            "speculate_us_p99": float(np.percentile(s, 99)), "observe_single_us_per_token": observe_s / observed * 1e6,
            "accepted_per_step": accepted / steps}


def batched_call(drafter: Drafter, problems: list[Problem], *, batch: int, budget: int,
                 observe_tokens: int = 5) -> dict[str, float]:
    """One propose call for `batch` requests ~500 tokens into their fresh rollouts, through propose_flat (what
    the engine calls) and propose; then each request observes its next `observe_tokens` true tokens in one
    observe_batch call. Medians of 7 calls: µs per request, µs per observed token."""
    rids = [f"batch-{j}" for j in range(batch)]
    pos = [500 + j % 7 for j in range(batch)]
    for j, rid in enumerate(rids):
        prob = problems[j % len(problems)]
        drafter.start(rid, j % len(problems), prob.prompt)
        drafter.observe(rid, prob.fresh[: pos[j]])
    budgets = [budget] * batch
    drafter.propose_flat(rids, budgets)  # warm
    flat, flat_cpu = _median(lambda: drafter.propose_flat(rids, budgets))
    drafts, _ = _median(lambda: drafter.propose(rids, budgets))
    obs = []
    for _ in range(7):
        toks = [problems[j % len(problems)].fresh[pos[j]: pos[j] + observe_tokens] for j in range(batch)]
        pos = [p + observe_tokens for p in pos]
        n = sum(len(t) for t in toks)
        obs.append([t / n for t in _timed2(lambda: drafter.observe_batch(rids, toks))])
    for rid in rids:
        drafter.finish(rid)
    obs_wall, obs_cpu = np.median(obs, axis=0)
    return {"batched_speculate_us_per_request": flat / batch * 1e6, "batched_speculate_cpu_us_per_request":
            flat_cpu / batch * 1e6, "batched_drafts_us_per_request": drafts / batch * 1e6,
            "append_us_per_token": float(obs_wall) * 1e6, "append_cpu_us_per_token": float(obs_cpu) * 1e6}


def _timed2(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall, this thread's CPU) seconds of fn(); CPU time is what a loaded machine does not inflate."""
    w, c = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w, time.thread_time() - c


def _median(fn: Callable[[], object], n: int = 7) -> tuple[float, float]:
    """Median (wall, CPU) seconds of n calls."""
    w, c = np.median([_timed2(fn) for _ in range(n)], axis=0)
    return float(w), float(c)


def index_costs(problems: list[Problem]) -> dict[str, float]:
    """Build, add/remove and memory of the native index itself (one shard per problem)."""
    seqs = [(i, np.concatenate([p.prompt, h])) for i, p in enumerate(problems) for h in p.history]
    total = sum(len(s) for _, s in seqs)
    shards: dict[int, SuffixIndex] = {}

    def build() -> None:
        for sid, (pi, s) in enumerate(seqs):
            shards.setdefault(pi, SuffixIndex()).add(sid, s)

    build_s = _timed(build)
    mem = sum(ix.bytes_used() for ix in shards.values())
    ix, extra = shards[0], np.concatenate([problems[0].prompt, problems[0].fresh])[:4000]
    add_s = min(_timed(lambda: (ix.add(10**9, extra), ix.remove(10**9))) for _ in range(5))
    remove_s = min(_remove_time(ix, extra) for _ in range(5))
    return {"build_us_per_token": build_s / total * 1e6, "bytes_per_token": mem / total,
            "add_4k_us": (add_s - remove_s) * 1e6, "remove_4k_us": remove_s * 1e6, "indexed_tokens": total}


def _remove_time(ix: SuffixIndex, seq: np.ndarray) -> float:
    ix.add(10**9 + 1, seq)
    return _timed(lambda: ix.remove(10**9 + 1))


def core_costs(problems: list[Problem], *, batch: int, budget: int, observe_tokens: int = 5) -> dict[str, float]:
    """The same batched propose and observe as batched_call on the native index alone (one per problem, each
    request growing its live sequence as in problem+request mode): no protocol layer, no validation."""
    shards = {i: SuffixIndex() for i in range(len(problems))}
    for i, p in enumerate(problems):
        for k, h in enumerate(p.history):
            shards[i].add(k, np.concatenate([p.prompt, h]))
    cursors, pos = [], [500 + j % 7 for j in range(batch)]
    for j in range(batch):
        p, ix = problems[j % len(problems)], shards[j % len(problems)]
        ix.add(10**6 + j, [])
        cursors.append(ix.cursor(DraftParams().max_match, seq_id=10**6 + j))
        cursors[-1].feed(np.concatenate([p.prompt, p.fresh[: pos[j]]]))
    budgets = np.full(batch, budget, dtype=np.int64)
    propose_flat_core(cursors, budgets)
    flat, flat_cpu = _median(lambda: propose_flat_core(cursors, budgets))
    obs = []
    for _ in range(7):
        toks = [problems[j % len(problems)].fresh[pos[j]: pos[j] + observe_tokens] for j in range(batch)]
        pos = [p + observe_tokens for p in pos]
        flat_toks = np.concatenate(toks)
        offsets = np.zeros(batch + 1, np.int64)
        np.cumsum([len(t) for t in toks], out=offsets[1:])
        obs.append([t / len(flat_toks) for t in _timed2(lambda: extend_batch(cursors, flat_toks, offsets))])
    obs_wall, obs_cpu = np.median(obs, axis=0)
    return {"batched_speculate_us_per_request_core": flat / batch * 1e6,
            "batched_speculate_cpu_us_per_request_core": flat_cpu / batch * 1e6,
            "append_us_per_token_core": float(obs_wall) * 1e6, "append_cpu_us_per_token_core": float(obs_cpu) * 1e6}


def runs(config: DrafterBenchConfig) -> Iterator[tuple[int, str, list[Problem]]]:
    for size in config.corpus_sizes:
        for kind in config.mutations:
            yield size, kind, make_workload(size, kind=kind, rate=config.mutation_rate, seed=config.seed)
