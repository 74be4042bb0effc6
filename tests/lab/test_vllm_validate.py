"""`dasrl bench vllm --trace` and the step-time validation (dasrl_lab/bench/vllm_validate.py) without vLLM:
the run trace writer, its refusal to overwrite, and the replay's prediction against whatif's own."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dasrl_lab.bench import vllm_validate
from dasrl_lab.bench.vllm_bench import VLLMBenchConfig, check_trace_free, trace_name, write_run_trace
from dasrl.policy.base import FixedBudget
from dasrl.policy.latency import LatencyModel
from dasrl_lab.trace import read_trace
from dasrl_lab.sim import whatif
from dasrl_lab.sim.profiles import measured
from dasrl_lab.sim.simulator import group_steps
from dasrl_lab.sim.stepprice import PrefixCache, StepPrice

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
    rep = whatif.replay(steps, method="none", policy=FixedBudget(0), cfg=whatif.WhatifConfig(), tokenizer=None,
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
                      "engine": {"block_size": 4, "enable_prefix_caching": True},
                      "dasrl_stats_last_repeat": {"latency": LAT.to_dict(), "latency_steps": 40}},
                     *_none_rows(tmp_path, 4, TRUTH)]}


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
    got = LatencyModel.load(tmp_path / "lat.json").to_dict()  # the fitted engine step
    assert got == pytest.approx({**LatencyModel(0.05, 0.002 + 0.001, 2e-5).to_dict(), "format": got["format"]})
    assert json.loads((tmp_path / "out.json").read_text())["rows"][0]["method"] == "das"


# ------------------------------------------------------------------------- issue 35 item 6
def test_prefix_cache_by_hand():
    """vLLM V1's rule, worked by hand at block 4: full blocks keyed by their whole prefix, the last prompt
    token always computed, a sibling in the same step reusing what the one before it cached."""
    p1, p2, p3 = list(range(1, 11)), list(range(1, 9)), [1, 2, 3, 4, 9, 9, 9, 9, 7]
    c = PrefixCache(4)
    assert [c.computed(p) for p in (p1, p1, p2, p3)] == [10, 2, 4, 5]
    # 10: cold; 2: blocks 1-4 and 5-8 reused; 4: p2 is two cached blocks, but its last token must be
    # computed, so its last block is; 5: the first block is shared, the second differs
    assert c.step([p1, p1, p2, p3]) == 2 + 2 + 4 + 1  # the next step: every full prompt block is cached (p3's too)
    assert c.computed([2, 1, 3, 4, 5]) == 5  # the same tokens in another order: another block
    c.reset()
    assert c.computed(p1) == 10
    assert PrefixCache(0).step([p1, p1]) == 20  # no prefix caching
    with pytest.raises(ValueError, match="block_size must be an int >= 0 .*got -1"):
        PrefixCache(-1)
    with pytest.raises(ValueError, match="empty prompt"):
        PrefixCache(4).computed([])


def test_step_price_parts_by_hand():
    """The prefill by computed prompt tokens, every engine step its overhead; the old pricing (one forward
    of every prompt token at the decode c_tok, no per-step term) gave 0.182 s and 0.126 s here."""
    lat = LatencyModel(c_base=0.05, c_tok=0.004)
    shapes = [(4, 33, 0, 0), (4, 4, 100, 0), (2, 2, 60, 0)]
    price = StepPrice(lat, c_step=0.01, c_prefill_tok=0.001, block_size=4)
    pre, dec = price.parts(shapes, 21)
    assert pre == pytest.approx(0.01 + 0.05 + 0.001 * 21)
    assert dec == pytest.approx((0.01 + 0.05 + 0.004 * 4) + (0.01 + 0.05 + 0.004 * 2))
    assert StepPrice(lat).parts(shapes, 21) == pytest.approx((0.05 + 0.004 * 33, 0.05 * 2 + 0.004 * 6))
    two = StepPrice(lat, c_step=0.01, c_prefill_tok=0.001, block_size=4, prefill_steps=2)  # vLLM's split prefill
    assert two.prefill_s(shapes[0], 21) == pytest.approx(2 * (0.01 + 0.05) + 0.001 * 21)
    hot = StepPrice(lat, c_step=0.01, c_prefill_tok=0.001, c_sample_tok=0.0005, block_size=4)  # T > 0
    assert hot.parts(shapes, 21, sampled=True) == pytest.approx((pre + 0.0005 * 4, dec + 0.0005 * (4 + 2)))
    assert hot.parts(shapes, 21) == pytest.approx((pre, dec))
    for bad in ({"c_step": -0.1}, {"c_prefill_tok": float("nan")}, {"block_size": 2.5}, {"prefill_steps": 0}):
        with pytest.raises(ValueError, match=f"StepPrice.{next(iter(bad))}"):
            StepPrice(lat, **bad)


def _none_rows(tmp_path, block: int, truth: StepPrice) -> list[dict]:
    """none runs at three temperatures, each its own outputs, whose measured steps are what `truth` prices: a
    prefill over 2 engine steps (vLLM's core starts before the last request is added), then one engine step
    per replayed decode forward."""
    rows = []
    for temp, lengths in ((0.0, (4, 9, 3, 12)), (0.3, (3, 3, 3, 3)), (0.6, (7, 2, 20, 5)), (1.0, (30, 1, 6, 16))):
        write_run_trace(tmp_path / "tr" / trace_name("none", temp, 0), _result(lengths), max_tokens=64)
        per = []
        for rep in vllm_validate.replay(tmp_path / "tr" / trace_name("none", temp, 0), "none", {"k": 8, "window": 16},
                                        tmp_path / "unused.json", block):
            pre, dec = truth.parts(rep["shapes"], rep["prefill_tokens_computed"], temp > 0)
            per.append({"s": pre + dec, "drafted": 0, "accepted": 0, "engine_steps": rep["forwards"] + 1, "prefill_s": pre,
                        "prefill_engine_steps": 2, "prefill_tokens_computed": rep["prefill_tokens_computed"]})
        rows.append({"method": "none", "temperature": temp, "per_step": [per],
                     "engine": {"block_size": block, "enable_prefix_caching": True}})
    return rows


TRUTH = StepPrice(LatencyModel(0.0, c_tok=0.002, c_other=2e-5), c_step=0.05, c_prefill_tok=0.0015, c_sample_tok=0.001,
                  block_size=4, prefill_steps=2)


def test_fit_recovers_the_engine_terms(tmp_path):
    """c_step, c_tok, c_other, c_sample_tok and c_prefill_tok come back from engine timings made with them; the replay's
    prompt tokens are vLLM's: step 0 computes 6 + 2 + 3 + 3 (the sibling of the 6-token prompt reuses its
    full block), step 1 2 + 2 + 3 + 3 (the block is still cached)."""
    rows = _none_rows(tmp_path, 4, TRUTH)
    assert [m["prefill_tokens_computed"] for m in rows[0]["per_step"][0]] == [14, 10]
    doc = {"config": {"k": 8, "window": 16}, "rows": rows}
    lat = {(r["method"], r["temperature"]): tmp_path / "unused.json" for r in rows}
    price, fit = vllm_validate.fit_step_price(doc, tmp_path / "tr", lat)
    assert price.c_step == pytest.approx(0.05) and price.c_prefill_tok == pytest.approx(0.0015)
    assert price.latency.c_tok == pytest.approx(0.002) and price.latency.c_other == pytest.approx(2e-5)
    assert price.c_sample_tok == pytest.approx(0.001)
    assert price.block_size == 4 and price.prefill_steps == 2 and fit["steps"] == 8
    with pytest.raises(ValueError, match="3 are needed"):
        vllm_validate.fit_step_price({**doc, "rows": rows[:1]}, tmp_path / "tr", lat)


def test_validation_parts_of_a_bench(tmp_path):
    doc = _bench_doc(tmp_path)
    out = vllm_validate.validate(doc, tmp_path / "tr", tmp_path / "lat.json")
    none = [r for r in out["rows"] if r["method"] == "none"]
    assert len(none) == 4 and all(r["within_bounds"] and r["prefill_tokens_predicted_equal_measured"] for r in none)
    for r in none:
        for part in ("prefill", "decode", "whole"):
            assert r[f"{part}_ratio_median"] == pytest.approx(1.0), (part, r)
    doc["rows"][1]["engine"] = {"block_size": 16, "enable_prefix_caching": True}
    with pytest.raises(ValueError, match="one engine config"):
        vllm_validate.validate(doc, tmp_path / "tr", tmp_path / "lat.json")


def test_fit_from_another_bench(tmp_path):
    """Out of sample: the price is fitted on one bench, its block size taken from the validated one."""
    fit_doc = {"config": {"k": 8, "window": 16}, "rows": _none_rows(tmp_path / "fit", 4, TRUTH)}
    (tmp_path / "fit.json").write_text(json.dumps(fit_doc))
    doc = _bench_doc(tmp_path)
    for r in doc["rows"]:
        r["engine"] = {"block_size": 8, "enable_prefix_caching": True}
    (tmp_path / "bench.json").write_text(json.dumps(doc))
    code, err = _main([tmp_path / "bench.json", tmp_path / "tr", tmp_path / "lat.json", tmp_path / "out.json",
                       tmp_path / "fit.json", tmp_path / "fit" / "tr"])
    assert code == 0, err
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["out_of_sample"] and out["step_price"]["block_size"] == 8
    assert out["step_price"]["c_step"] == pytest.approx(0.05)
    code, err = _main([tmp_path / "bench.json", tmp_path / "tr", tmp_path / "lat.json", tmp_path / "out.json",
                       tmp_path / "fit.json", tmp_path / "nothere"])
    assert code == 2 and "nothere: not a folder" in err


def test_das_replays_counting_drafts_as_the_run_recorded(tmp_path):
    """A bench document records whether das drafted by counting (VLLMBenchConfig.counting); one written before
    the key existed ran without. The replay's drafter follows it, with the run model's tokenizer."""
    from dasrl.drafter import CountingDrafter

    LAT.save(tmp_path / "lat.json")
    cfg = {"k": 8, "window": 16, "model": "smollm2-135m"}
    for counting in (True, False, None):
        drafter, _ = vllm_validate.drafter_and_policy("das", cfg | ({} if counting is None else {"counting": counting}),
                                                     tmp_path / "lat.json")
        assert isinstance(drafter, CountingDrafter) == bool(counting), counting
    assert VLLMBenchConfig().counting
