import json
import os

import numpy as np
import pytest

from dasrl.policy.latency import CPU_LATENCY, GPU_LATENCY, LatencyModel, OnlineLatency, prior_for


def test_fit_recovers_exact_coefficients():
    n = np.array([1, 8, 16, 64, 128, 256, 1, 64])
    kv = np.array([100, 800, 1600, 5000, 20000, 40000, 3000, 100])
    s = 0.05 + 0.002 * n + 4e-6 * kv
    m = LatencyModel.fit(n, s, kv_tokens=kv)
    assert m.c_base == pytest.approx(0.05, rel=1e-6)
    assert m.c_tok == pytest.approx(0.002, rel=1e-6)
    assert m.c_other == pytest.approx(4e-6, rel=1e-6)
    assert m.mean_rel_error(n, s, kv) < 1e-9


def test_fit_recovers_the_drafting_rows_kv_term():
    n = np.array([1, 8, 16, 64, 128, 256, 1, 64, 32, 17])
    kv = np.array([100, 800, 1600, 5000, 20000, 40000, 3000, 100, 8000, 4000])
    dkv = np.array([0, 800, 0, 5000, 2000, 40000, 0, 100, 250, 4000])
    s = 0.05 + 0.002 * n + 4e-6 * kv + 1.5e-5 * dkv
    m = LatencyModel.fit(n, s, kv_tokens=kv, draft_kv_tokens=dkv)
    assert (m.c_base, m.c_tok, m.c_other, m.c_draft_kv) == pytest.approx((0.05, 0.002, 4e-6, 1.5e-5), rel=1e-6)
    assert m.mean_rel_error(n, s, kv, dkv) < 1e-9
    assert LatencyModel.fit(n, s, kv_tokens=kv).c_draft_kv == 0.0  # fitted only when given
    # A forward with any drafting row also pays c_draft once (0.012 s here): recovered beside the others.
    s2 = s + 0.012 * (dkv > 0)
    m = LatencyModel.fit(n, s2, kv_tokens=kv, draft_kv_tokens=dkv)
    assert (m.c_base, m.c_tok, m.c_other, m.c_draft_kv, m.c_draft) == \
        pytest.approx((0.05, 0.002, 4e-6, 1.5e-5, 0.012), rel=1e-6)
    assert m.price((4, 17, 1200, 300)) == pytest.approx(0.05 + 0.034 + 0.0048 + 0.0045 + 0.012)


def test_price_reads_three_and_four_field_shapes():
    m = LatencyModel(0.1, 0.01, 0.001, 0.002)
    assert m.price((4, 10, 100)) == pytest.approx(0.1 + 0.1 + 0.1)  # a shape recorded before draft_kv
    assert m.price([4, 10, 100, 50]) == pytest.approx(0.3 + 0.1)
    old = {"format": "dasrl.latency/1", "c_base": 0.1, "c_tok": 0.01, "c_other": 0.001}  # saved before the term
    assert LatencyModel.from_dict(old).c_draft_kv == 0.0


def test_fit_without_kv_leaves_c_other_zero_and_noise_error_small():
    rng = np.random.default_rng(0)
    n = rng.integers(1, 512, 200)
    s = (0.06 + 0.0025 * n) * rng.uniform(0.97, 1.03, 200)
    m = LatencyModel.fit(n, s)
    assert m.c_other == 0.0
    assert m.c_base == pytest.approx(0.06, rel=0.05)
    assert m.c_tok == pytest.approx(0.0025, rel=0.05)
    assert m.mean_rel_error(n, s) < 0.03


def test_predict_scalar_and_array():
    m = LatencyModel(0.1, 0.01, 0.001)
    assert m.predict(10) == pytest.approx(0.2)
    assert m.predict(10, 100) == pytest.approx(0.3)
    np.testing.assert_allclose(m.predict(np.array([0, 10])), [0.1, 0.2])


def test_fit_clips_negative_coefficients():
    n = np.array([1, 2, 3, 4])
    s = np.array([0.4, 0.3, 0.2, 0.1])  # decreasing: unconstrained slope would be negative
    m = LatencyModel.fit(n, s)
    assert m.c_tok >= 0 and m.c_base >= 0


