"""Experiment 7 (paper Fig. 9): length variability. Per problem, the mean and the max generation length
of its samples at each step of the recorded GRPO run: the max (which sets the step time) sits far above
the mean and moves from step to step."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from dasrl_lab.experiments.base import Context, Experiment, Outcome, figure, pyplot


def length_table(responses) -> list[dict]:
    """One row per (problem, step): samples, mean, max and min response length, and how many hit the limit."""
    groups: dict[tuple, list] = defaultdict(list)
    for r in responses:
        groups[(r.problem_id, int(r.step))].append(r)
    rows = []
    for (pid, step), rs in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        ls = np.array([len(r.response_ids) for r in rs])
        rows.append({"problem": pid, "step": step, "samples": len(rs), "mean": round(float(ls.mean()), 2),
                     "max": int(ls.max()), "min": int(ls.min()),
                     "at_limit": sum(r.finish_reason == "length" for r in rs)})
    return rows


def run(ctx: Context) -> Outcome:
    col = ctx.collection()
    rows = length_table(col.trace().responses())
    problems = sorted({r["problem"] for r in rows}, key=str)
    ratio = np.array([r["max"] / max(r["mean"], 1e-9) for r in rows])
    means_cv = []
    for p in problems:
        m = np.array([r["mean"] for r in rows if r["problem"] == p])
        means_cv.append(float(m.std() / m.mean()) if m.mean() else 0.0)
    at_limit = sum(r["at_limit"] for r in rows) / max(sum(r["samples"] for r in rows), 1)
    by_step = defaultdict(list)
    for r in rows:
        by_step[r["step"]].append(r)
    step_ratio = [max(x["max"] for x in v) / np.mean([x["mean"] for x in v]) for v in by_step.values()]

    def draw(fig, axes) -> None:
        a, b = axes
        colors = pyplot().rcParams["axes.prop_cycle"].by_key()["color"]
        for i, p in enumerate(problems):
            sel = [r for r in rows if r["problem"] == p]
            c = colors[i % len(colors)]
            a.plot([r["step"] for r in sel], [r["mean"] for r in sel], color=c, label=f"problem {p}")
            a.plot([r["step"] for r in sel], [r["max"] for r in sel], color=c, ls="--", lw=0.9)
        a.axhline(col.config.max_new_tokens, color="k", lw=0.6, ls=":")
        a.set_xlabel("GRPO step")
        a.set_ylabel("generation length (tokens)")
        a.set_title("per problem: mean (solid) and max (dashed) over steps")
        a.legend(fontsize=7, ncol=2)
        a.grid(alpha=0.3)
        b.scatter([r["mean"] for r in rows], [r["max"] for r in rows], s=10)
        hi = max(r["max"] for r in rows) * 1.05
        b.plot([0, hi], [0, hi], "k:", lw=1)
        b.set_xlabel("mean length of the problem's samples")
        b.set_ylabel("max length")
        b.set_title("mean vs max, every (problem, step)")
        b.grid(alpha=0.3)

    comparison = (
        f"Paper Fig. 9: within a problem the longest sample is far longer than the mean, and both move "
        f"across steps, so a problem's length class has to be re-estimated online. Here "
        f"({len(problems)} problems x {col.config.samples} samples, {len(by_step)} steps): the max is "
        f"{np.median(ratio):.2f}x the mean (median over problem-steps; up to {ratio.max():.1f}x), the "
        f"step's longest rollout is {np.median(step_ratio):.2f}x the step's mean length, and a problem's mean "
        f"length varies by {np.mean(means_cv):.0%} (coefficient of variation over steps). {at_limit:.0%} of "
        f"the samples hit the {col.config.max_new_tokens}-token limit, which truncates the tail; the paper's "
        f"lengths run to 16K tokens, where the long tail is much longer.")
    return Outcome(summary={"max_over_mean_median": round(float(np.median(ratio)), 3),
                            "step_max_over_mean": round(float(np.median(step_ratio)), 3),
                            "mean_length_cv": round(float(np.mean(means_cv)), 3), "at_limit": round(at_limit, 3)},
                   rows=rows, figure=figure(draw, 1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [1.4, 1]}),
                   comparison=comparison,
                   details={"per_problem_cv": dict(zip(map(str, problems), [round(x, 4) for x in means_cv]))})


EXPERIMENT = Experiment("lengths", "Length variability: per problem, mean vs max generation length over steps",
                        "Fig. 9", run)
