"""Rollout time two ways. Measured: wall seconds of the rollout (the machine is shared, so this carries
other jobs' load). Modeled: the fitted forward-latency model (experiment 6) applied to every forward the
rollout actually ran (rows x positions per row, padding included, and the context it read), plus the
measured drafting time: what the same forwards cost on this machine unloaded. Both are reported."""

from __future__ import annotations


from dasrl.atomic import MAX_JSON_BYTES, read_json
from dasrl.policy import LatencyModel
from dasrl_lab.sim.workloads import CPU_LATENCY


MAX_FIT_ERROR = 0.15
"""Experiment 6's fit is used only when its mean relative error is at most this (a quiet machine)."""


def latency_model(ctx) -> tuple[LatencyModel, str]:
    """Experiment 6's fit (with the KV term) when it ran under this out folder and fits well; else the
    CPU figures measured on this project's machine unloaded (dasrl.policy.CPU_LATENCY)."""
    f = ctx.options.out / "latency" / "latency.json"
    if f.exists():
        d = read_json(f, MAX_JSON_BYTES, follow_symlinks=True)
        err = d["summary"]["kv_fit_rel_error"]
        if err <= MAX_FIT_ERROR:
            return LatencyModel.from_dict(d["details"]["with_kv"], source=str(f)), "fitted in experiment 6"
        note = f"experiment 6's fit missed by {err:.0%} on the loaded machine, so "
    else:
        note = "experiment 6 not run, so "
    c = CPU_LATENCY
    return c, (note + f"the CPU default (dasrl.policy.latency.CPU_LATENCY, one thread): {c.c_base * 1e3:.0f} ms + "
                      f"{c.c_tok * 1e3:.1f} ms/token + {c.c_other * 1e6:.0f} µs per row-context token + "
                      f"{c.c_draft_kv * 1e6:.0f} µs per drafting-row context token + {c.c_draft * 1e3:.1f} ms per "
                      f"forward with a drafting row")


def modeled_s(summary: dict, latency: LatencyModel) -> float:
    """Modeled seconds of one recorded rollout (see the module docstring)."""
    fwd = sum(latency.price(shape) for shape in summary["shapes"])
    return fwd + summary.get("draft_s", 0.0)


def modeled_curve(summary: dict, latency: LatencyModel) -> list[list[float]]:
    """[(modeled end time of forward k, live rows)]: the batch curve on the modeled clock."""
    t, out = 0.0, []
    for shape in summary["shapes"]:
        t += latency.price(shape)
        out.append([round(t, 4), shape[0]])
    return out
