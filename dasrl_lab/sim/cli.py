"""`dasrl simulate`, `dasrl trace info|synth` and `dasrl bench ablation` (the paper's Figure 12)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from dasrl.drafter import MAX_DRAFT, StoreConfig
from dasrl.policy import LatencyModel
from dasrl_lab.cli_args import (MAX_COUNT, MAX_SCALE, MAX_STEPS, MAX_WORKERS, MIN_SCALE, between, input_file,
                                json_option, output_file, write_json_out)
from dasrl_lab.policies import ALL_POLICIES as POLICIES
from dasrl_lab.trace import Response, TraceError, read_trace, summarize, write_trace
from dasrl_lab.sim.simulator import BATCH_MODES, DRAFTERS, SimConfig, SimResult, StepStats, group_steps, simulate
from dasrl_lab.sim.workloads import CPU_LATENCY, WORKLOADS, generate, get_workload

console = Console()
PAPER_ABLATION = 0.15  # Figure 12: distribution-aware vs unbounded drafting, makespan


# Options every simulator command shares, checked as typer parses them (dasrl_lab.cli_args).
SCALE = dict(callback=between(MIN_SCALE, MAX_SCALE), help="Scale the workload's lengths.")
STEPS = dict(callback=between(1, MAX_STEPS), help="Override the number of steps.")
WARMUP = dict(callback=between(0, MAX_STEPS))
MAX_TOKENS = 100_000_000
"""Tokens a generated workload may hold (about 8 bytes each in memory; long-tail holds ~1.2M)."""


def _workload(workload: Optional[str]):
    if workload is None:
        return None
    try:
        return get_workload(workload)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="'--workload'") from None


def _load_responses(trace: Optional[Path], workload: Optional[str], scale: float,
                    steps: Optional[int], warmup: int = 0) -> tuple[list[Response], LatencyModel | None, str]:
    """The responses of a trace or a generated workload; `warmup` must leave at least one step (checked
    before a workload is generated)."""
    if (trace is None) == (workload is None):
        raise typer.BadParameter("give a TRACE file or --workload NAME (one of them)")
    if trace is not None:
        if steps is not None or scale != 1.0:
            raise typer.BadParameter("--steps and --scale apply to a --workload, not to a TRACE")
        try:
            responses = read_trace(trace).responses()
        except TraceError as e:
            raise typer.BadParameter(str(e), param_hint="TRACE") from None
        n = len({int(r.step) for r in responses})
        source, lat = str(trace), None
    else:
        w = _workload(workload)
        cfg = w.config.scaled(scale) if scale != 1.0 else w.config
        if steps is not None:
            cfg = replace(cfg, steps=steps)
        size = cfg.problems * cfg.samples * cfg.steps * (cfg.prompt_len + cfg.median_len)
        if size > MAX_TOKENS:
            raise typer.BadParameter(f"workload {workload} at --scale {scale} and {cfg.steps} steps would hold "
                                     f"~{size:.2g} tokens, more than {MAX_TOKENS:.0e}: lower --scale or --steps")
        n, source, lat = cfg.steps, f"workload {workload} (scale {scale})", w.latency
    if warmup >= n:
        raise typer.BadParameter(f"{warmup} leaves none of the {n} steps of {source} to measure "
                                 f"(must be < {n})", param_hint="'--warmup'")
    if trace is None:
        with console.status(f"generating workload {workload}"):
            responses = generate(cfg)
    return responses, lat, source


def _check(name: str, valid, what: str) -> None:
    if name not in valid:
        raise typer.BadParameter(f"unknown {what} {name!r}; valid {what}s: {', '.join(valid)}")


def _run_all(runs: dict[str, tuple[str, str]], responses, cfg: SimConfig, k: int) -> dict[str, SimResult]:
    """Simulate each (drafter, policy) run with a progress bar over steps."""
    n_steps = len(group_steps(responses))
    out = {}
    with Progress(console=console, transient=True) as prog:
        task = prog.add_task("simulating", total=n_steps * len(runs))
        for label, (d, p) in runs.items():
            prog.update(task, description=f"simulating {label}")
            out[label] = simulate(responses, drafter=d, policy=p, config=cfg,
                                  policy_kw={"k": k} if p == "fixed" else None,
                                  progress=lambda i: prog.advance(task))
    return out


def _table(title: str, rows: dict[str, StepStats], baseline: str | None = None) -> Table:
    """A row per run, with its speedup over `baseline`'s makespan; without a baseline, a row per step."""
    t = Table(title=title)
    speedup = ("speedup",) if baseline else ()
    for c in ("run" if baseline else "step", "makespan s", *speedup, "forwards", "proposed", "accepted",
              "acc/row-fwd", "eff. batch"):
        t.add_column(c, justify="left" if c == "run" else "right")
    for label, s in rows.items():
        cells = [f"{rows[baseline].makespan / s.makespan:.2f}x" if s.makespan else "-"] if baseline else []
        t.add_row(label, f"{s.makespan:.2f}", *cells, str(s.forwards), str(s.proposed), str(s.accepted),
                  f"{s.accepted_per_row_forward:.2f}", f"{s.effective_batch:.1f}")
    return t


