"""The position-keyed sampler: parameters, keyed noise, filtering, purity, chi-square, noise robustness."""

import math

import numpy as np
import pytest
import torch

from dasrl.engine.sampling import _BLOCK, SamplingParams, draw, filtered_probs, _kept, _token_noise


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"logprobs_mode": "raw_logits"}, "raw_logits"),
    ({"logprobs_mode": "processed"}, "logprobs_mode"),
    ({"top_k": 2.5}, "top_k"),
])
def test_bad_params_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_params_frozen_and_defaults_as_vllm():
    """SamplingParams() is vLLM's default sampling (T = 1, no top-k, no top-p), not greedy; vLLM's -1
    means no top-k too."""
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p) == (1.0, 0, 1.0) and not p.greedy
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(top_k=-1).top_k == 0
    assert p.logprobs_mode == "processed_logprobs"
    with pytest.raises(Exception):
        p.temperature = 0.5  # type: ignore[misc]


def test_logprobs_modes():
    """processed_logprobs: log of the filtered, tempered probability of the drawn token; raw_logprobs: the
    log-softmax of the raw logits. The tokens are the same in both modes."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 700, generator=g) * 3
    seeds, pos = np.arange(6), np.arange(6) * 7
    sp = dict(temperature=0.7, top_p=0.9, top_k=50)
    tok, lp = draw(logits, SamplingParams(**sp), seeds=seeds, positions=pos)
    tok_raw, lp_raw = draw(logits, SamplingParams(**sp, logprobs_mode="raw_logprobs"), seeds=seeds, positions=pos)
    assert tok.tolist() == tok_raw.tolist()
    probs = filtered_probs(logits, SamplingParams(**sp)).numpy()
    assert np.allclose(lp, np.log(probs[np.arange(6), tok]), atol=1e-6)
    raw = torch.log_softmax(logits.double(), -1).numpy()[np.arange(6), tok]
    assert np.allclose(lp_raw, raw, atol=1e-12) and not np.allclose(lp, lp_raw, atol=1e-3)
    greedy = [draw(logits, SamplingParams(temperature=0.0, logprobs_mode=m), seeds=seeds, positions=pos)
              for m in ("processed_logprobs", "raw_logprobs")]
    assert greedy[0][0].tolist() == greedy[1][0].tolist()
    assert np.array_equal(greedy[0][1], greedy[1][1])  # greedy: both are the raw log-softmax, as vLLM


def test_token_noise_is_keyed_and_gumbel():
    seeds, pos = np.array([3, 3, 4, -1]), np.array([0, 1, 0, 9])
    toks = np.array([[0, 5, 49151], [0, 5, 49151], [0, 5, 49151], [7, 7, 8]])
    g = _token_noise(seeds, pos, toks)
    for i in range(4):  # row by row == all at once: a pure function of (seed, position, token)
        assert np.array_equal(_token_noise(seeds[i : i + 1], pos[i : i + 1], toks[i : i + 1]), g[i : i + 1])
    assert g[3, 0] == g[3, 1] and len(set(g[:3].ravel().tolist())) == 9
    # standard Gumbel: mean = Euler's gamma, variance = pi^2 / 6; its CDF exp(-exp(-x)) is uniform
    big = _token_noise(np.arange(200), np.zeros(200), np.tile(np.arange(1000), (200, 1))).ravel()
    assert abs(big.mean() - 0.5772) < 0.01 and abs(big.var() - math.pi**2 / 6) < 0.03
    counts = np.histogram(np.exp(-np.exp(-big)), bins=20, range=(0, 1))[0]
    assert _chi2(counts, np.full(20, len(big) / 20)) < _chi2_crit(19)


def _draw1(logits, params, seed=0, pos=0):
    return draw(logits, params, seeds=np.array([seed]), positions=np.array([pos]))


def test_greedy_takes_first_argmax():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 1.0, 5.0, 5.0]])
    tok, lp = draw(logits, SamplingParams(temperature=0.0), seeds=np.zeros(2), positions=np.zeros(2))
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


@pytest.mark.parametrize("vocab, top_p", [(1000, 0.9), (9000, 0.99)])
def test_top_p_beyond_candidate_windows(vocab, top_p):
    flat = torch.zeros(1, vocab)  # the cut needs more than every candidate window: a full sort
    p = filtered_probs(flat, SamplingParams(temperature=1.0, top_p=top_p))
    assert np.isclose(p.sum().item(), 1.0) and int((p > 0).sum()) == vocab  # all tied: kept whole
    ramp = torch.linspace(0, -1, vocab)[None]  # distinct values, nucleus past the first window
    p = filtered_probs(ramp, SamplingParams(temperature=1.0, top_p=top_p))[0].numpy()
    n_keep = int((p > 0).sum())
    full = torch.softmax(ramp.double(), -1)[0].numpy()
    assert full[: n_keep - 1].sum() < top_p <= full[:n_keep].sum() + 1e-12 and (p[:n_keep] > 0).all()


def _lm_like(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 2.5  # [n, V]
    hot = torch.randint(0, vocab, (n, 40), generator=g)
    return x.scatter_add_(1, hot, torch.rand(n, 40, generator=g) * 12)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_p=0.95),
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
])
def test_draw_is_a_pure_function_of_row_seed_position(params):
    """The same row, seed and position give the same token and logprob in any batch, order or size."""
    logits = _lm_like(24, 49152, 0)  # the real vocabulary size: reductions as large as the engine's
    seeds, pos = np.arange(24) * 7 - 30, np.arange(24) % 5
    tok, lp = draw(logits, params, seeds=seeds, positions=pos)
    for i in [0, 11, 23]:
        t1, l1 = draw(logits[i : i + 1], params, seeds=seeds[i : i + 1], positions=pos[i : i + 1])
        assert t1[0] == tok[i] and l1[0] == lp[i]
    perm = np.random.default_rng(0).permutation(24)
    tp, lpp = draw(logits[perm], params, seeds=seeds[perm], positions=pos[perm])
    assert np.array_equal(tp, tok[perm]) and np.array_equal(lpp, lp[perm])
    t2, l2 = draw(logits.repeat(3, 1), params, seeds=np.tile(seeds, 3), positions=np.tile(pos, 3))
    assert np.array_equal(t2, np.tile(tok, 3)) and np.array_equal(l2, np.tile(lp, 3))
    probs = filtered_probs(logits, params).numpy()
    assert (probs[np.arange(24), tok] > 0).all()  # never outside the kept set
    assert np.allclose(lp, np.log(probs[np.arange(24), tok]))


def test_bf16_logits_are_sampled():
    logits = _lm_like(4, 3000, 1).bfloat16()
    tok, lp = draw(logits, SamplingParams(temperature=0.8, top_p=0.9), seeds=np.arange(4), positions=np.zeros(4))
    probs = filtered_probs(logits.float(), SamplingParams(temperature=0.8, top_p=0.9)).numpy()
    assert np.allclose(lp, np.log(probs[np.arange(4), tok]))


def test_wrong_lengths_are_refused():
    with pytest.raises(ValueError, match="3 logits rows but 2 seeds"):
        draw(torch.zeros(3, 5), SamplingParams(temperature=1.0), seeds=np.zeros(2), positions=np.zeros(3))


def _chi2(obs, exp):
    return float(((obs - exp) ** 2 / exp).sum())


def _chi2_crit(df, z=3.09):  # ~0.999 quantile, Wilson-Hilferty
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


_TARGET = [2.0, 1.5, 1.0, 0.5, 0.2, 0.0, -1.0, -2.0]


def _spread_logits(vocab=1000):
    """The 8 target logits spread over token ids in four blocks (two sharing a block), the rest far below:
    the two-level race's block level is exercised."""
    ids = np.array([3, 700, 5, 260, 999, 511, 4, 300])
    logits = torch.full((1, vocab), -40.0)
    logits[0, ids] = torch.tensor(_TARGET)
    return logits, ids


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.0, top_k=4),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=0.6, top_k=5, top_p=0.95),
])
@pytest.mark.parametrize("layout", ["dense", "spread"])
def test_chi_square_against_target(params, layout):
    if layout == "dense":
        logits, ids = torch.tensor([_TARGET]), np.arange(8)
    else:
        logits, ids = _spread_logits()
        assert len(set((ids // _BLOCK).tolist())) == 4
    n = 40_000
    tok, lp = draw(logits.expand(n, -1), params, seeds=np.full(n, 1234), positions=np.arange(n))
    probs = filtered_probs(logits, params)[0].numpy()
    assert (probs[tok] > 0).all()  # never outside the kept set
    expected = probs[ids]
    others = 1.0 - expected.sum()  # the far tail of the spread layout: ~1e-15, never drawn
    assert others < 1e-12 and np.isin(tok, ids).all()
    counts = np.array([(tok == t).sum() for t in ids])
    keep = expected > 0
    assert (counts[~keep] == 0).all()
    assert _chi2(counts[keep], n * expected[keep]) < _chi2_crit(int(keep.sum()) - 1)
    assert np.allclose(lp, np.log(probs[tok]))


def test_seeds_and_positions_decorrelate():
    """Tokens of different (seed, position) pairs are independent: pairs of draws match at the rate sum p^2."""
    logits = torch.tensor([_TARGET])
    params = SamplingParams(temperature=1.0)
    n = 40_000
    a, _ = draw(logits.expand(n, -1), params, seeds=np.arange(n), positions=np.zeros(n))
    b, _ = draw(logits.expand(n, -1), params, seeds=np.arange(n), positions=np.ones(n))
    c, _ = draw(logits.expand(n, -1), params, seeds=np.arange(n) + 1, positions=np.zeros(n))
    p = filtered_probs(logits, params)[0].numpy()
    rate, sd = float((p**2).sum()), math.sqrt(float((p**2).sum()) / n)
    assert abs((a == b).mean() - rate) < 4 * sd and abs((a == c).mean() - rate) < 4 * sd


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_same_tokens_on_cpu_and_cuda():
    logits = _lm_like(16, 49152, 3)
    for params in [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_p=0.95)]:
        seeds, pos = np.arange(16), np.arange(16)
        a, la = draw(logits, params, seeds=seeds, positions=pos)
        b, lb = draw(logits.cuda(), params, seeds=seeds, positions=pos)
        assert np.array_equal(a, b) and np.allclose(la, lb)


def _reference_kept(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Brute force: sort the whole row, walk the prefix until its mass reaches top_p, keep logit >= that.
    Masses are the sampler's own tempered weights over their total (float32 exponentials, float64 sums:
    a boundary within ~1e-7 of top_p is decided by that definition), so this checks the staged search."""
    k = _kept(torch.from_numpy(logits)[None], SamplingParams(temperature=temperature))
    p = (k.weights[0] / k.total[0]).numpy()
    order = np.argsort(-logits, kind="stable")
    k = int(np.argmax(np.cumsum(p[order]) >= top_p))
    return logits >= logits[order[k]]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_top_p_cut_matches_a_full_sort_in_every_stage(temperature):
    """Rows whose cut lies within 8 nats of the best, within 10.5, and far beyond (the sure superset)."""
    g = torch.Generator().manual_seed(11)
    vocab = 6000
    rows = [torch.randn(vocab, generator=g) * 3,  # wide: cut a few nats down
            torch.randn(vocab, generator=g) * 0.3,  # flat: cut near the best
            torch.cat([torch.tensor([14.0]), torch.randn(vocab - 1, generator=g) * 0.1]),  # cut ~13 nats down
            torch.cat([torch.tensor([9.5, 9.5]), torch.randn(vocab - 2, generator=g) * 0.05])]  # in between
    logits = torch.stack(rows)  # [4, V]
    for top_p in (0.5, 0.9, 0.95, 0.999):
        got = filtered_probs(logits, SamplingParams(temperature=temperature, top_p=top_p)).numpy() > 0
        for i in range(len(rows)):
            assert np.array_equal(got[i], _reference_kept(logits[i].numpy(), temperature, top_p)), (i, top_p)


@pytest.mark.parametrize("vocab", [49_152, 1_000])
def test_kept_block_masses_equal_the_masked_block_sums(vocab):
    """Top-p sums only the blocks holding a kept token: the same masses, bit for bit, as summing every block
    of the masked weights (and a short last block when V % BLOCK != 0)."""
    from dasrl.engine.sampling import _block_sums

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, vocab, generator=g) * torch.tensor([[0.3], [1.0], [2.0], [3.0], [4.0], [6.0]])
    for temperature, top_p in ((1.0, 0.95), (0.6, 0.5), (1.3, 0.999)):
        k = _kept(logits, SamplingParams(temperature=temperature, top_p=top_p))
        w = (logits.float() - logits.amax(-1, keepdim=True)).div_(temperature).exp_()  # the sampler's weights
        w = w.masked_fill_(logits < k.floor, 0.0)
        assert torch.equal(k.block_mass, _block_sums(w))
        assert torch.equal(k.weights, w.double())


def test_ordered_bits_sort_as_the_floats():
    from dasrl.engine.sampling import _ordered_bits

    x = torch.tensor([float("-inf"), -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, 2.0, float("inf")])
    keys = _ordered_bits(x)
    assert (keys[1:] >= keys[:-1]).all() and keys[6] == keys[7]  # ascending; equal floats, equal keys
    assert keys[3] < keys[4]  # -0 below +0 (equal weights: no prefix mass depends on their order)
    assert int(keys.min()) >= 0 and int(keys.max()) < 1 << 32


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_p=0.95),
                                    SamplingParams(temperature=0.8, top_k=20)])
def test_race_over_kept_entries_equals_the_dense_race(params):
    """The race hashes only blocks with mass and the winning block's kept tokens: the same tokens and
    logprobs as racing every block and token (-inf logits, out-of-vocabulary ids of a short last block)."""
    from dasrl.engine.sampling import _RACE, _key, _race, _race_dense

    logits = _lm_like(40, 3000, 23)
    logits[::3, 2000:2900] = float("-inf")  # masked ids: never kept by top-p, kept (weight 0) otherwise
    k = _kept(logits, params, weights=False)
    rng = np.random.default_rng(24)
    for _ in range(25):
        keys = _key(rng.integers(-2**62, 2**62, 40), rng.integers(0, 10**6, 40), _RACE)
        a, b = _race(logits, k, params, keys), _race_dense(logits, k, params, keys)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_top_p_refuses_non_finite_logits():
    for bad in (float("nan"), float("inf")):
        logits = _lm_like(3, 49152, 25)
        logits[1, 7] = bad
        with pytest.raises(ValueError, match="logits row 1 is not finite"):
            draw(logits, SamplingParams(temperature=1.0, top_p=0.95), seeds=np.arange(3), positions=np.zeros(3))
