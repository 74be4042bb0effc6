"""The demo loop: each step, the same prompts are rolled out by a baseline session (plain decoding) and a
DAS session (history drafter + length-aware policy) from the same weights and seeds; the outputs must be
identical; the policy is updated once with GRPO on them; both sessions roll their windows."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Sequence

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dasrl.engine import SamplingParams
from dasrl.rollout import Rollout, RolloutSession, SessionConfig
from dasrl_lab.demo.grpo import GRPOConfig, GRPOTrainer, advantages
from dasrl_lab.tasks import PRESETS, Task, chat_ids, preset, reward
from dasrl_lab.trace import Response, TraceWriter


@dataclass(frozen=True)
class DemoConfig:
    """What `dasrl demo` runs."""

    preset: str = "math"
    """Task set and sizes: math (CHAMP statements, T = 0.6) | enumerations (a toy long tail) | short (arithmetic)."""
    model: str = "smollm2-135m"
    """Model: the embedded default, a local HF folder, or a hub id (online only)."""
    steps: int = 3
    """GRPO steps (every prompt comes back each step; 3 keeps `make demo` near 10 minutes on two cores)."""
    prompts: int = PRESETS["math"].prompts
    """Distinct problems."""
    samples: int = PRESETS["math"].samples
    """Samples per problem (GRPO group size)."""
    max_new_tokens: int = PRESETS["math"].max_new_tokens
    """Generation limit per sample."""
    temperature: float = PRESETS["math"].temperature
    """Sampling temperature."""
    top_p: float = PRESETS["math"].top_p
    """Nucleus sampling mass."""
    counting: bool = False
    """Counting drafts in the DAS session (drafter/counting.py: numbered patterns; for enumerations)."""
    policy: str = "das"
    """Budget policy of the DAS session."""
    seed: int = 0
    """Run seed (tasks and sample seeds)."""
    out: str = "runs"
    """Folder for the report (runs/<timestamp>/)."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """Policy update."""

    @staticmethod
    def for_preset(name: str, **overrides) -> "DemoConfig":
        """The preset's sizes, then every override that is not None."""
        p = preset(name)
        base = DemoConfig(preset=p.name, prompts=p.prompts, samples=p.samples, max_new_tokens=p.max_new_tokens,
                          temperature=p.temperature, top_p=p.top_p)
        return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})

    def validate(self) -> None:
        """Every check that needs no model: bad settings fail before any work and before any folder."""
        from dasrl.policy import POLICIES

        preset(self.preset)
        for name in ("steps", "prompts", "samples", "max_new_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1, got {v!r}")
        SamplingParams(temperature=self.temperature, top_p=self.top_p)
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; valid policies: {', '.join(POLICIES)}")


@dataclass
class StepRow:
    step: int
    baseline_s: float
    das_s: float
    speedup: float
    tokens_per_row_forward: float
    das_forwards: int
    baseline_forwards: int
    drafted: int
    accepted: int
    mean_reward_baseline: float
    mean_reward_das: float
    identical: bool
    train_s: float
    loss: float
    at_limit_fraction: float = 0.0
    """Samples that hit max_new_tokens."""
    tail_share: float = 0.0
    """Fraction of the baseline's rollout time spent with <= 25% of the rows live."""
    median_tokens: float = 0.0
    max_tokens: int = 0
    drafted_by_class: dict = field(default_factory=dict)
    """DAS drafted tokens per length class (where the allowance went)."""
    kl_to_initial: float = 0.0
    """KL(initial policy || policy after this step's update) per token, on step 0's first two samples per problem."""


class KLProbe:
    """Step 0's first two samples of each problem, with their log-probabilities under the initial weights;
    kl() estimates KL(initial || now) per token on them (one forward over a few sequences)."""

    def __init__(self, trainer: GRPOTrainer, prompts, outs: Sequence[Rollout], samples: int) -> None:
        keep = [i for i in range(len(outs)) if i % samples < 2]
        self.trainer = trainer
        self.prompts, self.completions = [prompts[i] for i in keep], [outs[i].completion_ids for i in keep]
        self.initial = trainer.logprobs(self.prompts, self.completions)

    def kl(self) -> float:
        now = self.trainer.logprobs(self.prompts, self.completions)
        return float(np.mean(self.initial - now)) if len(now) else 0.0


def tail_share(curve: Sequence[tuple[float, int]], rows: int, *, live_fraction: float = 0.25) -> float:
    """Fraction of a rollout's time spent with at most live_fraction of its rows live. curve: (seconds
    since start, live rows) per engine step, the rows of step i live from curve[i-1]'s time to curve[i]'s."""
    if len(curve) < 2:
        return 0.0
    t, live = np.array([c[0] for c in curve]), np.array([c[1] for c in curve])
    dt = np.diff(t)  # step i (i >= 1) took dt[i-1] with live[i] rows
    return float(dt[live[1:] <= live_fraction * rows].sum() / max(t[-1] - t[0], 1e-12))


def step_batch(tokenizer, tasks: Sequence[Task], samples: int) -> tuple[list[list[int]], list[int], list[int]]:
    """One RL step's batch: (prompt ids, answers, problem ids), each task repeated `samples` times."""
    prompts = [chat_ids(tokenizer, t.question, t.system) for t in tasks for _ in range(samples)]
    answers = [t.answer for t in tasks for _ in range(samples)]
    pids = [i for i in range(len(tasks)) for _ in range(samples)]
    return prompts, answers, pids


