"""`dasrl bench engine` and `dasrl calibrate`: the measurements behind docs/benchmarks.md "## Engine".

Engine bench: a task preset (`math` by default) rolled out for two epochs of G samples (other seeds per
epoch); history drafters index epoch 1 and epoch 2 is measured side by side in one run: no speculation,
ngram, global suffix (arctic too when installed), DAS's suffix index alone (`das-suffix`), DAS as a
session drafts (with counting drafts, `das`), the oracle, speculation with every cap 0 (`spec-idle`) and
HF `model.generate`. Every drafter runs under the same policy, so the drafter is the only difference;
every speculative row must reproduce the no-speculation outputs token for token (`exact`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from dasrl.drafter import DraftBatch, DraftStore, StoreConfig, with_counting
from dasrl.engine import (Completion, EngineConfig, RowCache, SamplingParams, SpecEngine, StepInfo, default_threads,
                          pack_drafts)
from dasrl.policy import CPU_LATENCY, ClassCaps, FixedBudget, LatencyModel, OnlineLatency, make_policy, prior_for
from dasrl.rollout import StepSummary
from dasrl_lab.drafters.arctic import ArcticDrafter, arctic_available
from dasrl_lab.drafters.baselines import NGramDrafter, OracleDrafter
from dasrl_lab.tasks import PRESETS, chat_ids, preset


# General chat prompts (the fidelity bench's requests); the engine bench runs a task preset.
PROBLEMS = [
    "What is 17 + 25? Explain step by step.",
    "A farmer has 12 cows and buys 7 more. How many cows does he have?",
    "Write a short poem about autumn leaves.",
    "List the first five prime numbers and explain why each is prime.",
    "If a train travels 60 km in 1.5 hours, what is its average speed?",
    "Explain what photosynthesis is in simple words.",
    "What is 9 times 8? Show your reasoning.",
    "Give three tips for learning a new language.",
    "Sarah has 3 boxes with 14 apples each. How many apples does she have?",
    "Describe the water cycle in a few sentences.",
    "What is the difference between a noun and a verb? Give examples.",
    "Write a Python function that checks whether a number is even.",
    "A rectangle is 7 cm long and 4 cm wide. What is its area and perimeter?",
    "Why is the sky blue? Answer briefly.",
    "Convert 5 kilometres to metres and explain the conversion.",
    "Tom reads 20 pages a day. How many pages does he read in two weeks?",
    "Name four countries in Europe and their capitals.",
    "What is 144 divided by 12? Explain.",
    "Summarise the story of Little Red Riding Hood in three sentences.",
    "What are the three states of matter? Give an example of each.",
    "A shop sells pens at 3 dollars each. How much do 15 pens cost?",
    "Explain what a fraction is to a ten-year-old.",
    "Write a friendly email inviting a colleague to lunch.",
    "What is the sum of the angles in a triangle? Why?",
]


def chat_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as a lone user turn under the model's chat template (no system message)."""
    return [chat_ids(tokenizer, t, None) for t in texts]


@dataclass(frozen=True)
class EngineBenchConfig:
    """Size of the engine benchmark workload."""

    preset: str = "math"
    """Task preset (dasrl_lab/tasks.py) the problems, stop lines and default sampling come from."""
    problems: int = 8
    """Distinct prompts (problems), the preset's first."""
    group: int = 4
    """Rollouts per problem per epoch (GRPO group size): batch = problems x group."""
    max_new_tokens: int = 512
    """Cap on each rollout's length."""
    policy: str = "das"
    """Policy of every speculative row: das (length classes from epoch 1, allowance) | fixed (budget k)."""
    budget: int = 6
    """Draft budget k of the fixed policy."""
    temperature: float = PRESETS["math"].temperature
    """Sampling temperature of both epochs."""
    top_p: float = PRESETS["math"].top_p
    """Nucleus sampling mass."""
    threads: int | None = None
    """torch threads for every row (HF generate included); None = the cores this process may use."""
    seed: int = 0
    """Seed of the task draw."""

    @staticmethod
    def quick() -> "EngineBenchConfig":
        return EngineBenchConfig(problems=8, group=2, max_new_tokens=384)


