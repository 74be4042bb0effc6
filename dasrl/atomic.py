"""Safe file I/O, the one place every loader and writer goes through.

Reading: only a regular file of bounded size, else a ValueError naming the path before a byte is read (a FIFO
would block forever, /dev/zero never ends, a huge file eats memory first); symlinks only where the caller
follows them (a path the user typed may be one, a file inside a folder we wrote never is).

Writing (atomic_write): a temporary file in the same folder, fsync'ed, renamed over the target, the folder
fsync'ed: a reader never sees a half-written file and a crash leaves the old one. A symlink is written
through; a target that is not a regular file is refused (renaming over /dev/stdout would replace the node).

Checkpoint: the one crash-safe save of a draft store and of a rollout session (docs/drafter.md,
"Persistence"): KIND.json, with the sha256 of its own canonical JSON, names KIND-<sha256[:16]>.npz; the data
file is written first and the manifest's rename is the commit. A save holds an exclusive flock on the folder,
a load a shared one. The checksums detect damage, not forgery: every field is still validated.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import re
import secrets
import stat
import zipfile
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np

__all__ = ["MAX_JSON_BYTES", "open_regular", "read_regular", "read_json", "write_target", "atomic_write", "write_json",
           "checksum", "Checkpoint"]


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a platform that cannot open folders (Windows): the rename is all we can do
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on a folder; the data was synced
            os.fsync(fd)
    finally:
        os.close(fd)


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new .NAME.<12 hex>.tmp next to `path`, mode 0o666 minus the umask (mkstemp would give 0o600)."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        with contextlib.suppress(FileExistsError):
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
    raise FileExistsError(f"cannot create a temporary file next to {path}")


MAX_JSON_BYTES = 2**28
"""Largest JSON file a loader reads (256 MiB: a store.json of ~6M sequences; our other JSON files are KiB)."""
_MAX_DATA_BYTES = 2**34
"""Largest checkpoint data file (npz) a loader reads (16 GiB)."""


def open_regular(path: str | os.PathLike, limit: int, *, follow_symlinks: bool = False) -> BinaryIO:
    """`path` opened for binary reading if it is a regular file of at most `limit` bytes (and not a symlink
    unless follow_symlinks), else ValueError naming it; a missing or unreadable file raises its OSError."""
    path = Path(path)
    # O_NONBLOCK: opening a FIFO returns at once (refused below) instead of waiting for a writer
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
    """JSON from read_regular; anything not UTF-8 JSON (too deep nesting included) is a ValueError naming path."""
    data = read_regular(path, limit, follow_symlinks=follow_symlinks)
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None


def write_target(path: str | os.PathLike) -> Path:
    """Where a write to `path` lands: `path`, or the file a symlink there points to. A path that is, or points
    to, anything but a regular file is refused (ValueError): writing would replace it."""
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
    """write(f) on a temporary file next to write_target(path), fsync'ed and renamed onto it (module docstring)."""
    path = write_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            with contextlib.suppress(FileNotFoundError):
                os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))  # rewriting: keep the file's mode
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def write_json(path: str | os.PathLike, obj: object, *, indent: int | None = 2) -> Path:
    return atomic_write(path, lambda f: f.write(json.dumps(obj, indent=indent).encode()))


