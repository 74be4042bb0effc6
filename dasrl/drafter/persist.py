"""A DraftStore's window on disk: `store.json` (metadata) + one npz of tokens, no pickle.

Atomic as a pair: the npz is written first under a content-addressed name (`store-<sha256[:16]>.npz`),
then `store.json`, which names it and carries its sha256, is renamed into place: that rename is the commit
point. A reader therefore sees the old pair or the new one; a crash in between leaves the old JSON naming
the old npz (deleted only after the commit). A JSON and an npz that do not belong together (checksum
differs) are refused, as is anything malformed: every field is validated before a store is built.

Several writers: a save holds an exclusive flock on the folder from its first write to its cleanup, a load
a shared one, so concurrent saves run one after the other (the last one wins, complete) and a load never
sees a data file deleted under it. The cleanup deletes only what saves write: other `store-<hash>.npz`
files (older saves, a killed save's orphan) and atomic_write's temporary files of those names; any other
file in the folder is the user's and stays.

Untrusted folders: `store.json` and the npz must be regular files, not symlinks (dasrl.atomic.open_regular;
a FIFO or a device is refused, not read), of bounded size; the npz members must be the two arrays, stored
uncompressed as save writes them (a compressed member could expand far past the file's size), their
sizes read from the zip directory and checked against what store.json declares (its sequence count, the
offsets' token count) before the tokens are read: memory is bounded by the declared window, not the file.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import math
import os
import re
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable

import numpy as np

from dasrl.atomic import MAX_JSON_BYTES, atomic_write, folder_lock, open_regular, temp_pattern, write_json
from dasrl.drafter.config import StoreConfig
from dasrl.drafter.suffix import first_bad

FORMAT = "dasrl-store/2"
MAX_STEPS = 2**20
"""Most steps a saved window may hold."""
_DATA_NAME = re.compile(r"store-[0-9a-f]{16}\.npz")
_TEMP_NAME = temp_pattern(r"store\.json|store-[0-9a-f]{16}\.npz")
MAX_DATA_BYTES = 2**34
"""Largest npz read (16 GiB)."""
MAX_TOKENS = 2**31
"""Most tokens a saved window may hold."""


@dataclass(frozen=True)
class SavedStore:
    """What load_store() read and validated."""

    config: StoreConfig
    """The config to build the store with (the caller's, else the saved mode/window/decay)."""
    step: int
    """The store's step counter."""
    num_steps: int
    """Steps in the window (ages run 0..num_steps-1, 0 = the newest)."""
    sequences: list[tuple[int, Hashable, float, np.ndarray]]
    """(age, problem id, weight, tokens [n] int32) of every sequence in the window."""


def save_store(folder: Path, *, step: int, num_steps: int, config: StoreConfig,
               sequences: list[tuple[int, Hashable, float, np.ndarray]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    offsets = np.zeros(len(sequences) + 1, np.int64)
    np.cumsum([len(s[3]) for s in sequences], out=offsets[1:])
    tokens = np.concatenate([s[3] for s in sequences]).astype(np.int32) if sequences else np.zeros(0, np.int32)
    buf = io.BytesIO()
    np.savez(buf, tokens=tokens, offsets=offsets)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    name = f"store-{digest[:16]}.npz"
    doc = {"format": FORMAT, "step": step, "num_steps": num_steps, "data": name, "sha256": digest,
           "config": {"mode": config.mode, "window": config.window, "decay": config.decay},
           "sequences": [[age, shard, weight] for age, shard, weight, _ in sequences]}
    with folder_lock(folder, fcntl.LOCK_EX):
        atomic_write(folder / name, lambda f: f.write(data))
        write_json(folder / "store.json", doc, indent=None)  # the commit point
        for entry in os.scandir(folder):
            if (_DATA_NAME.fullmatch(entry.name) and entry.name != name) or _TEMP_NAME.fullmatch(entry.name):
                os.unlink(entry.path)


def foreign_files(folder: Path) -> list[str]:
    """Names in a store folder that no save writes (anything but store.json, store-<hash>.npz and their
    temporaries): a loader refuses such a folder before reading a byte of it."""
    def known(name: str) -> bool:
        return name == "store.json" or bool(_DATA_NAME.fullmatch(name) or _TEMP_NAME.fullmatch(name))
    return sorted(e.name for e in os.scandir(folder) if e.is_dir(follow_symlinks=False) or not known(e.name))


def load_store(folder: Path, config: StoreConfig | None = None) -> SavedStore:
    try:
        with folder_lock(folder, fcntl.LOCK_SH):
            return _load(folder, config)
    except OSError as e:  # the folder itself: missing, not a folder, unreadable
        raise ValueError(f"cannot read a draft store from {folder}: {e}") from None


def _load(folder: Path, config: StoreConfig | None) -> SavedStore:
    where = folder / "store.json"

    def bad(what: str) -> ValueError:
        return ValueError(f"{where}: not a valid draft store: {what}")

    with _opened(where, MAX_JSON_BYTES) as f:
        text = f.read(MAX_JSON_BYTES + 1)
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:  # not JSON (UnicodeDecodeError is a ValueError; deep nesting is not)
        raise ValueError(f"cannot read a draft store from {folder}: {e}") from None
    if not isinstance(doc, dict):
        raise bad(f"expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise ValueError(f"{where}: not a dasrl store (format {doc.get('format')!r})")
    saved = doc.get("config")
    if not isinstance(saved, dict):
        raise bad(f"'config' must be an object, got {saved!r}")
    try:
        saved_cfg = StoreConfig(mode=saved.get("mode"), window=saved.get("window"), decay=saved.get("decay"))
    except (ValueError, TypeError) as e:
        raise bad(f"config: {e}") from None
    cfg = config or saved_cfg
    step, num_steps, seqs = doc.get("step"), doc.get("num_steps"), doc.get("sequences")
    if not _int(step) or step < 0:
        raise bad(f"'step' must be an int >= 0, got {step!r}")
    limit = min(step, saved_cfg.window or MAX_STEPS, MAX_STEPS)
    if not _int(num_steps) or not 0 <= num_steps <= limit:
        raise bad(f"'num_steps' must be an int in [0, {limit}] (step {step}, window {saved_cfg.window}), "
                  f"got {num_steps!r}")
    if not isinstance(seqs, list):
        raise bad(f"'sequences' must be a list, got {type(seqs).__name__}")
    for i, s in enumerate(seqs):
        if not (isinstance(s, list) and len(s) == 3):
            raise bad(f"sequence {i} must be [age, problem id, weight], got {s!r}")
        age, shard, weight = s
        if not _int(age) or not 0 <= age < num_steps:
            raise bad(f"sequence {i}: age must be an int in [0, {num_steps}), got {age!r}")
        if not (isinstance(shard, (int, str)) and not isinstance(shard, bool)):
            raise bad(f"sequence {i}: problem id must be an int or a str, got {shard!r}")
        if not (isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight)
                and 0 < weight <= 1e300):
            raise bad(f"sequence {i}: weight must be positive and finite, got {weight!r}")
    tokens, offsets = _read_data(folder, doc, len(seqs), bad)
    pos = first_bad(tokens, cfg.token_limit)
    if pos >= 0:
        raise bad(f"token id {int(tokens[pos])} at position {pos} is outside [0, {cfg.token_limit})")
    tokens = tokens.astype(np.int32, copy=False)
    out = [(int(age), shard, float(w), tokens[offsets[i]:offsets[i + 1]]) for i, (age, shard, w) in enumerate(seqs)]
    return SavedStore(cfg, int(step), int(num_steps), out)


def _read_data(folder: Path, doc: dict, n_seqs: int, bad) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, offsets) from the npz the JSON names, checked against its sha256. Read in the order that
    bounds memory by what the JSON declares: the zip directory, then offsets (n_seqs + 1 of them), then the
    tokens member's declared size against the offsets' token count, then the checksum (streamed), and only
    then the tokens: a crafted multi-GB npz is refused before it is read."""
    name, digest = doc.get("data"), doc.get("sha256")
    if not (isinstance(name, str) and _DATA_NAME.fullmatch(name)) or not isinstance(digest, str):
        raise bad(f"'data' must name a store-<hash>.npz file and 'sha256' its digest, got {name!r}, {digest!r}")
    path = folder / name
    with _opened(path, MAX_DATA_BYTES) as f:
        members = _check_members(path, f)
        if members["offsets.npy"] > 8 * (n_seqs + 1) + _NPY_HEADER:
            raise bad(f"{name}: offsets.npy is {members['offsets.npy']} bytes, more than {n_seqs + 1} offsets")
        offsets = _array(f, path, "offsets", bad)
        if len(offsets) != n_seqs + 1:
            raise bad(f"{n_seqs} sequences but {len(offsets)} offsets (expected {n_seqs + 1})")
        offsets = offsets.astype(np.int64)
        total = int(offsets[-1])
        if offsets[0] != 0 or (np.diff(offsets) < 0).any() or total > MAX_TOKENS:
            raise bad(f"offsets must rise from 0 to the token count (at most {MAX_TOKENS}) without decreasing")
        if members["tokens.npy"] > 8 * total + _NPY_HEADER:
            raise bad(f"{name}: tokens.npy is {members['tokens.npy']} bytes, more than the {total} tokens "
                      f"the offsets declare")
        if digest is not None:
            f.seek(0)
            h = hashlib.sha256()
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            if h.hexdigest() != digest:
                raise ValueError(f"{path}: does not match {folder / 'store.json'} (checksum differs: a damaged "
                                 f"file, or files from different saves)")
        tokens = _array(f, path, "tokens", bad)
    if len(tokens) != total:
        raise bad(f"offsets must rise from 0 to {len(tokens)} (the token count) without decreasing")
    tokens = np.ascontiguousarray(tokens)
    if tokens.size == 0:
        tokens = np.zeros(0, np.int32)
    return tokens, offsets


_NPY_HEADER = 4096
"""Most bytes of an npy member's header (numpy writes 64-128)."""


def _array(f, path: Path, key: str, bad) -> np.ndarray:
    """One member of the npz open in `f`: a 1-D integer array in native byte order."""
    try:
        f.seek(0)
        with np.load(f, allow_pickle=False) as z:
            arr = z[key]
    except Exception as e:  # zipfile.BadZipFile, EOFError, zlib.error, KeyError, ValueError (pickled): all one error
        raise ValueError(f"cannot read a draft store from {path.parent}: {path.name}: {type(e).__name__}: {e}") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu") or not arr.dtype.isnative:
        raise bad(f"{path.name}: {key!r} must be a 1-D integer array in this machine's byte order, got "
                  f"{arr.dtype.str} of shape {arr.shape}")
    return arr


@contextmanager
def _opened(path: Path, limit: int):
    """open_regular with the store's error messages (every failure a ValueError naming the folder)."""
    try:
        f = open_regular(path, limit)
    except ValueError as e:
        raise ValueError(f"cannot read a draft store from {path.parent}: {e}") from None
    except OSError as e:
        raise ValueError(f"{_where(path)}{e.strerror}") from None
    with f:
        yield f


def _check_members(path: Path, f) -> dict[str, int]:
    """The npz's zip directory, before numpy reads it: the two arrays save writes, stored uncompressed
    (so no member is larger than the file), with at most MAX_TOKENS tokens. Returns each member's size."""
    try:
        members = zipfile.ZipFile(f).infolist()
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as e:
        raise ValueError(f"{_where(path)}not a readable npz ({type(e).__name__}: {e})") from None
    names = sorted(m.filename for m in members)
    if names != ["offsets.npy", "tokens.npy"]:
        raise ValueError(f"{_where(path)}must hold exactly tokens.npy and offsets.npy, got {names}")
    for m in members:
        if m.compress_type != zipfile.ZIP_STORED or m.file_size != m.compress_size:
            raise ValueError(f"{_where(path)}member {m.filename} is compressed ({m.compress_size} bytes declared to "
                             f"expand to {m.file_size}); draft stores are saved uncompressed")
        if m.filename == "tokens.npy" and m.file_size > 8 * MAX_TOKENS + _NPY_HEADER:  # int64 tokens + header
            raise ValueError(f"{_where(path)}tokens.npy is {m.file_size} bytes, more than {MAX_TOKENS} tokens")
    return {m.filename: m.file_size for m in members}


def _where(path: Path) -> str:
    return f"cannot read a draft store from {path.parent}: {path.name}: "


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
