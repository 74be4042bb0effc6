import functools
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dasrl_lab.trace import (Response, TraceError, TraceWriter, read_trace, summarize, to_table,
                                 write_trace)

# A Parquet file from another writer carries no dasrl checksum: read only when asked, field by field.
read_foreign = functools.partial(read_trace, require_checksum=False)


def resp(step, pid, sample, n=5, lp=False):
    r = np.arange(n, dtype=np.int32) + sample
    return Response(step, pid, sample, np.array([1, 2, 3], np.int32), r, 0.5, "stop",
                    np.full(n, -0.1, np.float32) if lp else None)


def test_roundtrip_single_file(tmp_path):
    rs = [resp(0, 7, 0), resp(0, 7, 1, 9), resp(1, 8, 0, 3)]
    p = tmp_path / "t.parquet"
    write_trace(p, rs, vocab_size=100)
    t = read_trace(p)
    assert t.vocab_size == 100 and t.steps == [0, 1] and len(t) == 3
    back = t.responses()
    assert [r.problem_id for r in back] == [7, 7, 8]
    np.testing.assert_array_equal(back[1].response_ids, rs[1].response_ids)
    assert back[0].logprobs is None and back[0].reward == 0.5
    assert [(s, len(b)) for s, b in t.by_step()] == [(0, 2), (1, 1)]
    info = summarize(t)
    assert info["max"] == 9 and info["problems"] == 2 and info["steps"] == 2


def test_roundtrip_writer_directory_with_logprobs_and_string_ids(tmp_path):
    w = TraceWriter(tmp_path / "tr")
    w.write_step([resp(0, "a", 0, lp=True), resp(0, "b", 0, lp=True)])
    w.write_step([resp(1, "a", 0, lp=True)])
    with pytest.raises(TraceError, match="out of order"):
        w.write_step([resp(1, "a", 1, lp=True)])
    assert TraceWriter(tmp_path / "tr").last_step == 1  # resumes
    t = read_trace(tmp_path / "tr")
    assert len(t) == 3 and t.responses()[2].problem_id == "a"
    np.testing.assert_allclose(t.responses()[0].logprobs, -0.1)
    assert sorted(os.listdir(tmp_path / "tr")) == ["step-000000.parquet", "step-000001.parquet"]


def _write_raw(path, **over):
    cols = {"step": [0, 0, 1], "problem_id": [1, 1, 2], "sample": [0, 1, 0],
            "prompt_ids": [[1], [1], [2]], "response_ids": [[3, 4], [5], [6]], "reward": [1.0, None, 0.0],
            "finish_reason": ["stop", "length", "stop"]}
    cols.update(over)
    cols = {k: v for k, v in cols.items() if v is not None}
    pq.write_table(pa.table(cols), path)
    return path


def test_missing_column_named(tmp_path):
    p = _write_raw(tmp_path / "m.parquet", reward=None)
    with pytest.raises(TraceError, match="missing column.*reward"):
        read_foreign(p)


def test_out_of_order_steps_name_row(tmp_path):
    p = _write_raw(tmp_path / "o.parquet", step=[0, 2, 1])
    with pytest.raises(TraceError, match=r"row 2, column 'step'.*out of order"):
        read_foreign(p)


def test_bad_ids_name_row_and_column(tmp_path):
    p = _write_raw(tmp_path / "n.parquet", response_ids=[[3, 4], [5], [6, -1]])
    with pytest.raises(TraceError, match=r"row 2, column 'response_ids': token id -1 at position 1"):
        read_foreign(p)
    p = _write_raw(tmp_path / "v.parquet", prompt_ids=[[1], [99], [2]])
    with pytest.raises(TraceError, match=r"row 1, column 'prompt_ids'.*vocabulary"):
        read_foreign(p, vocab_size=50)
    p = _write_raw(tmp_path / "s.parquet", sample=[0, -4, 0])
    with pytest.raises(TraceError, match=r"row 1, column 'sample'"):
        read_foreign(p)
    p = _write_raw(tmp_path / "e.parquet", prompt_ids=[[1], [], [2]])
    with pytest.raises(TraceError, match=r"row 1, column 'prompt_ids': empty prompt"):
        read_foreign(p)
    p = _write_raw(tmp_path / "l.parquet", logprobs=[[0.1, 0.2], [0.1], [0.1, 0.3]])
    with pytest.raises(TraceError, match=r"row 2, column 'logprobs'"):
        read_foreign(p)


def test_corrupt_file_and_out_of_order_across_files(tmp_path):
    p = tmp_path / "c.parquet"
    p.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(TraceError, match="not a readable Parquet"):
        read_foreign(p)
    d = tmp_path / "d"
    d.mkdir()
    _write_raw(d / "a.parquet", step=[3, 3, 3])
    _write_raw(d / "b.parquet", step=[1, 1, 1])
    with pytest.raises(TraceError, match=r"b.parquet: row 0, column 'step'"):
        read_foreign(d)
    with pytest.raises(TraceError, match="no such"):
        read_foreign(tmp_path / "nope.parquet")


def test_atomic_write_leaves_no_partial_file(tmp_path, monkeypatch):
    p = tmp_path / "t.parquet"
    write_trace(p, [resp(0, 1, 0)])
    before = p.read_bytes()

    def boom(table, where, **kw):  # `where` is the open temporary file
        where.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", boom)
    with pytest.raises(OSError, match="disk full"):
        write_trace(p, [resp(0, 1, 0, 50)])
    assert p.read_bytes() == before  # old file intact
    assert os.listdir(tmp_path) == ["t.parquet"]  # temp removed


