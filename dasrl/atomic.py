"""Safe file I/O, the one place every loader and writer goes through.

Reading (open_regular, read_regular): a file a loader reads must be a regular file of bounded size. A FIFO
would block the open (or the read) forever, a device such as /dev/zero never ends, a huge file eats memory
before any check: all are refused with a ValueError naming the path, before anything is read. Symlinks are
refused too unless the caller asks to follow them (a path the user typed may be one; a file inside a folder
we wrote, such as a session save, never is).

Writing (atomic_write): write to a temporary file in the same folder, flush it to disk, then rename it over
the target, so a reader never sees a half-written file and a crash leaves the old one (or none). A target
that is a symlink is written through (the file it points to is replaced, the link stays); a target that is
not a regular file (a device such as /dev/stdout, a FIFO, a socket), directly or behind a link, is refused:
renaming over it would replace the node itself, for root even a system one.

Durability: the temporary file is fsync'ed before the rename (else a crash soon after could leave the
new name pointing at an empty or partial file on some filesystems) and the folder after it (else the
rename itself may be lost). Permissions: a new file gets the usual 0o666 minus the umask (the kernel
applies it, as for open()); a file that already exists keeps its mode.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import BinaryIO, Callable, Iterator


__all__ = ["fsync_dir", "temp_pattern", "MAX_JSON_BYTES", "open_regular", "read_regular", "read_json", "write_target",
           "atomic_write", "write_json"]

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


MAX_JSON_BYTES = 2**28
"""Largest JSON file a loader reads (256 MiB: a store.json of ~6M sequences; our other JSON files are KiB)."""


def open_regular(path: str | os.PathLike, limit: int, *, follow_symlinks: bool = False) -> BinaryIO:
    """`path` opened for binary reading, after checking that it is a regular file of at most `limit` bytes
    (not a symlink unless follow_symlinks); else ValueError naming it. A file that cannot be opened at all
    (missing, unreadable) raises its OSError as it is."""
    path = Path(path)
    # O_NONBLOCK: opening a FIFO returns at once (refused below) instead of waiting for a writer; it has
    # no effect on the reads of a regular file.
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_BINARY", 0) | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            raise ValueError(f"{path}: is a symbolic link; refused (this file must be a regular file)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file (mode {stat.filemode(st.st_mode)}: a FIFO, a device "
                             f"or a socket would block or never end); refused")
        if st.st_size > limit:
            raise ValueError(f"{path}: {st.st_size} bytes, more than the {limit} this file may hold; refused unread")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, limit: int, *, follow_symlinks: bool = False) -> bytes:
    """The bytes of `path`, opened by open_regular (same checks, same errors)."""
    with open_regular(path, limit, follow_symlinks=follow_symlinks) as f:
        data = f.read(limit + 1)
    if len(data) > limit:  # grew while we read
        raise ValueError(f"{path}: more than the {limit} bytes this file may hold; refused")
    return data


def read_json(path: str | os.PathLike, limit: int, *, follow_symlinks: bool = False) -> object:
    """JSON from a file read by read_regular; anything that is not UTF-8 JSON (deep nesting included, which
    raises RecursionError in the parser) is one ValueError naming the path."""
    data = read_regular(path, limit, follow_symlinks=follow_symlinks)
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None


def write_target(path: str | os.PathLike) -> Path:
    """Where a write to `path` lands: `path`, or the file a symlink at `path` points to (written through,
    the link kept). A path that is, or points to, something other than a regular file is refused
    (ValueError): a device, a FIFO or a socket would be replaced by a regular file."""
    path = Path(path)
    try:
        st = os.stat(path)  # follows links, the kernel's magic ones (/dev/stdout -> /proc/self/fd/1) too
    except FileNotFoundError:
        return path.resolve() if path.is_symlink() else path  # new (a dangling link: made where it points)
    except OSError as e:
        raise ValueError(f"{path}: cannot be written ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else f"not a regular file (mode {stat.filemode(st.st_mode)})"
        raise ValueError(f"{path} is {kind}; an output must be a regular file (writing would replace it, "
                         f"not write into it)")
    return path.resolve() if path.is_symlink() else path


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Call write(f) on a temporary binary file next to `path`, fsync it, os.replace it onto `path`, and
    fsync the folder. A symlink is written through; a device, FIFO or socket is refused (write_target)."""
    path = write_target(path)
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



@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, how: int) -> Iterator[None]:
    """An flock (fcntl.LOCK_EX or LOCK_SH) on the folder itself: no lock file left behind; released by the
    kernel if the process dies. The one lock of every save and load (a draft store's folder, a session's
    parent folder)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)  # closing releases the lock
