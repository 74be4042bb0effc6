"""Policy variants replayed on a recorded run (docs/benchmarks.md "The floor of the DAS drafter").

The simulator replays a trace exactly as the DAS session ran it (same drafts, accepted tokens and
forwards: docs/simulator.md "Validation"), so the session's policy can be varied and priced in seconds:

    python scripts/probes/policy_variants.py TRACE_DIR LATENCY_JSON [--counting]

Each row: forwards per step, and the modeled rollout time against plain decoding (steps 1+ = from the
second visit). The first row must reproduce the run's own DAS forwards (`summary.json`).
"""
import sys

import numpy as np

import dasrl.policy.allowance as allowance
from dasrl.drafter.counting import CountingDrafter, digit_tokens
from dasrl.drafter.store import DraftStore
from dasrl.policy.acceptance import AcceptanceRate
from dasrl.policy.allowance import ForwardAllowance, allowance_for
from dasrl.policy import ClassCaps, DASPolicy
from dasrl.policy.latency import CPU_LATENCY, LatencyModel
from dasrl.rollout.session import SessionConfig, speculation_policy
from dasrl.rollout.trace import read_trace
from dasrl_lab.sim.simulator import SimConfig, Simulator, group_steps

args = [a for a in sys.argv[1:] if a != "--counting"]
steps = group_steps(read_trace(args[0]).responses())
cfg = SimConfig(latency=LatencyModel.load(args[1]))
digits = None
if "--counting" in sys.argv:  # the drafter a session builds: counting drafts over the DraftStore
    from transformers import AutoTokenizer

    from dasrl.models import ensure_hf_folder
    digits = digit_tokens(AutoTokenizer.from_pretrained(ensure_hf_folder()))
max_new = max(len(r.response_ids) for _, rs in steps for r in rs)
plain = [s.makespan for s in Simulator(drafter="none", policy="none", config=cfg).run(steps, max_new_tokens=max_new).steps]
true_len = {(step, i): len(r.response_ids) for step, rs in steps for i, r in enumerate(rs)}


def run(label, policy):
    drafter = DraftStore(SessionConfig().store)
    drafter = drafter if digits is None else CountingDrafter(drafter, digits)
    res = Simulator(drafter=drafter, policy=policy, config=cfg).run(steps, max_new_tokens=max_new)
    t = [s.makespan for s in res.steps]
    print(f"| {label} | {' / '.join(str(s.forwards) for s in res.steps)} | "
          f"{' / '.join(f'{a / b:.2f}' for a, b in zip(t, plain))} | {sum(t[1:]) / sum(plain[1:]):.3f} |")


def das(latency=CPU_LATENCY, allow=None, caps=ClassCaps(), cls=ForwardAllowance, **kw):
    return cls(DASPolicy(caps=caps), allowance_for(latency) if allow is None else allow, latency=latency, **kw)


class LengthOracle(ForwardAllowance):
    """Knows every row's true remaining length (the bound of any length predictor)."""

    def _remaining(self, states):
        return np.array([true_len[s.req_id] - s.generated for s in states], np.float64)


print("| policy | forwards per step | time / plain per step | steps 1+ |\n|---|---|---|---|")
run("shipped (session default)", speculation_policy(SessionConfig()))
run("priced by the calibrated model", das(cfg.latency))
run("no allowance", das(allow=1 << 20))
run("no allowance, no acceptance cap", das(latency=None, allow=1 << 20))
run("caps 4 / 8 / 24", das(caps=ClassCaps(4, 8, 24)))
run("prior p 0.3", das(acceptance=AcceptanceRate(prior_p=0.3)))
run("prior p 0.8", das(acceptance=AcceptanceRate(prior_p=0.8)))
run("length oracle", das(cls=LengthOracle))


class NoTrim(ForwardAllowance):
    trims = False


run("no priced trim", das(cls=NoTrim))
pace = allowance.pace_draft
for g in (0.75, 0.5):
    allowance.pace_draft = lambda rem, p, *, horizon, most, g=g: pace(rem, p, horizon=g * horizon, most=most)
    run(f"leveling to {g} x the critical path", das())
allowance.pace_draft = lambda rem, p, *, horizon, most: np.asarray(most)
run("no leveling (every row its best)", das())
run("no leveling, no allowance, no acceptance cap, caps 16", das(latency=None, allow=1 << 20, caps=ClassCaps(16, 16, 16)))
allowance.pace_draft = pace
