"""The lab's rollout traces in Parquet, one row per response: the demo, the experiments and `dasrl bench vllm`
write them; the simulator, whatif and the validations replay them.

Columns: step (int64), problem_id (int64 >= 0 or string), sample (int64 >= 0), prompt_ids (list<int32>),
response_ids (list<int32>), reward (float64, may be null), finish_reason (string), and optionally
logprobs (list<float32>, one per response token). Schema metadata may carry `vocab_size`.

A trace is one Parquet file or a directory of them (`step-000012.parquet`, ...), read in name order;
`TraceWriter` writes one file per RL step, each atomically, so a crash leaves no partial file.
`read_trace` names the bad row and column. Parquet page checksums catch a flipped bit in a data page; a
content checksum in the footer metadata catches the rest, and a file without one is refused (a damaged
footer can drop the metadata whole; another writer's file reads with `require_checksum=False`).
Paths may be str, bytes or os.PathLike, names need not be UTF-8.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dasrl.atomic import atomic_write, open_regular

FORMAT = "dasrl.trace/1"
REQUIRED = ("step", "problem_id", "sample", "prompt_ids", "response_ids", "reward", "finish_reason")
OPTIONAL = ("logprobs",)
_INT32_MAX = 2**31 - 1  # token ids are stored as int32: a larger id would wrap (2**32 + 7 read back as 7)
MAX_TRACE_FILE_BYTES = 2**33
"""Largest trace file read (8 GiB; a step file of a long run is tens of MB)."""


class TraceError(ValueError):
    """A trace file that cannot be used, with the file, row and column at fault."""


@dataclass(frozen=True)
class Response:
    """One recorded response."""

    step: int  # RL step (epoch) it was generated in
    problem_id: int | str  # key of its prompt (same for GRPO siblings)
    sample: int  # index among the samples of the problem in this step
    prompt_ids: np.ndarray  # [n] int32
    response_ids: np.ndarray  # [m] int32
    reward: float | None = None
    finish_reason: str = "stop"  # stop (EOS) or length (hit the limit)
    logprobs: np.ndarray | None = None  # [m] float32, one per response token, if recorded


def _schema(with_logprobs: bool, pid_type: pa.DataType, vocab_size: int | None) -> pa.Schema:
    fields = [pa.field("step", pa.int64()), pa.field("problem_id", pid_type), pa.field("sample", pa.int64()),
              pa.field("prompt_ids", pa.list_(pa.int32())), pa.field("response_ids", pa.list_(pa.int32())),
              pa.field("reward", pa.float64()), pa.field("finish_reason", pa.string())]
    if with_logprobs:
        fields.append(pa.field("logprobs", pa.list_(pa.float32())))
    meta = {"format": FORMAT}
    if vocab_size is not None:
        meta["vocab_size"] = str(int(vocab_size))
    return pa.schema(fields, metadata=meta)


def _check_vocab_size(v, source: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 < v <= _INT32_MAX + 1:
        raise TraceError(f"{source}: vocab_size must be an int in [1, 2**31], got {v!r}")
    return int(v)


def _meta_vocab(meta: dict | None, source: str) -> int | None:
    raw = (meta or {}).get(b"vocab_size")
    if raw is None:
        return None
    try:
        v = int(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise TraceError(f"{source}: schema metadata vocab_size is {raw!r}, not an integer") from None
    return _check_vocab_size(v, f"{source}: schema metadata")


def _id_array(values, i: int, col: str) -> np.ndarray:
    """One response's token ids as int32, refusing what int32 cannot hold (instead of wrapping)."""
    a = np.asarray(values)
    if a.ndim != 1:
        raise TraceError(f"response {i}: {col} must be a 1-D sequence of token ids, got shape {a.shape}")
    if a.size == 0:
        return a.astype(np.int32)
    if a.dtype.kind not in "iu":
        if a.dtype == object and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in a):
            a = np.array([int(x) for x in a], dtype=object)
        else:
            raise TraceError(f"response {i}: {col} must hold integers, got dtype {a.dtype}")
    lo, hi = (int(a.min()), int(a.max())) if a.dtype.kind in "iu" else (min(a), max(a))
    if lo < 0 or hi > _INT32_MAX:
        bad = lo if lo < 0 else hi
        raise TraceError(f"response {i}: {col} has token id {bad}, outside [0, 2**31) (ids are stored as int32)")
    return a.astype(np.int32)


