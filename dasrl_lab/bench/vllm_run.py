"""One method of `dasrl bench vllm`, in its own process (vLLM's engine and KV cache are per process):

    python -m dasrl_lab.bench.vllm_run CONFIG.json METHOD OUT.json       # one run, then exit
    python -m dasrl_lab.bench.vllm_run CONFIG.json METHOD --serve FD     # many runs, one engine

`--serve` builds the engine once (no engine start per run); each stdin line {"temperature", "repeat", "out"}
resets the drafter's history and vLLM's prefix cache, runs `steps` RL steps, writes the result to "out"
and "done <out>" to file descriptor FD. The parent (vllm_bench.py) compares methods; this module imports
nothing of it.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

from dasrl.integrations.vllm import DASWorkerExtension

METHODS = ("none", "ngram", "suffix", "das", "das-static", "das-fixed")
"""das-static: das with a constant acceptance floor (latency_floor off), the ablation of the fitted one."""

QUESTIONS = [
    "Explain step by step how to compute 17 times 23.",
    "Write a short story about a robot who learns to paint.",
    "List five prime numbers and explain why each one is prime.",
    "Describe how a bicycle works, part by part.",
    "What is photosynthesis? Explain it to a ten-year-old.",
    "Give three tips for writing clear Python code, with an example for each.",
    "Tom has 12 apples and buys 7 more, then eats 3. How many apples does he have? Show your work.",
    "Summarise the water cycle in a few sentences.",
    "Write a haiku about the sea, then explain its imagery.",
    "How do you make a cup of tea? Give numbered steps.",
    "Explain the difference between a list and a tuple in Python.",
    "A train travels 60 km in 45 minutes. What is its speed in km/h? Explain.",
]


TASK_SETS = ("math", "enumerations", "long-tail", "questions")  # long-tail: the old name of enumerations
"""math, enumerations: dasrl_lab.tasks' presets (their prompts, answers and stop lines); questions: QUESTIONS."""


def bench_questions(n: int) -> list[str]:
    if not 1 <= n <= len(QUESTIONS):
        raise ValueError(f"--prompts must be in [1, {len(QUESTIONS)}], got {n}")
    return QUESTIONS[:n]


_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted",
             # prompt tokens looked up in vLLM's prefix cache and found there (kv_cache_manager.record_prefix_cache_stats):
             # their difference is the prompt tokens the engine computed, what the replay's prefill is priced by
             "vllm:prefix_cache_queries": "prefix_cache_queries", "vllm:prefix_cache_hits": "prefix_cache_hits"}


def speculative_config(method: str, k: int) -> dict | None:
    """vLLM's speculative_config of a bench method (None = no speculation)."""
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    if method.startswith("das"):
        return {"method": "custom_class", "model": "dasrl.integrations.vllm.DASProposer", "num_speculative_tokens": k}
    raise ValueError(f"unknown vLLM bench method {method!r}; valid: {', '.join(METHODS)}")


def _counters(llm) -> dict[str, int]:
    found = {_COUNTERS[m.name]: int(getattr(m, "value", 0) or 0) for m in llm.get_metrics() if m.name in _COUNTERS}
    return dict.fromkeys(_COUNTERS.values(), 0) | found


def workload(tok, cfg: dict) -> tuple[list[list[int]], list, tuple[str, ...]]:
    """Prompt token ids, answers (None: no reward) and stop lines of the config's task set: a preset's are
    built as the demo builds them (Preset.tasks, chat_ids, Preset.stop_lines)."""
    from dasrl_lab.tasks import chat_ids, preset

    if cfg.get("tasks", "questions") == "questions":
        qs = bench_questions(cfg["prompts"])
        return [[int(x) for x in chat_ids(tok, q, None)] for q in qs], [None] * len(qs), ()
    p = preset(cfg["tasks"])
    tasks = p.tasks(cfg["prompts"], seed=cfg["seed"])
    return [[int(x) for x in chat_ids(tok, t.question, t.system)] for t in tasks], [t.answer for t in tasks], p.stop_lines


