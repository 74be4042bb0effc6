"""`dasrl bench fidelity`: are seeded sampled rollouts the very tokens plain decoding gives?
(docs/benchmarks.md, "## Fidelity"). Per temperature, against plain decoding of every request in one batch:
every drafter at a fixed budget (history from an earlier epoch) and plain decoding in smaller batches. Per
variant: differing sequences and tokens, each first difference with its logit gap, and the flip rate
(differing sequences per token exposed up to and including each first difference).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from dasrl.engine import Completion, EngineConfig, SamplingParams, SpecEngine, StepInfo, default_threads, draw
from dasrl_lab.bench.engine import PROBLEMS, chat_prompts

DRAFTERS = ("ngram", "global", "das", "oracle", "trees")
SAMPLER = "gumbel"
"""The rows' `sampler`: the engine's one draw (the inverse-CDF draw it was compared with is gone, issue 30)."""


@dataclass(frozen=True)
class FidelityConfig:
    """Size of the fidelity benchmark."""

    problems: int = 12
    """Distinct prompts."""
    group: int = 4
    """Requests per prompt (siblings): requests = problems x group, all in the reference batch."""
    max_new_tokens: int = 256
    """Cap on each rollout's length."""
    temperatures: tuple[float, ...] = (1.0, 0.6)
    """Sampling temperatures, each a separate set of rows."""
    top_p: float = 0.95
    """Nucleus of every run."""
    drafters: tuple[str, ...] = DRAFTERS
    """Speculative variants (at the reference's batch)."""
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    """Plain-decoding variants: the same requests in consecutive batches of this size (< requests)."""
    single_requests: int = 8
    """The batch-1 variant decodes only the first this many requests (it is the slowest by far)."""
    budget: int = 6
    """Fixed draft budget of the speculative variants."""
    threads: int | None = None
    """torch threads; None = the cores this process may use."""
    batch_invariant: bool = False
    """EngineConfig.batch_invariant for every engine of the run (the forward-shape rows teacher-force the
    model itself, outside the engine: they are unaffected)."""

    def __post_init__(self) -> None:
        for name in ("problems", "group", "max_new_tokens", "single_requests", "budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if unknown := [d for d in self.drafters if d not in DRAFTERS]:
            raise ValueError(f"unknown drafter(s) {unknown}; known: {', '.join(DRAFTERS)}")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if any(not t > 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be > 0 (greedy is the engine tests' part), got {self.temperatures}")

    @property
    def requests(self) -> int:
        return self.problems * self.group

    @staticmethod
    def quick() -> "FidelityConfig":
        return FidelityConfig(problems=3, group=2, max_new_tokens=32, batch_sizes=(1, 4), single_requests=2)


@dataclass(frozen=True)
class Diff:
    """Where one variant's sequence first leaves the reference."""

    request: int
    position: int
    """Output position of the first differing token (or where one sequence ended early)."""
    ref_token: int | None
    token: int | None
    logit_gap: float | None = None
    """|logit[ref_token] - logit[token]| in a batch-1 forward of the reference prefix (None: a length end)."""


@dataclass
class Comparison:
    """A variant's outputs against the reference's, over the requests both decoded."""

    requests: int = 0
    tokens: int = 0
    """Reference tokens compared."""
    exposed: int = 0
    """Tokens sampled up to and including each sequence's first difference (all, if none)."""
    differing_tokens: int = 0
    """Positions (up to the longer of the two) whose tokens differ."""
    diffs: list[Diff] = field(default_factory=list)


def compare(ref: dict[int, list[int]], out: dict[int, list[int]]) -> Comparison:
    """Compare outputs by request index (only requests present in both)."""
    c = Comparison()
    for i in sorted(ref.keys() & out.keys()):
        a, b = ref[i], out[i]
        c.requests += 1
        c.tokens += len(a)
        n = min(len(a), len(b))
        neq = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
        first = int(neq[0]) if len(neq) else (n if len(a) != len(b) else None)
        c.differing_tokens += len(neq) + abs(len(a) - len(b))
        if first is None:
            c.exposed += len(a)
            continue
        c.exposed += first + 1
        c.diffs.append(Diff(request=i, position=first, ref_token=a[first] if first < len(a) else None,
                            token=b[first] if first < len(b) else None))
    return c


def engine_config(cfg: FidelityConfig) -> EngineConfig:
    return EngineConfig(num_threads=cfg.threads or default_threads(), batch_invariant=cfg.batch_invariant)


def logit_gap(model, prompt: list[int], prefix: list[int], a: int, b: int) -> float:
    """|logit a - logit b| at the output position after prefix, in a batch-1 forward (no cache)."""
    ids = torch.as_tensor([list(prompt) + list(prefix)])  # [1, L]
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, -1].float()  # [V]
    return abs(float(logits[a] - logits[b]))


def _drafter(name: str, history: list[tuple[int, list[int], list[int]]], ref: list[Completion]):
    from dasrl.drafter import DraftParams, DraftStore, StoreConfig
    from dasrl_lab.drafters.baselines import NGramDrafter, OracleDrafter

    if name == "ngram":
        return NGramDrafter()
    if name == "oracle":
        return OracleDrafter({i: c.token_ids for i, c in enumerate(ref)})
    cfg = {"global": StoreConfig(mode="global"), "das": StoreConfig(mode="problem+request"),
           "trees": StoreConfig(mode="problem+request", params=DraftParams(branching=3))}[name]
    store = DraftStore(cfg)
    for pid, prompt, response in history:
        store.add_rollout(pid, prompt, response)
    store.end_step()
    return store


def run_fidelity(model, tokenizer, cfg: FidelityConfig, *,
                 progress: Callable[[str, int], Callable[[StepInfo], None]] | None = None) -> list[dict]:
    """One row per (variant, temperature). progress(name, total_tokens) returns an on_step callback."""
    from dasrl.policy import FixedBudget

    engine = SpecEngine(model, tokenizer, engine_config(cfg))
    base = chat_prompts(tokenizer, [PROBLEMS[i % len(PROBLEMS)] for i in range(cfg.problems)])
    prompts = [p for p in base for _ in range(cfg.group)]
    pids = [i for i in range(cfg.problems) for _ in range(cfg.group)]
    seeds = [2000 + i for i in range(len(prompts))]
    cb = progress or (lambda name, n: None)

    def gen(name, idx, sampling, seeds_, drafter=None, policy=None):
        return engine.generate([prompts[i] for i in idx], seeds=[seeds_[i] for i in idx], sampling=sampling,
                               drafter=drafter, policy=policy, max_new_tokens=cfg.max_new_tokens,
                               problem_ids=[pids[i] for i in idx], req_ids=list(idx),
                               on_step=cb(name, len(idx) * cfg.max_new_tokens))

    everyone = list(range(len(prompts)))
    rows = []
    for temp in cfg.temperatures:
        sampling = SamplingParams(temperature=temp, top_p=cfg.top_p)
        epoch1 = gen(f"history T={temp}", everyone, sampling, [1000 + i for i in everyone])
        history = [(pids[i], prompts[i], c.token_ids) for i, c in enumerate(epoch1)]
        tag = f"T={temp}"
        ref = gen(f"{tag} reference", everyone, sampling, seeds)
        ref_out = {i: c.token_ids for i, c in enumerate(ref)}
        variants: list[tuple[str, dict[int, list[int]]]] = []
        for name in cfg.drafters:
            out = gen(f"{tag} {name}", everyone, sampling, seeds, drafter=_drafter(name, history, ref),
                      policy=FixedBudget(cfg.budget))
            variants.append((name, {i: c.token_ids for i, c in enumerate(out)}))
        for b in cfg.batch_sizes:
            if b >= len(prompts):
                continue
            todo = everyone[: cfg.single_requests] if b == 1 else everyone
            out_b: dict[int, list[int]] = {}
            for s in range(0, len(todo), b):
                chunk = todo[s : s + b]
                for i, c in zip(chunk, gen(f"{tag} batch={b} [{s}]", chunk, sampling, seeds)):
                    out_b[i] = c.token_ids
            variants.append((f"batch={b}", out_b))
        for name, out in variants:
            c = compare(ref_out, out)
            diffs = [_with_gap(model, prompts, ref_out, d) for d in c.diffs]
            rows.append(_row(name, temp, cfg, c, diffs, reference_batch=len(prompts)))
    return rows


def _with_gap(model, prompts, ref_out, d: Diff) -> Diff:
    if d.ref_token is None or d.token is None:
        return d
    gap = logit_gap(model, prompts[d.request], ref_out[d.request][: d.position], d.ref_token, d.token)
    return replace(d, logit_gap=round(gap, 9))


def _head(variant, temp, cfg: FidelityConfig) -> dict:
    """The keys every JSON row starts with."""
    return {"sampler": SAMPLER, "variant": variant, "temperature": temp, "top_p": cfg.top_p,
            "batch_invariant": cfg.batch_invariant}


def _row(variant, temp, cfg, c: Comparison, diffs: list[Diff], *, reference_batch: int) -> dict:
    return {**_head(variant, temp, cfg), "reference_batch": reference_batch, "requests": c.requests,
            "tokens": c.tokens, "differing_tokens": c.differing_tokens, "differing_sequences": len(diffs),
            "exposed_tokens": c.exposed, "flip_rate": len(diffs) / c.exposed if c.exposed else 0.0,
            "first_diffs": [d.__dict__ for d in diffs]}


def totals(rows: list[dict]) -> dict:
    """Over the rows: tokens compared, differing tokens and sequences, flips per exposed token."""
    t = {k: sum(r[k] for r in rows) for k in ("tokens", "differing_tokens", "differing_sequences", "exposed_tokens")}
    return {**t, "flip_rate": t["differing_sequences"] / t["exposed_tokens"] if t["exposed_tokens"] else 0.0}


def shape_flip_rows(model, tokenizer, cfg: FidelityConfig, *, seeds: int = 16, requests: int = 4,
                    tokens: int = 96, tick: Callable[[], None] = lambda: None) -> list[dict]:
    """Flips caused by the forward shape alone, on real logits: a few plain rollouts are teacher-forced
    once per sequence and once as a batch, and every output position is drawn under `seeds` keys from
    both logits (flips.py); the noise model's prediction at the measured sigma comes with each row."""
    from dasrl_lab.bench.flips import flip_row

    engine = SpecEngine(model, tokenizer, engine_config(cfg))
    prompts = chat_prompts(tokenizer, PROBLEMS[:requests])
    rows = []
    for temp in cfg.temperatures:
        sampling = SamplingParams(temperature=temp, top_p=cfg.top_p)
        outs = engine.generate(prompts, seeds=list(range(requests)), sampling=sampling,
                               max_new_tokens=min(tokens, cfg.max_new_tokens))
        seqs = [p + c.token_ids for p, c in zip(prompts, outs) if c.token_ids]
        starts = [len(p) for p, c in zip(prompts, outs) if c.token_ids]
        r = flip_row(model, seqs, starts, sampling, seeds=seeds)
        rows.append({**_head(f"forward shape (alone vs batch of {len(seqs)})", temp, cfg), "requests": len(seqs),
                     "tokens": r["draws"], "differing_tokens": r["flips"], "differing_sequences": r["flips"], **r})
        tick()
    return rows


def sampler_cost_rows(model, tokenizer, cfg: FidelityConfig, *, batch: int = 32, steps: int = 12,
                      repeats: int = 15) -> list[dict]:
    """The sampler's time at `batch` rows of real logits against the engine's median plain-decoding step
    (forward + sampling + bookkeeping) at that batch, in the same process."""
    engine = SpecEngine(model, tokenizer, engine_config(cfg))
    prompts = chat_prompts(tokenizer, [PROBLEMS[i % len(PROBLEMS)] for i in range(batch)])
    infos: list[StepInfo] = []
    outs = engine.generate(prompts, seeds=list(range(batch)), sampling=SamplingParams(temperature=1.0),
                           max_new_tokens=steps, ignore_eos=True, on_step=infos.append)
    # each plain-decoding step's wall time at the full batch (whatever the engine's own split of it)
    step_ms = 1e3 * statistics.median(b.elapsed_s - a.elapsed_s for a, b in zip(infos[1:], infos[2:])
                                      if b.batch_size == batch)
    fwd = [getattr(i, "forward_s", 0.0) for i in infos[2:] if i.batch_size == batch]
    forward_ms = 1e3 * statistics.median(fwd) if fwd and min(fwd) > 0 else None
    width = max(len(p) + len(c.token_ids) for p, c in zip(prompts, outs))
    ids = torch.zeros(batch, width, dtype=torch.long)  # [B, L] right-padded
    last = []
    for i, (p, c) in enumerate(zip(prompts, outs)):
        seq = p + c.token_ids
        ids[i, : len(seq)] = torch.as_tensor(seq)
        last.append(len(seq) - 1)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[torch.arange(batch), torch.as_tensor(last)].float()  # [B, V]
    rows = []
    seeds, pos = np.arange(batch), np.full(batch, steps)
    for temp in cfg.temperatures:
        params, draw_s = SamplingParams(temperature=temp, top_p=cfg.top_p), []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            draw(logits, params, seeds=seeds, positions=pos)
            draw_s.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(draw_s[1:])
        rows.append({**_head(f"cost (batch {batch})", temp, cfg), "requests": batch, "tokens": 0,
                     "differing_tokens": 0, "differing_sequences": 0, "sampler_ms": round(ms, 3),
                     "step_ms": round(step_ms, 2), "forward_ms": None if forward_ms is None else round(forward_ms, 2),
                     "sampler_share": round(ms / step_ms, 4),
                     "sampler_forward_share": None if forward_ms is None else round(ms / forward_ms, 4)})
    return rows

