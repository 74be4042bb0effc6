"""The CPU path of scripts/gpu-check.sh (`dasrl bench gpu --device cpu --tiny`), so the GPU script cannot rot:
the script end to end (its build step finds the core already built), and the JSON it writes, by content."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_script_on_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    cmd = ["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--device", "cpu", "--tiny", "--threads", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu-check.json").read_text())
    assert (tmp_path / "gpu-check.log").is_file()
    assert doc["ok"] and not doc["errors"] and doc["environment"]["device"] == "cpu"
    # (a) every fp32 row exact and not vacuous; rejections exercised; bf16 reported
    fp32 = doc["ladder"]["fp32"]
    assert {(r["sampler"], r["drafter"]) for r in fp32} >= {("greedy", "das-tree"), ("sampled", "das-chain"),
                                                            ("sampled", "oracle"), ("greedy", "oracle-noisy")}
    assert all(r["identical"] and not r["vacuous"] for r in fp32)
    assert sum(r["drafted"] - r["accepted"] for r in fp32) > 0 and doc["ladder_fp32_exact"]
    assert len(doc["ladder"]["bf16"]) == len(fp32)
    # (b) both shapes fitted from their own samples
    for name in ("qwen2.5-1.5b", "qwen2.5-7b"):
        c = doc["calibrate"][name]
        # 8 grid shapes + for the 2 multi-row drafting shapes a lone drafting row and the plain forward of its tokens
        assert c["dtype"] == "bf16" and len(c["samples"]) == 12 and all(s["seconds"] > 0 for s in c["samples"])
        assert c["latency"]["c_base"] >= 0 and 0 <= c["fit_mean_rel_error"] < 10
        pv = c["packed_vs_padded"]
        assert pv["packed_s"] > 0 and pv["padded_s"] > 0 and pv["padded_tokens"] > pv["packed_tokens"]
    # (c) the what-if priced by both latency models, the measured one being the 7B shape's fit
    runs = doc["whatif"]["runs"]
    assert set(runs) == {"assumed", "measured"}
    assert runs["measured"]["latency"] == doc["calibrate"]["qwen2.5-7b"]["latency"]
    assert all(r["none_s"] > 0 and r["das_s"] > 0 for r in runs.values())


def test_bad_config_is_named():
    from dasrl_lab.bench.gpu import GPUCheckConfig, run

    with pytest.raises(ValueError, match="unknown or no parts"):
        GPUCheckConfig(parts=("ladder", "bench"))
    with pytest.raises(ValueError, match="threads must be >= 1"):
        GPUCheckConfig(threads=0)
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        run(GPUCheckConfig(device="gpu0", parts=("whatif",)), None, log=lambda s: None)
    import torch

    from dasrl_lab.models import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
