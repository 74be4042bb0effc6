"""One library, one lab (docs/architecture.md, "One library, one lab").

The library's floors: drafter -> policy -> engine -> rollout -> integrations. No library module imports one on
a higher floor (lazy imports inside functions included), no two modules import each other, and nothing in
the library imports the lab. The lab (dasrl_lab/, and scripts/) reaches the library through its public names
only: the `__all__` of the public modules below. `import dasrl` pulls neither the lab nor its extras, and the
core install's paths (drafter, policy, vLLM proposer, VeRL router, routing) run without torch, transformers
and pyarrow (pyproject.toml: they are extras); tests/test_install.py checks the same in a real install. The
library's tests (tests/, tests/support/) import no lab module: the lab's are in tests/lab/, and `make test-lib`
runs the library's with the lab unimportable."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "dasrl"
LAB = [REPO / "dasrl_lab", REPO / "scripts"]
FLOORS = {"drafter": 0, "policy": 1, "engine": 2, "rollout": 3, "integrations": 4}
UTILITIES = {"dasrl", "dasrl._core", "dasrl._extras", "dasrl.atomic"}
"""Top-level modules every floor may use (they import no floor themselves; `dasrl` re-exports the API)."""
PUBLIC = ("dasrl", "dasrl.atomic", "dasrl.drafter", "dasrl.policy", "dasrl.engine", "dasrl.rollout",
          "dasrl.integrations.trl", "dasrl.integrations.ray", "dasrl.integrations.vllm", "dasrl.integrations.verl",
          "dasrl.integrations.verl.router")
"""The library's public modules: their `__all__` is the public API."""
MAX_PUBLIC_NAMES = 150
TESTS = REPO / "tests"
LAB_DRIVEN = {"test_vllm.py": "DAS in a real vLLM, driven through the lab's `dasrl bench vllm` harness; it runs only "
                              "in `make test-vllm`, whose file list names it here"}
