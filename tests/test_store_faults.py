"""Faults of the history drafter (issue 26): concurrent and killed saves, untrusted folders, decayed weights
that underflowed, budgets that are not ints or absurdly large."""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from dasrl.atomic import checksum
from dasrl.drafter.base import MAX_DRAFT
from dasrl.drafter.counting import CountingDrafter, _counting_draft
from dasrl.drafter.store import _MIN_STEP_WEIGHT, DraftStore, StoreConfig

ROOT = Path(__file__).resolve().parents[1]


def _store(tag: int, steps: int = 2) -> DraftStore:
    s = DraftStore(StoreConfig(window=4))
    for k in range(steps):
        s.add_rollout(tag, [tag, 1, 2], [3, 4, tag, k])
        s.end_step()
    return s


def _content(s: DraftStore) -> list:
    return sorted((str(shard), ix.weight(sid), ix.tokens(sid).tolist())
                  for shard, ix in s._shards.items() for sid in ix.ids())


def _run(code: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, **kw)


# ---------------------------------------------------------------------------------------- saves
SAVER = """
import sys
from dasrl.drafter.store import DraftStore, StoreConfig
folder, tag = sys.argv[1], int(sys.argv[2])
s = DraftStore(StoreConfig(window=4))
for k in range(40):
    s.add_rollout(tag, [tag, 1, 2], [3, 4, tag, k])
    s.end_step()
    s.save(folder)
    DraftStore.load(folder)  # a load between the saves of the other process
"""


def test_two_processes_saving_into_one_folder_end_with_one_complete_save(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    (folder / "store_backup.npz").write_bytes(b"mine")
    procs = [_run(SAVER, str(folder), str(tag), stderr=subprocess.PIPE) for tag in (100, 200)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    got = DraftStore.load(folder)
    got.check_integrity()
    assert {str(shard) for shard in got._shards} in ({"100"}, {"200"})  # one save's window, whole
    names = sorted(os.listdir(folder))
    assert names[0] == "store-" + json.loads((folder / "store.json").read_text())["data"][6:]
    assert names[1:] == ["store.json", "store_backup.npz"]  # nothing else of ours, the user's file kept


def test_save_deletes_only_its_own_files(tmp_path):
    folder = tmp_path / "s"
    folder.mkdir()
    user = ["store_backup.npz", "store.npz.bak", "store-1.npz", ".store.json.mine.tmp", "notes.tmp",
            "store-0123456789ABCDEF.npz"]
    for name in user:
        (folder / name).write_bytes(b"user data")
    _store(1).save(folder)
    _store(2).save(folder)
    data = json.loads((folder / "store.json").read_text())["data"]
    assert sorted(os.listdir(folder)) == sorted(user + ["store.json", data])
    assert _content(DraftStore.load(folder)) == _content(_store(2))


KILLED = """
import os, signal, sys
import dasrl.atomic
from dasrl.drafter.store import DraftStore, StoreConfig
def die(*a):
    os.kill(os.getpid(), signal.SIGKILL)
dasrl.atomic.os.replace = die  # killed with the npz's temporary file written, before its rename
s = DraftStore(StoreConfig())
s.add_rollout(1, [1, 2], [3, 4])
s.end_step()
s.save(sys.argv[1])
"""


def test_a_later_save_removes_what_a_killed_save_left(tmp_path):
    folder = tmp_path / "s"
    _store(1).save(folder)
    for _ in range(2):
        p = _run(KILLED, str(folder))
        p.wait(timeout=120)
        assert p.returncode == -9
    left = sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))
    assert len(left) == 2 and all(n.startswith(".store-") for n in left), left
    (folder / ".store.json.0123456789ab.tmp").write_bytes(b"{")  # a json write killed before its rename
    _store(2).save(folder)
    assert [n for n in os.listdir(folder) if n.endswith(".tmp")] == []
    assert _content(DraftStore.load(folder)) == _content(_store(2))


# ------------------------------------------------------------------------------ untrusted folders
def _saved(tmp_path) -> Path:
    folder = tmp_path / "s"
    _store(1).save(folder)
    return folder


def _data(folder: Path) -> Path:
    return folder / json.loads((folder / "store.json").read_text())["data"]


