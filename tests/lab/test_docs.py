"""The docs name only what exists (README.md and docs/*.md).

- Every relative path, inside the repo: a markdown link's target and every `../` path (from the doc's folder),
  every path in the text under one of the tree's top folders (from the repo root), globs and `{a,b}`
  included, and every bare `NAME.md` (from the doc's folder or the root, unless the tree writes a file of that
  name: the demo's report.md). A path in git history is written `<commit>:<path>` (what `git show` reads) and
  must exist at that commit.
- Every dotted Python name that starts with `dasrl.` or `dasrl_lab.` resolves: the longest importable module,
  then getattr for the rest.
- Every `Class.attribute` in backticks whose class is defined once in dasrl/ or dasrl_lab/ (other projects'
  classes, vLLM's say, are not checked): the class has it, or an instance of it is given it (`self.name = ...`).
- README.md and docs/architecture.md, the newcomer's read: every backticked bare identifier that reads as code
  (with an underscore or an inner capital) is defined somewhere in the tree (a def, class, assignment,
  attribute or argument name), or is another project's name the doc quotes (FOREIGN).
"""

from __future__ import annotations

import ast
import fnmatch
import glob
import importlib
import inspect
import itertools
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NEWCOMER = [REPO / "README.md", REPO / "docs" / "architecture.md"]
PACKAGES = ("dasrl", "dasrl_lab")
TOP = ("dasrl", "dasrl_lab", "tests", "docs", "scripts", "benchmarks", "src")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w./:-])(?:([0-9a-f]{7,40}):)?((?:\.\./)*(?:%s)/[\w.*/{},-]*)" % "|".join(TOP))
UP = re.compile(r"(?<![\w./:-])((?:\.\./)+[\w.*/{},-]+)")
BARE_MD = re.compile(r"(?<![\w./:-])([\w-]+\.md)\b")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
DOTTED = re.compile(r"(?<![\w.])((?:%s)(?:\.[A-Za-z_]\w*)+)" % "|".join(PACKAGES))
ATTR = re.compile(r"(?<![\w.])([A-Z]\w*)\.([A-Za-z_]\w*)(?![\w.(])")
BARE = re.compile(r"`(_?[A-Za-z]\w*)(?:\(\))?`")
FOREIGN = {"custom_class": "vLLM's speculative method for a drafter class",
           "rollout_data_dir": "VeRL's trainer option that dumps rollouts"}


def _docs():
    return [(p, p.read_text()) for p in DOCS]


def _code(text: str) -> list[str]:
    return CODE.findall(text)


def _expand(path: str) -> list[str]:
    """`a/{b,c}.py` -> a/b.py, a/c.py."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand(path[:m.start()] + alt + path[m.end():])]


def _exists(base: Path, path: str) -> bool:
    """Every expansion of `path` from `base` exists (a glob: matches something), inside the repo."""
    def one(q: str) -> bool:
        if not (base / q).resolve().is_relative_to(REPO):
            return False  # outside the repo: not there for a user of it
        return bool(glob.glob(str(base / q))) if any(c in q for c in "*?[") else (base / q).exists()
    return all(one(q) for q in _expand(path))


@cache
def _tree(commit: str) -> tuple[str, ...] | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-tree", "-r", "-t", "--name-only", commit],
                             capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return tuple(out.stdout.split()) if out.returncode == 0 else ()


def _in_history(commit: str, path: str) -> bool | None:
    names = _tree(commit)
    if names is None:
        return None
    return all(any(fnmatch.fnmatch(n, q.rstrip("/")) for n in names) for q in _expand(path))


def _clean(path: str) -> str:
    return path.rstrip(".,;")


@cache
def _written() -> frozenset[str]:
    """File names the tree's code writes (string constants like "report.md")."""
    return frozenset(node.value for pkg in PACKAGES for path in (REPO / pkg).rglob("*.py")
                     for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Constant) and isinstance(node.value, str)
                     and re.fullmatch(r"[\w-]+\.\w+", node.value))


