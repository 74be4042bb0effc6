"""`dasrl experiments [NAME ...] [--quick] [--out DIR] [--results FILE]`: reproduce the paper's figures."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich import box
from rich.table import Table

from dasrl_lab.cli_args import (MAX_COUNT, MAX_STEPS, between, input_file, json_option, model_option, output_file,
                             output_folder, preset_name, write_json_out)

REPLAYS = ("acceptance", "scope", "window")
"""The experiments that replay recorded rollouts (Figs. 4, 6, 7): --source can stand in for the collection run."""


def register(app: typer.Typer, bench: typer.Typer) -> None:
    from dasrl_lab.experiments.registry import EXPERIMENTS

    @app.command("experiments")
    def experiments_cmd(
        names: Optional[List[str]] = typer.Argument(None, help=f"Experiments to run (default: all): "
                                                               f"{', '.join(EXPERIMENTS)}."),
        quick: bool = typer.Option(False, help="Small sizes: the whole set in a few minutes (a smoke test)."),
        out: Optional[Path] = typer.Option(None, "--out", help="Folder for figures, numbers and the cached collection "
                                                               "run (default: runs/experiments; with --source, "
                                                               "runs/experiments-<its name>).", callback=output_folder),
        results: Optional[Path] = typer.Option(None, "--results", callback=output_file,
                                               help="Markdown to (re)generate from everything under --out "
                                                    "(default: docs/results.md; none with --source)."),
        no_results: bool = typer.Option(False, "--no-results", help="Do not write the markdown."),
        model: str = model_option("Model of the real rollouts."),
        preset: Optional[str] = typer.Option(None, help="Collection run: task set, math (default) | enumerations "
                                                        "| short.", callback=preset_name),
        steps: Optional[int] = typer.Option(None, help="Collection run: GRPO steps (default 24; quick 3).",
                                            callback=between(1, MAX_STEPS)),
        prompts: Optional[int] = typer.Option(None, help="Collection run: distinct problems (default 6; quick 3).",
                                              callback=between(1, MAX_COUNT)),
        samples: Optional[int] = typer.Option(None, help="Collection run: samples per problem (default 6; quick 3).",
                                              callback=between(1, MAX_COUNT)),
        max_new_tokens: Optional[int] = typer.Option(None, help="Collection run: tokens per sample (default 512; "
                                                                "quick 48).", callback=between(1, MAX_COUNT)),
        variant_every: Optional[int] = typer.Option(None, help="Collection run: engine variants every N steps "
                                                               "(default 8; quick 3).", callback=between(1, MAX_STEPS)),
        source: Optional[str] = typer.Option(None, help=f"Replay these recorded rollouts instead of the collection "
                                                        f"run's in {', '.join(REPLAYS)} (the only ones run then): "
                                                        f"'champ', or a trace / JSONL / Parquet / VeRL folder as "
                                                        f"`dasrl whatif` reads."),
        champ_model: str = typer.Option("GPT-4 Turbo",
                                        help="--source champ: whose solutions (default: the most text)."),
        problems: int = typer.Option(60, callback=between(0, 270),
                                     help="--source champ: the first N problems (0 = all)."),
    ) -> None:
        """Reproduce the DAS paper's measurements (docs/results.md): real rollouts on the embedded model,
        the simulator where a figure needs paper scale."""
        from dasrl_lab.experiments.base import Context, RunOptions, run_experiment
        from dasrl_lab.experiments.registry import select
        from dasrl_lab.experiments.report import write_results
        from dasrl_lab.sim.sources import ChampSource, SourceError

        try:
            chosen = select(list(names or (REPLAYS if source else [])))
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="NAME") from None
        if source is not None and any(e.name not in REPLAYS for e in chosen):
            raise typer.BadParameter(f"--source replays recorded rollouts in {', '.join(REPLAYS)} only, not in "
                                     f"{', '.join(e.name for e in chosen if e.name not in REPLAYS)}", param_hint="NAME")
        # A --source run writes beside, not over, the collection run's figures and docs/results.md.
        out = out or Path("runs/experiments" + (f"-{Path(source).name}" if source else ""))
        results = results or (None if source else Path("docs/results.md"))
        given = dict(steps=steps, prompts=prompts, samples=samples, max_new_tokens=max_new_tokens,
                     variant_every=variant_every, preset=preset)
        collect = tuple((k, v) for k, v in given.items() if v is not None)
        console = Console()
        command = "dasrl " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        ctx = Context(RunOptions(out=out, quick=quick, model=model, command=command, collect=collect, source=source,
                                 champ=ChampSource(model=champ_model, problems=problems)), console)
        if source is not None:  # bad input fails here, before anything is written
            try:
                with console.status(f"reading {source}"):
                    ctx.responses()
            except SourceError as e:
                raise typer.BadParameter(str(e), param_hint="'--source'") from None
        done, t0 = [], time.perf_counter()
        # The latency fit (experiment 6) runs first: the others' modeled times use it.
        chosen.sort(key=lambda e: e.name != "latency")
        for i, exp in enumerate(chosen):
            console.rule(f"[{i + 1}/{len(chosen)}] {exp.name}: {exp.title} ({exp.paper})")
            try:
                done.append(run_experiment(exp, ctx))
            except (ValueError, RuntimeError, FileNotFoundError) as e:
                typer.secho(f"error in experiment {exp.name!r}: {e}", fg="red", err=True)
                raise typer.Exit(2) from None
            console.print(f"{exp.name}: {done[-1]['comparison']}")
        table = Table(title=f"dasrl experiments{' (quick)' if quick else ''}: {time.perf_counter() - t0:.0f} s")
        for c in ("experiment", "paper", "headline numbers", "s"):
            table.add_column(c, justify="right" if c == "s" else "left")
        for d in done:
            head = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in list(d["summary"].items())[:4])
            table.add_row(d["name"], d["paper"], head, f"{d['seconds']:.0f}")
        console.print(table)
        console.print(f"figures and numbers: {out}/<name>/")
        if results is not None and not no_results:
            write_results(out, results)
            console.print(f"wrote {results}")

    @app.command("validate-sim")
    def validate_sim_cmd(
        run: Path = typer.Argument(..., help="A collection run folder (collect-<key>), or the --out folder of "
                                             "`dasrl experiments` holding one."),
        latency: Optional[Path] = typer.Option(None, help="Latency model JSON from `dasrl calibrate` on this "
                                                          "machine (default: the CPU prior, dasrl.policy.CPU_LATENCY).",
                                               callback=input_file),
        fit_overhead: bool = typer.Option(True, "--fit-overhead/--no-overhead",
                                          help="Add the step overhead beside the forwards, fitted on the run's "
                                               "other rollouts (the predicted one left out); --no-overhead: "
                                               "forwards only. "
                                               "Any --per-* value given replaces the fit."),
        per_forward: float = typer.Option(0.0, help=_help("per_forward"), callback=between(0, 60)),
        per_row_forward: float = typer.Option(0.0, help=_help("per_row_forward"), callback=between(0, 60)),
        per_draft_token: float = typer.Option(0.0, help=_help("per_draft_token"), callback=between(0, 60)),
        json_out: Optional[Path] = json_option("Write rows and summary here."),
        png: Optional[Path] = typer.Option(None, help="Write the predicted-vs-measured scatter here.",
                                           callback=output_file),
    ) -> None:
        """The simulator's predicted rollout time against the engine's measured one, per step and variant, on
        a recorded run (docs/simulator.md, "Validation")."""
        from dasrl_lab.experiments.validate import StepOverhead, find_collection, scatter, summary, validate
        from dasrl.policy import CPU_LATENCY, LatencyModel

        console = Console()
        try:
            folder = find_collection(run)
            lat = LatencyModel.load(latency) if latency is not None else CPU_LATENCY
            overhead = StepOverhead(per_forward, per_row_forward, per_draft_token)
            explicit = overhead != StepOverhead()
            with console.status("replaying") as status:
                rows = validate(folder, latency=lat, overhead=overhead if explicit or not fit_overhead else None,
                                progress=lambda name: status.update(f"replayed {name}"))
        except (OSError, ValueError) as e:
            typer.secho(f"error: {e}", fg="red", err=True)
            raise typer.Exit(2) from None
        source = str(latency) if latency is not None else "CPU default (not calibrated here)"
        oh_source = "given" if explicit else "fitted on the other rollouts" if fit_overhead else "none"
        table = Table(title=f"simulator vs engine: {folder.name}", caption=f"latency: {source}; step overhead: "
                      f"{oh_source}", box=box.SIMPLE_HEAD, pad_edge=False)
        for c in ("variant", "step", "pred s", "meas s", "error", "forwards", "drafted", "accepted", "replay"):
            table.add_column(c, justify="left" if c == "variant" else "right", min_width=9 if c == "variant" else None)
        for r in rows:
            table.add_row(r.variant, str(r.step), f"{r.predicted_s:.2f}", f"{r.measured_s:.2f}", f"{r.error:+.1%}",
                          str(r.forwards[1]), str(r.drafted[1]), str(r.accepted[1]),
                          "exact" if r.exact else "{}/{}/{}".format(r.forwards[0], r.drafted[0], r.accepted[0]),
                          style=None if r.exact else "red")
        console.print(table)
        summ = summary(rows)
        console.print(f"median |error| {summ['median_abs_error']:.1%}, worst {summ['max_abs_error']:.1%} over "
                      f"{summ['rows']} (variant, step) rows; replay exact on {summ['exact_rows']} of them "
                      f"(priced recorded forwards: median |error| {summ['median_abs_error_priced']:.1%})")
        write_json_out(json_out, {"run": str(folder), "latency": source, "latency_model": lat.to_dict(),
                                  "overhead": overhead.__dict__ if explicit else oh_source, "summary": summ,
                                  "rows": [r.to_dict() for r in rows]}, console)
        if png is not None:
            scatter(rows, png, title=f"simulator vs engine ({summ['rows']} steps x variants)")
            console.print(f"wrote {png}")


def _help(name: str) -> str:
    """The one-line docstring of a StepOverhead field (the CLI's help)."""
    import ast
    import inspect

    from dasrl_lab.experiments.validate import StepOverhead

    body = ast.parse(inspect.getsource(StepOverhead)).body[0].body
    return next((f"{b.value.value} (seconds)" for a, b in zip(body, body[1:]) if isinstance(a, ast.AnnAssign)
                 and a.target.id == name and isinstance(b, ast.Expr)), name)

