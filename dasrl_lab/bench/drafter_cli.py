"""`dasrl bench drafter`: side-by-side figures for the native history drafter and arctic-inference."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.progress import Progress

from dasrl.drafter import MAX_DRAFT, DraftStore, StoreConfig
from dasrl_lab.bench import drafter as B
from dasrl_lab.cli_args import between, json_option, rows_table, user_errors, write_json_out
from dasrl_lab.drafters.arctic import ArcticDrafter, arctic_status


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure(name: str, make: Callable[[], object], problems: list[B.Problem], cfg: B.DrafterBenchConfig,
             tick: Callable[[], None]) -> dict:
    rss0 = _rss()
    drafter = make()
    tokens = sum(len(p.prompt) + len(h) for p in problems for h in p.history)
    t0 = time.perf_counter()
    for i, p in enumerate(problems):
        for h in p.history:
            drafter.add_rollout(i, p.prompt, h)
    build_s = time.perf_counter() - t0
    drafter.end_step()
    row = {"drafter": name, "load_avg_1m": os.getloadavg()[0], "protocol_build_us_per_token": build_s / tokens * 1e6,
           "rss_bytes_per_token": max(0, _rss() - rss0) / tokens}
    row |= B.decode(drafter, problems, budget=cfg.budget, tokens=cfg.decode_tokens, on_request=tick)
    row |= B.batched_call(drafter, problems, batch=cfg.batch, budget=cfg.budget)
    return row


def run_bench(cfg: B.DrafterBenchConfig, *, console: Console) -> list[dict]:
    drafters: dict[str, Callable[[], object]] = {"dasrl": lambda: DraftStore(StoreConfig(mode="problem+request"))}
    rows: list[dict] = []
    if (absent := arctic_status()) is None:
        drafters["arctic"] = ArcticDrafter
    else:
        console.print(f"[yellow]arctic-inference: absent ({absent}); `make arctic` installs it. dasrl rows only")
        rows.append({"drafter": "arctic", "absent": absent})
    workloads = list(B.runs(cfg))
    total = sum(len(w[2]) for w in workloads) * len(drafters)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("decoding fresh rollouts", total=total)
        for size, kind, problems in workloads:
            native = B.index_costs(problems) | B.core_costs(problems, batch=cfg.batch, budget=cfg.budget)
            for name, make in drafters.items():
                row = {"mutation": kind, "corpus_tokens": size}
                row |= _measure(name, make, problems, cfg, lambda: progress.advance(task))
                if name == "dasrl":
                    row |= native
                else:  # arctic's own build cost is the protocol path; its memory is only visible as RSS
                    row |= {"build_us_per_token": row["protocol_build_us_per_token"],
                            "bytes_per_token": row["rss_bytes_per_token"], "indexed_tokens": native["indexed_tokens"]}
                rows.append(row)
    return rows


COLUMNS = [("drafter", "drafter", "{}"), ("mutation", "mutation", "{}"), ("corpus_tokens", "corpus", "{:,}"),
           ("speculate_us_p50", "spec p50 µs", "{:.2f}"), ("speculate_us_p99", "spec p99 µs", "{:.2f}"),
           ("batched_speculate_us_per_request", "batched µs/req", "{:.2f}"),
           ("batched_speculate_us_per_request_core", "core µs/req", "{:.2f}"),
           ("batched_speculate_cpu_us_per_request", "batched cpu µs/req", "{:.2f}"),
           ("append_us_per_token", "append µs/tok", "{:.3f}"),
           ("append_us_per_token_core", "core µs/tok", "{:.3f}"),
           ("append_cpu_us_per_token", "append cpu µs/tok", "{:.3f}"),
           ("observe_single_us_per_token", "1-req observe µs/tok", "{:.3f}"), ("build_us_per_token", "build µs/tok", "{:.3f}"),
           ("bytes_per_token", "bytes/tok", "{:.0f}"), ("accepted_per_step", "accepted/step", "{:.2f}")]


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @bench.command("drafter")
    def bench_drafter(
        json_out: Optional[Path] = json_option("Write the rows as JSON here."),
        quick: bool = typer.Option(False, help="Only the 100k-token corpus (under a minute)."),
        budget: int = typer.Option(B.DrafterBenchConfig.budget, help="Draft budget per decoding step.",
                                   callback=between(1, MAX_DRAFT)),
        seed: int = typer.Option(0, help="Workload seed."),
    ) -> None:
        """The history drafter vs arctic-inference on an RL-like workload (see docs/benchmarks.md)."""
        with user_errors():
            cfg = B.DrafterBenchConfig(budget=budget, seed=seed,
                                       corpus_sizes=(100_000,) if quick else B.DrafterBenchConfig.corpus_sizes)
        console = Console(width=max(Console().width, 170))  # the table is wide; never truncate numbers
        rows = run_bench(cfg, console=console)
        console.print(rows_table("dasrl bench drafter", [r for r in rows if "absent" not in r], COLUMNS))
        write_json_out(json_out, rows, console)
