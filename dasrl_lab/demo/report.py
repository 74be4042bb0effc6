"""The demo's report folder: summary.json, PNG plots and report.md."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np

from dasrl.atomic import write_json
from dasrl_lab.plots import pyplot, save_figure
from dasrl.rollout import RolloutSession


GPU_PROFILE = "qwen2.5-7b-h100"
"""The shipped GPU latency profile (dasrl_lab/sim/profiles.py) the report prices the same rollouts on."""


def gpu_prediction(steps: list[tuple[int, list]], das: RolloutSession, tokenizer) -> dict:
    """Predicted seconds per step of these rollouts on GPU_PROFILE, plain and DAS: `dasrl whatif`'s replay
    (the simulator, each forward priced by the profile) with the DAS session's drafter and its policy under
    that profile's latency (the allowance, hence the drafting, depends on the hardware)."""
    from dasrl.policy import FixedBudget
    from dasrl_lab.sim.profiles import derive
    from dasrl_lab.sim.whatif import WhatifConfig, replay, session_policy

    prof = derive(*GPU_PROFILE.rsplit("-", 1))
    wcfg = WhatifConfig(store=das.config.store)
    method = "das" if das.config.counting else "das-suffix"  # the session's drafter, counting or not
    plain = replay(steps, method="none", policy=FixedBudget(0), cfg=wcfg, tokenizer=tokenizer, label="none")
    spec = replay(steps, method=method, policy=session_policy(prof.latency), cfg=wcfg, tokenizer=tokenizer,
                  label=method)
    return {"profile": prof.name, "status": prof.status, "baseline_s": plain.price(prof), "das_s": spec.price(prof)}


def write_report(out: Path, *, cfg, rows, base: RolloutSession, das: RolloutSession, gpu: dict | None) -> None:
    later = [r for r in rows if r.step > 0]
    summary = {"config": asdict(cfg), "steps": [asdict(r) for r in rows],
               "identical_every_step": all(r.identical for r in rows),
               "baseline_s": sum(r.baseline_s for r in rows), "das_s": sum(r.das_s for r in rows),
               "speedup_from_second_visit": (sum(r.baseline_s for r in later) / sum(r.das_s for r in later))
               if later else None, "das_stats": das.stats(), "baseline_stats": base.stats(),
               "preset": cfg.preset,
               "at_limit_fraction": float(np.mean([r.at_limit_fraction for r in rows])) if rows else None,
               "tail_share": float(np.mean([r.tail_share for r in rows])) if rows else None,
               "gpu_prediction": gpu}
    write_json(out / "summary.json", summary)
    if not rows:
        (out / "report.md").write_text("# dasrl demo\n\nNo step finished.\n")
        return
    steps = [r.step for r in rows]
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r.baseline_s for r in rows], "o-", label="baseline (no speculation)")
    ax.plot(steps, [r.das_s for r in rows], "s-", label="DAS")
    ax.set(xlabel="RL step", ylabel="rollout seconds", title="Rollout time per step")
    ax.legend()
    save_figure(fig, out / "rollout_time.png", dpi=110)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r.mean_reward_baseline for r in rows], "o-", lw=3, alpha=0.5, label="baseline")
    ax.plot(steps, [r.mean_reward_das for r in rows], "s--", label="DAS")
    ax.set(xlabel="RL step", ylabel="mean reward", title="Reward per step (the curves coincide)")
    ax.legend()
    save_figure(fig, out / "reward.png", dpi=110)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [r.tokens_per_row_forward for r in rows], "s-")
    ax.set(xlabel="RL step", ylabel="tokens per forward (DAS)", title="Emitted tokens per verification forward")
    save_figure(fig, out / "tokens_per_row_forward.png", dpi=110)

    k = len(rows) - 1  # the last step: history is warm
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for sess, label in ((base, "baseline"), (das, "DAS")):
        curve = sess.history[k].batch_curve
        ax.step([t for t, _ in curve], [b for _, b in curve], where="post", label=label)
    ax.set(xlabel="seconds into the rollout", ylabel="live rows", title=f"Effective batch size, step {k}")
    ax.legend()
    save_figure(fig, out / "batch_collapse.png", dpi=110)

    lines = ["# dasrl demo report", "",
             f"GRPO (dasrl's minimal loop) on `{cfg.model}`: {cfg.prompts} prompts x {cfg.samples} samples, "
             f"{len(rows)} steps, <= {cfg.max_new_tokens} new tokens, T={cfg.temperature}, top-p={cfg.top_p}. "
             "Baseline and DAS roll out the same prompts from the same weights with the same seeds.", "",
             f"GPU columns: the same rollouts priced on `{GPU_PROFILE}` (an assumed latency profile, "
             "dasrl_lab/sim/profiles.py), predicted by replaying these rollouts (`dasrl whatif`): what the same "
             "tokens would cost a 7B model's forwards on that card.", "",
             "| step | baseline s | DAS s | speedup | GPU baseline s | GPU DAS s | tokens/forward | at limit | "
             "reward (baseline) | reward (DAS) | KL to initial | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        g = f"{gpu['baseline_s'][i]:.2f} | {gpu['das_s'][i]:.2f}" if gpu else "n/a | n/a"
        lines.append(f"| {r.step} | {r.baseline_s:.1f} | {r.das_s:.1f} | {r.speedup:.2f}x | {g} | "
                     f"{r.tokens_per_row_forward:.2f} | {r.at_limit_fraction:.0%} | {r.mean_reward_baseline:.3f} | "
                     f"{r.mean_reward_das:.3f} | {r.kl_to_initial:.2g} | {'yes' if r.identical else 'NO'} |")
    lines += ["", f"Samples at the length limit: {summary['at_limit_fraction']:.0%} (baseline rollouts, all steps). "
              "KL to initial: KL(initial policy || policy after the step's update) per token, on step 0's first "
              "two samples of each problem."]
    if summary["speedup_from_second_visit"]:
        lines += ["", f"From the second visit of each prompt on: {summary['speedup_from_second_visit']:.2f}x "
                      "(baseline seconds / DAS seconds)."]
    lines += ["", "![rollout time](rollout_time.png)", "![reward](reward.png)",
              "![batch collapse](batch_collapse.png)", "![tokens per forward](tokens_per_row_forward.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
