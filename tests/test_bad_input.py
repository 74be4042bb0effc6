"""Engine input validation at the boundary: a clear error naming the value, before any work."""

from __future__ import annotations

import numpy as np
import pytest

from dasrl.engine.rows import validate_job
from dasrl.engine.sampling import _MIN_TEMPERATURE, SamplingParams


def _job(prompts, **kw):
    args = dict(prompts=prompts, seeds=None, sampling=SamplingParams(), max_new_tokens=4, stop_ids=set(),
                stop_strings=(), req_ids=None, problem_ids=None, vocab_size=100, max_context=64, tokenizer=None)
    return validate_job(**{**args, **kw})


@pytest.mark.parametrize("t", [5e-324, 1e-300, 1e-6, _MIN_TEMPERATURE / 2])
def test_tiny_temperature_is_refused(t):
    with pytest.raises(ValueError, match=rf"temperature {t!r} is below 1e-05 .*use 0 for greedy"):
        SamplingParams(temperature=t)


def test_temperature_bounds_still_accept_zero_and_the_threshold():
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=_MIN_TEMPERATURE).greedy


def test_multi_dimensional_prompt_is_refused_not_flattened():
    with pytest.raises(ValueError, match=r"prompt 1 is a 2-D array of shape \(2, 3\); each prompt must be 1-D"):
        _job([[1, 2], np.ones((2, 3), np.int64)])
    with pytest.raises(TypeError, match=r"prompt 0 is the int 5: prompts is a list of prompts"):
        _job(np.array([5, 6, 7]))  # one prompt passed without the outer list: was 3 one-token prompts
    with pytest.raises(ValueError, match=r"prompt 0 is a 0-D array"):
        _job([np.array(5.0)])
    with pytest.raises(TypeError, match=r"prompt 0 is the int 5: prompts is a list of prompts"):
        _job([5, 6, 7])
    job = _job([np.array([1, 2, 3]), [4, 5]])
    assert job.prompts == [[1, 2, 3], [4, 5]]


def test_torch_prompts():
    torch = pytest.importorskip("torch")
    assert _job([torch.tensor([1, 2, 3])]).prompts == [[1, 2, 3]]
    with pytest.raises(ValueError, match=r"prompt 0 is a 2-D array of shape \(1, 3\)"):
        _job([torch.tensor([[1, 2, 3]])])  # a tokenizer's return_tensors="pt" output, batch of one


def test_max_context_beyond_the_model_is_refused(smollm):
    from dasrl.engine.engine import EngineConfig, SpecEngine

    model, tok = smollm
    with pytest.raises(ValueError, match=r"max_context=1000000\) exceeds the model's max_position_embeddings=8192"):
        SpecEngine(model, tok, EngineConfig(max_context=10**6))
    assert SpecEngine(model, tok, EngineConfig(max_context=8192)).max_context == 8192
    assert SpecEngine(model, tok).max_context == 8192


# ------------------------------------------------------------------------- issue 37 item 15
@pytest.mark.parametrize("kw, err, msg", [
    (dict(stop_ids={1.7}), TypeError, r"stop_token_ids must hold integers, got 1.7"),  # was truncated to 1
    (dict(stop_lines="abc"), TypeError, r"stop_lines must be a list of strings, got the string 'abc'"),
    (dict(stop_strings="abc"), TypeError, r"stop_strings must be a list of strings, got the string 'abc'"),
    (dict(prompts=[None]), TypeError, r"prompt 0 is NoneType None; each prompt is a list of token ids"),
    (dict(prompts=[{1, 2}]), TypeError, r"prompt 0 is set"),
])
def test_silently_converted_inputs_are_refused(kw, err, msg):
    with pytest.raises(err, match=msg):
        _job(kw.pop("prompts", [[1, 2]]), **kw)


@pytest.mark.parametrize("prompt, msg", [("What is 2+2?", "prompt 0 is a string; pass token ids"),
                                         (None, "prompt 0 is NoneType None")])
def test_session_names_a_prompt_that_is_not_token_ids(tiny_llama, prompt, msg):
    """RolloutSession.generate hashed prompts into problem ids first: a string or None prompt gave a cryptic
    int() error from problem_key."""
    from dasrl.rollout.session import RolloutSession, SessionConfig

    s = RolloutSession(tiny_llama(0), None, SessionConfig(counting=False))
    with pytest.raises(TypeError, match=msg):
        s.generate([prompt], max_new_tokens=2)
    assert s.history == [] and s._drawn == {}
