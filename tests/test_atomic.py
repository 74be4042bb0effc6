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


# ------------------------------------------------------------------------- issue 37 item 10
def test_a_symlink_is_written_through(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    os.symlink("real.json", tmp_path / "link.json")
    write_json(tmp_path / "link.json", {"x": 1})
    assert os.path.islink(tmp_path / "link.json") and os.readlink(tmp_path / "link.json") == "real.json"
    assert real.read_text() == '{\n  "x": 1\n}'


def test_fifos_devices_and_links_to_them_are_refused_not_replaced(tmp_path):
    """atomic_write renamed its temporary over whatever was at the path: a FIFO, a device node, the target
    of /dev/stdout (-> /proc/self/fd/1) became a regular file."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        write_json(fifo, {"x": 1})
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    r, w = os.pipe()
    try:
        os.symlink(f"/proc/self/fd/{w}", tmp_path / "stdout")
        with pytest.raises(ValueError, match="not a regular file"):
            write_json(tmp_path / "stdout", {"x": 1})
        assert os.path.islink(tmp_path / "stdout")
    finally:
        os.close(r)
        os.close(w)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "stdout"]  # no temporary left
    try:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        return
    with pytest.raises(ValueError, match="not a regular file"):
        write_json(tmp_path / "null", {"x": 1})
    assert stat.S_ISCHR(os.lstat(tmp_path / "null").st_mode)


def test_open_regular_refuses_what_would_hang_or_never_end(tmp_path):
    from dasrl.atomic import read_regular

    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match="not a regular file"):
        read_regular(tmp_path / "fifo", 100)  # returns at once: O_NONBLOCK, then refused
    os.symlink("/dev/zero", tmp_path / "zero")
    with pytest.raises(ValueError, match="is a symbolic link"):
        read_regular(tmp_path / "zero", 100)
    with pytest.raises(ValueError, match="not a regular file"):
        read_regular(tmp_path / "zero", 100, follow_symlinks=True)
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(ValueError, match="101 bytes, more than the 100"):
        read_regular(tmp_path / "big", 100)
    assert read_regular(tmp_path / "big", 101) == b"x" * 101
