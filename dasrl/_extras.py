"""The extras of `pip install dasrl[...]` as the library's import paths need them: a path that needs an extra
which is not installed raises ImportError naming the extra, not a bare "No module named 'torch'". It imports
nothing of the library (every floor may use it).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Callable

_EXTRA_MODULES = {"engine": ("torch", "transformers"), "trl": ("trl",), "ray": ("ray",), "vllm": ("vllm",)}
"""Each extra -> the top-level modules it brings that the library imports."""

_EXTRA_OF = {module: extra for extra, modules in _EXTRA_MODULES.items() for module in modules}


class _MissingExtra(ImportError):
    """A dasrl path needs an extra that is not installed (`name` is the missing module)."""


def _error(what: str, module: str) -> _MissingExtra:
    extra = _EXTRA_OF[module]
    return _MissingExtra(f"{what} needs {module}, which is not installed: pip install 'dasrl[{extra}]'", name=module)


def require(extra: str, what: str) -> None:
    """Raise _MissingExtra if a module of `extra` is not installed (found without being imported)."""
    for module in _EXTRA_MODULES[extra]:
        if sys.modules.get(module) is None and importlib.util.find_spec(module) is None:
            raise _error(what, module)


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """PEP 562 `__getattr__` and `__dir__` for a package whose names (name -> module) load on first use, so
    importing the package (or a numpy-only submodule) does not import what its other modules need."""

    def __getattr__(name: str) -> object:
        try:
            module = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        try:
            loaded = importlib.import_module(module)
        except ModuleNotFoundError as e:  # a module an extra brings: _MissingExtra naming the extra
            top = (e.name or "").split(".")[0]
            if top in _EXTRA_OF:
                raise _error(f"{package}.{name}", top) from e
            raise
        value = getattr(loaded, name)
        setattr(sys.modules[package], name, value)  # loaded once
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