def generate(llm, prompts: list[list[int]], params: list, stop, step_s: list[float] | None = None,
             step_rows: list[tuple[int, int, int]] | None = None) -> list[list[int]]:
    """Every request's output token ids. stop (a LineStop, or None): a request ends with the newline that
    closes a line holding a stop phrase, as in the engine; vLLM's stop strings cannot say that, so the
    requests are stepped here and such a request aborted as vLLM's own stop strings end one. With stop,
    `step_s` gets the wall seconds up to each engine step's output and `step_rows` per engine step (requests
    with output, requests whose first token it is, tokens output): vLLM's core starts on the first request
    while the rest are being added, so the prefill ends with the step that gives the last its first token."""
    if stop is None:
        return [list(map(int, o.outputs[0].token_ids)) for o in llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)]
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    rids = [f"dasrl-{next(_REQUEST_IDS)}" for _ in prompts]
    out: dict[str, list[int]] = {rid: [] for rid in rids}
    for rid, ids, sp in zip(rids, prompts, params):
        sp = sp.clone()
        sp.output_kind = RequestOutputKind.DELTA  # each step's new tokens (LLM.generate's FINAL_ONLY hides them)
        engine.add_request(rid, {"prompt_token_ids": ids}, sp)
    stopped: set[str] = set()
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if outputs and step_s is not None:  # a step() with no output yet (the engine core runs apart) is not one
            step_s.append(time.perf_counter() - t)
            t = time.perf_counter()
        if outputs and step_rows is not None:
            step_rows.append((sum(1 for o in outputs if o.outputs[0].token_ids),
                              sum(1 for o in outputs if o.outputs[0].token_ids and not out[o.request_id]),
                              sum(len(o.outputs[0].token_ids) for o in outputs)))
        for o in outputs:
            if o.request_id in stopped:
                continue
            toks = out[o.request_id]
            for tid in o.outputs[0].token_ids:  # not `t`: that is the step timer
                toks.append(int(tid))
                if stop.hit(toks):
                    stopped.add(o.request_id)
                    if not o.finished:
                        engine.abort_request([o.request_id])
                    break
    return [out[rid] for rid in rids]


_REQUEST_IDS = itertools.count()


class BenchWorkerExtension(DASWorkerExtension):
    """DASWorkerExtension plus dasrl_fix_cpu_sampling (vllm_cpu_fix.apply() in the worker, for any method) and
    dasrl_bench_reset (every (temperature, repeat) run starts cold, whatever the method)."""

    def dasrl_fix_cpu_sampling(self) -> bool:
        from dasrl_lab.bench import vllm_cpu_fix

        return vllm_cpu_fix.apply()

    def dasrl_bench_reset(self) -> str:
        runner = getattr(self, "model_runner", None)
        drafter = getattr(runner, "drafter", None)
        if hasattr(drafter, "reset"):  # DASProposer
            drafter.reset()
        elif hasattr(drafter, "suffix_cache"):  # vLLM's SuffixDecodingProposer: a fresh SuffixDecodingCache
            drafter.__init__(runner.vllm_config)
        return type(drafter).__name__


