"""`dasrl bench engine` and `dasrl calibrate`: the measurements behind docs/benchmarks.md "## Engine".

Engine bench: a workload with history. The same problems are rolled out for two "epochs" (G samples
each, T = 0.6, different seeds per epoch); history drafters index epoch 1 and epoch 2 is measured, side by
side in one run: no speculation, n-gram, global suffix (DraftStore mode global; arctic-inference too when
installed), DAS (DraftStore problem+request, fixed budget), the oracle (knows epoch 2's outputs: the
limit), and HF `model.generate` on the same batch as the external baseline. Every speculative row must
reproduce the no-speculation outputs token for token (`exact`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from dasrl.drafter.baselines import NGramDrafter, OracleDrafter
from dasrl.engine.cache import RowCache
from dasrl.engine.engine import Completion, EngineConfig, SpecEngine, StepInfo
from dasrl.engine.sampling import SamplingParams
from dasrl.policy.base import FixedBudget

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


@dataclass(frozen=True)
class EngineBenchConfig:
    """Size of the engine benchmark workload."""

    problems: int = 12
    """Distinct prompts (problems)."""
    group: int = 4
    """Rollouts per problem per epoch (GRPO group size): batch = problems x group."""
    max_new_tokens: int = 256
    """Cap on each rollout's length."""
    budget: int = 6
    """Fixed draft budget of the speculative rows."""
    temperature: float = 0.6
    """Sampling temperature of both epochs."""
    threads: int | None = None
    """torch threads for every row (HF generate included); None = the cores this process may use."""

    @staticmethod
    def quick() -> "EngineBenchConfig":
        return EngineBenchConfig(problems=8, group=2, max_new_tokens=128)


def chat_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    out = []
    for t in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _row(name: str, completions: list[Completion], engine: SpecEngine, ref: list[Completion] | None) -> dict:
    s = engine.last_run
    new = sum(len(c.token_ids) for c in completions)
    return {"drafter": name, "wall_s": round(s.wall_s, 3), "forward_passes": s.forwards, "new_tokens": new,
            "tokens_per_s": round(new / s.wall_s, 2), "accepted_per_forward": round(s.accepted / s.forwards, 3),
            "drafted": s.drafted, "accepted": s.accepted, "draft_s": round(s.draft_s, 3),
            "verify_s": round(s.verify_s, 3),
            "exact": None if ref is None else [c.token_ids for c in completions] == [c.token_ids for c in ref]}


def run_engine_bench(model, tokenizer, cfg: EngineBenchConfig, *,
                     progress: Callable[[str, int], Callable[[StepInfo], None]] | None = None) -> list[dict]:
    """Rows of the side-by-side run. progress(name, total_tokens) returns an on_step callback."""
    engine = SpecEngine(model, tokenizer, EngineConfig(num_threads=cfg.threads))
    base = chat_prompts(tokenizer, [PROBLEMS[i % len(PROBLEMS)] for i in range(cfg.problems)])
    prompts = [p for p in base for _ in range(cfg.group)]
    problem_ids = [i for i in range(cfg.problems) for _ in range(cfg.group)]
    sampling = SamplingParams(temperature=cfg.temperature)
    total = len(prompts) * cfg.max_new_tokens
    cb = progress or (lambda name, n: None)

    def gen(name, seeds, drafter=None, policy=None):
        return engine.generate(prompts, seeds=seeds, sampling=sampling, drafter=drafter, policy=policy,
                               max_new_tokens=cfg.max_new_tokens, problem_ids=problem_ids, on_step=cb(name, total))

    epoch1 = gen("epoch 1 (history)", seeds=[1000 + i for i in range(len(prompts))])
    seeds2 = [2000 + i for i in range(len(prompts))]

    def with_history(drafter):
        for pid, c in zip(problem_ids, epoch1):
            drafter.add_rollout(pid, c.prompt_ids, c.token_ids)
        drafter.end_step()
        return drafter

    rows = []
    ref = gen("none", seeds2)
    rows.append(_row("none", ref, engine, None))
    from dasrl.drafter.store import DraftStore, StoreConfig

    makers: list[tuple[str, Callable[[], object]]] = [
        ("ngram", NGramDrafter),
        ("global", lambda: with_history(DraftStore(StoreConfig(mode="global")))),
    ]
    try:
        from dasrl.drafter.arctic import ArcticDrafter, arctic_available

        if arctic_available():
            makers.append(("arctic", lambda: with_history(ArcticDrafter())))
    except ImportError:
        pass
    makers += [
        ("das", lambda: with_history(DraftStore(StoreConfig(mode="problem+request")))),
        ("oracle", lambda: OracleDrafter({i: c.token_ids for i, c in enumerate(ref)})),
    ]
    for name, make in makers:
        out = gen(name, seeds2, drafter=make(), policy=FixedBudget(cfg.budget))
        rows.append(_row(name, out, engine, ref))
    rows.append(hf_generate_row(model, tokenizer, prompts, cfg, engine.eos_ids))
    none_wall = rows[0]["wall_s"]
    for r in rows:
        r["speedup_vs_none"] = round(none_wall / r["wall_s"], 3)
    return rows


