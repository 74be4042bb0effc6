"""The fidelity bench: comparison bookkeeping, the flip-probability model against Monte Carlo, and a tiny
end-to-end run on the embedded model (fp32: the race's sampled rollouts equal plain decoding's)."""

import os

import numpy as np
import pytest
import torch

from dasrl_lab.bench.fidelity import DRAFTERS, FidelityConfig, compare, totals
from dasrl_lab.bench.flips import measure, noise_sigma, predicted
from dasrl.engine.sampling import SamplingParams, filtered_probs


def test_compare_counts_first_differences_and_lengths():
    ref = {0: [1, 2, 3, 4], 1: [5, 6, 7], 2: [8, 9], 3: [1, 1]}
    out = {0: [1, 2, 3, 4], 1: [5, 0, 7, 7], 2: [8], 4: [3]}  # 3 and 4 are not in both: skipped
    c = compare(ref, out)
    assert (c.requests, c.tokens) == (3, 9)
    assert c.differing_tokens == 0 + (1 + 1) + 1  # request 1: position 1 and the extra token; request 2: short
    assert [(d.request, d.position, d.ref_token, d.token) for d in c.diffs] == [(1, 1, 6, 0), (2, 1, 9, None)]
    assert c.exposed == 4 + 2 + 2


def test_totals():
    rows = [{"tokens": 10, "differing_tokens": 2, "differing_sequences": 1, "exposed_tokens": 8, "variant": "x"},
            {"tokens": 5, "differing_tokens": 0, "differing_sequences": 0, "exposed_tokens": 5}]
    assert totals(rows) == {"tokens": 15, "differing_tokens": 2, "differing_sequences": 1, "exposed_tokens": 13,
                            "flip_rate": 1 / 13}
    assert totals(rows[1:])["flip_rate"] == 0.0 and totals([])["flip_rate"] == 0.0


@pytest.mark.parametrize("kwargs, match", [
    ({"problems": 0}, "problems"), ({"drafters": ("ngram", "medusa")}, "medusa"),
    ({"temperatures": (0.0,)}, "temperatures"),
    ({"batch_sizes": (0,)}, "batch sizes"),
])
def test_bad_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FidelityConfig(**kwargs)


def test_noise_sigma_ignores_a_row_shift():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(200, 50, generator=g)
    b = a + 3.0 + 0.01 * torch.randn(200, 50, generator=g)
    sigma = noise_sigma(a, b, torch.softmax(a.double(), -1), mass=1.0)
    assert 0.009 < sigma < 0.011


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_predicted_flip_rates_match_monte_carlo(temperature):
    """The first-order formula of flips.py against draws from logits with injected iid noise."""
    g = torch.Generator().manual_seed(1)
    sigma = 0.01
    base = torch.randn(1, 30, generator=g) * 1.5
    a = base.expand(2000, -1).contiguous()  # [n, V]
    b = a + sigma * torch.randn(a.shape, generator=g)  # a fresh noise draw per row
    pred = predicted(filtered_probs(base, SamplingParams(temperature=temperature)), sigma / temperature)
    flips, draws = measure(a, b, SamplingParams(temperature=temperature), seeds=25)
    assert 0.8 < (flips / draws) / pred < 1.25, (flips / draws, pred)


def test_tiny_fidelity_run_is_exact_with_the_race(smollm):
    from dasrl_lab.bench.fidelity import run_fidelity

    model, tok = smollm
    drafters = ("oracle", "trees")  # the bench runs all of DRAFTERS; two keep this test short
    cfg = FidelityConfig(problems=1, group=3, max_new_tokens=6, temperatures=(1.0,), batch_sizes=(1, 2),
                         single_requests=2, drafters=drafters, threads=int(os.environ.get("DASRL_TEST_THREADS", "1")))
    rows = run_fidelity(model, tok, cfg)
    assert set(drafters) < set(DRAFTERS)
    assert [(r["sampler"], r["variant"]) for r in rows] == [("gumbel", v) for v in (*drafters, "batch=1", "batch=2")]
    for r in rows:
        assert {"sampler", "variant", "temperature", "tokens", "differing_tokens", "differing_sequences"} <= r.keys()
        assert r["requests"] == (2 if r["variant"] == "batch=1" else 3) and r["tokens"] > 0
        assert r["differing_tokens"] == 0 and r["first_diffs"] == [], r


def test_fidelity_bench_batch_invariant_flag():
    from typer.testing import CliRunner

    from dasrl_lab.cli import app
    from dasrl_lab.bench.fidelity import engine_config

    assert engine_config(FidelityConfig(batch_invariant=True)).batch_invariant
    assert not engine_config(FidelityConfig()).batch_invariant
    result = CliRunner().invoke(app, ["bench", "fidelity", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--batch-invariant" in result.output
