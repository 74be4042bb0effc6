"""RolloutSession on a tiny random Llama: sample seeds unique across calls of a step, a failing background
upkeep surfaces at the next call, bounded history, saves that survive SIGKILL at every stage and a full
disk, out-of-range seeds refused before any work."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from dasrl.drafter.store import DraftStore, StoreConfig
from dasrl.engine.sampling import SamplingParams
from dasrl.rollout.session import RolloutSession, SessionConfig, StepSummary

PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]
CONFIG = SessionConfig(counting=False)  # the tiny model has no tokenizer


def _session(tiny_llama, config=CONFIG, **kw) -> RolloutSession:
    return RolloutSession(tiny_llama(0), None, config, **kw)


def _step(s: RolloutSession, n: int = 2, **kw):
    out = s.generate([PROMPTS[0]] * n + [PROMPTS[1]] * n, max_new_tokens=6, **kw)
    s.end_step()
    return out


# ------------------------------------------------------------------------------------- seeds
def test_samples_of_a_step_are_unique_across_calls(tiny_llama):
    s = _session(tiny_llama)
    a = s.generate([PROMPTS[0]] * 2, max_new_tokens=6)
    b = s.generate([PROMPTS[0]] * 2 + [PROMPTS[1]], max_new_tokens=6)
    assert [r.sample for r in a + b] == [0, 1, 2, 3, 0]
    seeds = [r.seed for r in a + b]
    assert len(set(seeds)) == 5
    assert len({tuple(r.completion_ids) for r in a + b[:2]}) == 4  # T = 1 over a 97-token vocabulary
    # one call with the whole step's batch draws the same seeds and tokens (the rule is per step)
    whole = _session(tiny_llama).generate([PROMPTS[0]] * 4 + [PROMPTS[1]], max_new_tokens=6)
    assert [r.seed for r in whole] == seeds
    assert [r.completion_ids for r in whole] == [r.completion_ids for r in a + b]
    s.end_step()
    assert [r.sample for r in s.generate([PROMPTS[0]], max_new_tokens=2)] == [0]  # a new step starts at 0


def test_given_sample_indices_split_a_batch_over_processes(tiny_llama):
    """Two sessions each generating their part of a step with global indices == one session generating it."""
    whole = _session(tiny_llama).generate([PROMPTS[0]] * 4, max_new_tokens=6)
    rank0 = _session(tiny_llama).generate([PROMPTS[0]] * 2, samples=[0, 1], max_new_tokens=6)
    rank1 = _session(tiny_llama).generate([PROMPTS[0]] * 2, samples=[2, 3], max_new_tokens=6)
    assert [r.completion_ids for r in rank0 + rank1] == [r.completion_ids for r in whole]
    s = _session(tiny_llama)
    s.generate([PROMPTS[0]], samples=[5], max_new_tokens=2)
    for bad, match in [([5], "sample index 5 of problem .* drawn twice"), ([1, 1], "drawn twice"),
                       ([-1], "ints >= 0"), ([1.0], "ints >= 0"), ([1, 2, 3], "1 prompts but 3 sample")]:
        with pytest.raises(ValueError, match=match):
            s.generate([PROMPTS[0]] * (1 if len(bad) == 3 else len(bad)), samples=bad, max_new_tokens=2)
    assert [r.sample for r in s.generate([PROMPTS[0]], max_new_tokens=2)] == [6]  # after the largest drawn


def test_seeds_outside_64_bits_are_refused_before_work(tiny_llama):
    s = _session(tiny_llama)
    for seeds in ([2**64], [2**63], [-(2**63) - 1]):
        with pytest.raises(ValueError, match=r"seeds must fit in 64 bits.*" + str(seeds[0])):
            s.generate([PROMPTS[0]], seeds=seeds, max_new_tokens=2)
    assert s.history == []
    edge = s.generate([PROMPTS[0]] * 2, seeds=[2**63 - 1, -(2**63)], max_new_tokens=2)
    assert [r.seed for r in edge] == [2**63 - 1, -(2**63)]


# ------------------------------------------------------------------------------------- upkeep
class FailingStore(DraftStore):
    """The injected fault: a store whose window roll raises."""

    def end_step(self) -> None:
        raise OSError("disk on fire")


class SlowStore(DraftStore):
    """A store whose window roll takes a second (so a reader that does not wait would see the old window)."""

    def end_step(self) -> None:
        time.sleep(1.0)
        super().end_step()


@pytest.mark.parametrize("background", [True, False])
def test_a_failed_upkeep_surfaces_at_the_next_call(tiny_llama, tmp_path, background):
    s = _session(tiny_llama, SessionConfig(counting=False, background_upkeep=background),
                 drafter=FailingStore(StoreConfig()))
    s.generate(PROMPTS, max_new_tokens=4)
    if background:
        s.end_step()  # returns: the roll runs in the background
    else:
        with pytest.raises(RuntimeError, match="upkeep failed") as e:
            s.end_step()
        assert isinstance(e.value.__cause__, OSError)
    for call in (lambda: s.generate(PROMPTS, max_new_tokens=2), s.end_step, s.stats,
                 lambda: s.save(tmp_path / "x"), lambda: s.record([])):
        with pytest.raises(RuntimeError, match="upkeep failed .*disk on fire") as e:
            call()
        assert isinstance(e.value.__cause__, OSError) and "disk on fire" in str(e.value.__cause__)
    assert not (tmp_path / "x").exists() and len(s.history) == 1
    good = _session(tiny_llama)
    _step(good)
    good.save(tmp_path / "good")
    s.load(tmp_path / "good")  # a load replaces the half-rolled state: the session works again
    assert s.stats()["steps"] == 1 and len(s.generate(PROMPTS, max_new_tokens=2)) == 2


def test_stats_waits_for_the_upkeep(tiny_llama):
    s = _session(tiny_llama, SessionConfig(counting=False, store=StoreConfig(window=1)),
                 drafter=SlowStore(StoreConfig(window=1)))
    _step(s)
    one = s.stats()["store_tokens"]
    _step(s)  # its roll (a second from now) drops the first step's rollouts from the 1-step window
    now = s.stats()["store_tokens"]
    time.sleep(1.5)
    assert now == s.stats()["store_tokens"] < 2 * one  # read after the roll, not before it


# ------------------------------------------------------------------------------------- history
def test_the_step_record_sums_the_engines_forwards(tiny_llama):
    """A session's StepSummary is StepSummary.of(the engine's StepInfo list) plus the session's own fields;
    add() sums records as a distributed step sums its workers'."""
    s = _session(tiny_llama, SessionConfig(counting=False, policy="fixed", policy_kw=(("k", 4),)))
    _step(s)
    seen = []
    out = s.generate([PROMPTS[0]] * 2 + [PROMPTS[1]] * 2, max_new_tokens=6, on_step=seen.append)
    h = s.history[-1]
    assert s.engine.last_steps == seen and h.forwards == len(seen) and h.step == 1
    assert h.new_tokens == sum(len(r.completion_ids) for r in out) == sum(i.new_tokens for i in seen)
    assert (h.drafted, h.accepted, h.row_forwards) == tuple(sum(getattr(r, k) for r in out)
                                                           for k in ("drafted", "accepted", "forwards"))
    assert h.drafted > 0  # it drafted from step 0's rollouts: the sums are not all zero
    assert h.batch_curve == [(i.elapsed_s, i.batch_size) for i in seen]
    assert h.forward_s == sum(i.forward_s for i in seen) > 0 and h.rollout_s >= seen[-1].elapsed_s
    assert StepSummary.of(seen, step=1, rollout_s=h.rollout_s) == StepSummary(
        **{**vars(h), "upkeep_wait_s": 0.0, "upkeep_s": 0.0, "row_forwards": 0, "drafted_by_class": {}})
    both = StepSummary(step=1, rollout_s=0.0)
    both.add(h)
    both.add(h)
    assert (both.forwards, both.drafted, both.verify_s) == (2 * h.forwards, 2 * h.drafted, 2 * h.verify_s)
    assert both.drafted_by_class == {k: 2 * v for k, v in h.drafted_by_class.items()}