"""Library test files that still import the lab, and why."""


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    mods = {_module(p): p for p in ROOT.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("dasrl"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    out.add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name.startswith("dasrl")}
        edges[name] = out - {name}
    return edges


def _floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 1 and parts[0] == "dasrl" else None


def test_no_module_imports_a_higher_floor():
    bad = [f"{m} -> {o}" for m, outs in _imports().items() for o in sorted(outs)
           if _floor(m) is not None and _floor(o) is not None and _floor(o) > _floor(m)]
    assert not bad, "imports up a floor: " + "; ".join(sorted(bad))


def test_utilities_import_no_floor():
    edges = _imports()
    bad = [f"{u} -> {o}" for u in UTILITIES - {"dasrl"} if u in edges for o in edges[u] if _floor(o) is not None]
    assert not bad, "; ".join(bad)


def test_no_two_modules_import_each_other():
    edges = _imports()
    cycles = {tuple(sorted((m, o))) for m, outs in edges.items() if m != "dasrl" for o in outs
              if o != "dasrl" and m in edges.get(o, ())}
    assert not cycles, f"import cycles: {sorted(cycles)}"


def test_the_library_imports_no_lab_module():
    bad = [f"{m} -> {o}" for m, outs in _imports().items() for o in outs if o.split(".")[0] == "dasrl_lab"]
    assert not bad, "; ".join(bad)


def _public_names() -> dict[str, set[str]]:
    return {m: set(importlib.import_module(m).__all__) for m in PUBLIC}


def test_the_lab_reaches_the_library_through_public_names_only():
    public = _public_names()
    bad = []
    for path in [p for d in LAB for p in d.rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "dasrl":
                if node.module not in public:
                    bad.append(f"{where} imports from private module {node.module}")
                    continue
                bad += [f"{where} imports {a.name} from {node.module}, not in its __all__"
                        for a in node.names if a.name not in public[node.module]]
            elif isinstance(node, ast.Import):
                bad += [f"{where} imports {a.name}" for a in node.names
                        if a.name.split(".")[0] == "dasrl" and a.name not in public]
    assert not bad, "\n".join(bad)


def test_public_names_are_few_and_real():
    public = _public_names()
    for m, names in public.items():
        mod = importlib.import_module(m)
        missing = sorted(n for n in names if not hasattr(mod, n))
        assert not missing, f"{m}.__all__ names what it lacks: {missing}"
    total = set().union(*public.values())
    assert len(total) <= MAX_PUBLIC_NAMES, f"{len(total)} public names (at most {MAX_PUBLIC_NAMES})"
    assert len(public["dasrl"]) <= 20, sorted(public["dasrl"])


def test_import_dasrl_pulls_neither_the_lab_nor_its_extras():
    code = ("import sys, dasrl, dasrl.integrations.trl, dasrl.integrations.ray, dasrl.integrations.vllm; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'matplotlib', 'rich', 'typer', 'dasrl_lab', 'vllm', 'ray', 'trl'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _absolute_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in `path`, at any depth (code in strings is not read)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            out.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return out


def _imports_lab(path: Path) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line}" for line, m in _absolute_imports(path) if m.split(".")[0] == "dasrl_lab"]


def test_the_librarys_tests_import_no_lab_module():
    files = [p for p in sorted(TESTS.glob("*.py")) + sorted((TESTS / "support").glob("*.py"))
             if p.name not in LAB_DRIVEN]
    bad = [line for p in files for line in _imports_lab(p)]
    assert not bad, "library tests importing the lab (move the test to tests/lab/): " + "; ".join(bad)
    assert all((TESTS / name).is_file() and _imports_lab(TESTS / name) for name in LAB_DRIVEN), \
        "a file in LAB_DRIVEN no longer imports the lab (or is gone): take it off the list"


def test_the_lab_imports_no_test_module():
    bad = [f"{path.relative_to(REPO)}:{line} imports {m}" for path in [p for d in LAB for p in d.rglob("*.py")]
           for line, m in _absolute_imports(path) if m.split(".")[0] in {"tests", "support", "conftest"}]
    assert not bad, "; ".join(bad)


CORE_IMPORTS = ("dasrl", "dasrl.drafter", "dasrl.policy", "dasrl.integrations.vllm", "dasrl.integrations.vllm.proposer",
                "dasrl.integrations.vllm.tracker", "dasrl.integrations.verl", "dasrl.integrations.verl.router",
                "dasrl.rollout.routing")
"""What `pip install dasrl` (numpy and the C++ core, no extra) must import."""
EXTRAS_MODULES = ("torch", "transformers", "pyarrow")

_BLOCK = f"""
import sys, types
for m in {EXTRAS_MODULES!r}:
    sys.modules[m] = None  # as if not installed: importing it raises ModuleNotFoundError
# VeRL's router module imports torch and transformers itself (VeRL brings them); a stand-in shows that
# dasrl's router needs neither.
for name in ("verl", "verl.workers", "verl.workers.rollout", "verl.workers.rollout.router"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["verl.workers.rollout.router"].DEFAULT_ROUTING_CACHE_SIZE = 16
sys.modules["verl.workers.rollout.router"].GlobalRequestLoadBalancer = type("GlobalRequestLoadBalancer", (), {{}})
"""


def _run_blocked(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + code], capture_output=True, text=True, timeout=300)


def test_the_core_install_imports_without_torch_transformers_pyarrow():
    code = (f"import importlib\nfor m in {CORE_IMPORTS!r}: importlib.import_module(m)\n"
            "import dasrl.drafter as d, dasrl.policy as p, dasrl.rollout as r\n"
            "d.DraftStore(d.StoreConfig()); p.make_policy('das'); r.make_router\n"
            f"print(sorted(m for m in {EXTRAS_MODULES!r} if sys.modules.get(m) is not None))")
    out = _run_blocked(code)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_path_that_needs_a_missing_extra_names_it():
    cases = {"from dasrl import RolloutSession": "engine", "from dasrl import SpecEngine": "engine",
             "from dasrl.rollout import SessionConfig": "engine", "import dasrl.rollout.session": "engine",
             "import dasrl.integrations.trl": "engine",
             "import dasrl.integrations.ray": "engine"}
    code = (f"for stmt in {list(cases)!r}:\n"
            "    try:\n        exec(stmt)\n    except ImportError as e:\n        print(stmt, '|', e)\n"
            "    else:\n        print(stmt, '| imported')\n")
    out = _run_blocked(code)
    got = dict(line.split(" | ", 1) for line in out.stdout.splitlines())
    assert set(got) == set(cases), out.stdout + out.stderr
    for stmt, extra in cases.items():
        assert f"pip install 'dasrl[{extra}]'" in got[stmt], (stmt, got[stmt])


def test_the_dasrl_command_without_the_lab_says_which_extra_and_exits_2():
    code = "sys.modules['typer'] = None\nfrom dasrl_lab.__main__ import main\nmain()\n"
    out = _run_blocked(code)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == ["the dasrl command is the lab: pip install 'dasrl[lab]' (missing: typer)"]
