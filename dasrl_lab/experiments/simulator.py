"""Experiment 10 (beyond the paper): can the simulator's predictions be trusted? Every (variant, step) of the
collection run replayed by the simulator with that variant's own drafter and session policy (dasrl
validate-sim, dasrl_lab/experiments/validate.py), its forwards priced by experiment 6's latency fit plus the
step overhead fitted on the run's other rollouts, against the engine's measured rollout time. The paper
trusts its own latency model (Fig. 8); this checks the whole prediction end to end."""

from __future__ import annotations

import statistics
from pathlib import Path

from dasrl_lab.experiments.base import REAL, Context, Experiment, Outcome, latency_model
from dasrl_lab.experiments.validate import scatter, summary, validate


def run(ctx: Context) -> Outcome:
    col = ctx.collection()
    lat, lat_src = latency_model(ctx)
    rows = validate(col.folder, latency=lat, overhead=None)
    s = summary(rows)
    variants = list(dict.fromkeys(r.variant for r in rows))

    def figure(path: Path) -> None:
        scatter(rows, path, title=f"simulator vs engine ({s['rows']} steps x variants, SmolLM2-135M, CPU)")

    def per_variant(name: str) -> dict:
        errs = sorted(abs(r.error) for r in rows if r.variant == name)
        return {"variant": name, "rows": len(errs), "median abs error": f"{statistics.median(errs):.1%}",
                "worst abs error": f"{errs[-1]:.1%}",
                "replay exact": f"{sum(r.exact for r in rows if r.variant == name)}/{len(errs)}"}

    comparison = (
        "Not in the paper, which predicts rollout time from its latency model without checking the prediction "
        "against measured rollouts. Here every (variant, step) of the collection run is replayed by the "
        f"simulator and priced by the latency model ({lat_src}) plus the step overhead fitted on the run's "
        f"other rollouts: median |error| {s['median_abs_error']:.1%}, worst {s['max_abs_error']:.1%} over "
        f"{s['rows']} rows (issue goal: <= 10% and <= 20%); the replay is exact (drafted, accepted and forwards "
        f"equal the engine's) on {s['exact_rows']} of {s['rows']}. About "
        f"{(s['median_outside_forwards'] or 0):.0%} of a rollout's wall time is outside its forwards; the "
        "fitted overhead carries it. `dasrl validate-sim <out>` prints the same per row.")
    return Outcome(summary={"median_abs_error": s["median_abs_error"], "max_abs_error": s["max_abs_error"],
                            "exact_rows": s["exact_rows"], "rows": s["rows"]},
                   rows=[r.to_dict() for r in rows], figure=figure, comparison=comparison,
                   source=f"{REAL}, replayed by the simulator",
                   details={"latency": lat.to_dict(), "latency_source": lat_src, "summary": s},
                   table=[per_variant(v) for v in variants])


EXPERIMENT = Experiment("simulator", "The simulator's predicted rollout time against the engine's measured one",
                        "beyond the paper", run)
