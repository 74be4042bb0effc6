"""`dasrl bench engine`'s helpers: the calibration grid and its latency fit on the real model, and the goal lines."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from dasrl.engine import EngineConfig, SpecEngine  # noqa: E402
from dasrl_lab.bench.engine import CalibrationGrid, calibrate, fit_latency  # noqa: E402
from dasrl_lab.bench.engine_cli import goals  # noqa: E402


def test_calibration_fits_a_latency_model(smollm):
    model, tok = smollm
    engine = SpecEngine(model, tok, EngineConfig(num_threads=int(os.environ.get("DASRL_TEST_THREADS", "1"))))
    grid = CalibrationGrid(batch_sizes=(1, 4), tokens_per_row=(1, 4), contexts=(16, 64), repeats=1)
    samples = calibrate(engine, grid)
    # 8 grid shapes + for each (batch 4, 4 tokens) shape one row drafting beside plain ones and the plain
    # forward of the same token count (7 rows)
    assert len(samples) == 12 and all(s["seconds"] > 0 for s in samples)
    assert sorted((s["n_tokens"], s["kv_tokens"]) for s in samples if s["batch"] == 7) == [(7, 112), (7, 448)]
    assert {(s["n_tokens"], s["kv_tokens"]) for s in samples} >= {(1, 16), (16, 256)}
    lone = [(s["n_tokens"], s["kv_tokens"], s["draft_kv_tokens"]) for s in samples if s.get("drafting_rows") == 1]
    assert lone == [(7, 64, 16), (7, 256, 64)]
    model, err = fit_latency(samples)
    assert model.c_base > 0 and np.isfinite(err)


def test_goal_lines():
    rows = [{"drafter": d, "wall_s": w} for d, w in
            [("none", 10.0), ("global", 8.0), ("das", 4.0), ("oracle", 2.5), ("hf_generate", 12.0)]]
    text = "\n".join(goals(rows))
    assert "0.40" in text and "2.00x" in text and "80%" in text and "1.20x" in text  # saved: 6 s of 7.5 s
