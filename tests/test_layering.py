"""The package's floors (DESIGN.md): drafter -> policy -> engine -> rollout -> (sim | demo | integrations)
-> (bench | experiments). No module imports one on a higher floor (lazy imports inside functions included; each
package's cli.py registers commands and may reach up), and no two modules import each other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "dasrl"
FLOORS = {"drafter": 0, "policy": 1, "engine": 2, "rollout": 3, "sim": 4, "demo": 4, "integrations": 4,
          "bench": 5, "experiments": 5}
UTILITIES = {"dasrl", "dasrl._core", "dasrl.atomic", "dasrl.models", "dasrl_lab.tasks"}
"""Top-level modules every floor may use (they import no floor themselves)."""
KNOWN_CYCLES: set[tuple[str, str]] = set()
"""Pairs that still import each other lazily (issue 14); remove a pair here when it is broken."""


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
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
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def test_no_module_imports_a_higher_floor():
    bad = [f"{m} -> {o}" for m, outs in _imports().items() if not m.endswith(".cli") for o in sorted(outs)
           if _floor(m) is not None and _floor(o) is not None and _floor(o) > _floor(m)]
    assert not bad, "imports up a floor: " + "; ".join(sorted(bad))


def test_utilities_import_no_floor():
    edges = _imports()
    bad = [f"{u} -> {o}" for u in UTILITIES if u in edges for o in edges[u] if _floor(o) is not None]
    assert not bad, "; ".join(bad)


def test_no_two_modules_import_each_other():
    edges = _imports()
    cycles = {tuple(sorted((m, o))) for m, outs in edges.items() for o in outs if m in edges.get(o, ())}
    assert cycles - KNOWN_CYCLES == set(), f"new import cycles: {sorted(cycles - KNOWN_CYCLES)}"
    assert KNOWN_CYCLES - cycles == set(), f"fixed, drop from KNOWN_CYCLES: {sorted(KNOWN_CYCLES - cycles)}"