def test_every_path_a_doc_names_exists():
    missing = []
    for doc, text in _docs():
        where = doc.relative_to(REPO)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            target = target.split("#")[0]
            if target and not _exists(doc.parent, target):
                missing.append(f"{where}: link {target}")
        for commit, path in PATH.findall(text):
            path = _clean(path)
            if commit:
                if _in_history(commit, path) is False:
                    missing.append(f"{where}: {commit}:{path} (not in that commit)")
            elif not _exists(doc.parent if path.startswith("../") else REPO, path):
                missing.append(f"{where}: {path}")
        for path in UP.findall(text):
            if not _exists(doc.parent, _clean(path)):
                missing.append(f"{where}: {_clean(path)} (not in the repo)")
        for name in BARE_MD.findall(text):
            if not (_exists(doc.parent, name) or _exists(REPO, name) or name in _written()):
                missing.append(f"{where}: {name}")
    assert not missing, "paths the docs name that do not exist:\n" + "\n".join(sorted(set(missing)))


def _resolve(dotted: str) -> str | None:
    """None if `dotted` resolves, else what is missing."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name is None or not ".".join(parts[:i]).startswith(e.name):
                raise  # the module exists but needs something absent
            continue
        for name in parts[i:]:
            if not _has(obj, name):
                return f"{'.'.join(parts[:parts.index(name)])} has no {name}"
            obj = getattr(obj, name, None)
        return None
    return f"no module {parts[0]}"


def _has(obj, name: str) -> bool:
    if hasattr(obj, name):
        return True
    if not inspect.isclass(obj):
        return False
    for cls in obj.__mro__:  # instance attributes: self.name = ... in a method
        try:
            tree = ast.parse(inspect.getsource(cls).lstrip())
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self":
                return True
    return False


def test_every_dotted_name_resolves():
    bad = []
    for doc, text in _docs():
        for span in _code(text):
            for dotted in DOTTED.findall(span):
                why = _resolve(dotted)
                if why:
                    bad.append(f"{doc.relative_to(REPO)}: {dotted} ({why})")
    assert not bad, "names the docs give that do not resolve:\n" + "\n".join(sorted(set(bad)))


@cache
def _definitions() -> tuple[dict[str, list[tuple[str, str]]], frozenset[str]]:
    """(class name -> [(module, class)], every name the tree defines)."""
    classes: dict[str, list[tuple[str, str]]] = {}
    names: set[str] = set()
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            names.update(parts)  # package and module names
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    names.add(node.name)
                    classes.setdefault(node.name, []).append((module, node.name))
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
                    names.update(a.arg for a in itertools.chain(node.args.args, node.args.kwonlyargs))
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
    for src in (REPO / "src").rglob("*.[ch]pp"):
        names.update(re.findall(r"\b([A-Za-z_]\w*)\s*\(", src.read_text()))
    return classes, frozenset(names)


def test_every_class_attribute_a_doc_names_exists():
    classes, _ = _definitions()
    bad = []
    for doc, text in _docs():
        for span in _code(text):
            for cls_name, attr in ATTR.findall(span):
                where = classes.get(cls_name, [])
                if len(where) != 1:
                    continue  # not ours, or ambiguous
                module, _ = where[0]
                cls = getattr(importlib.import_module(module), cls_name)
                if not _has(cls, attr):
                    bad.append(f"{doc.relative_to(REPO)}: {cls_name}.{attr} ({module})")
    assert not bad, "attributes the docs name that do not exist:\n" + "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("doc", NEWCOMER, ids=lambda p: p.name)
def test_every_identifier_the_newcomers_docs_name_is_defined(doc):
    _, names = _definitions()
    text = doc.read_text()
    bad = sorted({n for n in BARE.findall(text) if ("_" in n.strip("_") or re.search(r"[a-z][A-Z]", n))
                  and n not in names and n not in FOREIGN})
    assert not bad, f"{doc.relative_to(REPO)} names what the tree does not define: {bad}"
