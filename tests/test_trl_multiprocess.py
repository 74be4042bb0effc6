"""TRL's GRPOTrainer on two CPU processes (torch.distributed.run, gloo) with dasrl rollouts: no two
completions of a GRPO group are the same (TRL's RepeatSampler spreads a group over the processes, which
all run with the same seed), and the two processes together produce the very completions one process
produces for the same global batch. On the tiny Llama over SmolLM2's tokenizer (what is checked is how TRL
spreads the groups and seeds over the processes; on SmolLM2 the three processes took ~60 CPU-s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
RUN = Path(__file__).with_name("_trl_grpo_run.py")


def _run(out: Path, procs: int, model: Path) -> list[dict]:
    out.mkdir()
    cmd = [sys.executable, str(RUN), str(out), str(model)] if procs == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", str(RUN), str(out),
        str(model)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "GLOO_SOCKET_IFNAME": "lo"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(procs)]


def test_two_processes_draw_distinct_samples_equal_to_one_process(tmp_path, tiny_chat):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    folder = tiny_chat[2]
    two = _run(tmp_path / "two", 2, folder)
    one = _run(tmp_path / "one", 1, folder)
    assert [(r["process_index"], r["num_processes"]) for r in two] == [(0, 2), (1, 2)]
    assert two[0]["distributed_type"].endswith("MULTI_CPU")
    assert [len(r["completions"]) for r in two] == [6, 6] and len(one[0]["completions"]) == 12
    merged = two[0]["completions"] + two[1]["completions"]  # accelerate: rank p holds the p-th slice
    for g in range(3):  # RepeatSampler: each prompt's 4 samples are consecutive; the 2nd group is split 2 + 2
        group = merged[4 * g: 4 * g + 4]
        assert len({tuple(c) for c in group}) == 4, group  # 16 tokens at T = 1: equal only by a seed clash
    assert merged == one[0]["completions"]
