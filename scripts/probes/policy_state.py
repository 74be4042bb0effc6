"""Policy state against the number of distinct problems ever seen (issue 26): memory, budgets() time and
the JSON size of the length and acceptance state, for the session's policy (das in the allowance).

    .venv/bin/python scripts/probes/policy_state.py [problems]
"""
import json, resource, sys, time

from dasrl.policy.allowance import ForwardAllowance
from dasrl.policy.base import RequestState
from dasrl.policy.budget import DASPolicy
from dasrl.policy.latency import CPU_LATENCY

n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
policy = ForwardAllowance(DASPolicy(max_len=512), 32, latency=CPU_LATENCY)
for i in range(n):  # one finished request per problem, each drafted a little
    s = RequestState(req_id=("old", i), problem_id=i, prompt_len=10, max_new_tokens=512, generated=50 + i % 400,
                     drafted=8, accepted=5)
    policy.finish(s)
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
times = []
for step in range(20):  # a live batch of 64 requests; one finishes per step (the tables are stale each time)
    states = [RequestState(req_id=("new", step, j), problem_id=j, prompt_len=10, max_new_tokens=512,
                           generated=step) for j in range(64)]
    t = time.perf_counter()
    policy.budgets(states)
    times.append(time.perf_counter() - t)
    policy.finish(states[0])
size = len(json.dumps({k: getattr(policy, k).state_dict() for k in ("lengths", "acceptance")}))
print(f"{n} problems: +{(rss1 - rss0) / 1024:.0f} MB peak RSS, budgets() best of 20 {min(times) * 1e3:.1f} ms "
      f"(64 rows), length+acceptance state {size / 1e6:.1f} MB of JSON")
