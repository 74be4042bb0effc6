"""`dasrl bench ray`: real Ray rollout workers on this machine, routers side by side on a long-tail step."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from dasrl_lab.cli_args import (ACTOR_BYTES, MAX_COUNT, MAX_STEPS, between, json_option, max_actors, model_option,
                                user_errors, write_json_out)

console = Console()

# A long tail by construction: a few requests run to the limit, most stop early.
PROMPTS = (
    ("Hi", "short"),
    ("What is 2+2? Answer with the number only.", "short"),
    ("Name one primary color. One word.", "short"),
    ("Is the sky blue? Answer yes or no.", "short"),
    ("What is the capital of Italy? One word.", "short"),
    ("Write a long story about a dragon who learns to cook.", "long"),
    ("Explain in detail how a car engine works, step by step.", "long"),
    ("List the numbers from 1 to 60, separated by commas.", "long"),
)


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @bench.command("ray")
    def bench_ray(workers: int = typer.Option(2, help="Ray rollout actors (one CPU each).", callback=between(1, 256)),
                  samples: int = typer.Option(4, help="Samples per problem (GRPO group size).",
                                              callback=between(1, MAX_COUNT)),
                  steps: int = typer.Option(3, help="Steps per router; the first only fills the length history.",
                                            callback=between(2, MAX_STEPS)),
                  max_new_tokens: int = typer.Option(128, help="Generation limit per sample.",
                                                     callback=between(1, MAX_COUNT)),
                  temperature: float = typer.Option(0.6, help="Sampling temperature."),
                  routers: str = typer.Option("length,round_robin,random", help="Routers to compare."),
                  speculate: bool = typer.Option(True, help="DAS speculation on each worker."),
                  model: str = model_option("Model every worker loads."),
                  json_out: Optional[Path] = json_option("Write results as JSON.")) -> None:
        """Real Ray actors on localhost: the same long-tail steps (same seeds, shuffled problem order per
        step, as an RL data loader does) under each router; step makespan after the first step."""
        try:
            import ray
        except ImportError:
            raise typer.BadParameter("this bench needs Ray: pip install 'dasrl[ray]'") from None
        from dasrl.engine import SamplingParams
        from dasrl.integrations.ray import DistributedConfig, DistributedRolloutSession, init_local
        from dasrl.rollout import ROUTERS, SessionConfig
        from dasrl_lab.models import load_model, resolve_source
        from dasrl_lab.tasks import chat_ids

        names = [r.strip() for r in routers.split(",") if r.strip()]
        if bad := [n for n in names if n not in ROUTERS]:
            raise typer.BadParameter(f"unknown router {bad[0]!r}; valid routers: {', '.join(ROUTERS)}")
        if not names:
            raise typer.BadParameter(f"no router in {routers!r}", param_hint="'--routers'")
        most = max_actors()
        if workers * len(names) > most:  # every router's actors live side by side, each loading the model
            raise typer.BadParameter(
                f"{workers} workers x {len(names)} routers = {workers * len(names)} actors that each load the model; "
                f"this machine's memory holds about {most} (~{ACTOR_BYTES >> 20} MiB each): give --workers <= "
                f"{max(most // len(names), 1)} or fewer --routers", param_hint="'--workers'")
        with user_errors("--temperature"):
            sp = SamplingParams(temperature=temperature, top_p=0.95)  # checked before the model loads
        with user_errors("--model"):
            source = resolve_source(model)[0]  # the actors load a folder or hub id (an embedded name: its folder)
            _, tok = load_model(source)
        problems = [chat_ids(tok, text, None) for text, _ in PROMPTS]
        rng = np.random.default_rng(0)
        orders = [rng.permutation(len(problems)).tolist() for _ in range(steps)]
        # every router's actors live side by side (idle while another runs), and the routers take turns
        # within each step, so a change in machine load hits them alike
        if not ray.is_initialized():
            init_local(num_cpus=workers * len(names), log_to_driver=False)  # loopback only
        load = os.getloadavg()[0]
        results, outputs = {n: [] for n in names}, {n: [] for n in names}
        with Progress(console=console, transient=True) as prog:
            task = prog.add_task("ray", total=len(names) * steps)
            prog.update(task, description=f"starting {workers} workers x {len(names)} routers")
            sessions = {n: DistributedRolloutSession(source, DistributedConfig(
                workers=workers, router=n, session=SessionConfig(speculate=speculate))) for n in names}
            for step in range(steps):
                prompts = [problems[p] for p in orders[step] for _ in range(samples)]
                pids = [p for p in orders[step] for _ in range(samples)]
                for name in names[step % len(names):] + names[:step % len(names)]:
                    prog.update(task, description=f"step {step}: {name}")
                    sess = sessions[name]
                    got = sess.generate(prompts, problem_ids=pids, sampling=sp, max_new_tokens=max_new_tokens)
                    outputs[name].append([r.completion_ids for r in got])
                    h = sess.history[-1]
                    results[name].append({
                        "step": step, "makespan_s": h.rollout_s, "worker_s": h.worker_s,
                        "worker_rows": h.worker_rows, "accepted": h.accepted, "new_tokens": h.new_tokens,
                        "imbalance": max(h.worker_s.values()) / float(np.mean(list(h.worker_s.values())))})
                    sess.end_step()
                    prog.advance(task)
            for sess in sessions.values():
                sess.shutdown()
        ray.shutdown()
        identical = all(o == outputs[names[0]] for o in outputs.values())
        t = Table(title=f"{workers} Ray workers, {len(problems)} problems x {samples}, <= {max_new_tokens} tokens "
                        f"(load {load:.1f} at start)")
        for c in ("router", "makespan s (steps 1..)", "per step", "imbalance", "vs round_robin"):
            t.add_column(c, justify="right")
        total = {n: sum(r["makespan_s"] for r in rows[1:]) for n, rows in results.items()}
        for n, rows in results.items():
            ref = total.get("round_robin")
            t.add_row(n, f"{total[n]:.1f}", " ".join(f"{r['makespan_s']:.1f}" for r in rows[1:]),
                      f"{np.mean([r['imbalance'] for r in rows[1:]]):.2f}",
                      f"{1 - total[n] / ref:+.1%}" if ref else "-")
        console.print(t)
        console.print(f"outputs identical across routers: {identical}")
        write_json_out(json_out, {"workers": workers, "samples": samples, "steps": steps,
                                  "max_new_tokens": max_new_tokens, "temperature": temperature,
                                  "speculate": speculate, "load_at_start": load, "identical": identical,
                                  "makespan_after_warmup_s": total, "steps_detail": results}, console)