def test_symlinks_are_refused(tmp_path):
    folder = _saved(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    for f in (folder / "store.json", _data(folder)):
        os.replace(f, outside / f.name)
        os.symlink(outside / f.name, f)  # a valid file, but outside the folder
        with pytest.raises(ValueError, match=rf"{f.name}: is a symbolic link"):
            DraftStore.load(folder)
        os.unlink(f)
        os.replace(outside / f.name, f)
    DraftStore.load(folder)
    os.unlink(folder / "store.json")
    os.symlink("/dev/zero", folder / "store.json")
    with pytest.raises(ValueError, match="store.json: is a symbolic link"):
        DraftStore.load(folder)


def _load_in_thread(folder: Path) -> BaseException | None:
    """load() in a daemon thread: a load that hangs (a FIFO with no writer) fails the test, not the run."""
    out: list = []

    def go():
        try:
            DraftStore.load(folder)
            out.append(None)
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out.append(e)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(30)
    assert out, "load() hangs"
    return out[0]


def test_fifo_and_devices_are_refused(tmp_path):
    folder = _saved(tmp_path)
    os.unlink(folder / "store.json")
    os.mkfifo(folder / "store.json")
    e = _load_in_thread(folder)
    assert isinstance(e, ValueError) and "store.json: not a regular file" in str(e), e
    os.unlink(folder / "store.json")
    try:
        os.mknod(folder / "store.json", 0o600 | 0o020000, os.makedev(1, 5))  # a /dev/zero of our own
    except PermissionError:
        return
    e = _load_in_thread(folder)
    assert isinstance(e, ValueError) and "store.json: not a regular file" in str(e), e


def test_oversized_json_is_refused_unread(tmp_path):
    from dasrl.atomic import MAX_JSON_BYTES
    folder = _saved(tmp_path)
    with open(folder / "store.json", "r+b") as f:
        f.truncate(MAX_JSON_BYTES + 1)  # sparse: nothing is written, and nothing must be read
    with pytest.raises(ValueError, match=rf"store.json: {MAX_JSON_BYTES + 1} bytes, more than"):
        DraftStore.load(folder)


def test_compressed_npz_that_expands_is_refused(tmp_path):
    folder = _saved(tmp_path)
    doc = json.loads((folder / "store.json").read_text())
    n = 2_000_000  # a few KiB compressed
    buf = io.BytesIO()
    np.savez_compressed(buf, tokens=np.zeros(n, np.int32), offsets=np.array([0, n], np.int64))
    assert len(buf.getvalue()) < 50_000
    os.unlink(_data(folder))
    (folder / doc["data"]).write_bytes(buf.getvalue())
    doc.update(sha256=hashlib.sha256(buf.getvalue()).hexdigest(), num_steps=1, sequences=[[0, 1, 0.5]])
    (folder / "store.json").write_text(json.dumps({**doc, "checksum": checksum(doc)}))  # a crafted file: its (unkeyed) checksum recomputed
    with pytest.raises(ValueError, match=r"member (tokens|offsets)\.npy is compressed \(\d+ bytes declared to expand"):
        DraftStore.load(folder)


def test_load_with_a_config_that_is_not_one(tmp_path):
    folder = _saved(tmp_path)
    for bad in ("x", {"window": 3}, 3):
        with pytest.raises(TypeError, match=rf"config must be a StoreConfig or None, got {bad!r}"):
            DraftStore.load(folder, config=bad)


# --------------------------------------------------------------------------------- decayed weights
@pytest.mark.parametrize("mode, decay, steps", [("problem", 0.5, 1200), ("problem+request", 0.8, 2300),
                                                ("problem", 1e-3, 120)])
def test_unbounded_window_never_underflows(tmp_path, mode, decay, steps):
    store = DraftStore(StoreConfig(mode=mode, window=0, decay=decay))
    for k in range(steps):
        store.start(k, 7, [1, 2, 3])
        store.observe(k, [4, 5, 6, k % 50 + 10])
        store.finish(k)
        store.end_step()
        if k % 97 == 0 or k == steps - 1:
            store.start("r", 7, [1, 2, 3, 4, 5, 6])
            d = store.propose(["r"], [4])[0]
            store.abort("r")
            assert len(d) and np.isfinite(d.probs).all() and (d.probs > 0).all(), (k, d)
    kept = math.floor(math.log(_MIN_STEP_WEIGHT) / math.log(decay))
    assert len(store._steps) == min(steps, kept)  # the older steps were evicted, not kept at weight 0
    weights = [store._shards[sh].weight(sid) for step in store._steps for sh, sid in step
               if sh in store._shards]  # (the cross-problem index's copies carry the same weights)
    assert min(weights) >= _MIN_STEP_WEIGHT and all(math.isfinite(w) for w in weights)
    store.save(tmp_path / "s")
    assert _content(DraftStore.load(tmp_path / "s")) == _content(store)


def test_live_weight_is_bounded_so_decayed_weights_stay_normal():
    for bad in (1e-300, 1e200, 0.0):
        with pytest.raises(ValueError, match=r"live_weight must be in \[1e-100, 1e100\], got " + re.escape(repr(bad))):
            StoreConfig(live_weight=bad)


# ------------------------------------------------------------------------------------- budgets
@pytest.mark.parametrize("bad", [1.9, "3", True, np.float64(2.0), np.bool_(True), None, [2]])
def test_budgets_that_are_not_ints_are_refused_not_truncated(bad):
    store = DraftStore()
    store.start("r", 1, [1, 2, 3])
    with pytest.raises(ValueError, match=rf"draft budget must be an int, got {re.escape(repr(bad))} .* for request 'r'"):
        store.propose(["r"], [bad])
    with pytest.raises(ValueError, match=r"draft budget must be an int, got np.float64\(1.5\) \(float64\) for request 'r'"):
        store.propose(["r"], np.array([1.5]))
    with pytest.raises(ValueError, match=r"draft budget must be an int, got (np.)?(True|np.True_) \(bool_?\) for request 'r'"):
        store.propose(["r"], np.array([True]))


def test_huge_budgets_are_served_up_to_max_draft():
    # counting: "1 2 3 ..." never runs out, so only the cap ends the draft
    tail = [7, 9, 2, 14, 13, 1, 2, 14, 14, 1, 2, 14, 15, 1, 2]  # "a: 43, 44, 45, " (digit d = token 10 + d)
    toks = _counting_draft(np.array(tail), digits=np.arange(10, 20), budget=5 * MAX_DRAFT)
    assert len(toks) == MAX_DRAFT
    counting = CountingDrafter(DraftStore(), np.arange(10, 20))
    counting.start("r", 1, tail)
    assert len(counting.propose(["r"], [2**31 - 1])[0]) == MAX_DRAFT


# ------------------------------------------------------------------------- issue 37 item 6
LOAD_PEAK = """
import sys
from dasrl.drafter.store import DraftStore  # `import dasrl` loads torch: its memory is not the load's
def status(key):
    return int([line for line in open("/proc/self/status") if line.startswith(key)][0].split()[1]) // 1024
with open("/proc/self/clear_refs", "w") as f:  # reset the peak RSS to the current RSS
    f.write("5")
before = status("VmRSS:")
try:
    DraftStore.load(sys.argv[1])
    print("LOADED")
except ValueError as e:
    print("REFUSED", e)
print("PEAK_MB", status("VmHWM:") - before)  # what the load itself added at its peak
"""


def test_an_npz_larger_than_its_json_declares_is_refused_before_it_is_read(tmp_path):
    """A crafted save: store.json declares one sequence of 4 tokens (and carries the npz's true sha256, an
    unkeyed checksum anyone can compute), the npz holds 100M tokens (400 MB). The load must refuse it from
    the zip directory, without reading the tokens: the child's peak RSS stays far below the member's size
    (it read the whole file, then the array, before any check on the old code: > 800 MB)."""
    folder = _saved(tmp_path)
    doc = json.loads((folder / "store.json").read_text())
    n = 100_000_000
    buf = io.BytesIO()
    np.savez(buf, tokens=np.zeros(n, np.int32), offsets=np.array([0, 4], np.int64))
    data = buf.getvalue()
    del buf
    os.unlink(_data(folder))
    digest = hashlib.sha256(data).hexdigest()
    name = f"store-{digest[:16]}.npz"
    (folder / name).write_bytes(data)
    del data
    doc.update(data=name, sha256=digest, num_steps=1, sequences=[[0, 1, 0.5]])
    (folder / "store.json").write_text(json.dumps({**doc, "checksum": checksum(doc)}))  # a crafted file: its (unkeyed) checksum recomputed
    out = subprocess.run([sys.executable, "-c", LOAD_PEAK, str(folder)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert "REFUSED" in out.stdout and "tokens.npy is 400000128 bytes, more than the" in out.stdout, out
    peak = int(out.stdout.split("PEAK_MB")[1])
    assert peak < 200, f"peak RSS {peak} MB: the tokens were read before the check"


def test_big_endian_tokens_are_a_value_error(tmp_path):
    """Tokens stored big-endian (a hand-made npz): the documented ValueError, not a TypeError from the
    native index's checks."""
    folder = _saved(tmp_path)
    doc = json.loads((folder / "store.json").read_text())
    with np.load(_data(folder)) as z:
        tokens, offsets = z["tokens"], z["offsets"]
    buf = io.BytesIO()
    np.savez(buf, tokens=tokens.astype(">i4"), offsets=offsets)
    data = buf.getvalue()
    os.unlink(_data(folder))
    digest = hashlib.sha256(data).hexdigest()
    (folder / f"store-{digest[:16]}.npz").write_bytes(data)
    doc.update(data=f"store-{digest[:16]}.npz", sha256=digest)
    (folder / "store.json").write_text(json.dumps({**doc, "checksum": checksum(doc)}))  # a crafted file: its (unkeyed) checksum recomputed
    with pytest.raises(ValueError, match=r"'tokens' must be a 1-D integer array in this machine's byte order, got >i4"):
        DraftStore.load(folder)
