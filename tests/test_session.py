"""RolloutSession on the real model: spec-on == spec-off across RL steps, history drafts get accepted,
state survives save/load, seeds depend only on (run, step, problem, sample)."""

from __future__ import annotations

import pytest

from dasrl.engine.sampling import SamplingParams
from dasrl.rollout.session import RolloutSession, SessionConfig, sample_seed

pytestmark = pytest.mark.slow


def test_seeds_depend_only_on_their_key():
    assert sample_seed(0, 3, 17, 2) == sample_seed(0, 3, 17, 2)
    assert len({sample_seed(0, s, p, k) for s in range(3) for p in (1, 2) for k in range(4)}) == 24


def test_spec_on_equals_spec_off_over_steps(smollm, chat_prompts, tmp_path):
    model, tok = smollm
    prompts = [chat_prompts[0]] * 3 + [chat_prompts[6]] * 3
    sp = SamplingParams(temperature=0.7, top_p=0.95)
    on = RolloutSession(model, tok, SessionConfig(speculate=True, policy="das"))
    off = RolloutSession(model, tok, SessionConfig(speculate=False))
    for step in range(2):
        a = on.generate(prompts, sampling=sp, max_new_tokens=24)
        b = off.generate(prompts, sampling=sp, max_new_tokens=24)
        assert [x.completion_ids for x in a] == [y.completion_ids for y in b]
        assert [x.sample for x in a] == [0, 1, 2, 0, 1, 2]
        on.end_step()
        off.end_step()
    assert on.history[1].accepted > 0  # step 2 drafts from step 1's rollouts of the same prompts
    assert on.stats()["store_tokens"] > 0 and off.stats()["drafted"] == 0
    on.save(tmp_path / "sess")
    back = RolloutSession(model, tok, SessionConfig(speculate=True))
    back.load(tmp_path / "sess")
    assert back.step == 2 and back.store.num_tokens == on.store.num_tokens
    c = back.generate(prompts, sampling=sp, max_new_tokens=24)
    d = off.generate(prompts, sampling=sp, max_new_tokens=24)
    assert [x.completion_ids for x in c] == [y.completion_ids for y in d]


def test_bad_input(smollm):
    model, tok = smollm
    s = RolloutSession(model, tok, SessionConfig(speculate=False))
    with pytest.raises(ValueError, match="at least one prompt"):
        s.generate([])
    with pytest.raises(ValueError, match="problem ids"):
        s.generate([[1, 2]], problem_ids=[1, 2])
    with pytest.raises(ValueError, match="not a dasrl session|cannot read"):
        s.load("/nonexistent/folder")


def test_drafter_override_and_record(smollm, chat_prompts):
    """A session with another drafter (an oracle, wrong at every 4th token) stays exact; record() + end_step()
    gives a session the history of a step it did not generate, so it drafts from it on the next step."""
    from support.drafters import Oracle

    model, tok = smollm
    prompts = [chat_prompts[0]] * 2 + [chat_prompts[6]] * 2
    sp = SamplingParams(temperature=0.7, top_p=0.95)
    off = RolloutSession(model, tok, SessionConfig(speculate=False))
    late = RolloutSession(model, tok, SessionConfig(speculate=True, policy="das"))
    with pytest.raises(ValueError, match="speculate is False"):
        RolloutSession(model, tok, SessionConfig(speculate=False), drafter=Oracle({}))
    ref = off.generate(prompts, sampling=sp, max_new_tokens=20)
    wrong = {(0, i): [t if j % 4 != 3 else (t + 1) % len(tok) for j, t in enumerate(r.completion_ids)]
             for i, r in enumerate(ref)}  # the session's request ids: (step, index)
    other = RolloutSession(model, tok, SessionConfig(speculate=True, policy="fixed", policy_kw=(("k", 4),)),
                           drafter=Oracle(wrong))
    assert other.store is None and isinstance(other.drafter, Oracle) and late.store is not None
    got = other.generate(prompts, sampling=sp, max_new_tokens=20)
    assert [x.completion_ids for x in got] == [y.completion_ids for y in ref]
    assert other.history[-1].drafted > other.history[-1].accepted > 0  # drafts taken, some refused
    late.record(ref)  # step 0 taken from the baseline, not generated
    assert late.store.num_tokens > 0 and late.history == []
    for s in (off, other, late):
        s.end_step()
    ref1 = off.generate(prompts, sampling=sp, max_new_tokens=20)
    got1 = late.generate(prompts, sampling=sp, max_new_tokens=20)
    assert [x.completion_ids for x in got1] == [y.completion_ids for y in ref1]
    assert [x.seed for x in got1] == [y.seed for y in ref1]
    assert late.history[-1].step == 1


def test_session_fits_its_forward_cost_online(smollm, chat_prompts):
    """Every decoding forward of a speculating session is recorded (tokens, context, seconds) and, once
    enough are in, the policy prices drafts with the fit, not the shipped CPU prior; stats() reports it.
    fit_latency=False prices with the prior throughout."""
    from dasrl.policy.latency import CPU_LATENCY

    model, tok = smollm
    prompts = [chat_prompts[0]] * 3 + [chat_prompts[6]] * 3
    sp = SamplingParams(temperature=0.7, top_p=0.95)
    s = RolloutSession(model, tok, SessionConfig(speculate=True))
    assert s.policy.latency is CPU_LATENCY and s.latency.prior is CPU_LATENCY  # a CPU session: the CPU prior
    s.generate(prompts, sampling=sp, max_new_tokens=48)
    rep = s.stats()["latency"]
    assert rep["samples"] == s.history[-1].forwards - 1  # every forward but the prefill
    assert rep["fitted"] and s.policy.latency is s.latency.fitted is not CPU_LATENCY
    assert rep["c_base"] > 0 and rep["c_tok"] > 0 and 0 <= rep["median_rel_error"] < 1
    fixed = RolloutSession(model, tok, SessionConfig(speculate=True, fit_latency=False))
    fixed.generate(prompts, sampling=sp, max_new_tokens=16)
    assert fixed.policy.latency is CPU_LATENCY and fixed.stats()["latency"] is None


def test_close_joins_the_upkeep_and_frees_the_store(smollm, chat_prompts):
    model, tok = smollm
    with RolloutSession(model, tok, SessionConfig(speculate=True)) as s:
        s.generate([chat_prompts[0]] * 2, max_new_tokens=8)
        s.end_step()  # upkeep in a background thread
        store = s.store
    assert s._upkeep is None
    with pytest.raises(ValueError, match="closed"):  # its history freed: a closed store answers nothing
        store.num_tokens
    with pytest.raises(RuntimeError, match="closed"):
        s.generate([chat_prompts[0]], max_new_tokens=4)
