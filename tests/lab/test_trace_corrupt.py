"""The lab's trace reader (dasrl_lab/trace.py) fed truncated, bit-flipped, wrong-typed and pickled files: one
clear TraceError each, never a raw traceback from pyarrow or numpy. Trace files carry Parquet page checksums
and a checksum of their content in the footer, so every flip is refused (or, for a flip in bytes nobody
reads, loads the same content)."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from dasrl_lab.trace import Response, TraceError, read_trace, write_trace
from support.corrupt import cuts as _cuts, flips as _flips


def _trace_file(tmp_path):
    rs = [Response(s, p, k, np.arange(4) + p, (np.arange(12) * 7 + k) % 500, reward=0.5,
                   logprobs=np.full(12, -0.2, np.float32))
          for s in range(2) for p in range(3) for k in range(2)]
    p = tmp_path / "t.parquet"
    write_trace(p, rs, vocab_size=500)
    return p


def _content(trace):
    return [(r.step, r.problem_id, r.sample, r.prompt_ids.tolist(), r.response_ids.tolist(), r.reward,
             r.finish_reason, r.logprobs.tolist()) for r in trace.responses()]


def test_trace_reader_truncated_flipped_wrong_typed_pickled(tmp_path):
    p = _trace_file(tmp_path)
    raw = p.read_bytes()
    want = _content(read_trace(p))
    q = tmp_path / "bad.parquet"
    same = 0
    for b in [raw[:n] for n in _cuts(raw)] + [b for _, b in _flips(raw, every=5)]:
        q.write_bytes(b)
        try:
            got = _content(read_trace(q))
        except TraceError as e:
            assert str(q) in str(e)
            continue
        assert got == want  # a flip in bytes the reader does not use (statistics, padding): same content
        same += 1
    assert same < len(raw) // 5  # most flips are caught, not ignored
    for b in (pickle.dumps(read_trace(p).responses()), json.dumps({"step": [0]}).encode(), b"PAR1" * 8, b""):
        q.write_bytes(b)
        with pytest.raises(TraceError, match="not a readable Parquet file"):
            read_trace(q)
    assert p.read_bytes() == raw  # the reader never writes


def test_bit_flips_in_a_trace_footer_are_caught_or_harmless(tmp_path):
    """One-bit flips (all 8 bits of every 3rd byte of the footer, where the metadata lives; the data pages
    are covered above) read back as the very same trace, data and metadata, or raise our error. Some
    flips drop the footer's metadata whole, and with it the checksum: those must be refused too."""
    p = tmp_path / "t.parquet"
    write_trace(p, [Response(3, 7, 0, [5, 6], [8, 9, 10], 1.0, "stop")], vocab_size=50)
    raw = p.read_bytes()
    footer = len(raw) - 8 - int.from_bytes(raw[-8:-4], "little")

    def seen(t):
        return _content_no_lp(t), t.vocab_size, t.table.schema.metadata

    want = seen(read_trace(p))
    q = tmp_path / "bad.parquet"
    caught, dropped = 0, 0
    for pos in range(footer, len(raw), 3):
        for bit in range(8):
            b = bytearray(raw)
            b[pos] ^= 1 << bit
            q.write_bytes(b)
            try:
                got = seen(read_trace(q))
            except TraceError as e:
                assert str(q) in str(e)
                caught += 1
                dropped += "no dasrl checksum" in str(e)
                continue
            assert got == want, (pos, bit)
    assert caught > 0.5 * 8 * (len(raw) - footer) / 3 and dropped > 0


def _content_no_lp(trace):
    return [(r.step, r.problem_id, r.sample, r.prompt_ids.tolist(), r.response_ids.tolist(), r.reward,
             r.finish_reason) for r in trace.responses()]


def test_trace_reader_wrong_types(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = {"step": [0], "problem_id": [1], "sample": [0], "prompt_ids": [[1]], "response_ids": [[2]],
            "reward": pa.array([None], pa.float64()), "finish_reason": ["stop"]}
    for col, value, msg in [("step", ["0"], "column 'step' has type string"),
                            ("prompt_ids", [["a"]], "column 'prompt_ids' has type list<.*string>"),
                            ("reward", ["high"], "column 'reward' has type string"),
                            ("problem_id", [1.5], "column 'problem_id' has type double"),
                            ("response_ids", [[2.5]], "column 'response_ids' has type list<.*double>")]:
        q = tmp_path / f"{col}.parquet"
        pq.write_table(pa.table({**base, col: value}), q)
        with pytest.raises(TraceError, match=msg):
            read_trace(q, require_checksum=False)  # another writer's file: validated


# ------------------------------------------------------------------------- issue 37 item 18
THREADS_AFTER_READS = """
import os, sys
from dasrl_lab.trace import TraceError, read_trace
before = len(os.listdir("/proc/self/task"))
for i in range(int(sys.argv[2])):
    try:
        read_trace(sys.argv[1])
    except TraceError:
        pass
print("THREADS", before, len(os.listdir("/proc/self/task")))
"""


def test_reading_traces_starts_no_native_threads(tmp_path):
    """The probe's process reading 55k damaged traces aborted at exit (rc 134, "terminate called without an
    active exception") 2 of 2 times. pq.read_table started Arrow's IO and CPU thread pools, whose threads
    outlive the read: a process exiting while Arrow tears them down can abort so (apache/arrow#34314,
    #39862). The reader now starts none: the process has as many threads after 50 reads (good and
    damaged) as before."""
    import subprocess
    import sys

    rs = [Response(step=0, problem_id=1, sample=k, prompt_ids=np.arange(1, 6, dtype=np.int32),
                   response_ids=np.arange(10, 30 + k, dtype=np.int32)) for k in range(4)]
    write_trace(tmp_path / "t.parquet", rs)
    raw = bytearray((tmp_path / "t.parquet").read_bytes())
    raw[len(raw) // 3] ^= 0x10  # a damaged copy: refused, via a different path through the reader
    (tmp_path / "bad.parquet").write_bytes(bytes(raw))
    for f in ("t.parquet", "bad.parquet"):
        out = subprocess.run([sys.executable, "-c", THREADS_AFTER_READS, str(tmp_path / f), "50"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        before, after = map(int, out.stdout.split("THREADS")[1].split())
        assert after == before, f"{f}: {before} threads before the reads, {after} after"
