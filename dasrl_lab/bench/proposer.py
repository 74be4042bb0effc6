"""`dasrl bench proposer`: the host seconds the vLLM proposer (BatchDrafter.propose: index the new tokens,
count what was accepted, price, draft, trim) takes per engine step, by batch size, without vLLM.

vLLM runs the proposer on the host between two forwards (custom_class turns async scheduling off), so on
a GPU these seconds add to every step: a 7B forward on an H100 is ~6-20 ms. The workload: B / 4 prompts x
4 siblings re-sampling an earlier step's responses (random token ids, 8 tokens changed per row), each row
emitting its accepted draft and one more token; step 1 (with step 0 as history) is timed while every row
is live (the full batch: the case where a fixed per-row cost weighs most).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import typer

from dasrl.integrations.vllm import BatchDrafter, VLLMDrafterConfig


@dataclass(frozen=True)
class ProposerBenchConfig:
    """One `dasrl bench proposer` run."""

    batches: tuple[int, ...] = (16, 64, 256)
    """Live requests per engine step."""
    length: int = 200
    """Tokens of every response."""
    prompt_len: int = 60
    """Tokens of every prompt."""
    k: int = 8
    """num_speculative_tokens."""

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 4 or any(b % 4 for b in self.batches):
            raise ValueError(f"batches must be multiples of 4 (4 siblings per prompt), got {self.batches}")
        if self.length < 8 or self.prompt_len < 1 or self.k < 1:
            raise ValueError(f"need length >= 8, prompt_len >= 1, k >= 1, got {self.length}, {self.prompt_len}, {self.k}")


def run_one(cfg: ProposerBenchConfig, batch: int, policy: dict, seed: int = 0) -> dict:
    """One policy at one batch size: median host ms per propose call at the full batch, drafted, accepted."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1000, 30000, cfg.prompt_len).tolist() for _ in range(batch // 4)]
    answers = [rng.integers(1000, 30000, cfg.length).tolist() for _ in range(batch // 4)]
    width = cfg.prompt_len + cfg.length + cfg.k + 1
    d = BatchDrafter(VLLMDrafterConfig.from_dict(policy), num_speculative_tokens=cfg.k, max_model_len=width)
    times: list[float] = []
    for step in range(2):
        truth = []
        for i in range(batch):  # a sibling's re-sample: its prompt's answer with 8 tokens changed
            r = np.array(answers[i // 4])
            r[rng.integers(0, cfg.length, 8)] = rng.integers(1000, 30000, 8)
            truth.append(r.tolist())
        ids = [f"s{step}r{i}" for i in range(batch)]
        rows = {rid: list(prompts[i // 4]) for i, rid in enumerate(ids)}
        new = {rid: [truth[i][0]] for i, rid in enumerate(ids)}
        row_of = {rid: i for i, rid in enumerate(ids)}
        while ids:
            for rid in ids:
                rows[rid].extend(new[rid])
            buf = np.zeros((len(ids), width), np.int32)  # [B, width] vLLM's token rows
            for i, rid in enumerate(ids):
                buf[i, :len(rows[rid])] = rows[rid]
            t0 = time.perf_counter()
            out = d.propose(req_ids=ids, prompt_lens=[cfg.prompt_len] * len(ids), token_rows=buf,
                            num_tokens=[len(rows[r]) for r in ids], sampled=[new[r] for r in ids])
            if step == 1 and len(ids) == batch:
                times.append(time.perf_counter() - t0)
            live = []
            for rid, draft in zip(ids, out):
                tr, g = truth[row_of[rid]], len(rows[rid]) - cfg.prompt_len
                a = 0
                while a < len(draft) and g + a < cfg.length and draft[a] == tr[g + a]:
                    a += 1
                new[rid] = tr[g:g + a + 1]
                if g + len(new[rid]) < cfg.length:
                    live.append(rid)
            ids = live
    return {"batch": batch, "policy": policy["policy"], "host_ms_per_step": round(float(np.median(times)) * 1e3, 3),
            "steps_timed": len(times), "drafted": d.stats.drafted, "accepted": d.stats.accepted,
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def policies(latency: Optional[Path]) -> list[dict]:
    """fixed k (every row drafts), das priced by `latency` (a latency.json; None: the shipped 7B-H100 profile,
    written to a temporary file, as the proposer reads one). Plain vLLM runs no proposer: 0 host seconds."""
    if latency is None:
        import tempfile

        from dasrl_lab.sim import profiles

        prof = next(p for p in profiles.shipped() if p.name == "qwen2.5-7b-h100")
        latency = Path(tempfile.mkdtemp()) / "qwen2.5-7b-h100.json"
        prof.latency.save(latency)
    return [{"policy": "fixed", "max_spec_factor": 0.0},
            {"policy": "das", "latency": str(latency), "latency_floor": False}]


COLUMNS = [("batch", "B", "{}"), ("policy", "policy", "{}"), ("host_ms_per_step", "host ms/step", "{:.3f}"),
           ("drafted", "drafted", "{}"), ("accepted", "accepted", "{}"), ("load_avg_1m", "load", "{:.2f}")]


def register(app: typer.Typer, bench: typer.Typer) -> None:
    from dasrl.atomic import write_json
    from dasrl_lab.cli_args import json_option, rows_table
    from rich.console import Console

    @bench.command("proposer")
    def bench_proposer(
        batches: str = typer.Option("16,64,256", help="Comma-separated batch sizes (multiples of 4)."),
        latency: Optional[Path] = typer.Option(None, help="latency.json pricing das (default: the shipped "
                                                          "7B-H100 profile)."),
        repeats: int = typer.Option(3, min=1, help="Runs per (batch, policy); the table keeps the median."),
        json_out: Optional[Path] = json_option("Write the rows as JSON here."),
    ) -> None:
        """Host seconds per engine step of the vLLM proposer (no vLLM): fixed and das, by batch size."""
        try:
            cfg = ProposerBenchConfig(batches=tuple(int(b) for b in batches.split(",")))
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        rows, pols = [], policies(latency)
        for b in cfg.batches:
            for pol in pols:
                runs = [run_one(cfg, b, pol, seed=r) for r in range(repeats)]
                best = sorted(runs, key=lambda r: r["host_ms_per_step"])[len(runs) // 2]
                rows.append(best | {"host_ms_repeats": [r["host_ms_per_step"] for r in runs]})
        console = Console()
        console.print(rows_table("dasrl bench proposer", rows, COLUMNS))
        if json_out is not None:
            write_json(json_out, rows)
            console.print(f"wrote {json_out}")
