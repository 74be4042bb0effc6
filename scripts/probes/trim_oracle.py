"""Where the T = 0.6 gap to the floor lies: an oracle cut of the priced drafts (no rejected token paid) and
match-length caps (vLLM's max_spec_factor rule), replayed exactly (docs/benchmarks.md, the math preset).

    python scripts/probes/trim_oracle.py TRACE_DIR LATENCY_JSON
"""
import sys
import numpy as np
from dasrl.drafter.store import DraftStore
from dasrl.policy.allowance import ForwardAllowance
from dasrl.policy import ClassCaps, DASPolicy
from dasrl.policy.latency import LatencyModel
from dasrl.rollout.session import SessionConfig, speculation_policy
from dasrl.rollout.trace import read_trace
from dasrl_lab.sim.simulator import SimConfig, Simulator, group_steps

steps = group_steps(read_trace(sys.argv[1]).responses())
lat = LatencyModel.load(sys.argv[2])
cfg = SimConfig(latency=lat)
max_new = max(len(r.response_ids) for _, rs in steps for r in rs)
plain = [s.makespan for s in Simulator(drafter="none", policy="none", config=cfg).run(steps, max_new_tokens=max_new).steps]
target = {(step, i): np.asarray(r.response_ids) for step, rs in steps for i, r in enumerate(rs)}


def run(label, policy):
    res = Simulator(drafter=DraftStore(SessionConfig().store), policy=policy, config=cfg).run(steps, max_new_tokens=max_new)
    t = [s.makespan for s in res.steps]
    d = [s.proposed for s in res.steps]; a = [s.accepted for s in res.steps]
    print(f"| {label} | {' / '.join(str(s.forwards) for s in res.steps)} | {' / '.join(f'{x}/{y}' for x, y in zip(d, a))} | "
          f"{' / '.join(f'{x / y:.2f}' for x, y in zip(t, plain))} | {sum(t[1:]) / sum(plain[1:]):.3f} |", flush=True)


def acc_len(s, d):
    tgt = target[s.req_id][s.generated:]
    n = 0
    for j in range(len(d)):
        if j >= len(tgt) or d.tokens[j] != tgt[j] or d.parents[j] != j - 1:
            break
        n += 1
    return n


class OracleCut(ForwardAllowance):
    def trim(self, states, drafts):
        drafts = super().trim(states, drafts)
        return [d.prefix(acc_len(s, d)) if len(d) else d for s, d in zip(states, drafts)]


class MatchCap(ForwardAllowance):
    factor = 1.0
    def trim(self, states, drafts):
        drafts = super().trim(states, drafts)
        return [d.prefix(min(len(d), int(self.factor * d.match_len))) if len(d) else d for s, d in zip(states, drafts)]


def das(cls=ForwardAllowance, caps=ClassCaps(), latency=lat):
    return cls(DASPolicy(caps=caps), None, latency=latency)


print("| policy | forwards | drafted/accepted | time/plain | steps 1+ |\n|---|---|---|---|---|")
run("shipped", speculation_policy(SessionConfig()))
run("priced by this model", das())
run("oracle cut of the priced drafts", das(OracleCut))
for f in (0.5, 1.0, 2.0):
    MatchCap.factor = f
    run(f"match-length cap x{f}", das(MatchCap))