def build(cfg: dict, method: str):
    from transformers import AutoTokenizer
    from vllm import LLM

    from dasrl_lab.models import ensure_hf_folder

    model = str(ensure_hf_folder(cfg["model"])) if not Path(cfg["model"]).exists() else cfg["model"]
    extra = {"dasrl": {"policy": "fixed" if method == "das-fixed" else "das", "window": cfg["window"],
                       "latency_floor": method != "das-static", "counting": cfg.get("counting", False),
                       **cfg.get("dasrl", {})}} if method.startswith("das") else {}
    kw = {"num_gpu_blocks_override": cfg["kv_blocks"]} if cfg.get("kv_blocks") else {}
    if cfg.get("block_size"):
        kw["block_size"] = cfg["block_size"]
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=cfg["max_model_len"], seed=cfg["seed"],
              speculative_config=speculative_config(method, cfg["k"]), disable_log_stats=False,
              additional_config=extra, worker_extension_cls="dasrl_lab.bench.vllm_run.BenchWorkerExtension",
              **kw)
    init_s = time.perf_counter() - t0
    vc = llm.llm_engine.vllm_config
    llm.dasrl_engine = {"block_size": vc.cache_config.block_size,
                        "enable_prefix_caching": bool(vc.cache_config.enable_prefix_caching),
                        "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens}
    if cfg.get("fix_cpu_sampling", True):  # every method's worker, vLLM's own included: all on correct sampling
        llm.collective_rpc("dasrl_fix_cpu_sampling")
    return llm, AutoTokenizer.from_pretrained(model), init_s


def run(cfg: dict, method: str, llm=None, tok=None, init_s: float = 0.0) -> dict:
    from vllm import SamplingParams

    from dasrl.engine import LineStop
    from dasrl_lab.tasks import reward

    if llm is None:
        llm, tok, init_s = build(cfg, method)
    prompts, answers, stop_lines = workload(tok, cfg)
    stop = LineStop(stop_lines, tok) if stop_lines else None
    steps = []
    for step in range(cfg["steps"]):
        reqs, params = [], []
        for p, ids in enumerate(prompts):
            for s in range(cfg["samples"]):
                reqs.append(ids)
                seed = cfg["seed"] * 1_000_003 + step * 10_007 + p * 101 + s if cfg.get("seeded") else None
                params.append(SamplingParams(temperature=cfg["temperature"], top_p=1.0, max_tokens=cfg["max_tokens"],
                                             seed=seed))
        before, pre = _counters(llm), _preemptions(llm)
        engine_s: list[float] = []
        engine_rows: list[tuple[int, int, int]] = []
        t = time.perf_counter()
        tokens = generate(llm, reqs, params, stop, engine_s, engine_rows)
        wall = time.perf_counter() - t
        after = _counters(llm)
        rewards = [None if answers[i // cfg["samples"]] is None else
                   float(reward(tok.decode(t, skip_special_tokens=True), answers[i // cfg["samples"]]))
                   for i, t in enumerate(tokens)]
        row = {"step": step, "wall_s": wall, "gen_tokens": sum(map(len, tokens)),
               **{k: after[k] - before[k] for k in after}, "preemptions": _preemptions(llm) - pre,
               "outputs": tokens, "rewards": rewards, "engine_steps_s": engine_s,
               "engine_steps_rows": engine_rows}
        row["tokens_per_s"] = row["gen_tokens"] / wall if wall > 0 else 0.0
        steps.append(row)
        print(f"[{method}] step {step}: {wall:.2f} s, {row['gen_tokens']} tokens, drafted {row['draft_tokens']}, "
              f"accepted {row['accepted']}", file=sys.stderr, flush=True)
    result = {"method": method, "init_s": init_s, "speculative_config": speculative_config(method, cfg["k"]),
              "engine": getattr(llm, "dasrl_engine", None), "steps": steps, "prompts": prompts, "samples": cfg["samples"]}  # request i = prompt i // samples
    if method.startswith("das"):
        result["dasrl_stats"] = llm.collective_rpc("dasrl_stats")[0]
    return result


def _preemptions(llm) -> int:
    return sum(int(getattr(m, "value", 0) or 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def serve(cfg: dict, method: str, fd: int) -> None:
    import os

    llm, tok, init_s = build(cfg, method)
    # One short pass over the workload's prompts before the first timed run: the engine's first forwards of
    # these shapes pay one-time costs (a first prefill took 3.1 s against ~0.3 s later) that no step has in RL.
    run(dict(cfg, steps=1, max_tokens=2, temperature=0.0), method, llm, tok, init_s)
    os.write(fd, b"ready\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        llm.collective_rpc("dasrl_bench_reset")
        # every run starts cold in vLLM's prefix cache too: the prompts an earlier run left there (or evicted)
        # would otherwise set how much of a run's prefill the engine computes
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache between runs (requests still running?)")
        res = run(dict(cfg, temperature=cmd["temperature"]), method, llm, tok, init_s)
        res.update(temperature=cmd["temperature"], repeat=cmd["repeat"])
        Path(cmd["out"]).write_text(json.dumps(res))
        os.write(fd, f"done {cmd['out']}\n".encode())


def main(argv: list[str]) -> None:
    if len(argv) == 4 and argv[2] == "--serve":
        serve(json.loads(Path(argv[0]).read_text()), argv[1], int(argv[3]))
        return
    if len(argv) != 3:
        raise SystemExit("usage: python -m dasrl_lab.bench.vllm_run CONFIG.json METHOD OUT.json "
                         "| CONFIG.json METHOD --serve FD")
    cfg = json.loads(Path(argv[0]).read_text())
    Path(argv[2]).write_text(json.dumps(run(cfg, argv[1])))


if __name__ == "__main__":
    main(sys.argv[1:])
