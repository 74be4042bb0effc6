"""The fourth reliability probe's defects (issue 43, items 5, 7, 9, 10, 11): a closed session or store refuses
every call instead of answering empty (or saving an empty store over a good one); bad values are refused
where they are given, naming them; a save's folder takes no lock files and follows a link; a load leaves a
stray file in a save alone, unread."""

from __future__ import annotations

import math
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from dasrl.drafter import DraftStore  # noqa: E402
from dasrl.engine import SamplingParams  # noqa: E402
from dasrl.policy import OnlineLatency, make_policy  # noqa: E402
from dasrl.policy.latency import CPU_LATENCY  # noqa: E402
from dasrl.rollout import RolloutSession, SessionConfig  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


@pytest.fixture
def session(tiny_llama):
    s = RolloutSession(tiny_llama(), None, SessionConfig(counting=False))
    s.generate(PROMPTS, sampling=SamplingParams(temperature=1.0), max_new_tokens=12)
    s.end_step()
    yield s
    s.close()


def test_a_closed_session_refuses_every_call_and_keeps_the_last_save(session, tmp_path):
    ckpt = tmp_path / "ckpt"
    session.save(ckpt)
    tokens = session.stats()["store_tokens"]
    assert tokens > 0
    session.close()
    session.close()  # idempotent
    for call in (lambda: session.save(ckpt), session.end_step, session.stats, lambda: session.record([]),
                 lambda: session.load(ckpt), lambda: session.generate(PROMPTS)):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    fresh = RolloutSession(session.engine.model, None, SessionConfig(counting=False))
    fresh.load(ckpt)  # the save the closed session would have overwritten with an empty store
    assert fresh.stats()["store_tokens"] == tokens
    fresh.close()


def test_a_closed_store_raises_instead_of_answering_empty(tmp_path):
    store = DraftStore()
    store.add_rollout(1, [1, 2, 3], [4, 5, 6, 4, 5, 6])
    store.end_step()
    store.save(tmp_path / "s")
    store.close()
    for call in (lambda: store.propose_flat([], []), lambda: store.save(tmp_path / "s"), store.end_step,
                 store.discard_step, lambda: store.num_tokens, lambda: store.bytes_used(), lambda: store.num_live,
                 lambda: store.observe("r", [1]), lambda: store.start("r", 1, [1, 2])):
        with pytest.raises(ValueError, match="closed"):
            call()
    assert DraftStore.load(tmp_path / "s").num_tokens == 9


@pytest.mark.parametrize("args, msg", [
    ((1, 1, 0, math.nan, 1), "seconds must be a finite number > 0, got nan"),
    ((-5, 1, 0, -1.0, 1), "tokens must be an int >= 1, got -5"),
    ((1, 1, 0, -1.0, 1), "seconds must be a finite number > 0, got -1.0"),
    ((1, -1, 0, 0.1, 1), "kv_tokens must be an int >= 0, got -1"),
    ((1, 1, 2, 0.1, 1), "draft_kv_tokens=2 exceeds kv_tokens=1"),
    ((1.5, 1, 0, 0.1, 1), "tokens must be an int >= 1, got 1.5"),
    ((1, 1, 0, 0.1, 0), "rows must be an int >= 1, got 0"),
    ((2, 1, 0, 0.1, 3), "rows=3 exceeds tokens=2"),
])
def test_online_latency_refuses_bad_records(args, msg):
    fit = OnlineLatency(CPU_LATENCY)
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        fit.record(*args[:4], rows=args[4])
    assert fit.num_samples == 0


@pytest.mark.parametrize("kw, err, msg", [
    (dict(max_tokens=math.nan), ValueError, "max_tokens must be an int >= 0 or None, got nan"),
    (dict(max_tokens=-1), ValueError, "max_tokens must be an int >= 0 or None, got -1"),
    (dict(latency="x"), TypeError, "latency must be a LatencyModel"),
    (dict(k=3), ValueError, r"policy 'das' does not take \['k'\]"),
])
def test_make_policy_refuses_bad_settings(kw, err, msg):
    with pytest.raises(err, match=msg):
        make_policy("das", **kw)
    with pytest.raises(ValueError, match=r"policy 'fixed' does not take \['caps'\]"):
        make_policy("fixed", caps=object())