def test_bad_samples_name_the_value():
    with pytest.raises(ValueError, match=r"seconds\[1\]"):
        LatencyModel.fit([1, 2, 3], [0.1, -1.0, 0.2])
    with pytest.raises(ValueError, match="differ in length"):
        LatencyModel.fit([1, 2], [0.1])
    with pytest.raises(ValueError, match="at least 3"):
        LatencyModel.fit([1, 2], [0.1, 0.2], kv_tokens=[1, 2])
    with pytest.raises(ValueError, match="c_tok"):
        LatencyModel(0.1, -0.5)


def test_save_load_roundtrip_atomic(tmp_path):
    m = LatencyModel(0.05, 0.002, 3e-6)
    p = tmp_path / "sub" / "latency.json"
    m.save(p)
    assert LatencyModel.load(p) == m
    assert os.listdir(p.parent) == ["latency.json"]  # no temp left


def test_load_validation_names_fields(tmp_path):
    p = tmp_path / "l.json"
    p.write_text(json.dumps({"c_base": 0.1}))
    with pytest.raises(ValueError, match="c_tok"):
        LatencyModel.load(p)
    p.write_text(json.dumps({"c_base": "x", "c_tok": 0.1}))
    with pytest.raises(ValueError, match="'c_base'"):
        LatencyModel.load(p)
    p.write_text(json.dumps({"format": "other/9", "c_base": 0.1, "c_tok": 0.1}))
    with pytest.raises(ValueError, match="format"):
        LatencyModel.load(p)
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LatencyModel.load(p)


def _forwards(lat: LatencyModel, n: int, seed: int = 0, drafting: float = 0.5, draft_kv: bool = True):
    """n forwards of varied shapes (tokens, kv, draft kv, seconds, rows) priced exactly by lat; a `drafting`
    share of them verify drafts (rows < tokens; with draft_kv, as the engine, their rows' context in dkv)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 64, n)
    kv = tokens * rng.integers(10, 500, n)
    drafts = rng.random(n) < drafting
    dkv = np.where(drafts & draft_kv, rng.integers(10, 500, n), 0)
    tokens = np.where(drafts, np.maximum(tokens, 2), tokens)
    rows = np.where(drafts, np.maximum(tokens // 2, 1), tokens)
    return tokens, kv, dkv, lat.predict(tokens, kv, dkv), rows


def test_online_fit_prices_with_the_prior_until_trusted_then_recovers_the_model():
    true = LatencyModel(c_base=0.05, c_tok=2e-3, c_other=1e-5, c_draft_kv=2e-5, c_draft=0.0)
    prior = LatencyModel(c_base=1.0, c_tok=1.0)
    fit = OnlineLatency(prior, min_samples=24, refit_every=8)
    for n, kv, dkv, s, rows in zip(*_forwards(true, 23)):
        fit.record(n, kv, dkv, s, rows=rows)
    assert fit.model() is prior and fit.fitted is None  # 23 < min_samples
    for n, kv, dkv, s, rows in zip(*_forwards(true, 9, seed=1)):
        fit.record(n, kv, dkv, s, rows=rows)
    got = fit.model()
    assert got is fit.fitted
    for name in ("c_base", "c_tok", "c_other", "c_draft_kv"):
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    assert fit.error() == pytest.approx(0.0, abs=1e-9)
    assert fit.report()["fitted"] and fit.report()["samples"] == 32


def test_online_fit_drops_forwards_another_process_slowed():
    """A shared machine: 20% of forwards take 3x (a neighbour on the core). The fit ignores them."""
    true = LatencyModel(c_base=0.06, c_tok=3e-3, c_other=1e-5)
    tokens, kv, dkv, s, rows = _forwards(true, 200, draft_kv=False)
    s = s.copy()
    s[::5] *= 3.0
    fit = OnlineLatency(LatencyModel(c_base=1.0, c_tok=1.0), refit_every=1)
    for *row, r in zip(tokens, kv, dkv, s, rows):
        fit.record(*row, rows=r)
    got = fit.model()
    assert got.c_base == pytest.approx(true.c_base, rel=0.02) and got.c_tok == pytest.approx(true.c_tok, rel=0.02)
    assert fit.kept == 160
    naive = LatencyModel.fit(tokens, s, kv)
    assert abs(naive.c_tok / true.c_tok - 1) > 0.1  # what the outliers would have done


def test_online_fit_scales_the_priors_drafting_terms_until_drafts_were_seen():
    true = LatencyModel(c_base=0.05, c_tok=2e-3, c_other=1e-5)
    prior = LatencyModel(c_base=0.1, c_tok=1.0, c_draft_kv=7e-6, c_draft=0.004)
    fit = OnlineLatency(prior)
    for *row, rows in zip(*_forwards(true, 40, draft_kv=False)):  # drafts verified, no drafting row's term seen
        fit.record(*row, rows=rows)
    got = fit.model()  # the prior's drafting terms at this machine's speed (fitted c_base / the prior's: 0.5)
    assert got.c_draft_kv == pytest.approx(3.5e-6) and got.c_draft == pytest.approx(0.002)
    assert got.c_tok == pytest.approx(true.c_tok, rel=1e-6)


def test_online_fit_refuses_bad_settings_and_untyped_priors():
    with pytest.raises(ValueError, match="min_samples"):
        OnlineLatency(CPU_LATENCY, min_samples=2)
    with pytest.raises(TypeError, match="prior"):
        OnlineLatency({"c_base": 1})


def test_device_priors():
    assert prior_for("cpu") is CPU_LATENCY and prior_for("cuda:1") is GPU_LATENCY
    assert GPU_LATENCY.c_base / GPU_LATENCY.c_tok > 200 > 30 > CPU_LATENCY.c_base / CPU_LATENCY.c_tok


def test_online_fit_without_spread_scales_the_prior():
    """Every forward fed 6 tokens (six rows, nothing drafted): c_base and c_tok cannot be told apart, so the
    fit is the prior at this machine's speed (median measured / predicted)."""
    prior = LatencyModel(c_base=0.05, c_tok=2e-3, c_other=1e-5)
    fit = OnlineLatency(prior)
    for i in range(30):
        kv = 6 * (100 + i)
        fit.record(6, kv, 0, 1.5 * prior.predict(6, kv), rows=6)
    got = fit.model()
    assert got.c_base == pytest.approx(0.075) and got.c_tok == pytest.approx(3e-3) and got.c_other == pytest.approx(1.5e-5)
    assert fit.error() == pytest.approx(0.0, abs=1e-12)


