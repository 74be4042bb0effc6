"""The position-keyed sampler: parameters, uniforms, filtering, and a chi-square test of the draws."""

import math

import numpy as np
import pytest
import torch

from dasrl.engine.sampling import SamplingParams, filtered_probs, sample, uniforms


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
])
def test_bad_params_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_params_frozen_and_greedy():
    p = SamplingParams()
    assert p.greedy and not SamplingParams(temperature=0.6).greedy
    with pytest.raises(Exception):
        p.temperature = 1.0  # type: ignore[misc]


def test_uniforms_are_position_keyed():
    seeds = np.array([1, 1, 2, -5, 2**62])
    pos = np.array([0, 7, 7, 3, 100])
    u = uniforms(seeds, pos)
    assert u.dtype == np.float64 and ((u >= 0) & (u < 1)).all()
    # one at a time == all at once, in any order: no hidden stream
    for i in range(len(seeds)):
        assert uniforms(seeds[i : i + 1], pos[i : i + 1])[0] == u[i]
    perm = np.array([4, 2, 0, 3, 1])
    assert np.array_equal(uniforms(seeds[perm], pos[perm]), u[perm])
    assert len(set(u.tolist())) == len(u)


def test_uniforms_look_uniform():
    u = uniforms(np.repeat(np.arange(100), 1000), np.tile(np.arange(1000), 100))
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    assert abs(u.mean() - 0.5) < 0.005
    assert _chi2(counts, np.full(20, len(u) / 20)) < _chi2_crit(19)


def test_greedy_takes_first_argmax():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 1.0, 5.0, 5.0]])
    tok, lp = sample(logits, SamplingParams(), np.zeros(2))
    assert tok.tolist() == [1, 0]
    assert np.allclose(lp, torch.log_softmax(logits.double(), -1)[[0, 1], [1, 0]].numpy())


def test_filters_keep_ties_and_renormalise():
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert np.allclose(p.numpy(), [[0.5, 0.25, 0.25, 0, 0]])  # the tie at rank 2 is kept whole
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert np.allclose(p.numpy(), [[0.5, 0.25, 0.25, 0, 0]])  # 0.4 + 0.2 reaches 0.5; the tie comes along
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.4))
    assert np.allclose(p.numpy(), [[1, 0, 0, 0, 0]])


def test_top_p_beyond_candidate_window():
    logits = torch.zeros(1, 1000)  # flat: the cut needs more than the 256 candidates
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))
    assert np.allclose(p.sum().item(), 1.0)
    assert int((p > 0).sum()) == 1000  # all tied: kept whole


def test_sample_is_row_independent():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 300, generator=g) * 3
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9)
    u = uniforms(np.arange(16), np.arange(16))
    tok, lp = sample(logits, params, u)
    for i in [0, 5, 15]:
        t1, l1 = sample(logits[i : i + 1], params, u[i : i + 1])
        assert t1[0] == tok[i] and l1[0] == lp[i]


def _chi2(obs, exp):
    return float(((obs - exp) ** 2 / exp).sum())


def _chi2_crit(df, z=3.09):  # ~0.999 quantile, Wilson-Hilferty
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.0, top_k=4),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=0.6, top_k=5, top_p=0.95),
])
def test_chi_square_against_target(params):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.2, 0.0, -1.0, -2.0]])
    n = 40_000
    u = uniforms(np.full(n, 1234), np.arange(n))
    tok, lp = sample(logits.expand(n, -1), params, u)
    expected = filtered_probs(logits, params)[0].numpy()
    counts = np.bincount(tok, minlength=8)
    assert (counts[expected == 0] == 0).all()  # never outside the kept set
    keep = expected > 0
    assert _chi2(counts[keep], n * expected[keep]) < _chi2_crit(int(keep.sum()) - 1)
    assert np.allclose(lp, np.log(expected[tok]))