def _totals(results: dict[str, SimResult]) -> dict[str, StepStats]:
    return {label: r.total for label, r in results.items()}


def register(app: typer.Typer, bench: typer.Typer) -> None:
    trace_app = typer.Typer(help="Rollout traces (Parquet): summarise or synthesise.", no_args_is_help=True)
    app.add_typer(trace_app, name="trace")

    @app.command("simulate")
    def simulate_cmd(
        trace: Optional[Path] = typer.Argument(None, help="Trace file or directory (or use --workload)."),
        workload: Optional[str] = typer.Option(None, help=f"Synthetic workload: {', '.join(WORKLOADS)}."),
        drafter: str = typer.Option("das", help=f"Drafter: {', '.join(DRAFTERS)}."),
        policy: str = typer.Option("das", help=f"Budget policy: {', '.join(POLICIES)}."),
        k: int = typer.Option(4, help="Cap of the fixed policy.", callback=between(0, MAX_DRAFT)),
        latency: Optional[Path] = typer.Option(None, callback=input_file,
                                               help="LatencyModel JSON (dasrl calibrate); default: the "
                                                    "workload's assumption, else SimConfig's."),
        batch_mode: str = typer.Option("static", help=f"{' | '.join(BATCH_MODES)}: static waves or refill freed rows."),
        max_batch: int = typer.Option(0, help="Rows per forward at most (0 = the whole step).",
                                      callback=between(0, MAX_COUNT)),
        window: int = typer.Option(16, help="History window (steps) of the windowed drafters.",
                                   callback=between(1, MAX_STEPS)),
        warmup: int = typer.Option(0, help="Leading steps replayed but left out of the totals.", **WARMUP),
        scale: float = typer.Option(1.0, **SCALE),
        steps: Optional[int] = typer.Option(None, **STEPS),
        json_out: Optional[Path] = json_option("Write results as JSON."),
    ) -> None:
        """Replay a trace (or a synthetic workload) with a drafter and policy, against no speculation and
        the oracle drafter under the same policy."""
        _check(drafter, DRAFTERS, "drafter")
        _check(policy, POLICIES, "policy")
        w = _workload(workload)
        try:  # every setting checked before the trace is read or the workload generated
            lat = LatencyModel.load(latency) if latency else (w.latency if w else SimConfig().latency)
            cfg = SimConfig(latency=lat, batch_mode=batch_mode, max_batch=max_batch, warmup=warmup,
                            store=StoreConfig(window=window))
        except (ValueError, OSError) as e:
            raise typer.BadParameter(str(e)) from None
        responses, _, source = _load_responses(trace, workload, scale, steps, warmup)
        runs = {f"{drafter}/{policy}": (drafter, policy), "none": ("none", "none"),
                f"oracle/{policy}": ("oracle", policy)}
        results = _run_all(runs, responses, cfg, k)
        main = results[f"{drafter}/{policy}"]
        console.print(_table(f"per step: {main.drafter}/{main.policy}", {str(s.step): s for s in main.steps}))
        console.print(_table(f"{source}: {len(responses)} responses, latency {lat}", _totals(results), "none"))
        lat_source = (f"calibrated ({latency})" if latency else
                      f"the {workload} workload's assumption, not measured" if w else "SimConfig's default, assumed")
        console.print(f"latency: {lat_source}. Expected error: the simulator against the engine's measured rollout "
                      f"time on this CPU is in docs/simulator.md, \"Validation\" (dasrl validate-sim).")
        write_json_out(json_out, {"source": source, "latency": lat.to_dict(), "latency_source": lat_source, "config": {
            "batch_mode": batch_mode, "max_batch": max_batch, "window": window, "warmup": warmup},
            "runs": {k2: r.to_dict() for k2, r in results.items()}}, console)

    @trace_app.command("info")
    def info_cmd(file: Path = typer.Argument(..., help="Trace file or directory.")) -> None:
        """Steps, problems and the response-length distribution of a trace."""
        try:
            s = summarize(read_trace(file))
        except TraceError as e:
            raise typer.BadParameter(str(e)) from None
        t = Table(title=str(file))
        t.add_column("field")
        t.add_column("value", justify="right")
        for key, v in s.items():
            t.add_row(key, f"{v:.1f}" if isinstance(v, float) else str(v))
        console.print(t)

    @trace_app.command("synth")
    def synth_cmd(out: Path = typer.Argument(..., help="Parquet file to write.", callback=output_file),
                  workload: str = typer.Option("long-tail", help=f"One of: {', '.join(WORKLOADS)}."),
                  scale: float = typer.Option(1.0, **SCALE),
                  steps: Optional[int] = typer.Option(None, **STEPS)) -> None:
        """Write a synthetic workload as a trace."""
        responses, _, source = _load_responses(None, workload, scale, steps)
        write_trace(out, responses, vocab_size=get_workload(workload).config.vocab)
        console.print(f"wrote {out}: {len(responses)} responses from {source}")

    @bench.command("ablation")
    def ablation_cmd(workload: str = typer.Option("long-tail", help=f"One of: {', '.join(WORKLOADS)}."),
                     drafter: str = typer.Option("das", help=f"Drafter: {', '.join(DRAFTERS)}."),
                     scale: float = typer.Option(1.0, **SCALE),
                     steps: Optional[int] = typer.Option(None, **STEPS),
                     warmup: int = typer.Option(1, help="Leading steps that only fill the history.", **WARMUP),
                     json_out: Optional[Path] = json_option("Write results as JSON.")) -> None:
        """Figure 12 of the paper: unbounded drafting vs the distribution-aware policy (and the closed-form
        optimum, fixed and no speculation) on a long-tail workload."""
        _check(drafter, DRAFTERS, "drafter")
        responses, lat, source = _load_responses(None, workload, scale, steps, warmup)
        cfg = SimConfig(latency=lat, warmup=warmup)
        runs = {"unbounded": (drafter, "unbounded"), "das": (drafter, "das"), "optimal": (drafter, "optimal"),
                "fixed(4)": (drafter, "fixed"), "none": ("none", "none")}
        results = _run_all(runs, responses, cfg, 4)
        console.print(_table(f"ablation on {source} (drafter {drafter})", _totals(results), "unbounded"))
        gain = 1 - results["das"].total.makespan / results["unbounded"].total.makespan
        console.print(f"distribution-aware vs unbounded: makespan {-gain:+.1%} (paper, Figure 12: "
                      f"{-PAPER_ABLATION:+.0%})")
        write_json_out(json_out, {"source": source, "latency": lat.to_dict(), "drafter": drafter,
                                  "das_vs_unbounded": gain, "paper": PAPER_ABLATION,
                                  "runs": {k2: r.to_dict() for k2, r in results.items()}}, console)

    @bench.command("routing")
    def routing_cmd(workload: str = typer.Option("long-tail", help=f"One of: {', '.join(WORKLOADS)}."),
                    workers: str = typer.Option("2,4,8,16", help="Worker counts to try, comma-separated."),
                    drafter: str = typer.Option("das", help=f"Drafter on each worker: {', '.join(DRAFTERS)}."),
                    policy: str = typer.Option("das", help=f"Budget policy on each worker: {', '.join(POLICIES)}."),
                    scale: float = typer.Option(1.0, **SCALE),
                    steps: Optional[int] = typer.Option(None, **STEPS),
                    warmup: int = typer.Option(1, help="Leading steps that only fill the length history.", **WARMUP),
                    seed: int = typer.Option(0, help="Seed of the random router.", callback=between(0, 2**32 - 1)),
                    latency: str = typer.Option("workload", help="Forward cost: workload (its assumption) | cpu "
                                                                 "(this project's CPU engine) | a latency JSON."),
                    json_out: Optional[Path] = json_option("Write results as JSON."),
                    plot: Optional[Path] = typer.Option(None, help="Write a PNG of makespan vs workers.",
                                                        callback=output_file)) -> None:
        """Many rollout workers: length-aware routing (LPT on the predicted makespan) vs round-robin vs
        random, each problem's samples kept on one worker, simulated step makespan."""
        from dasrl.rollout import ROUTERS
        from dasrl_lab.sim.workers import simulate_routed

        _check(drafter, DRAFTERS, "drafter")
        _check(policy, POLICIES, "policy")
        try:
            counts = [int(x) for x in workers.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter(f"--workers must be comma-separated integers, got {workers!r}") from None
        if not counts or min(counts) < 1 or max(counts) > MAX_WORKERS:
            raise typer.BadParameter(f"--workers needs counts from 1 to {MAX_WORKERS}, got {workers!r}")
        try:
            lat = ({"workload": _workload(workload).latency, "cpu": CPU_LATENCY}.get(latency)
                   or LatencyModel.load(latency))
        except (ValueError, OSError) as e:
            raise typer.BadParameter(f"{latency!r}: {e}", param_hint="'--latency'") from None
        responses, _, source = _load_responses(None, workload, scale, steps, warmup)
        cfg = SimConfig(latency=lat, warmup=warmup)
        results: dict[int, dict] = {}
        with Progress(console=console, transient=True) as prog:
            task = prog.add_task("simulating", total=len(counts) * len(ROUTERS))
            for n in counts:
                for name in ROUTERS:
                    prog.update(task, description=f"{n} workers, {name}")
                    results.setdefault(n, {})[name] = simulate_routed(
                        responses, workers=n, router=name, drafter=drafter, policy=policy, config=cfg, seed=seed)
                    prog.advance(task)
        t = Table(title=f"routing on {source} ({drafter}/{policy} on each worker; makespan after warmup)")
        for c in ("workers", *(f"{r} s" for r in ROUTERS), "length vs round_robin", "length vs random",
                  "imbalance (length / rr / random)"):
            t.add_column(c, justify="right")
        for n, rs in results.items():
            m = {k2: r.makespan for k2, r in rs.items()}
            imb = " / ".join(f"{r.to_dict()['mean_imbalance']:.2f}" for r in rs.values())
            t.add_row(str(n), *(f"{m[r]:.1f}" for r in ROUTERS), f"{1 - m['length'] / m['round_robin']:+.1%}",
                      f"{1 - m['length'] / m['random']:+.1%}", imb)
        console.print(t)
        write_json_out(json_out, {"source": source, "latency": lat.to_dict(), "drafter": drafter, "policy": policy,
                                  "warmup": warmup, "workers": {str(n): {k2: r.to_dict() for k2, r in rs.items()}
                                                                for n, rs in results.items()}}, console)
        if plot:
            from dasrl_lab.plots import pyplot, save_figure

            fig, ax = pyplot().subplots(figsize=(6, 4), dpi=100)
            for name in ROUTERS:
                ax.plot(counts, [results[n][name].makespan for n in counts], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("rollout workers")
            ax.set_ylabel("simulated makespan (s, after warmup)")
            ax.set_title(f"routing on {workload}")
            ax.legend()
            fig.tight_layout()
            save_figure(fig, plot, tight=False)
            console.print(f"wrote {plot}")
