"""Every bad flag of `dasrl simulate`, `dasrl trace synth`, `dasrl bench ablation|routing` and `dasrl demo`:
a usage error naming the flag and the value, exit code 2, before any work (no workload generated, no
model loaded, no run folder made)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dasrl.cli import app

runner = CliRunner()


def _run(args):
    result = runner.invoke(app, args)
    text = result.output.translate({ord(c): " " for c in "│╭╮╰╯─"})  # unwrap rich's error box
    return result.exit_code, " ".join(text.split())


@pytest.mark.parametrize("args, msg", [
    (["--steps", "-1"], "Invalid value for '--steps': must be >= 1, got -1"),
    (["--steps", "0"], "Invalid value for '--steps': must be >= 1, got 0"),  # not "the default"
    (["--scale", "0"], "Invalid value for '--scale': must be a number > 0, got 0.0"),
    (["--scale", "nan"], "must be a number > 0, got nan"),
    (["--window", "-3"], "Invalid value for '--window': must be >= 1, got -3"),
    (["--k", "-2"], "Invalid value for '--k': must be >= 0, got -2"),
    (["--max-batch", "-1"], "Invalid value for '--max-batch': must be >= 0, got -1"),
    (["--warmup", "-1"], "Invalid value for '--warmup': must be >= 0, got -1"),
    (["--warmup", "3"], "Invalid value for '--warmup': 3 leaves none of the 3 steps of workload tiny"),
    (["--steps", "2", "--warmup", "2"], "2 leaves none of the 2 steps"),
    (["--drafter", "magic"], "unknown drafter 'magic'"),
    (["--latency", "/nonexistent/latency.json"], "No such file or directory"),
])
def test_simulate_bad_flags(args, msg, tmp_path):
    out = tmp_path / "r.json"
    code, text = _run(["simulate", "--workload", "tiny", "--json", str(out), *args])
    assert code == 2 and msg in text, text
    assert not out.exists()


def test_simulate_trace_flags(tmp_path):
    code, text = _run(["simulate", "--workload", "nope"])
    assert code == 2 and "unknown workload 'nope'" in text
    code, text = _run(["simulate", str(tmp_path / "missing.parquet")])
    assert code == 2 and "no such trace file" in text
    code, text = _run(["trace", "synth", str(tmp_path / "t.parquet"), "--workload", "tiny", "--steps", "2"])
    assert code == 0, text
    code, text = _run(["simulate", str(tmp_path / "t.parquet"), "--warmup", "2"])
    assert code == 2 and "2 leaves none of the 2 steps" in text
    code, text = _run(["simulate", str(tmp_path / "t.parquet"), "--steps", "5"])
    assert code == 2 and "apply to a --workload, not to a TRACE" in text


@pytest.mark.parametrize("cmd", [["trace", "synth", "OUT"], ["bench", "ablation"], ["bench", "routing"]])
@pytest.mark.parametrize("args, msg", [(["--steps", "0"], "'--steps': must be >= 1, got 0"),
                                       (["--scale", "-1"], "'--scale': must be a number > 0, got -1.0")])
def test_other_sim_commands(cmd, args, msg, tmp_path):
    cmd = [str(tmp_path / "t.parquet") if c == "OUT" else c for c in cmd]
    code, text = _run([*cmd, "--workload", "tiny", *args])
    assert code == 2 and msg in text, text
    assert not (tmp_path / "t.parquet").exists()


def test_ablation_warmup_leaves_a_step():
    code, text = _run(["bench", "ablation", "--workload", "tiny", "--warmup", "3"])
    assert code == 2 and "'--warmup': 3 leaves none of the 3 steps" in text


@pytest.mark.parametrize("args, msg", [
    (["--policy", "nope"], "unknown policy 'nope'"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0, got -1.0"),
    (["--temperature", "1e-9"], "temperature 1e-09 is below 1e-05"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be an int >= 1, got 0"),
    (["--steps", "0"], "--steps must be an int >= 1, got 0"),
    (["--samples", "-2"], "--samples must be an int >= 1, got -2"),
])
def test_demo_bad_flags_fail_before_the_model_and_the_folder(args, msg, tmp_path):
    out = tmp_path / "runs"
    code, text = _run(["demo", "--out", str(out), "--model", str(tmp_path / "no-model-here"), *args])
    # a bad model path would fail only once it is loaded: that the flag's error comes instead shows the
    # flags are checked first
    assert code == 2 and msg in text, text
    assert not out.exists()


def test_demo_out_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    code, text = _run(["demo", "--out", str(f), "--model", str(tmp_path / "no-model-here")])
    assert code == 2 and "is a file; it must be a folder" in text


@pytest.mark.parametrize("args, msg", [(["--max-new-tokens", "0"], "'--max-new-tokens': must be >= 1, got 0"),
                                       (["--temperature", "-1"], "'--temperature': temperature must be a finite"),
                                       (["--routers", ","], "'--routers': no router in ','"),
                                       (["--routers", "nearest"], "unknown router 'nearest'"),
                                       (["--steps", "1"], "steps >= 2; got 2, 4, 1")])
def test_bench_ray_bad_flags_before_the_model(args, msg, tmp_path):
    pytest.importorskip("ray")
    code, text = _run(["bench", "ray", "--model", str(tmp_path / "no-model-here"), *args])
    assert code == 2 and msg in text, text
