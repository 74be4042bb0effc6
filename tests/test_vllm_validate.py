"""`dasrl bench vllm --trace` and the step-time validation (dasrl_lab/bench/vllm_validate.py) without vLLM:
the run trace writer, its refusal to overwrite, and the replay's prediction against whatif's own."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dasrl_lab.bench import vllm_validate
from dasrl_lab.bench.vllm_bench import VLLMBenchConfig, check_trace_free, trace_name, write_run_trace
from dasrl.policy.base import NoSpeculation
from dasrl.policy.latency import LatencyModel
from dasrl.rollout.trace import read_trace
from dasrl_lab.sim import whatif
from dasrl_lab.sim.profiles import measured
from dasrl_lab.sim.simulator import group_steps

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
    from dasrl_lab.drafters.arctic import ArcticDrafter
    from dasrl_lab.sim.vllm_baselines import VLLM_SUFFIX

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


# ------------------------------------------------------------------------- issue 37 item 11
def _bench_doc(tmp_path) -> dict:
    """A bench JSON of one das run whose trace is on disk, as `dasrl bench vllm --json --trace` writes."""
    write_run_trace(tmp_path / "tr" / trace_name("das", 0.0, 0), _result(), max_tokens=64)
    return {"config": {"k": 8, "window": 16},
            "rows": [{"method": "das", "temperature": 0.0, "per_step": [[{"s": 1.0, "drafted": 3, "accepted": 1}] * 2],
                      "dasrl_stats_last_repeat": {"latency": LAT.to_dict(), "latency_steps": 40}}]}


def _main(argv) -> tuple[int, str]:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            vllm_validate.main([str(a) for a in argv])
            code = 0
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


@pytest.mark.parametrize("case, msg", [
    ("args", "usage: python -m dasrl_lab.bench.vllm_validate"),
    ("missing bench", "No such file or directory"),
    ("bench not JSON", "bench.json: not valid JSON"),
    ("bench a list", "must be an object with 'config'"),
    ("no traces", "no such trace file"),
    ("trace dir a file", "not a folder"),
    ("out a folder", "is a folder; give a file name"),
])
def test_main_checks_every_input_before_writing(tmp_path, case, msg):
    """On b46648a each of these was a raw traceback, and a bad trace folder was found only after
    LATENCY_OUT.json had been written."""
    doc = _bench_doc(tmp_path)
    bench, lat, out = tmp_path / "bench.json", tmp_path / "lat.json", tmp_path / "out.json"
    bench.write_text(json.dumps(doc))
    trace_dir = tmp_path / "tr"
    argv = [bench, trace_dir, lat, out]
    if case == "args":
        argv = argv[:2]
    elif case == "missing bench":
        argv[0] = tmp_path / "missing.json"
    elif case == "bench not JSON":
        bench.write_text("{")
    elif case == "bench a list":
        bench.write_text("[1]")
    elif case == "no traces":
        argv[1] = tmp_path / "empty"
        argv[1].mkdir()
    elif case == "trace dir a file":
        argv[1] = bench
    elif case == "out a folder":
        argv[3] = tmp_path
    code, err = _main(argv)
    assert code == 2 and msg in err, (code, err)
    assert not lat.exists() and not out.exists()


def test_main_on_a_good_bench_writes_both(tmp_path):
    doc = _bench_doc(tmp_path)
    (tmp_path / "bench.json").write_text(json.dumps(doc))
    code, err = _main([tmp_path / "bench.json", tmp_path / "tr", tmp_path / "lat.json", tmp_path / "out.json"])
    assert code == 0, err
    assert LatencyModel.load(tmp_path / "lat.json") == LAT
    assert json.loads((tmp_path / "out.json").read_text())["rows"][0]["method"] == "das"