def score(tokenizer, outs: Sequence[Rollout], answers: Sequence, *, step: int) -> list[float]:
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

    from dasrl_lab.models import load_model

    console = console or Console()
    cfg.validate()
    tasks = preset(cfg.preset).tasks(cfg.prompts, seed=cfg.seed)
    with console.status(f"loading {cfg.model}"):
        model, tok = load_model(cfg.model, dtype=torch.float32)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out) / datetime.now().strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=False)
    sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p)
    base = RolloutSession(model, tok, SessionConfig(speculate=False, seed=cfg.seed))
    das = RolloutSession(model, tok, SessionConfig(speculate=True, policy=cfg.policy, seed=cfg.seed,
                                                   counting=cfg.counting))
    trainer = GRPOTrainer(model, cfg.grpo)
    prompts, answers, pids = step_batch(tok, tasks, cfg.samples)
    trace = TraceWriter(out / "trace")
    rows: list[StepRow] = []
    kl: KLProbe | None = None  # made at step 0
    responses: list[tuple[int, list[Response]]] = []  # the DAS rollouts of each step, for the GPU prediction
    console.print(f"GRPO demo ({cfg.preset}): {cfg.prompts} prompts x {cfg.samples} samples, {cfg.steps} steps, "
                  f"<= {cfg.max_new_tokens} new tokens, T={cfg.temperature}; report in {out}")
    try:
        for step in range(cfg.steps):
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
                                                   max_new_tokens=cfg.max_new_tokens, on_step=tick,
                                                   stop_lines=preset(cfg.preset).stop_lines),
                                     time.perf_counter() - t0)
            (b_out, b_s), (d_out, d_s) = results["baseline"], results["DAS"]
            rewards = {name: score(tok, outs, answers, step=step) for name, outs in (("baseline", b_out),
                                                                                      ("DAS", d_out))}
            t0 = time.perf_counter()
            kl = kl or KLProbe(trainer, prompts, d_out, cfg.samples)
            loss = trainer.step(prompts, [o.completion_ids for o in d_out], advantages(rewards["DAS"], pids))
            moved = kl.kl()
            train_s = time.perf_counter() - t0  # the KL probe's forwards included
            responses.append((step, trace_rows(step, d_out, rewards["DAS"])))
            trace.write_step(responses[-1][1])
            base.end_step()
            das.end_step()
            h, lengths = das.history[-1], np.array([len(o.completion_ids) for o in b_out])
            r = StepRow(
                step=step, baseline_s=b_s, das_s=d_s, speedup=b_s / d_s, das_forwards=h.forwards,
                baseline_forwards=base.history[-1].forwards, tokens_per_row_forward=h.tokens_per_row_forward,
                drafted=h.drafted, accepted=h.accepted, mean_reward_baseline=float(np.mean(rewards["baseline"])),
                mean_reward_das=float(np.mean(rewards["DAS"])), train_s=train_s, loss=loss,
                identical=all(x.completion_ids == y.completion_ids for x, y in zip(b_out, d_out)),
                at_limit_fraction=float(np.mean([o.finish_reason == "length" for o in b_out])),
                tail_share=tail_share(base.history[-1].batch_curve, len(prompts)),
                median_tokens=float(np.median(lengths)), max_tokens=int(lengths.max()),
                drafted_by_class=dict(h.drafted_by_class), kl_to_initial=moved)
            rows.append(r)
            console.print(f"step {step}: baseline {r.baseline_s:.1f}s  DAS {r.das_s:.1f}s  speedup "
                          f"{r.speedup:.2f}x  tokens/forward {r.tokens_per_row_forward:.2f}  reward "
                          f"{r.mean_reward_baseline:.3f} / {r.mean_reward_das:.3f}  KL {r.kl_to_initial:.2g}  "
                          f"at limit {r.at_limit_fraction:.0%}  identical={r.identical}")
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted: keeping the {len(rows)} finished steps")
    from dasrl_lab.demo.report import gpu_prediction, write_report

    with console.status("pricing the rollouts on a GPU profile"):
        gpu = gpu_prediction(responses[:len(rows)], das, tok) if rows else None
    write_report(out, cfg=cfg, rows=rows, base=base, das=das, gpu=gpu)
    _final_table(rows, console)
    console.print(f"report: {out / 'report.md'}")
    return out


def _final_table(rows: list[StepRow], console: Console) -> None:
    """Fits an 80-column terminal."""
    from rich import box

    t = Table(title="dasrl demo: baseline vs DAS, same seeds", box=box.SIMPLE_HEAD, padding=(0, 1))
    for c in ("step", "base s", "DAS s", "speedup", "tok/fwd", "acc %", "reward b/DAS", "same"):
        t.add_column(c, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(str(r.step), f"{r.baseline_s:.1f}", f"{r.das_s:.1f}", f"{r.speedup:.2f}x",
                  f"{r.tokens_per_row_forward:.2f}", f"{100 * r.accepted / max(r.drafted, 1):.0f}",
                  f"{r.mean_reward_baseline:.2f}/{r.mean_reward_das:.2f}", "yes" if r.identical else "NO")
    later = [r for r in rows if r.step > 0]
    if later:
        b, d = sum(r.baseline_s for r in later), sum(r.das_s for r in later)
        t.add_row("2nd+", f"{b:.1f}", f"{d:.1f}", f"{b / d:.2f}x", "", "", "", "")
    console.print(t)
