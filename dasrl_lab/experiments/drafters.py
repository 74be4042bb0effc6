"""Experiment 9 (beyond the paper): DAS vs other drafters in the same engine on the same steps, all
under DAS's budgets: ArcticInference-style global suffix decoding, n-gram prompt lookup, and the oracle
(knows the outputs: the limit of any drafter). Rollout time, and the fraction of the oracle's speedup
each reaches."""

from __future__ import annotations

from dasrl_lab.experiments.base import Context, Experiment, Outcome, figure, latency_model, modeled_s
from dasrl_lab.experiments.collect import VARIANTS

DRAFTERS = ("das", "global", "ngram", "oracle")
RUNS = ("none",) + DRAFTERS


def fraction_of_oracle(t_none: float, t_x: float, t_oracle: float) -> dict:
    """speedup = t_none / t_x; `ratio` = speedup_x / speedup_oracle (the engine bench's measure); `gain` =
    (speedup_x - 1) / (speedup_oracle - 1), the fraction of the oracle's gain (None when the oracle gains
    nothing)."""
    s_x, s_o = t_none / t_x, t_none / t_oracle
    return {"speedup": s_x, "ratio": s_x / s_o, "gain": (s_x - 1) / (s_o - 1) if s_o != 1 else None}


def run(ctx: Context) -> Outcome:
    col = ctx.collection()
    lat, lat_src = latency_model(ctx)
    rows = []
    for rec in col.variant_steps():
        for k in RUNS:
            s = rec["baseline"] if k == "none" else rec["variants"][k]
            rows.append({"step": rec["step"], "drafter": k, "rollout_s": round(modeled_s(s, lat), 3),
                         "wall_s": s["rollout_s"], "forwards": s["forwards"], "drafted": s["drafted"],
                         "accepted": s["accepted"],
                         "tokens_per_row_forward": round(s["new_tokens"] / max(s["row_forwards"], 1), 4)})

    def total(field: str, names=RUNS) -> dict:
        return {k: sum(r[field] for r in rows if r["drafter"] == k) for k in names}

    tot, wall = total("rollout_s"), total("wall_s")
    acc, drafted = total("accepted", DRAFTERS), total("drafted", DRAFTERS)
    fr = {k: fraction_of_oracle(tot["none"], tot[k], tot["oracle"]) for k in DRAFTERS}
    steps = [rec["step"] for rec in col.variant_steps()]

    def draw(fig, ax) -> None:
        w = 0.8 / len(RUNS)
        for i, k in enumerate(RUNS):
            ax.bar([j + (i - (len(RUNS) - 1) / 2) * w for j in range(len(steps))],
                   [r["rollout_s"] for r in rows if r["drafter"] == k], w,
                   label=k if k in ("none", "oracle") else f"{k} ({fr[k]['ratio']:.0%} of oracle)")
        ax.set_xticks(range(len(steps)), [f"step {s}" for s in steps])
        ax.set_ylabel("modeled rollout time (s)")
        ax.set_title("Drafters in the same engine, same steps, DAS budgets (SmolLM2-135M, CPU)")
        ax.legend(fontsize=8, ncol=2)
        ax.grid(alpha=0.3, axis="y")

    desc = {v.name: v.description for v in VARIANTS}
    best = max(("das", "global", "ngram"), key=lambda k: fr[k]["speedup"])
    comparison = (
        "Not in the paper (it compares against its own baselines); the issue's goals for this engine are DAS "
        ">= 1.3x the global suffix drafter and >= 75% of the oracle's speedup. Here, summed over steps "
        f"{steps}, modeled time (the latency model, {lat_src}, applied to the forwards each run made; the "
        f"wall clock of this shared machine is in the table): speedup over no speculation DAS "
        f"{fr['das']['speedup']:.2f}x, global suffix "
        f"{fr['global']['speedup']:.2f}x, n-gram {fr['ngram']['speedup']:.2f}x, oracle {fr['oracle']['speedup']:.2f}x; "
        f"DAS reaches {fr['das']['ratio']:.0%} of the oracle's speedup ({(fr['das']['gain'] or 0):.0%} of its gain) "
        f"and runs {tot['global'] / tot['das']:.2f}x the global drafter's speed. Fastest non-oracle drafter: "
        f"{best}. All drafters use DAS's length-aware budgets and per-forward allowance, so the differences are "
        f"the drafts alone; every variant reproduced the baseline's tokens exactly. "
        f"Accepted/drafted tokens: " + ", ".join(f"{k} {acc[k]}/{drafted[k]}" for k in DRAFTERS) + ".")
    return Outcome(summary={f"speedup {k}": round(fr[k]["speedup"], 3) for k in DRAFTERS}
                   | {"das_fraction_of_oracle": round(fr["das"]["ratio"], 3),
                      "das_vs_global": round(tot["global"] / tot["das"], 3)},
                   rows=rows, figure=figure(draw, figsize=(8, 3.6)), comparison=comparison,
                   details={"modeled_s": tot, "wall_s": wall, "latency_source": lat_src, "fractions": fr,
                            "descriptions": desc, "steps": steps},
                   table=[{"drafter": k, "what": desc.get(k, "plain decoding (baseline)"),
                           "modeled s": round(tot[k], 2), "wall s": round(wall[k], 2),
                           "speedup": f"{tot['none'] / tot[k]:.2f}x",
                           "of oracle speedup": f"{fr[k]['ratio']:.0%}" if k in fr else "-"}
                          for k in RUNS])


EXPERIMENT = Experiment("drafters", "DAS vs global suffix vs n-gram vs oracle drafters, same engine and steps",
                        "beyond the paper", run)