def test_history_is_bounded_and_stats_keep_totals(tiny_llama, tmp_path):
    s = _session(tiny_llama, SessionConfig(counting=False, history=3))
    sums = {"forwards": 0, "new_tokens": 0}
    for _ in range(5):
        s.generate(PROMPTS, max_new_tokens=4)
        sums = {k: v + getattr(s.history[-1], k) for k, v in sums.items()}
        s.end_step()
    st = s.stats()
    assert len(s.history) == 3 and [h.step for h in s.history] == [2, 3, 4]
    assert st["steps"] == 5 and st["forwards"] == sums["forwards"] and st["new_tokens"] == sums["new_tokens"]
    s.save(tmp_path / "s")
    assert len(json.loads((tmp_path / "s" / "session.json").read_text())["history"]) == 3
    back = _session(tiny_llama)
    back.load(tmp_path / "s")
    got = back.stats()
    # the latency fit is this process's measurement of its machine: a loaded session starts again from the prior
    skip = ("store_bytes", "latency")
    assert {k: got[k] for k in st if k not in skip} == {k: st[k] for k in st if k not in skip}
    assert len(back.history) == 3
    with pytest.raises(ValueError, match="history must be an int >= 1"):
        SessionConfig(history=0)


# ------------------------------------------------------------------------------------- saves
def _kill_at(module, name: str, nth: int) -> None:
    """Make the nth call of module.name SIGKILL this process (the fault; the real save code runs up to it)."""
    real, calls = getattr(module, name), [0]

    def hook(*a, **k):
        calls[0] += 1
        if calls[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    setattr(module, name, hook)


def _killed_save(s: RolloutSession, folder, stage: str) -> None:
    """s.save(folder) in a forked child that is SIGKILLed at `stage`."""
    import dasrl.atomic as atomic

    where = {"data": (atomic.os, "replace", 1),  # the npz's temporary file written, not renamed
             "manifest": (atomic.os, "replace", 2),  # the npz in place, session.json's temporary not renamed
             "cleanup": (atomic.os, "unlink", 1)}[stage]  # committed, the previous save's npz not deleted
    pid = os.fork()
    if pid == 0:  # the child: only file work (no torch), then it dies
        try:
            _kill_at(*where)
            s.save(folder)
        finally:
            os._exit(3)  # not killed: the parent's assertion says so
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (stage, status)


def _saved(tiny_llama, folder, steps: int) -> None:
    s = _session(tiny_llama)
    for _ in range(steps):
        _step(s)
    s.save(folder)


def _loads(tiny_llama, folder) -> int:
    s = _session(tiny_llama)
    s.load(folder)
    return s.step


@pytest.fixture(scope="module")
def saves(tiny_llama):
    """(the previous save's session: step 1, the new save's: step 3, a session to load into)."""
    sessions = [_session(tiny_llama) for _ in range(3)]
    for s, steps in zip(sessions, (1, 3, 0)):
        for _ in range(steps):
            _step(s)
    return sessions


def _one_save(folder) -> bool:
    """`folder` holds exactly one session save: session.json and the npz it names."""
    names = sorted(os.listdir(folder))
    return len(names) == 2 and names[1] == "session.json" and names[0] == json.loads(
        (folder / "session.json").read_text())["data"]


@pytest.mark.parametrize("stage, step", [("data", 1), ("manifest", 1), ("cleanup", 3)])
def test_a_save_killed_at_any_stage_leaves_a_loadable_save(saves, tmp_path, stage, step):
    previous, new, loader = saves
    folder = tmp_path / "sess"
    previous.save(folder)
    _killed_save(new, folder, stage)
    loader.load(folder)
    assert loader.step == step
    assert not _one_save(folder)  # the killed save's leftovers
    new.save(folder)  # a later save commits cleanly and removes them (and makes no lock file)
    assert sorted(q.name for q in tmp_path.iterdir()) == ["sess"] and _one_save(folder)
    loader.load(folder)
    assert loader.step == 3


def test_a_full_disk_leaves_the_previous_save(tiny_llama, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a 2 MiB tmpfs here (needs root): the ENOSPC case is not exercised")
    try:
        folder = disk / "sess"
        _saved(tiny_llama, folder, 1)
        before = sorted(os.listdir(folder))
        big = _session(tiny_llama)
        _step(big)
        for i in range(400):  # a window far beyond 2 MiB of npz
            big.store.add_rollout(1000 + i, [1, 2, 3], [(i * 7 + j) % 97 for j in range(2000)])
        big.end_step()
        with pytest.raises(OSError) as e:
            big.save(folder)
        assert e.value.errno == 28  # ENOSPC
        assert sorted(q.name for q in disk.iterdir()) == ["sess"]  # nothing half-written left
        assert sorted(os.listdir(folder)) == before
        assert _loads(tiny_llama, folder) == 1
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_save_keeps_other_files_in_its_folder(tiny_llama, tmp_path):
    """A save deletes only what saves of its kind write: the user's files, and a draft store saved into the
    same folder, stay."""
    (tmp_path / "weights.bin").write_bytes(b"x")
    DraftStore(StoreConfig()).save(tmp_path)
    s = _session(tiny_llama)
    _step(s)
    s.save(tmp_path)
    s.save(tmp_path)
    assert (tmp_path / "weights.bin").read_bytes() == b"x"
    assert len(os.listdir(tmp_path)) == 5  # weights.bin, store.json + its npz, session.json + its npz
    assert _loads(tiny_llama, tmp_path) == 1 and DraftStore.load(tmp_path).step == 0


def test_next_samples_counts_on_from_what_was_drawn():
    from dasrl.rollout.session import _next_samples

    drawn = {"a": {0, 1}}
    assert _next_samples(drawn, ["a", "b", "a"]) == [2, 0, 3]
    assert _next_samples({}, ["a", "a", "b", "a"]) == [0, 1, 0, 2]
    assert drawn == {"a": {0, 1}}  # the caller records what it drew


# ------------------------------------------------------------------------- issue 37 item 1
def test_two_processes_saving_one_folder_leave_a_loadable_save(tiny_llama, tmp_path):
    """Two ranks saving one checkpoint path: two forked processes, 15 saves each, 6 rounds. On b46648a 3-8
    of the 15 saves raised FileNotFoundError (a save's cleanup deleted the other's .ck.tmp-* folder) and
    some rounds left a folder that did not load. Now every save succeeds and every round ends loadable."""
    sessions = [_session(tiny_llama) for _ in range(2)]
    for s, steps in zip(sessions, (1, 2)):
        for _ in range(steps):
            _step(s)
    for rnd in range(6):
        folder = tmp_path / f"ck{rnd}"
        pids = []
        for s in sessions:
            pid = os.fork()
            if pid == 0:  # only file work in the children (no torch), then they exit with what happened
                code = 0
                try:
                    for _ in range(15):
                        s.save(folder)
                except BaseException:  # noqa: BLE001 (the exit code reports it)
                    import traceback
                    traceback.print_exc()
                    code = 1
                os._exit(code)
            pids.append(pid)
        codes = [os.waitpid(pid, 0)[1] for pid in pids]
        assert codes == [0, 0], f"round {rnd}: a save raised (exit statuses {codes})"
        assert _loads(tiny_llama, folder) in (1, 2)
        assert _one_save(folder)  # nothing left of the other saves


def test_a_load_waits_for_a_save_in_progress(tiny_llama, tmp_path):
    """A load during a save (another process holding the folder's lock, session.json not in place) waits for
    the save's lock and reads the new save."""
    import fcntl

    s = _session(tiny_llama)
    _step(s)
    s.save(tmp_path / "ck")
    _step(s)
    s.save(tmp_path / "new")
    lock = os.open(tmp_path / "ck", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # a save in progress: its lock (on the folder) held
    os.unlink(tmp_path / "ck" / "session.json")  # ... a state no load could read
    loader, done = _session(tiny_llama), []
    t = __import__("threading").Thread(target=lambda: done.append(loader.load(tmp_path / "ck")), daemon=True)
    t.start()
    t.join(1.0)
    assert not done, "load did not wait for the save's lock"
    for f in sorted((tmp_path / "new").iterdir()):  # the save's data file, then its commit
        shutil.copy(f, tmp_path / "ck" / f.name)
    os.close(lock)
    t.join(30)
    assert done and loader.step == 2


# ------------------------------------------------------------------------- issue 37 item 2
def _plain_forward_works(model) -> None:
    """A trainer's forward on the model: the stock attention, no engine layout."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    assert out.logits.shape == (1, 4, model.config.vocab_size)


def _race(generators):
    """Every generator (a no-argument call) started at once, each in its own thread: what each returned
    or raised."""
    import threading

    barrier = threading.Barrier(len(generators))
    got: list = [None] * len(generators)

    def go(i):
        barrier.wait()
        try:
            got[i] = generators[i]()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            got[i] = e
    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(generators))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got


def test_two_threads_generating_on_one_session(tiny_llama):
    """On b46648a both threads drew sample indices [0, 0, 0, 0] (duplicate seeds, identical completions),
    some runs crashed (mat1 and mat2 shapes cannot be multiplied), and the model was left on the engine's
    attention (every plain forward then failed)."""
    model = tiny_llama(0)
    attn = model.config._attn_implementation
    s = RolloutSession(model, None, CONFIG)
    for _ in range(4):
        rnd = _race([lambda: s.generate([PROMPTS[0]] * 4, max_new_tokens=24)] * 2)
        assert not any(isinstance(r, BaseException) for r in rnd), rnd
        a, b = rnd
        assert sorted(r.sample for r in a + b) == list(range(8))
        assert len({r.seed for r in a + b}) == 8
        s.end_step()
    assert model.config._attn_implementation == attn
    assert not any("forward" in m.__dict__ for m in model.modules())  # no padded linear left patched
    _plain_forward_works(model)


def test_two_sessions_sharing_a_model(tiny_llama):
    model = tiny_llama(0)
    attn = model.config._attn_implementation
    a, b = RolloutSession(model, None, CONFIG), RolloutSession(model, None, CONFIG)
    alone = [_session(tiny_llama), _session(tiny_llama)]  # each on its own copy of the model
    for _ in range(4):
        rnd = _race([lambda: a.generate([PROMPTS[0]] * 3, max_new_tokens=24),
                     lambda: b.generate([PROMPTS[1]] * 5, max_new_tokens=24)])
        assert not any(isinstance(r, BaseException) for r in rnd), rnd
        want = [alone[0].generate([PROMPTS[0]] * 3, max_new_tokens=24),
                alone[1].generate([PROMPTS[1]] * 5, max_new_tokens=24)]
        # the same tokens as each session alone: nothing of one forward mixed into the other's
        assert [[r.completion_ids for r in got] for got in rnd] == [[r.completion_ids for r in w] for w in want]
        for x in (a, b, *alone):
            x.end_step()
    assert model.config._attn_implementation == attn
    _plain_forward_works(model)


def test_a_failed_generate_restores_the_model_and_releases_its_samples(tiny_llama):
    model = tiny_llama(0)
    attn = model.config._attn_implementation
    s = RolloutSession(model, None, CONFIG)

    def boom(info):
        raise RuntimeError("the caller's on_step failed")
    with pytest.raises(Exception, match="on_step failed"):
        s.generate([PROMPTS[0]] * 2, max_new_tokens=6, on_step=boom)
    assert model.config._attn_implementation == attn
    _plain_forward_works(model)
    assert [r.sample for r in s.generate([PROMPTS[0]] * 2, max_new_tokens=6)] == [0, 1]  # a retry's seeds


# ------------------------------------------------------------------------- issue 37 items 7 and 14
class InterruptedStore(DraftStore):
    """A real SIGINT sent to this process as the drafter's start() or finish() returns: Python raises the
    KeyboardInterrupt at the next bytecode, in the engine, right after the call."""

    def __init__(self, *a, at: str, **k) -> None:
        super().__init__(*a, **k)
        self.at, self.armed = at, True

    def _interrupt(self, where: str) -> None:
        if self.armed and where == self.at:
            self.armed = False
            os.kill(os.getpid(), signal.SIGINT)

    def start(self, *a, **k) -> None:
        super().start(*a, **k)
        self._interrupt("start")

    def finish(self, req_id) -> None:
        super().finish(req_id)
        self._interrupt("finish")


@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler for the test: a suite run as a background job (`make test &`) inherits
    SIGINT ignored, and the signal would then never reach the engine."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("at", ["start", "finish"])
def test_an_interrupt_right_after_the_drafter_call(tiny_llama, at, sigint_raises):
    """On b46648a, after start: every later generate of the step failed with "request (0, 0) already
    started"; after finish: the KeyboardInterrupt was replaced by a ValueError."""
    store = InterruptedStore(StoreConfig(), at=at)
    s = _session(tiny_llama, drafter=store)
    with pytest.raises(KeyboardInterrupt):
        s.generate([PROMPTS[0]] * 2, max_new_tokens=6)
    assert store.num_live == 0  # nothing left live in the drafter
    out = s.generate([PROMPTS[0]] * 2, max_new_tokens=6)  # the same step goes on
    assert [r.sample for r in out] == [0, 1]
    s.end_step()


def test_every_generate_call_of_a_step_feeds_the_length_history(tiny_llama):
    """3 calls x 4 samples in one step: 12 lengths recorded (b46648a recorded 4: the request ids (step, i)
    repeated across the calls, and the length history skipped ids it had seen finish)."""
    s = _session(tiny_llama, SessionConfig(counting=False, background_upkeep=False))
    for _ in range(3):
        s.generate([PROMPTS[0]] * 4, max_new_tokens=6)
    s.end_step()
    recorded = sum(len(ls) for _, ls in s.policy.lengths.state_dict()["problems"])
    assert recorded == 12
