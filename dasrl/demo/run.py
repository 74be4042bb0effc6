"""The demo loop: each step, the same prompts are rolled out by a baseline session (plain decoding) and a
DAS session (history drafter + length-aware policy) from the same weights and seeds; the outputs must be
identical; the policy is updated once with GRPO on them; both sessions roll their windows.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Sequence

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dasrl.demo.grpo import GRPOConfig, GRPOTrainer, advantages
from dasrl.demo.tasks import SYSTEM, Task, make_tasks, reward
from dasrl.engine.sampling import SamplingParams
from dasrl.rollout.session import Rollout, RolloutSession, SessionConfig
from dasrl.rollout.trace import Response, TraceWriter


@dataclass(frozen=True)
class DemoConfig:
    """What `dasrl demo` runs."""

    model: str = "smollm2-135m"
    """Model: the embedded default, a local HF folder, or a hub id (online only)."""
    steps: int = 4
    """GRPO steps (every prompt comes back each step)."""
    prompts: int = 4
    """Distinct problems."""
    samples: int = 8
    """Samples per problem (GRPO group size)."""
    max_new_tokens: int = 128
    """Generation limit per sample."""
    temperature: float = 0.6
    """Sampling temperature."""
    top_p: float = 0.95
    """Nucleus sampling mass."""
    policy: str = "das"
    """Budget policy of the DAS session."""
    seed: int = 0
    """Run seed (tasks and sample seeds)."""
    out: str = "runs"
    """Folder for the report (runs/<timestamp>/)."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """Policy update."""


@dataclass
class StepRow:
    step: int
    baseline_s: float
    das_s: float
    speedup: float
    accepted_per_forward: float
    das_forwards: int
    baseline_forwards: int
    drafted: int
    accepted: int
    mean_reward_baseline: float
    mean_reward_das: float
    identical: bool
    train_s: float
    loss: float


def chat_ids(tokenizer, question: str) -> list[int]:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def step_batch(tokenizer, tasks: Sequence[Task], samples: int) -> tuple[list[list[int]], list[int], list[int]]:
    """One RL step's batch: (prompt ids, answers, problem ids), each task repeated `samples` times."""
    prompts = [chat_ids(tokenizer, t.question) for t in tasks for _ in range(samples)]
    answers = [t.answer for t in tasks for _ in range(samples)]
    pids = [i for i in range(len(tasks)) for _ in range(samples)]
    return prompts, answers, pids


def score(tokenizer, outs: Sequence[Rollout], answers: Sequence[int], *, step: int) -> list[float]:
    """The reward of each rollout; a reward function that raises is reported with the sample it broke on."""
    rs = []
    for o, ans in zip(outs, answers):
        text = tokenizer.decode(o.completion_ids, skip_special_tokens=True)
        try:
            rs.append(float(reward(text, ans)))
        except Exception as e:  # a user's reward function: say which sample broke it
            raise RuntimeError(f"reward function raised on step {step}, problem {o.problem_id}, sample "
                               f"{o.sample}: {type(e).__name__}: {e}") from e
    return rs


def trace_rows(step: int, outs: Sequence[Rollout], rewards: Sequence[float]) -> list[Response]:
    """The step's rollouts as trace rows (TraceWriter.write_step)."""
    return [Response(step=step, problem_id=o.problem_id, sample=o.sample,
                     prompt_ids=np.asarray(o.prompt_ids, np.int32),
                     response_ids=np.asarray(o.completion_ids, np.int32), reward=r,
                     finish_reason=o.finish_reason or "length", logprobs=np.asarray(o.logprobs, np.float32))
            for o, r in zip(outs, rewards)]