@contextlib.contextmanager
def _folder_lock(folder: str | os.PathLike, how: int) -> Iterator[None]:
    """An flock on the folder itself: no lock file left behind, released by the kernel if the process dies."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def checksum(doc: dict) -> str:
    """sha256 of a manifest's canonical JSON (sorted keys, no spaces), its own 'checksum' left out."""
    text = json.dumps({k: v for k, v in doc.items() if k != "checksum"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


_NPY_HEADER = 4096
"""Most bytes of an npy member's header (numpy writes 64-128)."""


class Checkpoint:
    """A save folder of one kind ("store", "session"): KIND.json naming KIND-<hash>.npz (module docstring)."""

    def __init__(self, folder: str | os.PathLike, kind: str, noun: str) -> None:
        self.folder, self.kind, self.noun = Path(folder), kind, noun
        self.manifest = self.folder / f"{kind}.json"
        self._data = re.compile(rf"{kind}-[0-9a-f]{{16}}\.npz")
        # the temporaries _create_temp makes for KIND.json and the data files (a killed save leaves them)
        self._temp = re.compile(rf"\.(?:{kind}\.json|{kind}-[0-9a-f]{{16}}\.npz)\.[0-9a-f]{{12}}\.tmp")

    def error(self, detail: str) -> ValueError:
        return ValueError(f"cannot read a {self.noun} from {self.folder}: {detail}")

    def bad(self, detail: str) -> ValueError:
        return ValueError(f"{self.manifest}: not a valid {self.noun}: {detail}")

    def save(self, doc: dict, arrays: dict[str, np.ndarray] | None = None) -> None:
        """Commit `doc` (JSON) and `arrays` (1-D integer arrays, or None for no data file) as one save; then
        delete only what saves of this kind leave (other data files, temporaries): the rest is the user's."""
        name = data = None
        if arrays is not None:
            buf = io.BytesIO()
            np.savez(buf, **arrays)  # ZIP_STORED: uncompressed
            data = buf.getvalue()
            digest = hashlib.sha256(data).hexdigest()
            name = f"{self.kind}-{digest[:16]}.npz"
            doc = {**doc, "data": name, "sha256": digest}
        doc = json.loads(json.dumps(doc))  # as a load will see it (int keys become strings...)
        doc = {"checksum": checksum(doc), **doc}
        self.folder.mkdir(parents=True, exist_ok=True)
        with _folder_lock(self.folder, fcntl.LOCK_EX):
            ours = name is not None and not (self.folder / name).exists()  # an identical save's file is not ours
            try:
                if data is not None:
                    atomic_write(self.folder / name, lambda f: f.write(data))
                write_json(self.manifest, doc, indent=None)  # the commit point
            except BaseException:
                if ours and (self.folder / name).exists():
                    os.unlink(self.folder / name)  # never committed: the previous save stays whole
                raise
            for entry in os.scandir(self.folder):  # under the lock, every other such file is a dead save's
                if (self._data.fullmatch(entry.name) and entry.name != name) or self._temp.fullmatch(entry.name):
                    os.unlink(entry.path)

    @contextlib.contextmanager
    def reading(self, fmt: str) -> Iterator[dict]:
        """The manifest (format `fmt`, checksum verified), under the shared lock: read its data inside."""
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(_folder_lock(self.folder, fcntl.LOCK_SH))
            except OSError as e:  # the folder itself: missing, not a folder, unreadable
                raise self.error(str(e)) from None
            with self._open(self.manifest, MAX_JSON_BYTES) as f:
                text = f.read(MAX_JSON_BYTES + 1)
            try:
                doc = json.loads(text)
            except (ValueError, RecursionError) as e:  # not UTF-8 JSON, or nested too deep
                raise self.error(f"{self.manifest.name}: not valid JSON ({type(e).__name__}: {e})") from None
            if not isinstance(doc, dict):
                raise self.bad(f"expected a JSON object, got {type(doc).__name__}")
            if doc.get("format") != fmt:
                raise ValueError(f"{self.manifest}: not a dasrl {self.kind} (format {doc.get('format')!r})")
            if "checksum" in doc and doc["checksum"] != checksum(doc):  # absent only in a hand-made file
                raise ValueError(f"{self.manifest}: checksum mismatch (the file was changed or damaged after it "
                                 f"was written)")
            doc.pop("checksum", None)
            yield doc

    def arrays(self, doc: dict, limits: dict[str, int]) -> dict[str, np.ndarray]:
        """The arrays of the data file `doc` names: exactly the keys of `limits`, each 1-D, integer, native
        byte order, at most limits[key] values. The zip directory is checked before the checksum and the
        checksum before the arrays are read, so memory is bounded by the manifest, not by the file."""
        name, digest = doc.get("data"), doc.get("sha256")
        if not (isinstance(name, str) and self._data.fullmatch(name)) or not isinstance(digest, str):
            raise self.bad(f"'data' must name a {self.kind}-<hash>.npz file and 'sha256' its digest, got "
                           f"{name!r}, {digest!r}")
        path = self.folder / name
        with self._open(path, _MAX_DATA_BYTES) as f:
            try:
                members = zipfile.ZipFile(f).infolist()
            except (zipfile.BadZipFile, ValueError, EOFError, OSError) as e:
                raise self.error(f"{name}: not a readable npz ({type(e).__name__}: {e})") from None
            names, want = sorted(m.filename for m in members), sorted(f"{k}.npy" for k in limits)
            if names != want:
                raise self.error(f"{name}: must hold exactly {want}, got {names}")
            for m in members:
                if m.compress_type != zipfile.ZIP_STORED or m.file_size != m.compress_size:
                    raise self.error(f"{name}: member {m.filename} is compressed ({m.compress_size} bytes declared "
                                     f"to expand to {m.file_size}); saves are uncompressed")
                n = limits[m.filename[:-4]]
                if m.file_size > 8 * n + _NPY_HEADER:  # int64 values + header
                    raise self.bad(f"{name}: {m.filename} is {m.file_size} bytes, more than the {n} values "
                                   f"{self.manifest.name} declares")
            f.seek(0)
            h = hashlib.sha256()
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            if h.hexdigest() != digest:
                raise ValueError(f"{path}: does not match {self.manifest} (checksum differs: a damaged file, or "
                                 f"files from different saves)")
            try:
                f.seek(0)
                with np.load(f, allow_pickle=False) as z:
                    out = {key: z[key] for key in limits}
            except Exception as e:  # BadZipFile, EOFError, ValueError (pickled), ...: all one error
                raise self.error(f"{name}: {type(e).__name__}: {e}") from None
        for key, arr in out.items():
            if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu") or not arr.dtype.isnative:
                raise self.bad(f"{name}: {key!r} must be a 1-D integer array in this machine's byte order, got "
                               f"{arr.dtype.str} of shape {arr.shape}")
        return out

    @contextlib.contextmanager
    def _open(self, path: Path, limit: int) -> Iterator[BinaryIO]:
        """open_regular, its refusals as this checkpoint's errors."""
        try:
            f = open_regular(path, limit)
        except ValueError as e:
            raise self.error(str(e)) from None
        except OSError as e:
            raise self.error(f"{path.name}: {e.strerror}") from None
        with f:
            yield f
