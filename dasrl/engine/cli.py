"""`dasrl bench engine` and `dasrl calibrate`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import typer

from dasrl.atomic import write_json
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

ENGINE_COLUMNS = [("drafter", "drafter", "{}"), ("wall_s", "wall s", "{:.2f}"),
                  ("speedup_vs_none", "speedup", "{:.2f}x"), ("forward_passes", "forwards", "{}"),
                  ("new_tokens", "new tokens", "{}"), ("tokens_per_s", "tok/s", "{:.1f}"),
                  ("accepted_per_forward", "accepted/fwd", "{:.2f}"), ("draft_s", "draft s", "{:.2f}"),
                  ("verify_s", "verify s", "{:.2f}"), ("exact", "exact", "{}")]


def _write_json(path: Path, obj: object) -> None:
    write_json(path, obj)


def _table(title: str, rows: list[dict], columns) -> Table:
    table = Table(title=title)
    for _, name, _ in columns:
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(*[fmt.format(r[k]) if r.get(k) is not None else "-" for k, _, fmt in columns])
    return table


def goals(rows: list[dict]) -> list[str]:
    """The issue's goals, as measured: DAS <= 0.5x none, >= 1.3x global, >= 75% of the oracle's speedup."""
    by = {r["drafter"]: r for r in rows}
    if not {"none", "das", "global", "oracle"} <= by.keys():
        return []
    das, none, glob, orc = (by[k]["wall_s"] for k in ("das", "none", "global", "oracle"))
    lines = [f"DAS / none wall time: {das / none:.2f} (goal <= 0.50)",
             f"DAS speedup over global suffix: {glob / das:.2f}x (goal >= 1.30x)",
             f"DAS speedup / oracle speedup: {(none / das) / (none / orc):.0%} (goal >= 75%)"]
    if "hf_generate" in by:
        lines.append(f"no-speculation engine vs HF generate: {by['hf_generate']['wall_s'] / none:.2f}x "
                     f"(goal >= 1.00x: not slower)")
    return lines


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @bench.command("engine")
    def bench_engine(
        json_out: Optional[Path] = typer.Option(None, "--json", help="Write the rows as JSON here."),
        quick: bool = typer.Option(False, help="16 rollouts x 128 tokens (a few minutes)."),
        model: str = typer.Option("smollm2-135m", help="Model name, local folder or hub id."),
        budget: Optional[int] = typer.Option(None, help="Fixed draft budget of the speculative rows."),
        problems: Optional[int] = typer.Option(None, help="Distinct prompts."),
        group: Optional[int] = typer.Option(None, help="Rollouts per prompt per epoch."),
        max_new_tokens: Optional[int] = typer.Option(None, help="Cap on each rollout's length."),
        threads: Optional[int] = typer.Option(None, help="torch threads (default: the cores available)."),
    ) -> None:
        """Epoch-2 rollouts side by side: none, ngram, global, das, oracle, HF generate (docs/benchmarks.md)."""
        from dasrl.engine.bench import EngineBenchConfig, run_engine_bench
        from dasrl.models import load_model

        cfg = EngineBenchConfig.quick() if quick else EngineBenchConfig()
        overrides = {k: v for k, v in dict(budget=budget, problems=problems, group=group,
                                           max_new_tokens=max_new_tokens, threads=threads).items()
                     if v is not None}
        for k, v in overrides.items():
            if v < 1:
                raise typer.BadParameter(f"--{k.replace('_', '-')} must be >= 1, got {v}")
        cfg = dataclasses.replace(cfg, **overrides)
        console = Console(width=max(Console().width, 140))
        lm, tok = load_model(model)
        console.print(f"{model}: {cfg.problems} problems x {cfg.group} rollouts, <= {cfg.max_new_tokens} new "
                      f"tokens, T={cfg.temperature}, budget {cfg.budget}, threads {cfg.threads or 'all'}")
        with Progress(TextColumn("{task.description:>20}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("batch {task.fields[batch]:>3}"), TimeElapsedColumn(), console=console) as prog:
            def progress(name: str, total: int):
                task = prog.add_task(name, total=total, batch=0)

                def on_step(info):
                    prog.update(task, advance=info.new_tokens, batch=info.batch_size)
                    if info.batch_size == info.finished:
                        prog.update(task, completed=total)
                return on_step

            rows = run_engine_bench(lm, tok, cfg, progress=progress)
        console.print(_table("dasrl bench engine (epoch 2)", rows, ENGINE_COLUMNS))
        for line in goals(rows):
            console.print(line)
        if json_out is not None:
            _write_json(json_out, rows)
            console.print(f"wrote {json_out}")

    @app.command("calibrate")
    def calibrate_cmd(
        model: str = typer.Option("smollm2-135m", help="Model name, local folder or hub id."),
        out: Path = typer.Option(Path("latency.json"), "--out", help="Where to save the fitted LatencyModel."),
        quick: bool = typer.Option(False, help="A smaller grid (under a minute)."),
        samples_json: Optional[Path] = typer.Option(None, "--samples", help="Also save the raw timings."),
    ) -> None:
        """Profile the engine forward over batch x tokens-per-row x context, fit the latency model, save it."""
        from dasrl.engine import SpecEngine
        from dasrl.engine.bench import CalibrationGrid, calibrate, fit_latency
        from dasrl.models import load_model

        grid = CalibrationGrid.quick() if quick else CalibrationGrid()
        console = Console()
        lm, tok = load_model(model)
        engine = SpecEngine(lm, tok)
        n = len(grid.batch_sizes) * len(grid.tokens_per_row) * len(grid.contexts)
        with Progress(console=console, transient=True) as prog:
            task = prog.add_task("profiling forwards", total=n)
            samples = calibrate(engine, grid, tick=lambda: prog.advance(task))
        fitted, err = fit_latency(samples)
        table = Table(title=f"forward latency, {model}")
        for name in ("batch", "tokens/row", "context", "measured ms", "predicted ms"):
            table.add_column(name, justify="right")
        for s in samples:
            pred = fitted.predict(s["n_tokens"], s["kv_tokens"])
            table.add_row(str(s["batch"]), str(s["tokens_per_row"]), str(s["context"]),
                          f"{s['seconds'] * 1e3:.1f}", f"{pred * 1e3:.1f}")
        console.print(table)
        console.print(f"c_base = {fitted.c_base * 1e3:.2f} ms, c_tok = {fitted.c_tok * 1e3:.3f} ms/token, "
                      f"c_other = {fitted.c_other * 1e6:.2f} µs per row-context token; "
                      f"mean relative error {err:.1%}")
        fitted.save(out)
        console.print(f"wrote {out}")
        if samples_json is not None:
            _write_json(samples_json, samples)
