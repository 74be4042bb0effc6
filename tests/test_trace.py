import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dasrl.rollout.trace import (Response, TraceError, TraceWriter, read_trace, summarize, to_table,
                                 write_trace)


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
        read_trace(p)


def test_out_of_order_steps_name_row(tmp_path):
    p = _write_raw(tmp_path / "o.parquet", step=[0, 2, 1])
    with pytest.raises(TraceError, match=r"row 2, column 'step'.*out of order"):
        read_trace(p)


def test_bad_ids_name_row_and_column(tmp_path):
    p = _write_raw(tmp_path / "n.parquet", response_ids=[[3, 4], [5], [6, -1]])
    with pytest.raises(TraceError, match=r"row 2, column 'response_ids': token id -1 at position 1"):
        read_trace(p)
    p = _write_raw(tmp_path / "v.parquet", prompt_ids=[[1], [99], [2]])
    with pytest.raises(TraceError, match=r"row 1, column 'prompt_ids'.*vocabulary"):
        read_trace(p, vocab_size=50)
    p = _write_raw(tmp_path / "s.parquet", sample=[0, -4, 0])
    with pytest.raises(TraceError, match=r"row 1, column 'sample'"):
        read_trace(p)
    p = _write_raw(tmp_path / "e.parquet", prompt_ids=[[1], [], [2]])
    with pytest.raises(TraceError, match=r"row 1, column 'prompt_ids': empty prompt"):
        read_trace(p)
    p = _write_raw(tmp_path / "l.parquet", logprobs=[[0.1, 0.2], [0.1], [0.1, 0.3]])
    with pytest.raises(TraceError, match=r"row 2, column 'logprobs'"):
        read_trace(p)


def test_corrupt_file_and_out_of_order_across_files(tmp_path):
    p = tmp_path / "c.parquet"
    p.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(TraceError, match="not a readable Parquet"):
        read_trace(p)
    d = tmp_path / "d"
    d.mkdir()
    _write_raw(d / "a.parquet", step=[3, 3, 3])
    _write_raw(d / "b.parquet", step=[1, 1, 1])
    with pytest.raises(TraceError, match=r"b.parquet: row 0, column 'step'"):
        read_trace(d)
    with pytest.raises(TraceError, match="no such"):
        read_trace(tmp_path / "nope.parquet")


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
