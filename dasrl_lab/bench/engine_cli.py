"""`dasrl bench engine` and `dasrl calibrate`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dasrl.atomic import write_json
from dasrl.drafter import MAX_DRAFT
from dasrl_lab.cli_args import (MAX_COUNT, between, dtype_name, json_option, model_option, output_file, preset_name,
                                rows_table, user_errors, write_json_out)
from dasrl_lab.cli_args import device as device_opt, temperature as temperature_opt, threads as threads_opt

ENGINE_COLUMNS = [("drafter", "drafter", "{}"), ("wall_s", "wall s", "{:.2f}"),
                  ("speedup_vs_none", "speedup", "{:.2f}x"), ("forward_passes", "forwards", "{}"),
                  ("new_tokens", "new tokens", "{}"), ("tokens_per_s", "tok/s", "{:.1f}"),
                  ("accepted_per_batch_forward", "accepted/fwd", "{:.2f}"), ("draft_s", "draft s", "{:.2f}"),
                  ("verify_s", "verify s", "{:.2f}"), ("exact", "exact", "{}")]
CALIBRATE_COLUMNS = [("batch", "batch", "{}"), ("tokens_per_row", "tokens/row", "{}"),
                     ("drafting", "drafting rows", "{}"), ("context", "context", "{}"), ("ms", "measured ms", "{:.1f}"),
                     ("predicted_ms", "predicted ms", "{:.1f}")]


def _token_bars(prog: Progress, *, hide_done: bool):
    """progress(name, total tokens) -> an engine on_step callback driving a new bar of `prog` by new tokens."""
    def progress(name: str, total: int):
        task = prog.add_task(name, total=total, batch=0)

        def on_step(info):
            prog.update(task, advance=info.new_tokens, batch=info.batch_size)
            if info.batch_size == info.finished:
                prog.update(task, completed=total, visible=not hide_done)
        return on_step
    return progress


def goals(rows: list[dict]) -> list[str]:
    """The long-tail issue's goals, as measured: DAS <= 0.6x none, >= 1.2x faster than global, and at least
    60% of the oracle's time saved."""
    by = {r["drafter"]: r for r in rows}
    if not {"none", "das", "global", "oracle"} <= by.keys():
        return []
    das, none, glob, orc = (by[k]["wall_s"] for k in ("das", "none", "global", "oracle"))
    saved = (none - das) / (none - orc) if none > orc else float("nan")
    lines = [f"DAS / none wall time: {das / none:.2f} (goal <= 0.60)",
             f"DAS speedup over global suffix: {glob / das:.2f}x (goal >= 1.20x)",
             f"DAS time saved / oracle time saved: {saved:.0%} (goal >= 60%)"]
    if "hf_generate" in by:
        lines.append(f"no-speculation engine vs HF generate: {by['hf_generate']['wall_s'] / none:.2f}x "
                     f"(goal >= 1.00x: not slower)")
    return lines


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @bench.command("engine")
    def bench_engine(
        json_out: Optional[Path] = json_option("Write the rows as JSON here."),
        quick: bool = typer.Option(False, help="16 rollouts x 384 tokens (a few minutes)."),
        model: str = model_option("Model name, local folder or hub id."),
        preset: str = typer.Option("math", help="Task preset: math (CHAMP, T=0.6) | enumerations (toy) | short.",
                                   callback=preset_name),
        temperature: Optional[float] = typer.Option(None, help="Sampling temperature (default: the preset's).",
                                                    callback=temperature_opt),
        policy: str = typer.Option("das", help="Policy of every speculative row: das (length classes from epoch 1, "
                                               "per-forward allowance) | fixed (--budget k)."),
        budget: Optional[int] = typer.Option(None, help="Draft budget k of the fixed policy.",
                                             callback=between(1, MAX_DRAFT)),
        problems: Optional[int] = typer.Option(None, help="Distinct prompts.", callback=between(1, MAX_COUNT)),
        group: Optional[int] = typer.Option(None, help="Rollouts per prompt per epoch.",
                                            callback=between(1, MAX_COUNT)),
        max_new_tokens: Optional[int] = typer.Option(None, help="Cap on each rollout's length.",
                                                     callback=between(1, MAX_COUNT)),
        threads: Optional[int] = typer.Option(None, help="torch threads (default: the cores available).",
                                              callback=threads_opt),
        device: Optional[str] = typer.Option(None, help="cpu | cuda | cuda:N (default: CUDA when available).",
                                             callback=device_opt),
    ) -> None:
        """Epoch-2 rollouts side by side: none, ngram, global, das, oracle, HF generate (docs/benchmarks.md)."""
        from dasrl_lab.bench.engine import EngineBenchConfig, run_engine_bench
        from dasrl_lab.models import load_model
        from dasrl_lab.tasks import preset as task_preset

        cfg = EngineBenchConfig.quick() if quick else EngineBenchConfig()
        overrides = {k: v for k, v in dict(budget=budget, problems=problems, group=group,
                                           max_new_tokens=max_new_tokens, threads=threads).items() if v is not None}
        if policy not in ("das", "fixed"):
            raise typer.BadParameter(f"--policy must be das or fixed, got {policy!r}")
        p = task_preset(preset)
        cfg = dataclasses.replace(cfg, policy=policy, preset=p.name, top_p=p.top_p,
                                  temperature=p.temperature if temperature is None else temperature, **overrides)
        console = Console(width=max(Console().width, 140))
        with user_errors("--model"):
            lm, tok = load_model(model, device=device)
        console.print(f"{model}: {cfg.problems} problems x {cfg.group} rollouts, <= {cfg.max_new_tokens} new "
                      f"tokens, T={cfg.temperature}, policy {cfg.policy}, threads {cfg.threads or 'all'}")
        with Progress(TextColumn("{task.description:>20}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("batch {task.fields[batch]:>3}"), TimeElapsedColumn(), console=console) as prog:
            rows = run_engine_bench(lm, tok, cfg, progress=_token_bars(prog, hide_done=False))
        console.print(rows_table("dasrl bench engine (epoch 2)", rows, ENGINE_COLUMNS))
        for line in goals(rows):
            console.print(line)
        write_json_out(json_out, rows, console)

    @app.command("calibrate")
    def calibrate_cmd(
        model: str = model_option("Model name, local folder or hub id."),
        out: Path = typer.Option(Path("latency.json"), "--out", help="Where to save the fitted LatencyModel.",
                                 callback=output_file),
        quick: bool = typer.Option(False, help="A smaller grid (under a minute)."),
        samples_json: Optional[Path] = typer.Option(None, "--samples", help="Also save the raw timings.",
                                                    callback=output_file),
        device: Optional[str] = typer.Option(None, help="cpu | cuda | cuda:N (default: CUDA when available).",
                                             callback=device_opt),
        dtype: str = typer.Option("fp32", help="fp32 or bf16 (weights).", callback=dtype_name),
    ) -> None:
        """Profile the engine forward over batch x tokens-per-row x context, fit the latency model, save it."""
        import torch

        from dasrl.engine import EngineConfig, SpecEngine, default_threads
        from dasrl_lab.bench.engine import CalibrationGrid, calibrate, fit_latency, packed_vs_padded
        from dasrl_lab.models import load_model

        grid = CalibrationGrid.quick() if quick else CalibrationGrid()
        console = Console()
        with user_errors("--model"):
            lm, tok = load_model(model, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32, device=device)
        engine = SpecEngine(lm, tok, EngineConfig(num_threads=default_threads()))
        n = len(grid.batch_sizes) * len(grid.tokens_per_row) * len(grid.contexts)
        with Progress(console=console, transient=True) as prog:
            task = prog.add_task("profiling forwards", total=n)
            samples = calibrate(engine, grid, tick=lambda: prog.advance(task))
        fitted, err = fit_latency(samples)
        shown = [{**s, "drafting": s.get("drafting_rows", s["batch"] if s["tokens_per_row"] > 1 else 0),
                  "ms": s["seconds"] * 1e3,
                  "predicted_ms": fitted.predict(s["n_tokens"], s["kv_tokens"], s["draft_kv_tokens"]) * 1e3}
                 for s in samples]
        console.print(rows_table(f"forward latency, {model}", shown, CALIBRATE_COLUMNS))
        console.print(f"c_base = {fitted.c_base * 1e3:.2f} ms, c_tok = {fitted.c_tok * 1e3:.3f} ms/token, "
                      f"c_other = {fitted.c_other * 1e6:.2f} µs per row-context token, c_draft_kv = "
                      f"{fitted.c_draft_kv * 1e6:.2f} µs per drafting-row context token, c_draft = "
                      f"{fitted.c_draft * 1e3:.2f} ms per forward with any drafting row; "
                      f"mean relative error {err:.1%}")
        fitted.save(out)
        console.print(f"wrote {out}")
        pv = packed_vs_padded(engine, fitted, repeats=grid.repeats)
        packed, pred = pv["packed_s"], pv["predicted_packed_s"]
        console.print(f"packed forward, {pv['rows']} rows (one drafting {pv['draft']}), context {pv['context']}: "
                      f"{packed * 1e3:.1f} ms measured, {pred * 1e3:.1f} ms predicted for its {pv['packed_tokens']} "
                      f"tokens ({packed / pred - 1:+.0%})")
        console.print(f"the padded shape [{pv['rows']}, {1 + pv['draft']}] ({pv['padded_tokens']} tokens): "
                      f"{pv['padded_s'] * 1e3:.1f} ms")
        if samples_json is not None:
            write_json(samples_json, samples)

    @bench.command("fidelity")
    def bench_fidelity(
        json_out: Optional[Path] = json_option("Write one row per (variant, T) here."),
        quick: bool = typer.Option(False, help="6 requests x 32 tokens, batch 1 and 4 (a few minutes)."),
        model: str = model_option("Model name, local folder or hub id."),
        dtype: str = typer.Option("fp32", help="fp32 or bf16 (weights and logits).", callback=dtype_name),
        problems: Optional[int] = typer.Option(None, help="Distinct prompts.", callback=between(1, MAX_COUNT)),
        group: Optional[int] = typer.Option(None, help="Requests per prompt.", callback=between(1, MAX_COUNT)),
        max_new_tokens: Optional[int] = typer.Option(None, help="Cap on each rollout's length.",
                                                     callback=between(1, MAX_COUNT)),
        temperature: Optional[list[float]] = typer.Option(None, help="Only these temperatures (repeatable).",
                                                          callback=temperature_opt),
        threads: Optional[int] = typer.Option(None, help="torch threads (default: the cores available).",
                                              callback=threads_opt),
        noise_seeds: int = typer.Option(16, help="Keys per row in the forward-shape flip measurement (0 = skip).",
                                        callback=between(0, 1024)),
        batch_invariant: bool = typer.Option(False, "--batch-invariant",
                                             help="EngineConfig(batch_invariant=True) for every engine variant."),
    ) -> None:
        """Seeded sampled rollouts vs plain decoding, token for token: every drafter and batch shape
        (docs/sampling.md, docs/benchmarks.md "## Fidelity")."""
        import torch

        from dasrl_lab.bench.fidelity import (FidelityConfig, run_fidelity, sampler_cost_rows, shape_flip_rows,
                                              totals)
        from dasrl_lab.models import load_model

        cfg = FidelityConfig.quick() if quick else FidelityConfig()
        overrides = {k: v for k, v in dict(problems=problems, group=group, max_new_tokens=max_new_tokens,
                                           threads=threads).items() if v is not None}
        overrides["batch_invariant"] = batch_invariant
        if temperature:
            overrides["temperatures"] = tuple(temperature)
        with user_errors():
            cfg = dataclasses.replace(cfg, **overrides)
        console = Console(width=max(Console().width, 150))
        with user_errors("--model"):
            lm, tok = load_model(model, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        console.print(f"{model} ({dtype}): {cfg.requests} requests, <= {cfg.max_new_tokens} new tokens, "
                      f"T={list(cfg.temperatures)}, top_p={cfg.top_p}, "
                      f"drafters {list(cfg.drafters)} (budget {cfg.budget}), batches {list(cfg.batch_sizes)}"
                      + (", batch-invariant engine" if cfg.batch_invariant else ""))
        with Progress(TextColumn("{task.description:>34}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("batch {task.fields[batch]:>3}"), TimeElapsedColumn(), console=console,
                      transient=True) as prog:
            rows = run_fidelity(lm, tok, cfg, progress=_token_bars(prog, hide_done=True))
            if noise_seeds > 0:
                task = prog.add_task("forward-shape flips", total=len(cfg.temperatures), batch=0)
                rows += shape_flip_rows(lm, tok, cfg, seeds=noise_seeds, tick=lambda: prog.advance(task))
            prog.add_task("sampler cost at batch 32", total=None, batch=32)
            rows += sampler_cost_rows(lm, tok, cfg)
        cols = [("sampler", "sampler", "{}"), ("variant", "variant", "{}"), ("temperature", "T", "{}"),
                ("requests", "seqs", "{}"), ("tokens", "tokens", "{}"), ("differing_sequences", "diff seqs", "{}"),
                ("differing_tokens", "diff tokens", "{}"), ("flip_rate", "flips/token", "{:.2e}"),
                ("first", "first diffs (req@pos gap)", "{}"), ("sampler_ms", "sampler ms", "{:.2f}"),
                ("sampler_share", "of step", "{:.1%}"), ("sampler_forward_share", "of forward", "{:.1%}")]
        shown = []
        for r in rows:
            firsts = [f"{d['request']}@{d['position']} {d['logit_gap']:.1e}" if d.get("logit_gap") is not None
                      else f"{d['request']}@{d['position']}" for d in r.get("first_diffs", [])[:3]]
            shown.append({**r, "first": " ".join(firsts) + (" ..." if len(r.get("first_diffs", [])) > 3 else "")})
        console.print(rows_table(f"dasrl bench fidelity ({model}, {dtype})", shown, cols))
        t = totals([r for r in rows if "first_diffs" in r])
        console.print(f"{t['differing_tokens']} differing tokens and {t['differing_sequences']} differing sequences "
                      f"in {t['tokens']} tokens compared (flip rate {t['flip_rate']:.2e} per exposed token)")
        write_json_out(json_out, rows, console)