def test_writer_refuses_mixed_steps_and_partial_logprobs(tmp_path):
    with pytest.raises(TraceError, match="one step"):
        TraceWriter(tmp_path / "w").write_step([resp(0, 1, 0), resp(1, 1, 0)])
    with pytest.raises(TraceError, match="every response or for none"):
        to_table([resp(0, 1, 0, lp=True), resp(0, 1, 1)])


def test_ids_beyond_int32_are_refused_not_wrapped(tmp_path):
    # 2**32 + 7 would be stored as int32 7: refused at write, and a foreign int64 file is refused at read
    for ids in ([2**32 + 7], np.array([2**32 + 7], np.int64), [2**70], [-1]):
        with pytest.raises(TraceError, match=r"response 0: response_ids has token id -?\d+, outside \[0, 2\*\*31\)"):
            write_trace(tmp_path / "w.parquet", [Response(0, 1, 0, [1], ids)])
    with pytest.raises(TraceError, match="response 0: prompt_ids must be a 1-D"):
        write_trace(tmp_path / "w.parquet", [Response(0, 1, 0, np.ones((2, 2), np.int64), [1])])
    p = tmp_path / "big.parquet"
    pq.write_table(pa.table({"step": [0], "problem_id": [1], "sample": [0],
                             "prompt_ids": pa.array([[1]], pa.list_(pa.int64())),
                             "response_ids": pa.array([[5, 2**32 + 7]], pa.list_(pa.int64())),
                             "reward": pa.array([None], pa.float64()), "finish_reason": ["stop"]}), p)
    with pytest.raises(TraceError, match=r"row 0, column 'response_ids': token id 4294967303 at position 1 "
                                         r"is too large for int32"):
        read_foreign(p)
    assert not (tmp_path / "w.parquet").exists()


def test_zero_row_file_is_refused(tmp_path):
    p = _write_raw(tmp_path / "e.parquet", step=[], problem_id=[], sample=[], prompt_ids=[], response_ids=[],
                   reward=pa.array([], pa.float64()), finish_reason=[])
    with pytest.raises(TraceError, match=r"e.parquet: holds no rows"):
        read_foreign(p)
    d = tmp_path / "d"
    d.mkdir()
    write_trace(d / "step-000000.parquet", [resp(0, 1, 0)])
    os.replace(p, d / "step-000001.parquet")
    with pytest.raises(TraceError, match=r"step-000001.parquet: holds no rows"):
        read_foreign(d)


@pytest.mark.parametrize("raw, msg", [("abc", "vocab_size is b'abc', not an integer"),
                                      ("1e5", "not an integer"), ("0", r"vocab_size must be an int in \[1, 2\*\*31\], got 0"),
                                      ("-3", "got -3"), ("\xff", "not an integer")])
def test_bad_vocab_size_metadata(tmp_path, raw, msg):
    p = tmp_path / "v.parquet"
    t = pa.table({"step": [0], "problem_id": [1], "sample": [0], "prompt_ids": [[1]], "response_ids": [[2]],
                  "reward": pa.array([None], pa.float64()), "finish_reason": ["stop"]})
    pq.write_table(t.replace_schema_metadata({"vocab_size": raw}), p)
    with pytest.raises(TraceError, match=msg):
        read_foreign(p)


def test_mixed_int_and_string_problem_ids(tmp_path):
    with pytest.raises(TraceError, match=r"problem ids mix int and str \(1 and 'a' at response 1\)"):
        write_trace(tmp_path / "m.parquet", [resp(0, 1, 0), resp(0, "a", 0)])
    with pytest.raises(TraceError, match=r"response 0: problem_id must be an int or a str, got 1.5"):
        write_trace(tmp_path / "m.parquet", [resp(0, 1.5, 0)])
    d = tmp_path / "d"
    w = TraceWriter(d)
    w.write_step([resp(0, 1, 0)])
    w.write_step([resp(1, "a", 0)])  # each file alone is fine; together they mix
    with pytest.raises(TraceError, match=r"step-000001.parquet: problem ids are strings but .*step-000000.parquet "
                                         r"has integers"):
        read_trace(d)


def test_a_file_without_our_checksum_is_refused_unless_asked(tmp_path):
    p = _write_raw(tmp_path / "f.parquet")
    with pytest.raises(TraceError, match=r"f.parquet: no dasrl checksum in its metadata .*require_checksum=False"):
        read_trace(p)
    assert len(read_foreign(p)) == 3
    q = tmp_path / "ours.parquet"
    write_trace(q, [resp(0, 1, 0)], vocab_size=100)
    t = pq.read_table(q)
    pq.write_table(t.replace_schema_metadata({}), q)  # the footer's metadata gone, the data intact
    with pytest.raises(TraceError, match="no dasrl checksum"):
        read_trace(q)


def test_names_that_are_not_utf8(tmp_path):
    name = os.fsencode(tmp_path) + b"/tr\xff\xfe.parquet"
    write_trace(name, [resp(0, 1, 0), resp(0, 1, 1)], vocab_size=100)
    for path in (name, os.fsdecode(name)):
        t = read_trace(path)
        assert len(t) == 2 and t.vocab_size == 100
    d = os.fsencode(tmp_path) + b"/d\xff"
    TraceWriter(d).write_step([resp(0, 1, 0)])
    assert len(read_trace(d)) == 1
    cli = os.path.join(os.path.dirname(sys.executable), "dasrl")
    r = subprocess.run([os.fsencode(cli), b"trace", b"info", name], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-2000:]
    assert b"responses" in r.stdout and b"hit_length" in r.stdout
