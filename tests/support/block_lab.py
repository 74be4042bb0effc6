"""Makes `dasrl_lab` unimportable, to prove the library's tests need no lab (`make test-lib`).

`install()` puts a finder first on sys.meta_path that refuses `dasrl_lab` and its submodules with the
ModuleNotFoundError a machine without the lab would raise. tests/conftest.py calls it when DASRL_BLOCK_LAB=1
(and then does not collect tests/lab/)."""

from __future__ import annotations

import importlib.abc
import sys

BLOCKED = "dasrl_lab"


class LabBlocker(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == BLOCKED or fullname.startswith(BLOCKED + "."):
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked: DASRL_BLOCK_LAB=1)", name=fullname)
        return None


def install() -> None:
    loaded = sorted(m for m in sys.modules if m == BLOCKED or m.startswith(BLOCKED + "."))
    if loaded:
        raise RuntimeError(f"the lab was imported before it could be blocked: {loaded}")
    if not any(isinstance(f, LabBlocker) for f in sys.meta_path):
        sys.meta_path.insert(0, LabBlocker())