def _pid_kind(responses: Sequence[Response]) -> pa.DataType:
    """int64 or string: one type for every problem id (mixing them would turn 3 and "3" into one key or fail
    in Arrow, so it is refused)."""
    first = responses[0].problem_id
    for i, r in enumerate(responses):
        pid = r.problem_id
        if isinstance(pid, bool) or not isinstance(pid, (str, int, np.integer)):
            raise TraceError(f"response {i}: problem_id must be an int or a str, got {pid!r}")
        if isinstance(pid, str) != isinstance(first, str):
            raise TraceError(f"problem ids mix int and str ({first!r} and {pid!r} at response {i}): "
                             "use one type for every problem id of a trace")
    return pa.string() if isinstance(first, str) else pa.int64()


def to_table(responses: Sequence[Response], *, vocab_size: int | None = None) -> pa.Table:
    if not responses:
        raise TraceError("no responses to write")
    vocab_size = _check_vocab_size(vocab_size, "trace being written")
    with_lp = any(r.logprobs is not None for r in responses)
    if with_lp and not all(r.logprobs is not None for r in responses):
        raise TraceError("logprobs must be given for every response or for none")
    pid_type = _pid_kind(responses)
    cols = {
        "step": [int(r.step) for r in responses],
        "problem_id": [r.problem_id if pid_type == pa.string() else int(r.problem_id) for r in responses],
        "sample": [int(r.sample) for r in responses],
        "prompt_ids": [_id_array(r.prompt_ids, i, "prompt_ids") for i, r in enumerate(responses)],
        "response_ids": [_id_array(r.response_ids, i, "response_ids") for i, r in enumerate(responses)],
        "reward": [None if r.reward is None else float(r.reward) for r in responses],
        "finish_reason": [r.finish_reason for r in responses],
    }
    if with_lp:
        cols["logprobs"] = [np.asarray(r.logprobs, np.float32) for r in responses]
    table = pa.table(cols, schema=_schema(with_lp, pid_type, vocab_size))
    validate(table, source="trace being written", vocab_size=vocab_size)
    meta = dict(table.schema.metadata)
    return table.replace_schema_metadata({**meta, _CHECKSUM: _digest(table)})


_CHECKSUM = b"dasrl.checksum"


def _digest(table: pa.Table) -> bytes:
    """blake2b of a table's column names, values, nulls and metadata (not of its Parquet bytes, which differ
    for the same table): it catches a flipped column name or metadata value, which page checksums miss."""
    h = hashlib.blake2b(digest_size=16)
    meta = table.schema.metadata or {}
    for k in sorted(meta):
        if k not in (_CHECKSUM, b"ARROW:schema"):
            h.update(b"meta\0" + k + b"\0" + meta[k] + b"\0")
    for name in sorted(table.column_names):
        col = table.column(name).combine_chunks()
        h.update(b"col\0" + name.encode() + b"\0")
        h.update(np.packbits(col.is_null().to_numpy(zero_copy_only=False)).tobytes())
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            off = col.offsets.to_numpy().astype(np.int64)
            h.update(np.diff(off).tobytes())
            col = col.flatten()
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            h.update("\0".join(x or "" for x in col.to_pylist()).encode())
        else:
            h.update(str(col.type).encode() + b"\0")
            h.update(col.fill_null(0).to_numpy(zero_copy_only=False).tobytes())
    return h.hexdigest().encode()


def _atomic_write(table: pa.Table, path: Path) -> None:
    atomic_write(path, lambda f: pq.write_table(table, f, write_page_checksum=True))


