"""Bad flags and bad paths of every `dasrl` command: a usage error naming the flag and the value, exit code 2,
no traceback, before any work (no workload generated, no model loaded, no file or run folder written)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dasrl_lab.cli import app

runner = CliRunner()


def _run(args):
    result = runner.invoke(app, args)
    text = result.output.translate({ord(c): " " for c in "│╭╮╰╯─"})  # unwrap rich's error box
    return result.exit_code, " ".join(text.split())


@pytest.mark.parametrize("args, msg", [
    (["--steps", "-1"], "Invalid value for '--steps': must be >= 1, got -1"),
    (["--steps", "0"], "Invalid value for '--steps': must be >= 1, got 0"),  # not "the default"
    (["--scale", "0"], "Invalid value for '--scale': must be >= 0.01, got 0.0"),
    (["--scale", "nan"], "'--scale': must be a number, got nan"),
    (["--window", "-3"], "Invalid value for '--window': must be >= 1, got -3"),
    (["--k", "-2"], "Invalid value for '--k': must be >= 0, got -2"),
    (["--max-batch", "-1"], "Invalid value for '--max-batch': must be >= 0, got -1"),
    (["--warmup", "-1"], "Invalid value for '--warmup': must be >= 0, got -1"),
    (["--warmup", "3"], "Invalid value for '--warmup': 3 leaves none of the 3 steps of workload tiny"),
    (["--steps", "2", "--warmup", "2"], "2 leaves none of the 2 steps"),
    (["--drafter", "magic"], "unknown drafter 'magic'"),
    (["--latency", "/nonexistent/latency.json"], "'--latency': /nonexistent/latency.json: no such file"),
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
                                       (["--scale", "-1"], "'--scale': must be >= 0.01, got -1.0")])
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
    (["--max-new-tokens", "0"], "'--max-new-tokens': must be >= 1, got 0"),
    (["--steps", "0"], "'--steps': must be >= 1, got 0"),
    (["--samples", "-2"], "'--samples': must be >= 1, got -2"),
])
def test_demo_bad_flags_fail_before_the_model_and_the_folder(args, msg, tmp_path, unloadable_model):
    out = tmp_path / "runs"
    code, text = _run(["demo", "--out", str(out), "--model", unloadable_model, *args])
    # the model would fail only once it is loaded: that the flag's error comes instead shows the flags
    # are checked first
    assert code == 2 and msg in text, text
    assert not out.exists()


def test_demo_out_is_a_file(tmp_path, unloadable_model):
    f = tmp_path / "file"
    f.write_text("x")
    code, text = _run(["demo", "--out", str(f), "--model", unloadable_model])
    assert code == 2 and "is a file; give a folder" in text


@pytest.mark.parametrize("args, msg", [(["--max-new-tokens", "0"], "'--max-new-tokens': must be >= 1, got 0"),
                                       (["--temperature", "-1"], "'--temperature': temperature must be a finite"),
                                       (["--routers", ","], "'--routers': no router in ','"),
                                       (["--routers", "nearest"], "unknown router 'nearest'"),
                                       (["--steps", "1"], "'--steps': must be >= 2, got 1")])
def test_bench_ray_bad_flags_before_the_model(args, msg, unloadable_model):
    pytest.importorskip("ray")
    code, text = _run(["bench", "ray", "--model", unloadable_model, *args])
    assert code == 2 and msg in text, text


# ---------------------------------------------------------------------------------------------------------
# Every command, every class of bad input (issue 26, "Bad input and faults"): unwritable outputs, models
# that are not models, threads and sizes out of range, malformed inputs. Each row must end in a usage error
# naming the option and the value (exit code 2, no traceback) before any work: on the code before
# dasrl_lab/cli_args.py these raised from deep inside the run (IsADirectoryError after the whole bench,
# FileNotFoundError from load_model, a SIGSEGV from torch.set_num_threads(100000)) or ran for hours.

@pytest.fixture
def unloadable_model(tmp_path) -> str:
    """A folder that looks like a model (config.json naming a model_type, a weights file) but does not
    load: a command that reports a bad flag with this model did not load it first."""
    folder = tmp_path / "unloadable-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"not weights")
    return str(folder)


def _places(tmp: Path) -> dict[str, str]:
    (tmp / "afolder").mkdir()
    (tmp / "afile").write_text("x")
    (tmp / "nomodel").mkdir()
    (tmp / "badcfg").mkdir()
    (tmp / "badcfg" / "config.json").write_text("{")
    (tmp / "noweights").mkdir()
    (tmp / "noweights" / "config.json").write_text('{"model_type": "llama"}')
    for name, text in (("run-json", "{"), ("run-list", "[1, 2]"),
                       ("run-keys", '{"format": "dasrl-experiments-collect/3", "config": {}}')):
        (tmp / name).mkdir()
        (tmp / name / "collect.json").write_text(text)
    return {"DIR": str(tmp / "afolder"), "FILE": str(tmp / "afile"), "UNDER_FILE": str(tmp / "afile" / "x.json"),
            "RO": "/proc/dasrl-test.json", "NOMODEL": str(tmp / "nomodel"), "BADCFG": str(tmp / "badcfg"),
            "NOWEIGHTS": str(tmp / "noweights"), "MISSING": str(tmp / "missing" / "model"), "TMP": str(tmp)}


WRITES = [["simulate", "--workload", "tiny", "--json"], ["bench", "ablation", "--workload", "tiny", "--json"],
          ["bench", "routing", "--workload", "tiny", "--json"], ["bench", "routing", "--workload", "tiny", "--plot"],
          ["trace", "synth"], ["bench", "drafter", "--quick", "--json"], ["bench", "engine", "--quick", "--json"],
          ["bench", "fidelity", "--quick", "--json"], ["calibrate", "--quick", "--out"],
          ["calibrate", "--quick", "--samples"], ["validate-sim", "{TMP}", "--json"],
          ["validate-sim", "{TMP}", "--png"],
          ["bench", "gpu", "--device", "cpu", "--tiny", "--json"], ["bench", "ray", "--json"],
          ["bench", "vllm", "--json"], ["experiments", "--quick", "--results"]]
FOLDERS = [["demo", "--out"], ["experiments", "--quick", "--out"]]
LOADS = [["bench", "engine"], ["bench", "fidelity"], ["calibrate"], ["bench", "ray"], ["demo"], ["experiments"],
         ["bench", "vllm"]]
CASES = (
    [(cmd + ["{DIR}"], "is a folder; give a file name") for cmd in WRITES]
    + [(cmd + ["{UNDER_FILE}"], "afile is a file, not a folder") for cmd in WRITES]
    + [(cmd + ["{RO}"], "cannot write in /proc") for cmd in WRITES]
    + [(cmd + ["{FILE}"], "is a file; give a folder") for cmd in FOLDERS]
    + [(cmd + ["{UNDER_FILE}"], "afile is a file, not a folder") for cmd in FOLDERS]
    + [(cmd + ["--model", model], msg) for cmd in LOADS for model, msg in [
        ("{NOMODEL}", "nomodel' has no config.json"), ("{FILE}", "afile' is a file; give a model folder"),
        ("{BADCFG}", "config.json is not a readable JSON file"), ("{NOWEIGHTS}", "holds no weights"),
        ("{MISSING}", "model' does not exist")]]
    + [(["bench", cmd, "--quick", "--threads", t], msg) for cmd in ("engine", "fidelity")
       for t, msg in [("0", "'--threads': must be >= 1, got 0"), ("100000", "'--threads': must be <= ")]]
    + [(["bench", "gpu", "--device", "cpu", "--tiny", "--threads", "-1"], "'--threads': must be >= 0, got -1"),
       (["bench", "gpu", "--device", "cpu", "--tiny", "--threads", "100000"], "'--threads': must be <= "),
       (["bench", "engine", "--quick", "--device", "tpu"], "'--device': unknown device 'tpu'"),
       (["calibrate", "--quick", "--device", "tpu"], "'--device': unknown device 'tpu'"),
       # absurd sizes
       (["trace", "synth", "{TMP}/t.parquet", "--scale", "1e9"], "'--scale': must be <= 100.0, got 1000000000.0"),
       (["simulate", "--workload", "tiny", "--steps", "1000000000"], "'--steps': must be <= 10000, got 1000000000"),
       (["simulate", "--workload", "paper-math", "--scale", "50", "--steps", "100"],
        "workload paper-math at --scale 50.0 and 100 steps would hold ~"),
       (["simulate", "--workload", "tiny", "--window", "1000000000"], "'--window': must be <= 10000"),
       (["simulate", "--workload", "tiny", "--k", "1000000000"], "'--k': must be <= 1024"),
       (["simulate", "--workload", "tiny", "--max-batch", "1000000000"], "'--max-batch': must be <= 100000"),
       (["bench", "routing", "--workload", "tiny", "--workers", "2,100000"],
        "--workers needs counts from 1 to 4096, got '2,100000'"),
       (["bench", "ablation", "--workload", "tiny", "--scale", "inf"], "'--scale': must be <= 100.0, got inf"),
       (["bench", "drafter", "--budget", "1000000000"], "'--budget': must be <= 1024"),
       (["bench", "engine", "--problems", "1000000000"], "'--problems': must be <= 100000"),
       (["bench", "fidelity", "--noise-seeds", "1000000000"], "'--noise-seeds': must be <= 1024"),
       (["bench", "ray", "--workers", "100000"], "'--workers': must be <= 256, got 100000"),
       (["bench", "vllm", "--samples", "1000000000"], "'--samples': must be <= 100000"),
       (["demo", "--steps", "1000000000"], "'--steps': must be <= 10000, got 1000000000"),
       (["demo", "--prompts", "1000000000"], "'--prompts': must be <= 100000"),
       (["bench", "engine", "--preset", "nope"], "unknown preset 'nope'"),
       (["experiments", "--preset", "nope"], "unknown preset 'nope'"),
       (["calibrate", "--dtype", "fp16"], "'--dtype': must be fp32 or bf16, got 'fp16'"),
       (["bench", "fidelity", "--dtype", "fp16"], "'--dtype': must be fp32 or bf16, got 'fp16'"),
       (["experiments", "--steps", "1000000000"], "'--steps': must be <= 10000, got 1000000000"),
       # malformed inputs
       (["simulate", "--workload", "tiny", "--latency", "{DIR}"], "'--latency': {DIR}: is a folder, not a file"),
       (["validate-sim", "{TMP}/run-json"], "run-json/collect.json: not a readable JSON file"),
       (["validate-sim", "{TMP}/run-list"], "run-list/collect.json: format 'list'"),
       (["validate-sim", "{TMP}/run-keys"], "run-keys/collect.json: not what `dasrl experiments` writes (KeyError"),
       (["validate-sim", "{TMP}/run-json", "--per-forward", "-1"], "'--per-forward': must be >= 0, got -1.0"),
       (["validate-sim", "{TMP}/run-json", "--latency", "{TMP}/none.json"],
        "'--latency': {TMP}/none.json: no such file")]
)


@pytest.mark.parametrize("args, msg", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_every_bad_input_is_one_usage_error(args, msg, tmp_path, unloadable_model):
    places = _places(tmp_path)

    def fill(text: str) -> str:
        for key, value in places.items():
            text = text.replace("{" + key + "}", value)
        return text

    args = [fill(a) for a in args]
    if "--model" not in args and any(args[:len(cmd)] == cmd for cmd in LOADS):
        args += ["--model", unloadable_model]  # a command that reached the model would fail on it instead
    result = runner.invoke(app, args)
    text = " ".join(result.output.translate({ord(c): " " for c in "│╭╮╰╯─"}).split())
    squeeze = str.maketrans("", "", " ")  # rich wraps the message anywhere, even inside a path
    assert result.exit_code == 2 and fill(msg).translate(squeeze) in text.translate(squeeze), (
        result.exit_code, text, result.exception)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    assert "Traceback" not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["afolder", "afile", "nomodel", "badcfg", "noweights", "run-json", "run-list", "run-keys",
         "unloadable-model"])  # nothing written
    assert not list(Path(places["DIR"]).iterdir())  # no probe file left behind


# ---------------------------------------------------------------------------------------------------------
# Issue 37 item 4: FIFOs and device files given as inputs. On b46648a every one of these hung forever
# (the open of a FIFO waits for a writer) or read /dev/zero until memory ran out. Each runs in a daemon
# thread so that a hang fails the test instead of the run.
def _run_in_thread(args, timeout: float = 60):
    import threading

    out: list = []
    t = threading.Thread(target=lambda: out.append(_run(args)), daemon=True)
    t.start()
    t.join(timeout)
    assert out, f"dasrl {' '.join(args)} hangs"
    return out[0]


@pytest.mark.parametrize("args, msg", [
    (["whatif", "{FIFO}.jsonl", "--methods", "none"], "{FIFO}.jsonl: not a regular file"),
    (["whatif", "{VERL}", "--methods", "none"], "2.jsonl: not a regular file"),
    (["whatif", "{TMP}/ok.jsonl", "--methods", "none", "--latency", "{FIFO}.json"], "{FIFO}.json: not a regular file"),
    (["whatif", "{TMP}/ok.jsonl", "--methods", "none", "--latency", "{ZERO}"], "{ZERO}: not a regular file"),
    (["bench", "routing", "--workload", "tiny", "--latency", "{FIFO}.json"], "{FIFO}.json: not a regular file"),
    (["simulate", "--workload", "tiny", "--latency", "{FIFO}.json"], "{FIFO}.json: not a regular file"),
    (["simulate", "{FIFO}.parquet"], "{FIFO}.parquet: not a readable Parquet file"),
    (["trace", "info", "{FIFO}.parquet"], "{FIFO}.parquet: not a readable Parquet file"),
    (["experiments", "--source", "{FIFO}.jsonl", "--out", "{TMP}/out"], "{FIFO}.jsonl: not a regular file"),
])
def test_fifos_and_devices_are_refused_not_read(args, msg, tmp_path):
    fifo = tmp_path / "fifo"
    for ext in (".jsonl", ".json", ".parquet"):
        os.mkfifo(f"{fifo}{ext}")
    verl = tmp_path / "verl"
    verl.mkdir()
    (verl / "1.jsonl").write_text('{"input": "q", "output": "a", "step": 1}\n')
    os.mkfifo(verl / "2.jsonl")
    (tmp_path / "ok.jsonl").write_text('{"step": 0, "problem_id": "a", "response": "b"}\n')
    os.symlink("/dev/zero", tmp_path / "zero.json")
    places = {"FIFO": str(fifo), "VERL": str(verl), "ZERO": str(tmp_path / "zero.json"), "TMP": str(tmp_path)}

    def fill(text: str) -> str:
        for key, value in places.items():
            text = text.replace("{" + key + "}", value)
        return text

    code, text = _run_in_thread([fill(a) for a in args])
    squeeze = str.maketrans("", "", " ")
    assert code == 2 and fill(msg).translate(squeeze) in text.translate(squeeze), (code, text)
    assert "Traceback" not in text
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------
# Issue 37 items 9, 10, 12, 13, 17: flags that were checked only after work started (or never), outputs
# that replaced device nodes and links, names the output checks could not stat. Each is one usage error
# before any work: the unloadable model shows no model was loaded first, and nothing is written.
LONG = "x" * 300


@pytest.mark.parametrize("args, msg", [
    (["bench", "engine", "--quick", "--temperature", "-1"], "'--temperature': temperature must be a finite number >= 0"),
    (["bench", "engine", "--quick", "--temperature", "nan"], "'--temperature': temperature must be a finite number >= 0"),
    (["bench", "fidelity", "--quick", "--temperature", "-1"], "'--temperature': temperature must be a finite number"),
    (["bench", "routing", "--workload", "tiny", "--seed", "-1"], "'--seed': must be >= 0, got -1"),
    (["bench", "ray", "--workers", "256"], "256 workers x 3 routers = 768 actors that each load the model"),
    (["simulate", "--workload", "tiny", "--json", "{TMP}/" + LONG + ".json"], "File name too long"),
    (["simulate", "--workload", "tiny", "--json", "{TMP}/" + LONG + "/r.json"], "File name too long"),
    (["demo", "--out", "{TMP}/" + LONG], "File name too long"),
    (["demo", "--out", ""], "'--out': must not be empty"),
    (["simulate", "--workload", "tiny", "--scale", "1e-300"], "'--scale': must be >= 0.01, got 1e-300"),
    (["trace", "synth", "{TMP}/t.parquet", "--workload", "tiny", "--scale", "0.001"], "'--scale': must be >= 0.01"),
])
def test_flags_checked_before_any_work(args, msg, tmp_path, unloadable_model):
    if args[:2] == ["bench", "ray"]:
        pytest.importorskip("ray")
    args = [a.replace("{TMP}", str(tmp_path)) for a in args]
    if args[0] in ("demo",) or args[:2] in (["bench", "engine"], ["bench", "fidelity"], ["bench", "ray"]):
        args += ["--model", unloadable_model]
    before = sorted(p.name for p in tmp_path.iterdir())
    code, text = _run(args)
    squeeze = str.maketrans("", "", " ")
    assert code == 2 and msg.translate(squeeze) in text.translate(squeeze), (code, text)
    assert "Traceback" not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_bogus_model_name_is_refused_before_any_experiment(tmp_path, monkeypatch):
    """`experiments --model bogus` ran the latency experiment for ~50 s, wrote its folder, then raised a
    transformers traceback. Now: one usage error (the name is no embedded model, folder, or hub id this
    machine can load), before anything runs."""
    monkeypatch.chdir(tmp_path)
    code, text = _run(["experiments", "--quick", "--model", "bogus", "--out", str(tmp_path / "out")])
    assert code == 2 and "'bogus' is not an embedded model" in text and "hub id that can be loaded" in text, text
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


def test_outputs_write_through_links_and_refuse_devices(tmp_path):
    """`ln -s /proc/self/fd/1 out.json; dasrl trace synth out.json` replaced the link with a regular file
    (as root, `--json /dev/stdout` would have replaced the system's /dev/stdout). A link to a regular file
    is written through (the link stays); a link to a pipe, a FIFO or a device node is refused, untouched."""
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    os.symlink(real, link)
    code, text = _run(["simulate", "--workload", "tiny", "--steps", "2", "--json", str(link)])
    assert code == 0, text
    assert link.is_symlink() and os.readlink(link) == str(real) and json.loads(real.read_text())["source"]
    r, w = os.pipe()
    try:
        pipe_link = tmp_path / "out.json"
        os.symlink(f"/proc/self/fd/{w}", pipe_link)
        code, text = _run(["trace", "synth", str(pipe_link), "--workload", "tiny", "--steps", "2"])
        assert code == 2 and "not a regular file" in text, text
        assert pipe_link.is_symlink()
    finally:
        os.close(r)
        os.close(w)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    code, text = _run(["simulate", "--workload", "tiny", "--steps", "2", "--json", str(fifo)])
    assert code == 2 and "not a regular file" in text, text
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    try:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
    except PermissionError:
        return
    code, text = _run(["simulate", "--workload", "tiny", "--steps", "2", "--json", str(tmp_path / "null")])
    assert code == 2 and "not a regular file" in text, text
    assert stat.S_ISCHR(os.lstat(tmp_path / "null").st_mode)


def test_an_output_path_with_a_non_utf8_byte(tmp_path):
    """A file name with a byte that is not UTF-8 (argv hands it over as a surrogate) was a traceback: the
    output is written under exactly that name (exit 0), as any other name. Run as a user runs it: the
    command in a process of its own, the name as bytes."""
    import subprocess
    import sys

    out = os.fsencode(tmp_path) + b"/out\xff.json"
    cmd = [sys.executable, "-c", "from dasrl_lab.cli import app; app()", "simulate", "--workload", "tiny",
           "--steps", "2", "--json", out]
    done = subprocess.run(cmd, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    assert json.loads(open(out, "rb").read())["source"]