def das_policy(problem_ids: list[int], history: list[Completion], latency: LatencyModel = CPU_LATENCY,
               caps: ClassCaps = ClassCaps()):
    """The session's das policy with its length history taken from `history` (epoch 1), priced by `latency`."""
    pol = make_policy("das", latency=latency, caps=caps)
    for pid, c in zip(problem_ids, history):
        pol.lengths.record(pid, len(c.token_ids))
    return pol


def _row(name: str, completions: list[Completion], engine: SpecEngine, ref: list[Completion] | None) -> dict:
    s = StepSummary.of(engine.last_steps)
    new = sum(len(c.token_ids) for c in completions)
    return {"drafter": name, "wall_s": round(s.rollout_s, 3), "forward_passes": s.forwards, "new_tokens": new,
            "forward_s": round(s.forward_s, 3),
            "tokens_per_s": round(new / s.rollout_s, 2), "accepted_per_batch_forward": round(s.accepted / s.forwards, 3),
            "drafted": s.drafted, "accepted": s.accepted, "draft_s": round(s.draft_s, 3),
            "verify_s": round(s.verify_s, 3),
            "exact": None if ref is None else [c.token_ids for c in completions] == [c.token_ids for c in ref]}


def run_engine_bench(model, tokenizer, cfg: EngineBenchConfig, *,
                     progress: Callable[[str, int], Callable[[StepInfo], None]] | None = None) -> list[dict]:
    """Rows of the side-by-side run. progress(name, total_tokens) returns an on_step callback."""
    engine = SpecEngine(model, tokenizer, EngineConfig(num_threads=cfg.threads or default_threads()))
    task_set = preset(cfg.preset)
    base = [chat_ids(tokenizer, t.question, t.system) for t in task_set.tasks(cfg.problems, seed=cfg.seed)]
    prompts = [p for p in base for _ in range(cfg.group)]
    problem_ids = [i for i in range(cfg.problems) for _ in range(cfg.group)]
    sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p)
    cb = progress or (lambda name, n: None)
    device = engine.lm_head.weight.device.type

    def gen(name, seeds, drafter=None, policy=None, timer=None):
        tick = cb(name, len(prompts) * cfg.max_new_tokens)

        def on_step(info: StepInfo) -> None:
            for call in (timer, tick):
                if call is not None:
                    call(info)

        return engine.generate(prompts, seeds=seeds, sampling=sampling, drafter=drafter, policy=policy,
                               max_new_tokens=cfg.max_new_tokens, problem_ids=problem_ids, on_step=on_step,
                               stop_lines=task_set.stop_lines)

    epoch1 = gen("epoch 1 (history)", seeds=[1000 + i for i in range(len(prompts))])
    seeds2 = [2000 + i for i in range(len(prompts))]

    def with_history(drafter):
        for pid, c in zip(problem_ids, epoch1):
            drafter.add_rollout(pid, c.prompt_ids, c.token_ids)
        drafter.end_step()
        return drafter

    ref = gen("none", seeds2)
    rows = [_row("none", ref, engine, None)]
    makers: list[tuple[str, Callable[[], object]]] = [
        ("ngram", NGramDrafter),
        ("global", lambda: with_history(DraftStore(StoreConfig(mode="global")))),
    ]
    if arctic_available():
        makers.append(("arctic", lambda: with_history(ArcticDrafter())))

    def das_suffix() -> DraftStore:
        return with_history(DraftStore(StoreConfig(mode="problem+request")))

    makers += [
        ("das-suffix", das_suffix),
        ("das", lambda: with_counting(das_suffix(), tokenizer)),  # as a session drafts: counting where it can
        ("oracle", lambda: OracleDrafter({i: c.token_ids for i, c in enumerate(ref)})),
    ]

    def policy():
        return das_policy(problem_ids, epoch1, prior_for(device)) if cfg.policy == "das" else FixedBudget(cfg.budget)

    idle = ("spec-idle", das_suffix, lambda: das_policy(problem_ids, epoch1, prior_for(device), ClassCaps(0, 0, 0)))
    for name, make, make_policy in [(n, m, policy) for n, m in makers] + [idle]:  # spec-idle: speculation on,
        pol = make_policy()  # every cap 0 -- what the machinery costs a session that drafts nothing
        fit = OnlineLatency(pol.latency) if pol.latency is not None else None  # as a session prices
        out = gen(name, seeds2, drafter=make(), policy=pol, timer=None if fit is None else fit.timer(pol))
        rows.append(_row(name, out, engine, ref))
    rows.append(hf_generate_row(model, tokenizer, prompts, cfg, engine.eos_ids))
    none_wall = rows[0]["wall_s"]
    for r in rows:
        r["speedup_vs_none"] = round(none_wall / r["wall_s"], 3)
        r["policy"] = "none" if r["drafter"] in ("none", "hf_generate") else cfg.policy
    return rows


