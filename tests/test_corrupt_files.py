"""Every loader a user points at a file, fed truncated, bit-flipped, wrong-typed and pickled files: one
clear error (ValueError) each, never a raw traceback from json or numpy, and the caller's state unchanged
(a failed RolloutSession.load leaves step, history, store and policy statistics as they were). The draft
store's own loader is covered in tests/test_store.py, the lab's trace reader in
tests/lab/test_trace_corrupt.py.

Bit flips: session.json carries a checksum, so every flip is refused (or, for a flip in bytes nobody
reads, loads the same content). A latency model is a small
hand-editable JSON file without a checksum: a flipped digit is a different valid model, so there the
contract is only "a ValueError or a valid LatencyModel, nothing else"."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from dataclasses import asdict

import numpy as np
import pytest

from dasrl.policy.latency import LatencyModel
from dasrl.rollout.session import Rollout, RolloutSession, SessionConfig, StepSummary
from support.corrupt import cuts as _cuts, flips as _flips


# ---------------------------------------------------------------------------------------- session


def _rollouts(step: int, pids=(1, 2, 3), n=3):
    rng = np.random.default_rng(step)
    return [Rollout(problem_id=p, sample=k, seed=0, prompt_ids=[10 + p, 11, 12],
                    completion_ids=rng.integers(20, 200, size=8 + 4 * k).tolist(), logprobs=[-0.1] * (8 + 4 * k),
                    finish_reason="stop", forwards=1, drafted=0, accepted=0)
            for p in pids for k in range(n)]


def _fill(session: RolloutSession, steps: int, pids) -> None:
    for step in range(steps):
        session.record(_rollouts(step, pids))
        session.history.append(StepSummary(step=session.step, rollout_s=0.5 + step, upkeep_wait_s=0.0,
                                           forwards=3, row_forwards=9, new_tokens=40,
                                           batch_curve=[(0.0, 9), (0.25, 3)], worker_s={0: 0.25, 3: 0.5},
                                           worker_rows={0: 4, 3: 5}, rerun=2, dead=[1]))  # int keys survive JSON
        session.end_step()
    session._join_upkeep()


def _snapshot(s: RolloutSession):
    return (s.step, [asdict(h) for h in s.history], s.store, s.store.num_tokens if s.store else None,
            json.dumps(s.policy.lengths.state_dict(), sort_keys=True),
            json.dumps(s.policy.parts()["acceptance_rate"].state_dict(), sort_keys=True))


@pytest.fixture(scope="module")
def sessions(smollm, tmp_path_factory):
    """(make a fresh speculating session, folder of a saved session with a store and statistics)."""
    model, tok = smollm

    def make():
        return RolloutSession(model, tok, SessionConfig(speculate=True, policy="das", background_upkeep=False))

    saved = make()
    _fill(saved, 2, pids=(1, 2, 3))
    folder = tmp_path_factory.mktemp("sess") / "saved"
    saved.save(folder)
    return make, folder, _snapshot(saved)


@pytest.fixture
def caller(sessions):
    """A session with its own state (step 4, other problems), to check that a failed load keeps it."""
    make, _, _ = sessions
    s = make()
    _fill(s, 4, pids=(7, 8))
    return s


def _copy(folder, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(folder, dst)
    return dst


def test_a_good_save_loads_and_replaces_everything(sessions, caller):
    make, folder, want = sessions
    caller.load(folder)
    got = _snapshot(caller)
    assert got[0] == want[0] == 2 and got[1] == want[1] and got[3] == want[3] and got[4:] == want[4:]


def test_session_json_truncated_flipped_wrong_typed_pickled(sessions, caller, tmp_path):
    _, folder, _ = sessions
    d = _copy(folder, tmp_path)
    raw = (folder / "session.json").read_bytes()
    before = _snapshot(caller)
    state = json.loads(raw)
    bad = [raw[:n] for n in _cuts(raw)]
    bad += [b for _, b in _flips(raw, every=max(1, len(raw) // 400))]
    bad += [json.dumps(x).encode() for x in (
        [1, 2], "session", 3, None,
        {**state, "step": "2"}, {**state, "step": -1}, {**state, "step": True},
        {**state, "history": {"0": 1}}, {**state, "history": [[1, 2]]},
        {**state, "history": [{**state["history"][0], "forwards": "many"}]},
        {**state, "history": [{**state["history"][0], "batch_curve": [[0.1]]}]},
        {**state, "history": [{**state["history"][0], "worker_s": {"w0": 0.1}}]},
        {**state, "history": [{**state["history"][0], "dead": ["1"]}]},
        {**state, "lengths": [1]}, {**state, "acceptance_rate": {"problems": [[1, "x"]]}},
        {**state, "extra": 1}, {**state, "format": "dasrl-session/9"})]
    bad += [pickle.dumps(state), pickle.dumps(caller.history), b"\x00" * 64, "\ufeff{}".encode()]
    for i, b in enumerate(bad):
        (d / "session.json").write_bytes(b)
        with pytest.raises(ValueError) as e:
            caller.load(d)
        assert str(d) in str(e.value), (i, e.value)  # the error names the file it could not use
        assert _snapshot(caller) == before, i


def test_checksum_absent_still_validates(sessions, caller, tmp_path):
    """A session.json without its checksum (a hand-made file) loads, and its fields are still type-checked
    one by one."""
    _, folder, want = sessions
    d = _copy(folder, tmp_path)
    state = json.loads((folder / "session.json").read_text())
    del state["checksum"]
    (d / "session.json").write_text(json.dumps({**state, "history": [{"step": 0}]}))
    before = _snapshot(caller)
    with pytest.raises(ValueError, match=r"history\[0\]: .*missing field\(s\) \['rollout_s', 'upkeep_wait_s'\]"):
        caller.load(d)
    assert _snapshot(caller) == before
    (d / "session.json").write_text(json.dumps(state))
    caller.load(d)
    assert caller.step == 2 and caller.store.num_tokens == want[3]


def test_store_missing_mismatched_or_damaged(sessions, caller, tmp_path):
    make, folder, _ = sessions
    before = _snapshot(caller)
    d = _copy(folder, tmp_path)
    data = d / json.loads((d / "session.json").read_text())["data"]
    raw = data.read_bytes()
    data.unlink()
    with pytest.raises(ValueError, match=rf"cannot read a session from {d}: {data.name}: No such file"):
        caller.load(d)
    assert _snapshot(caller) == before
    # the arrays of another save (a save cut short between its data file and session.json)
    other = make()
    _fill(other, 1, pids=(5,))
    other.save(tmp_path / "other")
    (other_data,) = (tmp_path / "other").glob("session-*.npz")
    data.write_bytes(other_data.read_bytes())
    with pytest.raises(ValueError, match="does not match"):
        caller.load(d)
    assert _snapshot(caller) == before
    # a damaged data file: truncated, flipped, pickled, wrong-typed
    for b in (raw[: len(raw) // 2], raw[:-1] + bytes([raw[-1] ^ 1]), pickle.dumps({"tokens": [1, 2]}), b"[]"):
        data.write_bytes(b)
        with pytest.raises(ValueError, match="does not match|not a readable npz"):
            caller.load(d)
        assert _snapshot(caller) == before
    data.write_bytes(raw)
    caller.load(d)  # restored bytes: loads again


def test_store_mismatch_warnings(smollm, sessions, tmp_path):
    """A save without a store into a session with one (and the reverse) is a change of setup, not
    damage: it loads, with a warning that says what is not restored."""
    model, tok = smollm
    make, folder, _ = sessions
    plain = RolloutSession(model, tok, SessionConfig(speculate=False))
    plain.save(tmp_path / "plain")
    spec = make()
    _fill(spec, 1, pids=(4,))
    keep = spec.store
    with pytest.warns(UserWarning, match="has no draft store"):
        spec.load(tmp_path / "plain")
    assert spec.store is keep and spec.step == 0
    with pytest.warns(UserWarning, match="not loaded: this session has no DraftStore"):
        plain.load(folder)
    assert plain.step == 2 and plain.store is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make().load(folder)  # the matching setup: no warning


# ---------------------------------------------------------------------------------------- latency


def test_latency_loader_truncated_flipped_wrong_typed_pickled(tmp_path):
    p = tmp_path / "latency.json"
    LatencyModel(c_base=0.05, c_tok=0.0025, c_other=1e-6).save(p)
    raw = p.read_bytes()
    assert LatencyModel.load(p) == LatencyModel(0.05, 0.0025, 1e-6)
    q = tmp_path / "bad.json"
    bad = [raw[:n] for n in _cuts(raw)] + [b for _, b in _flips(raw, every=1)]
    bad += [json.dumps(x).encode() for x in ([0.05, 0.0025], "x", None, {"c_base": 0.05},
                                             {"c_base": "0.05", "c_tok": 0.1}, {"c_base": -1, "c_tok": 0.1},
                                             {"c_base": True, "c_tok": 0.1}, {"c_base": [1], "c_tok": 0.1},
                                             {"format": "dasrl.latency/2", "c_base": 0.1, "c_tok": 0.1})]
    bad += [b'{"c_base": NaN, "c_tok": 0.1}', b'{"c_base": 1e999, "c_tok": 0.1}',
            b'{"c_base": 1' + b"0" * 400 + b', "c_tok": 0.1}', b"[" * 100_000 + b"]" * 100_000,
            pickle.dumps({"c_base": 0.05, "c_tok": 0.0025}), b"\xff\xfe{}"]
    refused = 0
    for b in bad:
        q.write_bytes(b)
        try:
            m = LatencyModel.load(q)
        except ValueError as e:
            assert str(q) in str(e)
            refused += 1
        else:  # a flipped digit: a different but valid model
            assert isinstance(m, LatencyModel)
    assert refused > len(bad) // 2
    with pytest.raises(FileNotFoundError):
        LatencyModel.load(tmp_path / "missing.json")
    assert os.listdir(tmp_path) == sorted(["latency.json", "bad.json"]) or set(os.listdir(tmp_path)) == {
        "latency.json", "bad.json"}


# ------------------------------------------------------------------------- issue 37 items 4 and 5
def _in_thread(fn, timeout: float = 30):
    """fn() in a daemon thread: what it raised (None if nothing); a call that hangs fails the test."""
    import threading

    out: list = []

    def go():
        try:
            fn()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out.append(e)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout)
    assert out, f"{fn} hangs"
    return out[0]


def test_session_json_that_is_a_fifo_a_device_or_huge_is_refused_unread(sessions, caller, tmp_path):
    """On b46648a a FIFO session.json hung load() forever, one linked to /dev/zero grew memory until killed,
    and a 1 GB file reached 2.4 GB RSS before its JSON error."""
    _, folder, _ = sessions
    before = _snapshot(caller)
    bad = _copy(folder, tmp_path)
    os.unlink(bad / "session.json")
    os.mkfifo(bad / "session.json")
    e = _in_thread(lambda: caller.load(bad))
    assert isinstance(e, ValueError) and "session.json: not a regular file" in str(e), e
    os.unlink(bad / "session.json")
    os.symlink("/dev/zero", bad / "session.json")
    e = _in_thread(lambda: caller.load(bad))
    assert isinstance(e, ValueError) and "session.json: is a symbolic link" in str(e), e
    os.unlink(bad / "session.json")
    try:
        os.mknod(bad / "session.json", 0o600 | 0o020000, os.makedev(1, 5))  # a /dev/zero of our own
    except PermissionError:
        pass
    else:
        e = _in_thread(lambda: caller.load(bad))
        assert isinstance(e, ValueError) and "session.json: not a regular file" in str(e), e
        os.unlink(bad / "session.json")
    with open(bad / "session.json", "wb") as f:
        f.truncate(2**30)  # sparse: 1 GB of zeros that take no disk, and must not be read
    e = _in_thread(lambda: caller.load(bad))
    assert isinstance(e, ValueError) and "session.json: 1073741824 bytes, more than the" in str(e), e
    assert _snapshot(caller) == before


def _crafted(folder, tmp_path, change) -> object:
    """A copy of the save whose session.json `change(state)` edits, its (unkeyed) checksum recomputed."""
    from dasrl.atomic import checksum

    bad = _copy(folder, tmp_path)
    state = json.loads((bad / "session.json").read_text())
    state.pop("checksum")
    change(state)
    (bad / "session.json").write_text(json.dumps({"checksum": checksum(state), **state}))
    return bad


def _set_length(value):
    def change(state):
        state["lengths"]["problems"][0][1][0] = value
    return change


@pytest.mark.parametrize("change, msg", [
    (_set_length(2**24), r"field 'lengths': .*has a length that is not an int in \[0, 1048576\]"),
    (_set_length(2**40), r"field 'lengths': .*has a length that is not an int in \[0, 1048576\]"),
    (lambda s: s["lengths"].update(max_len=-5), r"field 'lengths': length state: max_len must be an int in \[1, "),
    (lambda s: s["lengths"].update(max_len=2**40), r"field 'lengths': length state: max_len must be an int in \[1, "),
    (lambda s: s.update(step=10**30), r"field 'step' must be an int in \[0, 1000000000\], got 1000000000000000000"),
])
def test_crafted_session_json_is_range_checked_before_allocating(sessions, caller, tmp_path, change, msg):
    """The checksum is unkeyed, so a crafted file passes it. On b46648a one length of 2**24 took ~15 s and
    1.2 GB to load (the pooled table grows with the longest length), 2**40 was a raw MemoryError, and
    max_len -5 and step 10**30 were taken."""
    _, folder, _ = sessions
    before = _snapshot(caller)
    bad = _crafted(folder, tmp_path, change)
    with pytest.raises(ValueError, match=msg):
        caller.load(bad)
    assert _snapshot(caller) == before