def hf_generate_row(model, tokenizer, prompts: list[list[int]], cfg: EngineBenchConfig, eos_ids) -> dict:
    """HF model.generate on the same batch (left padding, same temperature, no top-k/top-p)."""
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
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=cfg.temperature, top_k=None,
                             top_p=None, max_new_tokens=cfg.max_new_tokens, pad_token_id=pad,
                             eos_token_id=list(eos_ids))
    wall = time.perf_counter() - t0
    gen = out[:, width:]  # [B, T]
    new = 0
    for row in gen.tolist():
        n = len(row)
        for i, t in enumerate(row):
            if t in eos_ids:
                n = i + 1
                break
        new += n
    return {"drafter": "hf_generate", "wall_s": round(wall, 3), "forward_passes": int(gen.shape[1]),
            "new_tokens": new, "tokens_per_s": round(new / wall, 2), "accepted_per_forward": 0.0, "drafted": 0,
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
    repeats: int = 3
    """Timed forwards per shape (the median is kept), after one warm-up."""

    @staticmethod
    def quick() -> "CalibrationGrid":
        return CalibrationGrid(batch_sizes=(1, 8, 32), tokens_per_row=(1, 4, 12), contexts=(128, 384), repeats=2)


def time_forward(engine: SpecEngine, *, batch: int, q: int, context: int, repeats: int) -> float:
    """Median seconds of one engine forward: batch rows x q tokens (a chain) on `context` cached tokens."""
    cache = RowCache.for_model(engine.model, rows=batch, capacity=context + q)
    cache.lengths[:] = context
    lengths = torch.full((batch,), context, dtype=torch.long)
    slots = lengths[:, None] + torch.arange(q)[None, :]  # [B, q]
    view = context + q
    mask = (torch.arange(view)[None, None, :] <= slots[:, :, None])  # [B, q, S] causal over the context
    ids = torch.randint(0, engine.vocab_size, (batch, q), generator=torch.Generator().manual_seed(0))
    rows, cols = torch.nonzero(torch.ones(batch, q, dtype=torch.bool), as_tuple=True)
    times = []
    from dasrl.engine.attention import attention_implementation

    with torch.inference_mode(), attention_implementation(engine.model, engine.attn_name):
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            engine._forward(cache, ids=ids, pos=slots, slots=slots, mask=mask, view_len=view, rows=rows, cols=cols)
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
                            "kv_tokens": b * ctx, "seconds": s})
                tick()
    return out


def fit_latency(samples: list[dict]):
    from dasrl.policy.latency import LatencyModel

    n = np.array([s["n_tokens"] for s in samples], dtype=float)
    kv = np.array([s["kv_tokens"] for s in samples], dtype=float)
    secs = np.array([s["seconds"] for s in samples], dtype=float)
    model = LatencyModel.fit(n, secs, kv)
    return model, model.mean_rel_error(n, secs, kv)
