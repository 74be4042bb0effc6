"""Atomic file writes: write to a temporary file in the same folder, then rename over the target, so a
reader never sees a half-written file and a crash leaves the old one (or none)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Call write(f) on a temporary binary file next to `path`, then os.replace it onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_json(path: str | os.PathLike, obj: object, *, indent: int | None = 2) -> Path:
    return atomic_write(path, lambda f: f.write(json.dumps(obj, indent=indent).encode()))