def run_demo(cfg: DemoConfig, *, console: Console | None = None) -> Path:
    import torch

    from dasrl.models import load_model

    console = console or Console()
    tasks = make_tasks(cfg.prompts, seed=cfg.seed)
    if cfg.steps < 1 or cfg.samples < 1:
        raise ValueError(f"--steps and --samples must be >= 1, got {cfg.steps} and {cfg.samples}")
    with console.status(f"loading {cfg.model}"):
        model, tok = load_model(cfg.model, dtype=torch.float32)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out) / datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=False)
    sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p)
    base = RolloutSession(model, tok, SessionConfig(speculate=False, seed=cfg.seed))
    das = RolloutSession(model, tok, SessionConfig(speculate=True, policy=cfg.policy, seed=cfg.seed))
    trainer = GRPOTrainer(model, cfg.grpo)
    prompts, answers, pids = step_batch(tok, tasks, cfg.samples)
    trace = TraceWriter(out / "trace")
    rows: list[StepRow] = []
    console.print(f"GRPO demo: {cfg.prompts} prompts x {cfg.samples} samples, {cfg.steps} steps, "
                  f"<= {cfg.max_new_tokens} new tokens, T={cfg.temperature}; report in {out}")
    try:
        for step in range(cfg.steps):
            rows.append(_one_step(step, cfg=cfg, base=base, das=das, trainer=trainer, prompts=prompts,
                                  answers=answers, pids=pids, tok=tok, sampling=sampling, trace=trace,
                                  console=console))
            r = rows[-1]
            console.print(f"step {step}: baseline {r.baseline_s:.1f}s  DAS {r.das_s:.1f}s  speedup "
                          f"{r.speedup:.2f}x  tokens/forward {r.accepted_per_forward:.2f}  reward "
                          f"{r.mean_reward_baseline:.3f} / {r.mean_reward_das:.3f}  identical={r.identical}")
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted: keeping the {len(rows)} finished steps")
    from dasrl.demo.report import write_report

    write_report(out, cfg=cfg, rows=rows, base=base, das=das)
    _final_table(rows, console)
    console.print(f"report: {out / 'report.md'}")
    return out


def _one_step(step: int, *, cfg: DemoConfig, base: RolloutSession, das: RolloutSession, trainer: GRPOTrainer,
              prompts, answers, pids, tok, sampling, trace: TraceWriter, console: Console) -> StepRow:
    results = {}
    order = [("baseline", base), ("DAS", das)] if step % 2 == 0 else [("DAS", das), ("baseline", base)]
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[live]} live rows"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        for name, sess in order:
            task = progress.add_task(f"step {step} {name:8s}", total=len(prompts), live=len(prompts))

            def tick(info, task=task):
                progress.update(task, completed=len(prompts) - info.batch_size, live=info.batch_size)

            t0 = time.perf_counter()
            results[name] = (sess.generate(prompts, problem_ids=pids, sampling=sampling,
                                           max_new_tokens=cfg.max_new_tokens, on_step=tick),
                             time.perf_counter() - t0)
    (b_out, b_s), (d_out, d_s) = results["baseline"], results["DAS"]
    identical = all(x.completion_ids == y.completion_ids for x, y in zip(b_out, d_out))
    rewards = {name: score(tok, outs, answers, step=step) for name, outs in (("baseline", b_out), ("DAS", d_out))}
    t0 = time.perf_counter()
    loss = trainer.step(prompts, [o.completion_ids for o in d_out], advantages(rewards["DAS"], pids))
    train_s = time.perf_counter() - t0
    trace.write_step(trace_rows(step, d_out, rewards["DAS"]))
    base.end_step()
    das.end_step()
    h = das.history[-1]
    return StepRow(step=step, baseline_s=b_s, das_s=d_s, speedup=b_s / d_s, das_forwards=h.forwards,
                   baseline_forwards=base.history[-1].forwards, accepted_per_forward=h.accepted_per_forward,
                   drafted=h.drafted, accepted=h.accepted, mean_reward_baseline=float(np.mean(rewards["baseline"])),
                   mean_reward_das=float(np.mean(rewards["DAS"])), identical=identical, train_s=train_s, loss=loss)


def _final_table(rows: list[StepRow], console: Console) -> None:
    t = Table(title="dasrl demo: baseline vs DAS, same seeds")
    for c in ("step", "baseline s", "DAS s", "speedup", "tokens/forward", "drafted", "accepted", "reward (base)",
              "reward (DAS)", "identical"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r.step), f"{r.baseline_s:.1f}", f"{r.das_s:.1f}", f"{r.speedup:.2f}x",
                  f"{r.accepted_per_forward:.2f}", str(r.drafted), str(r.accepted), f"{r.mean_reward_baseline:.3f}",
                  f"{r.mean_reward_das:.3f}", "yes" if r.identical else "NO")
    later = [r for r in rows if r.step > 0]
    if later:
        b, d = sum(r.baseline_s for r in later), sum(r.das_s for r in later)
        t.add_row("2nd visit on", f"{b:.1f}", f"{d:.1f}", f"{b / d:.2f}x", "", "", "", "", "", "")
    console.print(t)


def rows_json(rows: list[StepRow]) -> list[dict]:
    return [asdict(r) for r in rows]