def write_trace(path: str | bytes | os.PathLike, responses: Sequence[Response], *,
                vocab_size: int | None = None) -> None:
    """Write a whole trace as one Parquet file, atomically."""
    _atomic_write(to_table(responses, vocab_size=vocab_size), Path(os.fsdecode(path)))


class TraceWriter:
    """Appends RL steps to a trace directory: one atomically written file per step."""

    def __init__(self, path: str | bytes | os.PathLike, *, vocab_size: int | None = None) -> None:
        self.path = Path(os.fsdecode(path))
        if self.path.exists() and not self.path.is_dir():
            raise TraceError(f"{self.path}: exists and is not a directory (TraceWriter writes one file per step)")
        self.path.mkdir(parents=True, exist_ok=True)
        self.vocab_size = _check_vocab_size(vocab_size, f"TraceWriter({self.path})")
        done = [int(p.stem[5:]) for p in self.path.glob("step-*.parquet") if p.stem[5:].isdigit()]
        self.last_step = max(done) if done else None

    def write_step(self, responses: Sequence[Response]) -> Path:
        steps = {int(r.step) for r in responses}
        if len(steps) != 1:
            raise TraceError(f"write_step takes the responses of one step, got steps {sorted(steps)}")
        step = steps.pop()
        if step < 0:
            raise TraceError(f"step must be >= 0, got {step}")
        if self.last_step is not None and step <= self.last_step:
            raise TraceError(f"step {step} out of order: {self.path} already holds step {self.last_step}")
        out = self.path / f"step-{step:06d}.parquet"
        _atomic_write(to_table(responses, vocab_size=self.vocab_size), out)
        self.last_step = step
        return out


# ------------------------------------------------------------------------------ reading


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.parquet"))
        if not files:
            raise TraceError(f"{path}: directory holds no .parquet files")
        return files
    if not path.exists():
        raise TraceError(f"{path}: no such trace file")
    return [path]


def read_parquet(fh) -> pa.Table:
    """The table of the Parquet file open in `fh`, page checksums verified, read on this thread only:
    pq.read_table starts Arrow's thread pools, whose teardown at exit can abort the process (rc 134;
    apache/arrow#34314, #39862); a trace file is small, so no threads lose nothing."""
    return pq.ParquetFile(fh, page_checksum_verification=True, pre_buffer=False).read(use_threads=False)


def _read_one(f: Path, require_checksum: bool) -> pa.Table:
    try:
        # Opened by Python (Arrow wants a UTF-8 path) through open_regular (a FIFO would hang, a device never end).
        with open_regular(f, MAX_TRACE_FILE_BYTES, follow_symlinks=True) as fh:
            t = read_parquet(fh)
    except (pa.ArrowException, OSError, ValueError) as e:  # truncated, bit-flipped, not Parquet at all
        raise TraceError(f"{f}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    try:
        t.column_names, t.schema.metadata  # names and metadata decode lazily: a flipped byte fails here
    except UnicodeDecodeError as e:
        raise TraceError(f"{f}: damaged schema (a column name or metadata is not UTF-8: {e})") from None
    if t.num_rows == 0:
        raise TraceError(f"{f}: holds no rows (a trace file has at least one response)")
    want = (t.schema.metadata or {}).get(_CHECKSUM)
    if want is None and require_checksum:
        raise TraceError(f"{f}: no dasrl checksum in its metadata (a damaged footer, or a Parquet file from "
                         "another writer: read_trace(..., require_checksum=False) validates those field by field)")
    if want is not None:
        try:
            got = _digest(t)
        except (pa.ArrowException, ValueError, TypeError) as e:
            raise TraceError(f"{f}: damaged columns ({type(e).__name__}: {e})") from None
        if got != want:
            raise TraceError(f"{f}: checksum mismatch (the file was changed or damaged after it was written)")
    return t


def _bad(source: str, row: int, col: str, msg: str) -> TraceError:
    return TraceError(f"{source}: row {row}, column {col!r}: {msg}")


def _check_ids(table: pa.Table, col: str, source: str, vocab_size: int | None, row0: int) -> None:
    arr = table.column(col).combine_chunks()
    if arr.null_count:
        raise _bad(source, row0 + int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0]), col, "null")
    values = arr.flatten().to_numpy()
    offsets = arr.offsets.to_numpy()
    limit = _INT32_MAX + 1 if vocab_size is None else vocab_size
    bad = (values < 0) | (values >= limit)
    if bad.any():
        pos = int(np.flatnonzero(bad)[0])
        row = int(np.searchsorted(offsets, pos, "right") - 1)
        what = ("negative" if values[pos] < 0 else f"outside the vocabulary (size {vocab_size})" if vocab_size
                else "too large for int32 token ids")
        raise _bad(source, row0 + row, col, f"token id {int(values[pos])} at position {pos - offsets[row]} is {what}")


