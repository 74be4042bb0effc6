"""validate-sim on a real (small) collection run of the tiny Llama over SmolLM2's tokenizer: the simulator's replay of every variant — its drafter,
its session's policy and allowance, history taken in by record() on the steps without variants — agrees
exactly with the engine on drafted and accepted tokens and forwards, and its forward shapes are the
engine's, so its priced time equals the engine's recorded forwards priced the same way."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from dasrl_lab.experiments.base import Context, RunOptions
from dasrl_lab.experiments.collect import BASELINE, VARIANTS, CollectConfig, ensure_collection
from dasrl_lab.experiments.validate import StepOverhead, find_collection, summary, validate
from dasrl.policy.latency import LatencyModel

pytestmark = pytest.mark.slow
LAT = LatencyModel(0.03, 1e-3, 2e-6)


SIZES = (("steps", 3), ("prompts", 2), ("samples", 3), ("max_new_tokens", 40), ("variant_every", 3))


@pytest.fixture(scope="module")
def trained(tiny_chat):
    """The model the collection run generates with and trains: a copy of the tiny Llama over SmolLM2's
    tokenizer (the session's own stays as built). The replay's agreement with the engine does not depend on
    the weights; on SmolLM2 the collection took ~45 CPU-s of the suite."""
    import copy

    model, tok, _ = tiny_chat
    return copy.deepcopy(model), tok


@pytest.fixture(scope="module")
def collection(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("exp")
    ctx = Context(RunOptions(out=out), Console(quiet=True))
    ctx._model = trained
    return ensure_collection(CollectConfig(**dict(SIZES)), ctx)


def test_replay_is_exact_and_prices_the_engines_forwards(collection):
    rows = validate(collection.folder, latency=LAT)
    assert {(r.variant, r.step) for r in rows} == {(BASELINE, s) for s in range(3)} | {(v.name, 2) for v in VARIANTS}
    for r in rows:
        assert r.exact, r
        assert r.predicted_s == pytest.approx(r.priced_s, rel=1e-12), r  # the same forward shapes, one by one
        assert r.measured_s > 0
    assert any(r.accepted[1] > 0 for r in rows)  # drafts were accepted somewhere: a real check
    assert any(r.accepted[1] < r.drafted[1] for r in rows)  # and rejected somewhere
    s = summary(rows)
    assert s["exact_rows"] == len(rows) and s["max_abs_error"] >= s["median_abs_error"] >= 0


def test_overhead_adds_its_terms(collection):
    base = {(r.variant, r.step): r for r in validate(collection.folder, latency=LAT)}
    for oh, term in ((StepOverhead(per_forward=0.01), lambda r: 0.01 * r.forwards[0]),
                     (StepOverhead(per_draft_token=1e-4), lambda r: 1e-4 * r.drafted[0])):
        for r in validate(collection.folder, latency=LAT, overhead=oh):
            assert r.predicted_s - base[(r.variant, r.step)].predicted_s == pytest.approx(term(r))


def test_cli_writes_json_and_png(collection, tmp_path):
    from dasrl_lab.cli import app

    lat = tmp_path / "lat.json"
    LAT.save(lat)
    out, png = tmp_path / "v.json", tmp_path / "v.png"
    r = CliRunner().invoke(app, ["validate-sim", str(collection.folder.parent), "--latency", str(lat),
                                 "--json", str(out), "--png", str(png)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert {"median_abs_error", "max_abs_error"} <= doc["summary"].keys()
    assert {"variant", "step", "predicted_s", "measured_s"} <= doc["rows"][0].keys()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_names_a_bad_run(tmp_path):
    from dasrl_lab.cli import app

    r = CliRunner().invoke(app, ["validate-sim", str(tmp_path)])
    assert r.exit_code == 2 and "no collect.json" in r.output
    with pytest.raises(FileNotFoundError, match="no collect.json"):
        find_collection(tmp_path)



def test_overhead_fit_recovers_known_terms():
    """rollout_s = the recorded forwards priced + 10 ms per forward + 2 ms per row-forward + 0.5 ms per
    drafted token: the fit gets those back (no model needed)."""
    rng = np.random.default_rng(0)
    rollouts = []
    for _ in range(8):
        shapes = [[int(b), int(b + d), int(b * 300)] for b, d in zip(rng.integers(1, 33, 50), rng.integers(0, 20, 50))]
        fw, rf, dr = len(shapes), sum(s[0] for s in shapes), sum(s[1] - s[0] for s in shapes)
        priced = sum(LAT.predict(t, kv) for _, t, kv in shapes)
        rollouts.append({"shapes": shapes, "forwards": fw, "row_forwards": rf, "drafted": dr,
                         "rollout_s": priced + 0.01 * fw + 0.002 * rf + 0.0005 * dr})
    oh = StepOverhead.measure(rollouts, LAT)
    assert (oh.per_forward, oh.per_row_forward, oh.per_draft_token) == pytest.approx((0.01, 0.002, 0.0005), rel=1e-6)
    with pytest.raises(ValueError, match=">= 3 recorded rollouts"):
        StepOverhead.measure(rollouts[:2], LAT)


def test_fitted_overhead_is_added_to_the_prediction(collection):
    fitted = {(r.variant, r.step): r for r in validate(collection.folder, latency=LAT, overhead=None)}
    for r in validate(collection.folder, latency=LAT):
        f = fitted[(r.variant, r.step)]
        assert f.predicted_s == pytest.approx(r.predicted_s + f.overhead_s) and f.overhead_s >= 0


def test_simulator_experiment_writes_its_section(collection, trained, tmp_path):
    """`dasrl experiments simulator` on the cached collection: the same rows as validate-sim, a figure and
    a section of docs/results.md."""
    from dasrl_lab.experiments.base import run_experiment
    from dasrl_lab.experiments.registry import EXPERIMENTS
    from dasrl_lab.experiments.report import write_results

    out = collection.folder.parent
    ctx = Context(RunOptions(out=out, collect=SIZES), Console(quiet=True))
    ctx._model = trained
    doc = run_experiment(EXPERIMENTS["simulator"], ctx)
    assert doc["summary"]["exact_rows"] == doc["summary"]["rows"] == 3 + len(VARIANTS)
    assert (out / "simulator" / "simulator.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = write_results(out, tmp_path / "results.md")
    assert "The simulator's predicted rollout time" in md.read_text() and "replay exact" in md.read_text()