def hf_generate_row(model, tokenizer, prompts: list[list[int]], cfg: EngineBenchConfig, eos_ids) -> dict:
    """HF model.generate on the same batch (left padding, same temperature and top-p; no stop lines: it
    samples other tokens anyway, a reference for the engine's speed, not its outputs)."""
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, L]
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), do_sample=True,
                             temperature=cfg.temperature, top_k=None, top_p=cfg.top_p,
                             max_new_tokens=cfg.max_new_tokens, pad_token_id=pad, eos_token_id=list(eos_ids))
    wall = time.perf_counter() - t0
    gen = out[:, width:]  # [B, T]
    new = sum(next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row)) for row in gen.tolist())
    return {"drafter": "hf_generate", "wall_s": round(wall, 3), "forward_passes": int(gen.shape[1]),
            "new_tokens": new, "tokens_per_s": round(new / wall, 2), "accepted_per_batch_forward": 0.0, "drafted": 0,
            "accepted": 0, "draft_s": 0.0, "verify_s": round(wall, 3), "exact": None}


# ---------------------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class CalibrationGrid:
    """Forward shapes profiled by `dasrl calibrate`."""

    batch_sizes: tuple[int, ...] = (1, 4, 16, 32)
    """Live rows in the forward."""
    tokens_per_row: tuple[int, ...] = (1, 2, 4, 8, 16)
    """Input tokens per row (1 = plain decoding, 1 + k with a draft of k)."""
    contexts: tuple[int, ...] = (128, 512)
    """Committed context length of every row."""
    lone_drafter: bool = True
    """Also time each drafting shape with one row drafting beside plain ones (a collapsed batch's case:
    the fixed cost of drafting at all, which all-rows-drafting shapes cannot separate)."""
    repeats: int = 3
    """Timed forwards per shape (the median is kept), after one warm-up."""

    @staticmethod
    def quick() -> "CalibrationGrid":
        return CalibrationGrid(batch_sizes=(1, 8, 32), tokens_per_row=(1, 4, 12), contexts=(128, 384), repeats=2)


