"""`dasrl bench vllm --trace` and the step-time validation (dasrl/bench/vllm_validate.py) without vLLM:
the run trace writer, its refusal to overwrite, and the replay's prediction against whatif's own."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dasrl.bench import vllm_validate
from dasrl.bench.vllm_bench import VLLMBenchConfig, check_trace_free, trace_name, write_run_trace
from dasrl.policy.base import NoSpeculation
from dasrl.policy.latency import LatencyModel
from dasrl.rollout.trace import read_trace
from dasrl.sim import whatif
from dasrl.sim.profiles import measured
from dasrl.sim.simulator import group_steps

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
LAT = LatencyModel(c_base=0.08, c_tok=0.004, c_other=3e-5)


def _result(lengths=(4, 9, 3, 12)) -> dict:
    """vllm_run.run's result shape: 2 prompts x 2 samples x 2 steps, request i = prompt i // 2."""
    outs = [[100 + i * 20 + j for j in range(n)] for i, n in enumerate(lengths)]
    return {"prompts": PROMPTS, "samples": 2,
            "steps": [{"step": s, "outputs": outs, "rewards": [1.0, 0.0, None, 1.0]} for s in range(2)]}


def test_run_trace_reads_back(tmp_path):
    res = _result()
    write_run_trace(tmp_path / "t", res, max_tokens=12)
    got = read_trace(tmp_path / "t").responses()
    assert [r.step for r in got] == [0] * 4 + [1] * 4
    for r, i in zip(got, list(range(4)) * 2):
        assert (r.problem_id, r.sample) == (i // 2, i % 2)
        assert r.prompt_ids.tolist() == PROMPTS[i // 2]
        assert r.response_ids.tolist() == res["steps"][0]["outputs"][i]
        assert r.reward == res["steps"][0]["rewards"][i]
        assert r.finish_reason == ("length" if i == 3 else "stop")  # 12 tokens = max_tokens


def test_trace_folder_is_never_overwritten(tmp_path):
    cfg = VLLMBenchConfig(methods=("none", "das"), temperatures=(0.0, 1.0), repeats=2)
    check_trace_free(cfg, tmp_path)  # empty: fine
    (tmp_path / trace_name("das", 1.0, 1)).mkdir()
    with pytest.raises(ValueError, match="das-T1-r1"):
        check_trace_free(cfg, tmp_path)


def test_arctic_takes_a_traces_read_only_ids():
    pytest.importorskip("arctic_inference")
    from dasrl.drafter.arctic import ArcticDrafter
    from dasrl.sim.vllm_baselines import VLLM_SUFFIX

    ids = np.arange(1, 9, dtype=np.int32)
    ids.flags.writeable = False  # what read_trace hands out (views of Arrow buffers)
    d = ArcticDrafter(VLLM_SUFFIX)
    d.start("r", 0, ids)
    d.observe("r", ids[:3])


def test_none_prediction_is_whatifs(tmp_path):
    """The validation prices the replay as `dasrl whatif` does (whatif.replay + Replay.price)."""
    write_run_trace(tmp_path / "tr" / trace_name("none", 0.0, 0), _result(), max_tokens=64)
    LAT.save(tmp_path / "lat.json")
    got = vllm_validate.predict(tmp_path / "tr" / "none-T0-r0", "none", {"k": 8, "window": 16}, LAT,
                                tmp_path / "lat.json")
    steps = group_steps(read_trace(tmp_path / "tr" / "none-T0-r0").responses())
    rep = whatif.replay(steps, method="none", policy=NoSpeculation(), cfg=whatif.WhatifConfig(), tokenizer=None,
                        label="none")
    assert [g["predicted_s"] for g in got] == pytest.approx(rep.price(measured("x", LAT, "test")))
    assert [g["forwards"] for g in got] == [12, 12]  # the longest has 12 tokens: the prefill samples the first


def test_profile_is_the_best_fitted_das_row(tmp_path):
    rows = [{"method": "none", "temperature": 1.0},
            {"method": "das", "temperature": 0.0, "dasrl_stats_last_repeat": {"latency": LAT.to_dict(), "latency_steps": 55}},
            {"method": "das", "temperature": 1.0,
             "dasrl_stats_last_repeat": {"latency": {**LAT.to_dict(), "c_base": 0.07}, "latency_steps": 256}}]
    lat, src = vllm_validate.bench_profile({"rows": rows})
    assert lat.c_base == 0.07 and src == {"method": "das", "temperature": 1.0, "fitted_steps": 256}
    with pytest.raises(ValueError, match="latency fit"):
        vllm_validate.bench_profile({"rows": rows[:1]})
