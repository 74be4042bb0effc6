"""Atomic writes: the umask decides a new file's mode, a rewrite keeps the file's mode, the data is
fsync'ed before the rename and the folder after it, and a failed write leaves the old file and no
temporary."""

from __future__ import annotations

import os
import stat

import pytest

from dasrl.atomic import atomic_write, write_json


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.mark.parametrize("umask, want", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_file_respects_the_umask(tmp_path, umask, want):
    old = os.umask(umask)
    try:
        write_json(tmp_path / "a.json", {"x": 1})
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a.json") == want


def test_rewrite_keeps_the_existing_mode(tmp_path):
    p = tmp_path / "a.json"
    write_json(p, {"x": 1})
    os.chmod(p, 0o640)
    write_json(p, {"x": 2})
    assert _mode(p) == 0o640 and p.read_text().strip().endswith("}")


def test_fsync_file_before_rename_and_folder_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):  # the real call, recorded: a file or the folder?
        events.append("fsync-dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync-file")
        return real_fsync(fd)

    def replace(a, b):
        events.append("replace")
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic_write(tmp_path / "b.bin", lambda f: f.write(b"data"))
    assert events == ["fsync-file", "replace", "fsync-dir"]
    assert (tmp_path / "b.bin").read_bytes() == b"data"


def test_failed_write_keeps_the_old_file_and_no_temporary(tmp_path):
    p = tmp_path / "c.bin"
    atomic_write(p, lambda f: f.write(b"old"))

    def broken(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(p, broken)
    assert p.read_bytes() == b"old" and os.listdir(tmp_path) == ["c.bin"]