def test_online_fit_learns_a_draft_tokens_price_only_from_forwards_that_drafted():
    """Plain forwards over a batch that shrinks from 8 rows to 1 on a CPU: the cost is a staircase in the rows
    (here 0.3 s at 1-4 rows, 0.55 s at 5-8: 62 ms a row between), while a draft token on top of 8 rows costs
    25 ms (the 1.5B model, docs/benchmarks.md). A line through the plain forwards alone would price a draft
    token at the staircase's slope and never let the session draft, so until 12 forwards drafted the model is
    the prior at the measured speed; then the drafting forwards' own price is fitted."""
    prior = LatencyModel(c_base=0.05, c_tok=2.5e-3)  # c_tok / c_base 5%
    fit = OnlineLatency(prior, min_samples=24, refit_every=1)
    for i in range(60):
        rows = 8 - i % 8
        fit.record(rows, 100 * rows, 0, 0.3 if rows <= 4 else 0.55, rows=rows)
    naive = LatencyModel.fit([8 - i % 8 for i in range(60)], [0.3 if 8 - i % 8 <= 4 else 0.55 for i in range(60)])
    assert naive.c_tok > 0.04  # what the plain forwards alone say a token costs (44 ms)
    got = fit.model()
    assert got.c_tok / got.c_base == pytest.approx(prior.c_tok / prior.c_base)  # the prior's shape, scaled
    for i in range(12):  # 8 rows drafting 1..12 tokens in all
        fit.record(8 + 1 + i, 800, 800, 0.55 + 0.025 * (1 + i), rows=8)
    got = fit.model()
    assert 0.02 < got.c_tok < 0.03  # the drafting forwards' price (24 ms; the staircase went to the context term)
