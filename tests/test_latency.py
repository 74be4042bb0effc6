import json
import os

import numpy as np
import pytest

from dasrl.policy.latency import LatencyModel


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