def time_forward(engine: SpecEngine, *, batch: int, q: int | list[int], context: int, repeats: int) -> float:
    """Median seconds of one packed engine forward: `batch` rows on `context` cached tokens each, row b
    feeding q (or q[b]) tokens (its pending token and a chain draft of q - 1)."""
    qs = [q] * batch if isinstance(q, int) else list(q)
    if len(qs) != batch or min(qs) < 1:
        raise ValueError(f"need {batch} token counts >= 1, got {qs}")
    cache = RowCache.for_model(engine.model, rows=batch, capacity=context + max(qs))
    cache.lengths[:] = context
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, engine.vocab_size, (sum(qs) - batch,), generator=gen).numpy().astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(np.asarray(qs) - 1)]).astype(np.int64)
    parents = np.concatenate([np.arange(-1, k - 2, dtype=np.int32) for k in qs]) if len(tokens) else \
        np.zeros(0, np.int32)
    drafts = DraftBatch(tokens, parents, np.ones(len(tokens)), offsets, np.zeros(batch, np.int64))
    inputs = pack_drafts(pending=np.zeros(batch, np.int64), lengths=cache.lengths.copy(), drafts=drafts,
                         bucket=engine.attention_bucket)
    times = []
    with engine.forward_context():
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            logits = engine._forward(cache, inputs)
            if logits.is_cuda:  # kernels run asynchronously: time them to the end
                torch.cuda.synchronize(logits.device)
            if i:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(engine: SpecEngine, grid: CalibrationGrid, *, tick: Callable[[], None] = lambda: None) -> list[dict]:
    """Profile every shape of the grid: rows of batch, tokens_per_row, context, n_tokens, kv_tokens, seconds."""
    out = []
    for ctx in grid.contexts:
        for b in grid.batch_sizes:
            for q in grid.tokens_per_row:
                s = time_forward(engine, batch=b, q=q, context=ctx, repeats=grid.repeats)
                out.append({"batch": b, "tokens_per_row": q, "context": ctx, "n_tokens": b * q,
                            "kv_tokens": b * ctx, "draft_kv_tokens": b * ctx if q > 1 else 0, "seconds": s})
                if grid.lone_drafter and q > 1 and b > 1:
                    s = time_forward(engine, batch=b, q=[q] + [1] * (b - 1), context=ctx, repeats=grid.repeats)
                    out.append({"batch": b, "tokens_per_row": q, "drafting_rows": 1, "context": ctx,
                                "n_tokens": b + q - 1, "kv_tokens": b * ctx, "draft_kv_tokens": ctx, "seconds": s})
                    # the same token count without a drafting row: c_draft is then what drafting adds at equal
                    # tokens, not whatever the linear terms leave unexplained at small batches
                    n = b + q - 1
                    s = time_forward(engine, batch=n, q=1, context=ctx, repeats=grid.repeats)
                    out.append({"batch": n, "tokens_per_row": 1, "context": ctx, "n_tokens": n, "kv_tokens": n * ctx,
                                "draft_kv_tokens": 0, "seconds": s})
                tick()
    return out


def fit_latency(samples: list[dict]):
    n, kv, secs = (np.array([s[k] for s in samples], dtype=float) for k in ("n_tokens", "kv_tokens", "seconds"))
    dkv = np.array([s.get("draft_kv_tokens", 0) for s in samples], dtype=float)
    model = LatencyModel.fit(n, secs, kv, dkv)
    return model, model.mean_rel_error(n, secs, kv, dkv)


def packed_vs_padded(engine: SpecEngine, latency, *, rows: int = 32, draft: int = 16, context: int = 256,
                     repeats: int = 5) -> dict:
    """One row drafting `draft` tokens and rows - 1 drafting none: the packed forward measured and predicted by
    the fitted model (one drafting row), beside the [rows, 1 + draft] tokens a padded forward computes."""
    packed = time_forward(engine, batch=rows, q=[1 + draft] + [1] * (rows - 1), context=context, repeats=repeats)
    padded = time_forward(engine, batch=rows, q=1 + draft, context=context, repeats=repeats)
    return {"rows": rows, "draft": draft, "context": context, "packed_s": packed, "padded_s": padded,
            "packed_tokens": rows + draft, "padded_tokens": rows * (1 + draft),
            "predicted_packed_s": float(latency.predict(rows + draft, rows * context, context)),
            "padded_over_packed": padded / packed}