def validate(table: pa.Table, *, source: str, vocab_size: int | None = None, row0: int = 0) -> None:
    """Raise TraceError naming the first bad row/column (row numbers count from row0)."""
    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        raise TraceError(f"{source}: missing column(s) {', '.join(missing)} (has {', '.join(table.column_names)})")
    expect = {"step": pa.types.is_integer, "sample": pa.types.is_integer, "reward": pa.types.is_floating,
              "finish_reason": lambda t: pa.types.is_string(t) or pa.types.is_large_string(t),
              "problem_id": lambda t: pa.types.is_integer(t) or pa.types.is_string(t),
              "prompt_ids": lambda t: pa.types.is_list(t) and pa.types.is_integer(t.value_type),
              "response_ids": lambda t: pa.types.is_list(t) and pa.types.is_integer(t.value_type),
              "logprobs": lambda t: pa.types.is_list(t) and pa.types.is_floating(t.value_type)}
    for c in REQUIRED + OPTIONAL:
        if c in table.column_names and not expect[c](table.schema.field(c).type):
            raise TraceError(f"{source}: column {c!r} has type {table.schema.field(c).type}")
    for c in ("step", "problem_id", "sample", "finish_reason"):
        col = table.column(c)
        if col.null_count:
            raise _bad(source, row0 + int(np.flatnonzero(col.is_null().to_numpy())[0]), c, "null")
    int_pid = pa.types.is_integer(table.schema.field("problem_id").type)
    for c in ("step", "sample") + (("problem_id",) if int_pid else ()):
        v = table.column(c).to_numpy()
        if (v < 0).any():
            i = int(np.flatnonzero(v < 0)[0])
            raise _bad(source, row0 + i, c, f"{int(v[i])} is negative")
    steps = table.column("step").to_numpy()
    if steps.size > 1 and (np.diff(steps) < 0).any():
        i = int(np.flatnonzero(np.diff(steps) < 0)[0]) + 1
        raise _bad(source, row0 + i, "step", f"step {int(steps[i])} after step {int(steps[i - 1])}: steps out of order")
    _check_ids(table, "prompt_ids", source, vocab_size, row0)
    _check_ids(table, "response_ids", source, vocab_size, row0)
    plen = pc.list_value_length(table.column("prompt_ids")).to_numpy()
    if (plen == 0).any():
        raise _bad(source, row0 + int(np.flatnonzero(plen == 0)[0]), "prompt_ids", "empty prompt")
    if "logprobs" in table.column_names:
        lp = table.column("logprobs").combine_chunks()
        rl = pc.list_value_length(table.column("response_ids")).to_numpy()
        ll = pc.list_value_length(lp).to_numpy(zero_copy_only=False)
        bad = (lp.is_null().to_numpy(zero_copy_only=False) == 0) & (ll != rl)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise _bad(source, row0 + i, "logprobs", f"{int(ll[i])} logprobs for {int(rl[i])} response tokens")


