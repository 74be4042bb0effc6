"""Atomic file writes: write to a temporary file in the same folder, flush it to disk, then rename it over
the target, so a reader never sees a half-written file and a crash leaves the old one (or none).

Durability: the temporary file is fsync'ed before the rename (else a crash soon after could leave the
new name pointing at an empty or partial file on some filesystems) and the folder after it (else the
rename itself may be lost). Permissions: a new file gets the usual 0o666 minus the umask (the kernel
applies it, as for open()); a file that already exists keeps its mode.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import BinaryIO, Callable


def fsync_dir(folder: Path) -> None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(folder, flags)
    except OSError:  # a platform that cannot open folders (Windows): the rename is all we can do
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a folder; the data itself was synced
        pass
    finally:
        os.close(fd)


def temp_pattern(name_regex: str) -> re.Pattern:
    """The names of the temporary files atomic_write makes for targets whose names match `name_regex`
    (one that a killed writer can leave behind), for a caller that cleans up after its own writes."""
    return re.compile(rf"\.(?:{name_regex})\.[0-9a-f]{{12}}\.tmp")


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new temporary file next to `path`, created with mode 0o666 so that the umask applies
    (tempfile.mkstemp creates 0o600 whatever the umask says). Its name is matched by temp_pattern."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a temporary file next to {path}")


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Call write(f) on a temporary binary file next to `path`, fsync it, os.replace it onto `path`, and
    fsync the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            try:
                os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))  # rewriting: keep the file's mode
            except FileNotFoundError:
                pass
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def write_json(path: str | os.PathLike, obj: object, *, indent: int | None = 2) -> Path:
    return atomic_write(path, lambda f: f.write(json.dumps(obj, indent=indent).encode()))


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, *, dpi: int = 100, tight: bool = True) -> Path:
    """Write a matplotlib figure as PNG, atomically, and close it (also when the write fails)."""
    try:
        return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi,
                                                        **({"bbox_inches": "tight"} if tight else {})))
    finally:
        pyplot().close(fig)