@pytest.mark.parametrize("kw, msg", [
    (dict(speculate="yes"), "speculate must be True or False, got 'yes'"),
    (dict(seed=-1), r"seed must be an int in \[0, 2\*\*63\), got -1"),
    (dict(seed=1.5), "seed must be an int in"),
    (dict(seed=2**64), "seed must be an int in"),
    (dict(draft_allowance=1.5), "draft_allowance must be an int >= 0 or None, got 1.5"),
    (dict(policy_kw={"k": 3}), r"policy 'das' does not take \['k'\]"),
    (dict(policy_kw=(("caps",),)), "policy_kw must be"),
    (dict(fit_latency=1), "fit_latency must be True or False, got 1"),
    (dict(counting="no"), "counting must be True or False"),
    (dict(background_upkeep=None), "background_upkeep must be True or False"),
    (dict(policy="greedy"), "unknown policy 'greedy'"),
    (dict(store="problem"), "store must be a StoreConfig"),
    (dict(engine={}), "engine must be a EngineConfig"),
    (dict(latency=3), "latency must be a path"),
    (dict(policy="fixed", draft_allowance=8), "draft_allowance and latency price the das policy"),
    (dict(history=0), "history must be an int >= 1"),
])
def test_session_config_refuses_bad_values(kw, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        SessionConfig(**kw)


def test_session_config_takes_policy_settings_as_a_dict():
    assert SessionConfig(policy="fixed", policy_kw={"k": 3}).policy_kw == (("k", 3),)


def test_bad_arguments_of_the_session_are_named(session, tmp_path):
    with pytest.raises(TypeError, match="needs the model to roll out .* got NoneType"):
        RolloutSession(None, None)
    with pytest.raises(TypeError, match="record\\(\\): item 0 is a int, not a Rollout"):
        session.record([1, 2])
    with pytest.raises(TypeError, match="problem id 0 is a list .* not hashable"):
        session.generate(PROMPTS[:1], problem_ids=[[1, 2]])
    for bad in ("", "  "):
        with pytest.raises(ValueError, match="needs a folder path"):
            session.save(bad)
    assert not list(tmp_path.iterdir())


def test_saves_leave_no_lock_files_and_loads_write_nothing(session, tmp_path):
    for i in range(20):
        session.save(tmp_path / f"ckpt{i}")
        if i:
            shutil.rmtree(tmp_path / f"ckpt{i - 1}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt19"]
    before = sorted(os.listdir(tmp_path))
    session.load(tmp_path / "ckpt19")
    assert sorted(os.listdir(tmp_path)) == before


def test_a_save_onto_a_link_goes_where_it_points(session, tmp_path):
    real = tmp_path / "disk" / "ckpt"
    real.parent.mkdir()
    session.save(real)
    link = tmp_path / "ckpt"
    os.symlink(real, link)
    session.save(link)
    session.save(link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "disk"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["ckpt"]
    session.load(link)


def test_a_stray_file_in_a_save_is_left_alone_unread(session, tmp_path):
    ckpt = tmp_path / "ckpt"
    session.save(ckpt)
    big = ckpt / "huge.bin"
    with open(big, "wb") as f:  # 6 GiB, sparse: hashing it cost 22 s when loads hashed the whole folder
        f.truncate(6 << 30)
    fresh = RolloutSession(session.engine.model, None, SessionConfig(counting=False))
    fresh.load(ckpt)  # only session.json and the data file it names are read
    assert fresh.stats()["store_tokens"] == session.stats()["store_tokens"] > 0
    session.save(ckpt)
    assert big.stat().st_size == 6 << 30  # the user's file is not a save's: kept
    fresh.close()


def test_the_trainers_train_mode_is_kept(tiny_llama):
    model = tiny_llama().train()
    s = RolloutSession(model, None, SessionConfig(speculate=False))
    assert model.training
    s.generate(PROMPTS, max_new_tokens=4)
    assert all(m.training for m in model.modules())
    model.eval()
    s.generate(PROMPTS, max_new_tokens=4)
    assert not any(m.training for m in model.modules())
    s.close()