class Trace:
    """A validated trace: the Arrow table plus per-step access."""

    def __init__(self, table: pa.Table, source: str = "trace") -> None:
        self.table, self.source = table, source
        self.vocab_size = _meta_vocab(table.schema.metadata, source)

    def __len__(self) -> int:
        return self.table.num_rows

    @property
    def steps(self) -> list[int]:
        return sorted(set(self.table.column("step").to_pylist()))

    def lengths(self) -> np.ndarray:
        return pc.list_value_length(self.table.column("response_ids")).to_numpy()

    def responses(self) -> list[Response]:
        t = self.table
        cols = {c: t.column(c).to_pylist() for c in ("step", "problem_id", "sample", "reward", "finish_reason")}
        lists = {}
        for c in ("prompt_ids", "response_ids") + (("logprobs",) if "logprobs" in t.column_names else ()):
            arr = t.column(c).combine_chunks()
            vals = arr.flatten().to_numpy()
            vals = vals.astype(np.float32 if c == "logprobs" else np.int32, copy=False)
            off = arr.offsets.to_numpy()
            lists[c] = [vals[off[i]:off[i + 1]] for i in range(len(arr))]
        lp = lists.get("logprobs", [None] * t.num_rows)
        return [Response(cols["step"][i], cols["problem_id"][i], cols["sample"][i], lists["prompt_ids"][i],
                         lists["response_ids"][i], cols["reward"][i], cols["finish_reason"][i], lp[i])
                for i in range(t.num_rows)]

    def by_step(self) -> Iterator[tuple[int, list[Response]]]:
        """(step, its responses) in step order."""
        for step, rs in itertools.groupby(self.responses(), key=lambda r: r.step):
            yield step, list(rs)


def read_trace(path: str | bytes | os.PathLike, *, vocab_size: int | None = None,
               require_checksum: bool = True) -> Trace:
    """Read and validate a trace file or directory; errors name the file, row and column. Files without
    dasrl's checksum are refused unless `require_checksum` is False (see the module docstring)."""
    vocab_size = _check_vocab_size(vocab_size, "read_trace")
    path = Path(os.fsdecode(path))
    files = _files(path)
    tables, last_step, pid_from = [], None, None
    for f in files:
        t = _read_one(f, require_checksum)
        meta_vs = _meta_vocab(t.schema.metadata, str(f))
        vs = vocab_size if vocab_size is not None else meta_vs
        validate(t, source=str(f), vocab_size=vs)
        is_str = not pa.types.is_integer(t.schema.field("problem_id").type)
        if pid_from is not None and is_str != pid_from[1]:
            kind = {True: "string", False: "integer"}
            raise TraceError(f"{f}: problem ids are {kind[is_str]}s but {pid_from[0]} has {kind[pid_from[1]]}s: "
                             "one type for every problem id of a trace")
        pid_from = pid_from or (f, is_str)
        steps = t.column("step").to_numpy()  # not empty: _read_one refuses a file without rows
        if last_step is not None and steps[0] < last_step:
            raise _bad(str(f), 0, "step", f"step {int(steps[0])} after step {last_step} of the previous file: "
                       "steps out of order")
        last_step = int(steps[-1])
        tables.append(t)
    try:
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise TraceError(f"{path}: step files have incompatible schemas ({e})") from None
    return Trace(table, str(path))


def summarize(trace: Trace) -> dict:
    """Steps, problems, responses and the length distribution (mean, p50, p90, p99, max)."""
    L = trace.lengths().astype(np.float64)
    fr = trace.table.column("finish_reason").to_pylist()
    return {"responses": len(trace), "steps": len(trace.steps),
            "problems": len(set(trace.table.column("problem_id").to_pylist())),
            "tokens": int(L.sum()), "mean": float(L.mean()), "p50": float(np.percentile(L, 50)),
            "p90": float(np.percentile(L, 90)), "p99": float(np.percentile(L, 99)), "max": int(L.max()),
            "hit_length": sum(1 for x in fr if x == "length")}

